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


# The check read at once (torch's foreach AdamW, the CPU default) and read a step late with the decision taken on
# the device (torch's fused AdamW and novatune's AdamW kernel take found_inf; train/nonfinite.py): the same outcomes.
OPTIMIZERS = {"foreach": {"fused_adamw": False}, "fused": {"fused_adamw": True}, "kernel": {"adamw_kernel": "novatune"}}
READS = pytest.mark.parametrize("optimizer", list(OPTIMIZERS))


def deferral_spy(monkeypatch) -> list:
    """The steps whose check is deferred (non-empty exactly when the optimizer takes found_inf)."""
    from novatune.train.nonfinite import StepGuard

    seen: list = []
    real = StepGuard.defer
    monkeypatch.setattr(StepGuard, "defer", lambda self, step, *a: seen.append(step) or real(self, step, *a))
    return seen


@READS
def test_nan_weight_stops_at_step_1_and_exports_nothing(make_cfg, monkeypatch, optimizer):
    deferred = deferral_spy(monkeypatch)
    cfg = make_cfg("nanw", train=OPTIMIZERS[optimizer], checkpoint={"save_every": 1})
    with pytest.raises(NonFiniteError, match="step 1"):
        train(cfg, console=quiet(), model_hook=poison_weight)
    out = Path(cfg.checkpoint.output_dir)
    assert ckpt.list_checkpoints(out) == [] and not (out / "final").exists()
    assert bool(deferred) == (optimizer != "foreach")


@READS
@pytest.mark.parametrize("log_every", [1, 4])
def test_nan_mid_run_keeps_the_finite_checkpoints(make_cfg, monkeypatch, optimizer, log_every):
    """With the check read a step late, the checkpoint of step 4 (and with logging every step, its metrics row)
    still waits for step 4's check; the weights in memory never take the non-finite update."""
    deferred = deferral_spy(monkeypatch)
    cfg = make_cfg("nanmid", train={"max_steps": 6, **OPTIMIZERS[optimizer]}, checkpoint={"save_every": 1, "keep": 2},
                   logging={"every": log_every})

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
    logged = [r["step"] for r in strict_rows(out)] if (out / "metrics.jsonl").exists() else []
    assert logged == ([1, 2, 3] if log_every == 1 else [])
    assert deferred == ([] if optimizer == "foreach" else [1, 2, 3, 4])
    # only the poisoned element is non-finite: the update of step 4 was never applied
    poisoned = next(p for n, p in model_ref[0].named_parameters() if "mlp" in n).detach().view(-1)
    assert torch.isnan(poisoned[0]) and torch.isfinite(poisoned[1:]).all()


def nan_loss_at_step_3() -> tuple[dict, object, object]:
    """(state, model_hook, step_hook): the first micro-batch of step 3 returns a NaN loss; state[step] holds the
    weights by name after each step."""
    state: dict = {}

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
        state["armed"] = step == 2

    return state, model_hook, step_hook


def test_skip_drops_one_bad_update_and_trains_on(make_cfg):
    cfg = make_cfg("skip", train={"max_steps": 5, "on_nonfinite": "skip"})
    state, model_hook, step_hook = nan_loss_at_step_3()
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


@READS
def test_a_run_whose_gradients_are_all_zero_stops_instead_of_exporting(make_cfg, monkeypatch, optimizer):
    """Finite but dead (every gradient exactly zero, as after a learning rate that saturated the weights): the run
    ends with ZeroGradientError at the third such step and exports nothing."""
    from novatune.train.nonfinite import ZERO_GRADIENT_STEPS, ZeroGradientError

    deferred = deferral_spy(monkeypatch)
    cfg = make_cfg("dead", train={"max_steps": 6, **OPTIMIZERS[optimizer]})

    def zero_gradients(model):
        for p in model.parameters():
            if p.requires_grad:
                p.register_hook(torch.zeros_like)

    with pytest.raises(ZeroGradientError, match=f"exactly zero on steps 1-{ZERO_GRADIENT_STEPS}.*train.lr"):
        train(cfg, console=quiet(), model_hook=zero_gradients)
    assert not (Path(cfg.checkpoint.output_dir) / "final").exists()
    assert bool(deferred) == (optimizer != "foreach")


def test_checkpoints_of_weights_that_no_longer_train_are_set_aside(make_cfg):
    """Steps 1-2 train; the gradients are zero from step 3 on (as after an update that saturated the weights at
    step 2). The run stops at step 5 (3 zero steps); the checkpoints of steps 2-4 (step 2's update made the dead
    weights) are set aside, step 1's stays, and a resume continues from step 1. run.json says why it stopped."""
    import json

    from novatune.train import checkpoint as ckpt
    from novatune.train.nonfinite import ZeroGradientError

    cfg = make_cfg("dead_late", train={"max_steps": 8}, checkpoint={"save_every": 1, "keep": 10})
    calls = {"backward": 0}

    def zero_from_step_3(model):
        params = [p for p in model.parameters() if p.requires_grad]

        def hook(grad):
            return torch.zeros_like(grad) if calls["backward"] >= 2 * cfg.train.grad_accum * len(params) else grad

        def count(grad):
            calls["backward"] += 1
            return hook(grad)

        for p in params:
            p.register_hook(count)

    with pytest.raises(ZeroGradientError, match="exactly zero on steps 3-5.*from step 2 on"):
        train(cfg, console=quiet(), model_hook=zero_from_step_3)
    out = Path(cfg.checkpoint.output_dir)
    assert [ckpt.step_of(c) for c in ckpt.list_checkpoints(out)] == [1]
    assert len(list(ckpt.checkpoints_dir(out).glob("damaged-step_*"))) == 3
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "unhealthy" and "exactly zero" in run["reason"]


def test_zero_gradients_on_a_zero_loss_blame_no_checkpoint():
    """Zero gradients with a zero loss (batches with nothing to learn) say nothing against the weights: no step's
    checkpoint is marked dead; with a positive loss the step before the first zero is."""
    from novatune.train.nonfinite import StepGuard, ZeroGradientError

    for loss, dead in ((0.0, None), (6.2, 3)):
        guard = StepGuard("stop", 0)
        assert guard.allow(3, torch.tensor(loss), torch.tensor(1.0))
        with pytest.raises(ZeroGradientError) as info:
            for step in (4, 5, 6):
                guard.allow(step, torch.tensor(loss), torch.tensor(0.0))
        assert info.value.dead_from == dead
        assert ("set aside" in str(info.value)) == (dead is not None)


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


def test_the_guard_reads_deferred_steps_in_order_and_keeps_the_newest():
    """resolve(keep=1) checks all but the newest deferred step, oldest first; a non-finite one raises naming its
    step; found_inf is GradScaler's 0-dim fp32 flag; only stop mode with an optimizer that takes it defers."""
    from novatune.ops.adamw import FusedClipAdamW
    from novatune.train.nonfinite import StepGuard

    guard = StepGuard("stop", 3)
    one = torch.tensor(1.0)
    for step in (1, 2, 3):
        assert float(guard.defer(step, one * step, one)) == 0.0
    guard.resolve(keep=1)
    assert [s for s, _ in guard.pending] == [3]
    flag = guard.defer(4, torch.tensor(float("nan")), one)
    assert flag.shape == () and flag.dtype == torch.float32 and float(flag) == 1.0
    assert float(guard.defer(5, one, torch.tensor(float("inf")))) == 1.0
    with pytest.raises(NonFiniteError, match="step 4"):
        guard.resolve(keep=1)
    w = [torch.nn.Parameter(torch.zeros(3))]
    assert StepGuard("stop", 3).defers(torch.optim.AdamW(w, fused=True))
    assert StepGuard("stop", 3).defers(FusedClipAdamW(w))
    assert not StepGuard("skip", 3).defers(torch.optim.AdamW(w, fused=True))
    assert not StepGuard("stop", 3).defers(torch.optim.AdamW(w, foreach=True))
    assert not StepGuard("stop", 3).defers(torch.optim.SGD(w))


def test_the_kernel_optimizer_skips_a_flagged_step_and_forgets_the_flag():
    from novatune.ops.adamw import FusedClipAdamW

    model = torch.nn.Linear(5, 3)
    opt = FusedClipAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    before = [p.detach().clone() for p in model.parameters()]
    opt.found_inf = torch.tensor(1.0)
    opt.step()
    assert opt.found_inf is None
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert all(torch.equal(opt.state[p]["exp_avg"], torch.zeros_like(p)) for p in model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # the flag was used once: this step updates
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_rows_read_a_step_late_equal_the_rows_read_at_once(make_cfg, monkeypatch):
    """The same run (torch's fused AdamW) with the check and the metrics read at once and a step late: the same
    rows (steps, losses, grad norms, lr, tokens) and losses; read late, the row of step s is written during step
    s + 1 (its values were on their way to the host), and the last one before the run ends."""
    from novatune.train.nonfinite import StepGuard

    keys = ("step", "loss", "grad_norm", "lr", "tokens", "total_steps")
    rows, losses, written_by_hook = {}, {}, {}
    for late in (False, True):
        monkeypatch.setattr(StepGuard, "defers", lambda self, opt, late=late: late)
        cfg = make_cfg(f"late{late}", train={"max_steps": 5, "fused_adamw": True}, logging={"every": 2})
        metrics = Path(cfg.checkpoint.output_dir) / "metrics.jsonl"
        seen = []

        def hook(step, mbs, metrics=metrics, seen=seen):
            seen.append(len(metrics.read_text().splitlines()) if metrics.exists() else 0)

        res = train(cfg, console=quiet(), step_hook=hook)
        rows[late] = [{k: r[k] for k in keys} for r in strict_rows(Path(cfg.checkpoint.output_dir))]
        losses[late], written_by_hook[late] = res.losses, seen
    assert rows[True] == rows[False] and [r["step"] for r in rows[True]] == [2, 4, 5]
    assert losses[True] == losses[False]
    assert written_by_hook[False] == [0, 1, 1, 2, 3]  # rows of steps 2, 4, 5 written within their own step
    assert written_by_hook[True] == [0, 0, 1, 1, 3]  # step 2's row during step 3; step 5 (the last) at once


def test_read_a_step_late_a_nan_batch_stops_at_the_next_step_with_its_update_refused(make_cfg):
    """No checkpoint or row to settle at the bad step (save_every 0, a row every 5 steps): step 3's NaN loss is
    read while step 4 runs, and the run stops naming step 3. Step 3's update was refused on the device: the weights
    after it are the weights before it, moved only by step 4's finite update."""
    cfg = make_cfg("late", train={"max_steps": 6, "fused_adamw": True}, logging={"every": 5})
    state, model_hook, step_hook = nan_loss_at_step_3()
    with pytest.raises(NonFiniteError, match="step 3"):
        train(cfg, console=quiet(), model_hook=model_hook, step_hook=step_hook)
    assert 3 in state and 4 not in state  # step 3 ran to its end; the stop came while step 4 ran
    assert all(torch.equal(w, state[2][n]) for n, w in state[3].items())  # step 3 changed nothing
    out = Path(cfg.checkpoint.output_dir)
    assert not (out / "final").exists() and ckpt.list_checkpoints(out) == []
    assert not (out / "metrics.jsonl").exists() or strict_rows(out) == []


@READS
def test_an_error_in_the_loop_keeps_the_rows_of_the_steps_before_it(make_cfg, optimizer):
    """An exception inside the loop (here the step hook's) after logged steps: their rows are written whether the
    check is read at once or a step late."""
    cfg = make_cfg("boom", train={"max_steps": 4, **OPTIMIZERS[optimizer]})

    def hook(step, mbs):
        if step == 2:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        train(cfg, console=quiet(), step_hook=hook)
    assert [r["step"] for r in strict_rows(Path(cfg.checkpoint.output_dir))] == [1, 2]


@pytest.mark.gpu
def test_host_copy_on_cuda_reads_the_values_from_pinned_memory_behind_later_work():
    """The pinned copy behind its event on the copy's own stream: the values of device scalars, read after more
    work was queued (that the read waits for the copy alone is its design, not measured here)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from novatune.train.nonfinite import HostCopy, stack_scalars

    loss, norm = torch.tensor(2.5, device="cuda"), torch.tensor(float("nan"), device="cuda")
    copy = HostCopy(stack_scalars([loss, norm]))
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        big = big @ big.T / 4096  # queued after the copy
    got = copy.values()
    assert got[0] == 2.5 and got[1] != got[1]
    assert copy.host.is_pinned()
