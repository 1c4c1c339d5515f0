"""The run builder (train/session.py): the trainer, bench, proof and eval all step the model through it."""
from __future__ import annotations

import torch

from novatune.train.loop import train
from novatune.train.session import build


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_session_steps_give_the_trainers_losses(make_cfg):
    """build() + step() is the trainer's step: the same seed gives bit-identical per-step losses and weights."""
    cfg = make_cfg("loop")
    res = train(cfg)
    session = build(make_cfg("session"))
    losses = [float(session.step(session.next_micro_batches()).loss) for _ in range(session.total_steps)]
    assert losses == [res.losses[s] for s in sorted(res.losses)]
    after = _params(session.model)
    for name, p in res.model.named_parameters():
        assert torch.equal(p.detach(), after[name]), name
    assert session.optimizer.state and not res.session.optimizer.state  # a finished run frees the AdamW moments


def test_forward_backward_then_skip_update_leaves_the_run_unchanged(make_cfg):
    """The seam for a non-finite check: forward_backward() changes no weight; skip_update() drops the gradients
    without touching weights or optimizer state and advances the schedule (a skipped step counts);
    apply_update() then changes the weights."""
    session = build(make_cfg())
    before = _params(session.model)
    out = session.forward_backward(session.next_micro_batches())
    assert out.loss.ndim == 0 and out.grad_norm.ndim == 0 and torch.isfinite(out.loss)
    assert all(p.grad is not None for p in session.params)
    assert all(torch.equal(p, before[n]) for n, p in session.model.named_parameters())
    session.skip_update()
    assert all(p.grad is None for p in session.params)
    assert session.scheduler.last_epoch == 1 and not session.optimizer.state
    assert all(torch.equal(p, before[n]) for n, p in session.model.named_parameters())
    session.step(session.next_micro_batches())
    assert session.scheduler.last_epoch == 2
    assert any(not torch.equal(p, before[n]) for n, p in session.model.named_parameters())


def test_hooks_run_before_the_model_and_before_the_optimizer(make_cfg):
    seen = []
    session = build(make_cfg(), before_model=lambda conf: seen.append(("before", conf.model_type)),
                    model_hook=lambda m: seen.append(("model", type(m).__name__)))
    assert seen == [("before", "qwen3"), ("model", type(session.model).__name__)]


def test_batches_are_the_streams_next_steps(make_cfg):
    a, b = build(make_cfg("a")), build(make_cfg("b"))
    ahead = a.batches(2)
    assert len(ahead) == 2 and all(len(mbs) == a.cfg.train.grad_accum for mbs in ahead)
    for mbs in ahead:
        for x, y in zip(mbs, b.next_micro_batches()):
            assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["cu_seqlens"], y["cu_seqlens"])
    assert a.flops_per_token(10.0) > 0
