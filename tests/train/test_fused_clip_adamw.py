"""train.adamw_kernel: novatune (FusedClipAdamW): torch.optim.AdamW's update through novatune's kernel with the
clipping scale applied inside it. Against stock (clip_grad_norm_ then torch.optim.AdamW): the same training to fp32
rounding, checkpoints interchangeable both ways, the refusals, and the bench's stock stacks kept on torch's AdamW.

Tolerance against torch (fp32, CPU): torch's single-tensor AdamW computes the same update with other roundings
(lerp for the first moment, addcdiv, its CPU sqrt), ~1e-7 relative per step; over a few steps of a tiny model the
weights agree to 1e-5 relative and the losses to 1e-5.
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from rich.console import Console

from novatune.train import optim
from novatune.train.errors import SetupError
from novatune.train.loop import train


class T:  # the TrainConfig fields build_optimizer reads
    def __init__(self, optimizer="adamw", adamw_kernel="novatune", weight_decay=0.1):
        self.optimizer, self.adamw_kernel, self.lr, self.weight_decay = optimizer, adamw_kernel, 1e-3, weight_decay
        self.fused_adamw, self.betas, self.eps = None, [0.9, 0.999], 1e-8


def record_clip_coefs(monkeypatch) -> list:
    """The clipping coefficient each FusedClipAdamW.step() finds set (None where none was), in call order."""
    from novatune.ops.adamw import FusedClipAdamW

    coefs: list = []
    real_step = FusedClipAdamW.step

    def recording_step(self, closure=None):
        coefs.append(None if self.clip_coef is None else float(self.clip_coef))
        return real_step(self, closure)

    monkeypatch.setattr(FusedClipAdamW, "step", recording_step)
    return coefs


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(33, 47), torch.nn.LayerNorm(47), torch.nn.Linear(47, 5))


def _grads(model, step):
    gen = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def test_steps_match_clip_grad_norm_then_torch_adamw():
    ours, stock = _model(), _model()
    opt = optim.build_optimizer(ours, T(), torch.device("cpu"))
    ref = optim.build_optimizer(stock, T(adamw_kernel="torch"), torch.device("cpu"))
    assert isinstance(opt, optim.FusedClipAdamW) and type(ref) is torch.optim.AdamW
    for step in range(5):
        _grads(ours, step)
        _grads(stock, step)
        grads_before = [p.grad.clone() for p in ours.parameters()]
        norm = torch.nn.utils.get_total_norm([p.grad for p in ours.parameters()], 2.0)
        opt.clip_coef = (0.5 / (norm + 1e-6)).clamp(max=1.0).float()  # what the session sets (max_norm 0.5)
        opt.step()
        assert opt.clip_coef is None  # used once
        assert all(torch.equal(p.grad, g) for p, g in zip(ours.parameters(), grads_before, strict=True))
        assert torch.nn.utils.clip_grad_norm_(list(stock.parameters()), 0.5) == pytest.approx(float(norm))
        ref.step()
    for a, b in zip(ours.parameters(), stock.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_checkpoints_are_interchangeable_with_torch_adamw():
    """torch.optim.AdamW's state_dict loads into FusedClipAdamW and back, and training continues the same."""
    a, b = _model(), _model()
    torch_opt = optim.build_optimizer(a, T(adamw_kernel="torch"), torch.device("cpu"))
    for step in range(2):
        _grads(a, step)
        torch_opt.step()
    b.load_state_dict(a.state_dict())
    ours = optim.build_optimizer(b, T(), torch.device("cpu"))
    ours.load_state_dict(copy.deepcopy(torch_opt.state_dict()))  # as read from a file: no shared tensors
    _grads(a, 2)
    _grads(b, 2)
    torch_opt.step()
    ours.step()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-7)
        assert float(ours.state[q]["step"]) == 3
    back = optim.build_optimizer(_model(), T(adamw_kernel="torch"), torch.device("cpu"))
    back.load_state_dict(ours.state_dict())
    assert set(back.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}


def test_refusals_name_the_fix():
    with pytest.raises(SetupError, match="train.adamw_kernel: torch"):
        optim.build_optimizer(_model(), T(optimizer="adamw_kahan"), torch.device("cpu"))
    opt = optim.build_optimizer(_model().half(), T(), torch.device("cpu"))
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.zeros_like(p)
    with pytest.raises(RuntimeError, match="bf16 or fp32 parameters.*train.adamw_kernel: torch"):
        opt.step()


def test_training_with_the_kernel_follows_stock_and_logs_the_unclipped_norm(make_cfg, monkeypatch):
    """`novatune train` with train.adamw_kernel novatune and clipping that bites (max_grad_norm 0.05): per-step
    losses equal to the torch optimizer's run to fp32 rounding; the logged norms are the same pre-clip norms (above
    0.05), and each step's clipping coefficient reached the kernel's optimizer."""
    import json

    coefs = record_clip_coefs(monkeypatch)
    quiet = Console(quiet=True)
    runs, norms = {}, {}
    for kernel in ("torch", "novatune"):
        cfg = make_cfg(kernel, train={"max_steps": 4, "max_grad_norm": 0.05, "adamw_kernel": kernel})
        runs[kernel] = train(cfg, console=quiet)
        metrics = Path(cfg.checkpoint.output_dir) / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        norms[kernel] = [r["grad_norm"] for r in rows if "grad_norm" in r]
    for s, loss in runs["torch"].losses.items():
        assert runs["novatune"].losses[s] == pytest.approx(loss, rel=1e-5, abs=1e-6), s
    assert runs["novatune"].losses[4] != runs["novatune"].losses[1]
    assert len(norms["novatune"]) == 4 and norms["novatune"] == pytest.approx(norms["torch"], rel=1e-5)
    assert min(norms["novatune"]) > 0.05
    assert len(coefs) == 4 and all(c is not None and 0 < c < 1 for c in coefs), coefs


def test_the_stock_stacks_keep_torch_adamw():
    from novatune.bench.stacks import STACKS

    for name in ("stock", "hf-varlen", "liger-peer"):
        assert "train.adamw_kernel=torch" in STACKS[name].overrides, name


def test_config_refuses_what_the_kernel_does_not_run(make_cfg):
    from novatune.train.config import ConfigError

    with pytest.raises(ConfigError, match="(?s)adamw_kernel.*adamw_kahan.*train.adamw_kernel: torch"):
        make_cfg(train={"adamw_kernel": "novatune", "optimizer": "adamw_kahan"})
    with pytest.raises(ConfigError, match="(?s)adamw_kernel.*foreach.*drop train.fused_adamw: false"):
        make_cfg(train={"adamw_kernel": "novatune", "fused_adamw": False})
    make_cfg(train={"adamw_kernel": "novatune", "fused_adamw": True})  # one fused pass: the kernel is one


@pytest.mark.parametrize("device,patched,full,changes,want", [
    ("cuda", True, True, {}, "novatune"),
    ("cuda", True, False, {}, "torch"),  # LoRA: many small adapters, torch's multi-tensor launches
    ("cuda", False, True, {}, "torch"),  # a stock model keeps stock's optimizer
    ("cpu", True, True, {}, "torch"),
    ("cuda", True, True, {"fused_adamw": False}, "torch"),  # the user asked for torch's foreach AdamW
    ("cuda", True, True, {"fused_adamw": True}, "novatune"),  # a one-pass AdamW: the kernel is one (the examples')
    ("cuda", True, True, {"optimizer": "adamw_kahan"}, "torch"),
    ("cpu", False, False, {"adamw_kernel": "novatune"}, "novatune"),  # asked for: the CPU runs its fp32 reference
    ("cuda", True, True, {"adamw_kernel": "torch"}, "torch"),
])
def test_auto_takes_the_kernel_for_patched_full_fine_tuning_on_cuda(device, patched, full, changes, want):
    tcfg = T(adamw_kernel="auto")
    for key, value in changes.items():
        setattr(tcfg, key, value)
    assert optim.adamw_kernel(tcfg, torch.device(device), patched, full) == want


def test_trains_most_weights_tells_full_fine_tuning_from_adapters():
    model = _model()
    assert optim.trains_most_weights(model)
    model[0].weight.requires_grad_(False)  # 33 x 47 = 1,551 of the model's 1,932 elements
    assert not optim.trains_most_weights(model)


def test_a_checkpoint_keeps_the_resuming_optimizers_own_flags():
    """Optimizer.load_state_dict takes group settings from the file: the kernel's checkpoint (foreach and fused
    unset) must not decide how torch's AdamW that resumes it steps (a fused one would lose `fused`, and its step
    counts would stay where the file put them). live_group_flags keeps the live optimizer's flags."""
    model = _model()
    ours = optim.build_optimizer(model, T(), torch.device("cpu"))
    _grads(model, 0)
    ours.step()
    saved = copy.deepcopy(ours.state_dict())
    assert all(g["foreach"] is None and g["fused"] is None for g in saved["param_groups"])

    def resuming():
        opt = optim.build_optimizer(_model(), T(adamw_kernel="torch"), torch.device("cpu"))
        for g in opt.param_groups:
            g["foreach"] = True  # torch's multi-tensor path, as CUDA's default picks it
        return opt

    plain = resuming()
    plain.load_state_dict(copy.deepcopy(saved))
    assert all(g["foreach"] is None for g in plain.param_groups)  # the file's flag, not this optimizer's
    kept = resuming()
    kept.load_state_dict(optim.live_group_flags(kept, copy.deepcopy(saved)))
    assert all(g["foreach"] is True for g in kept.param_groups)
    assert [g["weight_decay"] for g in kept.param_groups] == [g["weight_decay"] for g in saved["param_groups"]]
    assert float(kept.state[kept.param_groups[0]["params"][0]]["step"]) == 1
