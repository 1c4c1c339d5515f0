"""The training loop's guarantees: token-normalised gradient accumulation, kill-and-resume on the same loss
curve, atomic keep-last-N checkpoints, exports that load with from_pretrained, schedules and MFU arithmetic."""
from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from novatune.data.dataset import BatchStream, build_data
from novatune.train import checkpoint as ckpt
from novatune.train.loop import train
from novatune.train.model import SetupError, apply_patch, build_model, load_tokenizer, prepare
from novatune.train.session import forward_backward

PATCH = [False, True]


def quiet():
    return Console(file=open("/dev/null", "w"), soft_wrap=True)


def _setup(cfg):
    tok = load_tokenizer(cfg.model)
    data = build_data(cfg.data, tok, len(tok))
    model = prepare(build_model(cfg.model, torch.device("cpu"), torch.float32, tok, seed=0), cfg)
    report = apply_patch(model, cfg.model)
    return model, data, report


@pytest.mark.parametrize("patched", PATCH, ids=["stock", "patched"])
def test_grad_accum_4x1_equals_one_batch_of_4(make_cfg, patched, monkeypatch, reference_backend):
    # the patched ops run their PyTorch references here (the Triton interpreter is minutes at these sizes; the
    # kernels are checked against the references in tests/kernels): this checks the patch's num_items plumbing
    reference_backend()
    cfg = make_cfg(model={"patch": patched})
    model, data, report = _setup(cfg)
    mode = "host" if report is not None else None
    rows = data.rows[:4]
    stream = BatchStream(rows, micro_batch=4, shuffle=False)
    one = [stream.next()]
    four = [BatchStream([r], 1, shuffle=False).next() for r in rows]
    assert sum(b["num_target_tokens"] for b in four) == one[0]["num_target_tokens"] > 0

    def grads(mbs):
        model.zero_grad(set_to_none=True)
        loss = forward_backward(model, mbs, torch.device("cpu"), mode)
        return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss1, g1 = grads(one)
    loss4, g4 = grads(four)
    # fp32: the same sums in a different order (padding rows in the batch of 4) -> ~1e-6 relative
    torch.testing.assert_close(loss4, loss1, rtol=1e-5, atol=1e-6)
    assert g1.keys() == g4.keys() and len(g1) > 5
    for n in g1:
        torch.testing.assert_close(g4[n], g1[n], rtol=1e-4, atol=1e-6, msg=n)
    # and the loss is the mean CE over all target tokens of the accumulated batch (not a mean of means)
    with torch.no_grad():
        model.eval()
        if report is not None:
            report.revert()
        b = one[0]
        logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False).logits
        ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                b["labels"][:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(loss1, ref, rtol=1e-5, atol=1e-6)


def test_train_same_losses_for_4x1_and_1x4(make_cfg):
    a = train(make_cfg("a", train={"micro_batch": 4, "grad_accum": 1, "max_steps": 3}), console=quiet())
    b = train(make_cfg("b", train={"micro_batch": 1, "grad_accum": 4, "max_steps": 3}), console=quiet())
    assert a.losses.keys() == b.losses.keys() == {1, 2, 3}
    for s in a.losses:
        assert a.losses[s] == pytest.approx(b.losses[s], rel=1e-4)


@pytest.mark.parametrize("method,patched", [("full", False), ("lora", False), ("full", True)],
    ids=["full", "lora-dropout", "full-patched"])
def test_kill_and_resume_continues_the_same_loss_curve(make_cfg, method, patched, monkeypatch, reference_backend):
    reference_backend()  # patched: PyTorch references, not the interpreter
    extra = {"method": {"type": "lora", "r": 4, "alpha": 8, "dropout": 0.1}} if method == "lora" else {}
    extra["model"] = {"patch": patched}
    steps = {"max_steps": 7, "lr": 1e-2 if method == "lora" else 3e-3}
    full = train(make_cfg("full", train=steps, **extra), console=quiet())
    assert sorted(full.losses) == list(range(1, 8))
    cfg = make_cfg("killed", train=steps, checkpoint={"save_every": 2, "keep": 2}, **extra)
    first = train(cfg, console=quiet(), stop_after=5)  # "killed" after step 5; the last checkpoint is step 4
    assert first.steps == 5 and not first.exported
    assert [p.name for p in ckpt.list_checkpoints(cfg.checkpoint.output_dir)] == ["step_00000002", "step_00000004"]
    second = train(cfg, console=quiet())  # resume: auto
    assert second.resumed_from.name == "step_00000004" and sorted(second.losses) == [5, 6, 7]
    for s in range(1, 6):
        assert first.losses[s] == pytest.approx(full.losses[s], rel=1e-6, abs=1e-7), s
    for s in range(5, 8):
        assert second.losses[s] == pytest.approx(full.losses[s], rel=1e-6, abs=1e-7), s
    metrics = Path(cfg.checkpoint.output_dir) / "metrics.jsonl"
    rows = [json.loads(ln) for ln in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 8))  # the curve continues: no duplicate or missing step
    assert [p.name for p in ckpt.list_checkpoints(cfg.checkpoint.output_dir)] == ["step_00000006", "step_00000007"]
    assert not list((ckpt.checkpoints_dir(cfg.checkpoint.output_dir)).glob(".tmp-*"))


def test_export_full_loads_with_from_pretrained(make_cfg):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    res = train(make_cfg("exp", train={"max_steps": 2}), console=quiet())
    (final,) = res.exported
    loaded = AutoModelForCausalLM.from_pretrained(final).eval()
    tok = AutoTokenizer.from_pretrained(final)
    assert tok.chat_template and loaded.config.use_cache  # ready for inference
    ids = torch.tensor([tok("Ava has 3 apples.")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, res.model.eval()(input_ids=ids).logits)


def test_export_lora_adapter_and_merged(make_cfg):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = make_cfg("lora", method={"type": "lora", "r": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "up_proj"]},
                   train={"max_steps": 3, "lr": 2e-2})
    res = train(cfg, console=quiet())
    adapter, merged = res.exported
    assert (adapter / "adapter_config.json").exists() and (merged / "config.json").exists()
    m = AutoModelForCausalLM.from_pretrained(merged).eval()
    # the base is the seeded random init: rebuild it, attach the adapter, compare with the merged weights
    tok = load_tokenizer(cfg.model)
    base = build_model(cfg.model, torch.device("cpu"), torch.float32, tok, seed=0).eval()
    with_adapter = PeftModel.from_pretrained(base, adapter).eval()
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        a = with_adapter(input_ids=ids).logits
        b = m(input_ids=ids).logits
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    with torch.no_grad(), with_adapter.disable_adapter():
        plain = with_adapter(input_ids=ids).logits
    assert (plain - a).abs().max() > 1e-4  # the adapter learned something


def test_patch_requested_but_missing_is_a_clear_error(make_cfg, monkeypatch):
    monkeypatch.setitem(sys.modules, "novatune.patch.apply", None)  # import now raises ImportError
    cfg = make_cfg(model={"patch": True})
    with pytest.raises(SetupError, match=r"model.patch=false"):
        apply_patch(torch.nn.Linear(2, 2), cfg.model)
    cfg = make_cfg(model={"patch": False})
    assert apply_patch(torch.nn.Linear(2, 2), cfg.model) is None  # no patch asked: no error


def test_bad_patch_option_names_the_key(make_cfg):
    cfg = make_cfg(model={"patch": True, "patch_options": {"rms_nrom": False}})
    with pytest.raises(SetupError, match="model.patch_options"):
        apply_patch(torch.nn.Linear(2, 2), cfg.model)


def test_resume_from_mismatched_checkpoint_says_what_to_do(make_cfg):
    cfg = make_cfg("m1", train={"max_steps": 2}, checkpoint={"save_every": 1})
    train(cfg, console=quiet(), stop_after=1)  # unfinished: its checkpoint is there to resume
    other = make_cfg("m1", train={"max_steps": 4}, checkpoint={"save_every": 1},
                     model={"arch_overrides": {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64,
                                               "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}})
    with pytest.raises(ckpt.CheckpointError, match="does not match this model"):
        train(other, console=quiet())


def test_train_leaves_a_callers_freeze_as_it_was(make_cfg):
    """`novatune train` called from a script that froze its own objects first (say, before forking data workers):
    the trainer's release at the end does not undo the caller's freeze."""
    gc.freeze()
    try:
        train(make_cfg(train={"max_steps": 2}), console=quiet())
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    train(make_cfg("again", train={"max_steps": 2}), console=quiet())
    assert gc.get_freeze_count() == 0  # its own freeze, handed back
