"""Non-finite training never passes silently: stop names the step and keeps the last good checkpoint; skip drops
the update; no NaN ever reaches a checkpoint or an export (train.on_nonfinite, novatune/train/nonfinite.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from novatune.train import checkpoint as ckpt
from novatune.train.loop import train
from novatune.train.nonfinite import NonFiniteError


def quiet():
    return Console(file=open("/dev/null", "w"), soft_wrap=True)


def poison_weight(model):
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "mlp" in n).view(-1)[0] = float("nan")


def strict_rows(out: Path) -> list[dict]:
    def bad(c):
        raise ValueError(f"bare {c} in metrics.jsonl")

    return [json.loads(ln, parse_constant=bad) for ln in (out / "metrics.jsonl").read_text().splitlines()]


def test_nan_weight_stops_at_step_1_and_exports_nothing(make_cfg):
    cfg = make_cfg("nanw", checkpoint={"save_every": 1})
    with pytest.raises(NonFiniteError, match="step 1"):
        train(cfg, console=quiet(), model_hook=poison_weight)
    out = Path(cfg.checkpoint.output_dir)
    assert ckpt.list_checkpoints(out) == [] and not (out / "final").exists()


def test_nan_mid_run_keeps_the_finite_checkpoints(make_cfg):
    cfg = make_cfg("nanmid", train={"max_steps": 6}, checkpoint={"save_every": 1, "keep": 2})

    def hook(step, mbs):
        if step == 3:  # after step 3's checkpoint: step 4 goes non-finite
            poison_weight(model_ref[0])

    model_ref = []
    with pytest.raises(NonFiniteError, match="step 4"):
        train(cfg, console=quiet(), model_hook=model_ref.append, step_hook=hook)
    out = Path(cfg.checkpoint.output_dir)
    names = [p.name for p in ckpt.list_checkpoints(out)]
    assert names == ["step_00000002", "step_00000003"] and not (out / "final").exists()
    for p in ckpt.list_checkpoints(out):
        assert ckpt.verify(p) == []
    assert [r["step"] for r in strict_rows(out)] == [1, 2, 3]


def test_skip_drops_one_bad_update_and_trains_on(make_cfg):
    cfg = make_cfg("skip", train={"max_steps": 5, "on_nonfinite": "skip"})
    state = {}

    def model_hook(model):
        state["model"] = model

        def nan_once(module, args, output):
            if state.get("armed"):
                state["armed"] = False
                output.loss = output.loss * float("nan")
            return output

        model.register_forward_hook(nan_once)

    def step_hook(step, mbs):
        state[step] = {n: p.detach().clone() for n, p in state["model"].named_parameters()}
        state["armed"] = step == 2  # the first micro-batch of step 3 returns a NaN loss

    res = train(cfg, console=quiet(), model_hook=model_hook, step_hook=step_hook)
    assert res.steps == 5 and res.exported
    for n, w in state[2].items():  # step 3 changed nothing
        assert torch.equal(state[3][n], w), n
    assert any(not torch.equal(state[4][n], state[3][n]) for n in state[3])  # step 4 trained again
    rows = strict_rows(Path(cfg.checkpoint.output_dir))
    assert rows[2]["step"] == 3 and rows[2]["loss"] is None and rows[2]["skipped"] is True
    assert all(r["loss"] is not None and "skipped" not in r for i, r in enumerate(rows) if i != 2)


def test_skip_stops_after_too_many_consecutive(make_cfg):
    cfg = make_cfg("skipmany", train={"max_steps": 6, "on_nonfinite": "skip", "max_skipped_steps": 2})
    with pytest.raises(NonFiniteError, match="3 consecutive steps skipped"):
        train(cfg, console=quiet(), model_hook=poison_weight)


def test_save_and_export_refuse_nonfinite_weights(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
    with pytest.raises(NonFiniteError, match="weight"):
        ckpt.save(tmp_path, 1, model, opt, sched, {"data": {}})
    with pytest.raises(NonFiniteError, match="export"):
        ckpt.export(model, None, tmp_path, lora=False)
    assert not ckpt.checkpoints_dir(tmp_path).exists() and not (tmp_path / "final").exists()


def test_nonfinite_names_checks_every_chunk(monkeypatch):
    from novatune.train import nonfinite

    monkeypatch.setattr(nonfinite, "CHUNK", 7)
    t = torch.randn(5, 9)
    nan_last = t.clone()
    nan_last[-1, -1] = float("nan")
    inf_mid = t.clone().t()  # not contiguous
    inf_mid[4, 2] = -float("inf")
    tensors = {"ok": t, "nan": nan_last, "inf": inf_mid, "empty": torch.empty(0), "ints": torch.arange(3),
               "half": torch.full((3,), 6e4, dtype=torch.float16)}
    assert nonfinite.nonfinite_names(tensors) == ["nan", "inf"]


def test_a_run_whose_gradients_are_all_zero_stops_instead_of_exporting(make_cfg):
    """Finite but dead (every gradient exactly zero, as after a learning rate that saturated the weights): the run
    ends with ZeroGradientError at the third such step and exports nothing."""
    from novatune.train.nonfinite import ZERO_GRADIENT_STEPS, ZeroGradientError

    cfg = make_cfg("dead", train={"max_steps": 6})

    def zero_gradients(model):
        for p in model.parameters():
            if p.requires_grad:
                p.register_hook(torch.zeros_like)

    with pytest.raises(ZeroGradientError, match=f"exactly zero on steps 1-{ZERO_GRADIENT_STEPS}.*train.lr"):
        train(cfg, console=quiet(), model_hook=zero_gradients)
    assert not (Path(cfg.checkpoint.output_dir) / "final").exists()


def test_zero_gradient_steps_must_be_consecutive():
    from novatune.train.nonfinite import StepGuard, ZeroGradientError

    guard = StepGuard("stop", 0)
    loss, zero, some = torch.tensor(2.0), torch.tensor(0.0), torch.tensor(0.5)
    for step, norm in enumerate([zero, zero, some, zero, zero, some, zero], start=1):
        assert guard.allow(step, loss, norm)
    assert guard.allow(8, loss, zero)
    with pytest.raises(ZeroGradientError, match="steps 7-9"):
        guard.allow(9, loss, zero)
    skipping = StepGuard("skip", 5)  # a skipped non-finite step breaks a run of zero-gradient steps
    assert skipping.allow(1, loss, zero) and skipping.allow(2, loss, zero)
    assert not skipping.allow(3, loss, torch.tensor(float("nan")))
    assert skipping.allow(4, loss, zero) and skipping.allow(5, loss, zero)
