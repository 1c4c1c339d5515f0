"""AdamW (fused on CUDA) and the learning-rate schedule.

Weight decay applies to matrices only (2-D+ parameters); norms and biases are excluded, the usual practice.
Schedule: linear warmup from 0 over `warmup` steps, then linear or cosine decay to `min_lr_ratio * lr` at the
last step (constant: flat after warmup). Implemented as a LambdaLR so its state_dict is just the step count.
"""
from __future__ import annotations

import math

import torch


def warmup_steps(warmup: float, total_steps: int) -> int:
    return int(warmup) if warmup >= 1 else int(round(warmup * total_steps))


def lr_lambda(step: int, total: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the base lr for optimizer step `step` (0-based: the lr used by the (step+1)-th update)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    if schedule == "linear":
        decay = 1.0 - progress
    else:
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * decay


def build_optimizer(model, tcfg, device: torch.device) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": tcfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    fused = tcfg.fused_adamw if tcfg.fused_adamw is not None else device.type == "cuda"
    kw = {"fused": True} if fused else {}  # else torch's default (foreach on CUDA)
    return torch.optim.AdamW(groups, lr=tcfg.lr, betas=tuple(tcfg.betas), eps=tcfg.eps, **kw)


def build_scheduler(opt, tcfg, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    w = warmup_steps(tcfg.warmup, total_steps)
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_lambda(s, total_steps, w, tcfg.schedule, tcfg.min_lr_ratio))
