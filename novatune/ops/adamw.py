"""AdamW with the moments in the parameter's dtype and the clipping scale folded into the update, dispatched by the
device rule of novatune.ops._backend, and the optimizer that steps with it.

    adamw_step(p, m, v, g, scale=None, lr=, beta1=, beta2=, eps=, weight_decay=, step=)   in place
    FusedClipAdamW(params, lr=, betas=, eps=, weight_decay=)                                a torch.optim.AdamW

An optimizer update, not a differentiable op: no custom-op registration or SPEC (nothing traces or tunes it).
CUDA: the Triton kernel (novatune.kernels.adamw); CPU: the fp32 reference, or the kernel under TRITON_INTERPRET=1.
The math: novatune/reference/adamw.py. The optimizer is used by the run builder (`train.adamw_kernel`,
novatune/train/optim.py) and by `novatune.patch(trainer)` (novatune/patch/trainer_optim.py).
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from novatune.kernels import adamw as K
from novatune.ops._backend import use_triton
from novatune.reference.adamw import adamw_step_ref

__all__ = ["adamw_step", "clip_coefficient", "local_shard", "FusedClipAdamW", "trains_most_weights"]


def adamw_step(p: Tensor, m: Tensor, v: Tensor, g: Tensor, scale: Tensor | None = None, **hyper) -> None:
    """One in-place AdamW step (hyper: lr, beta1, beta2, eps, weight_decay, step, and optionally found_inf: a
    one-element fp32 tensor, nonzero to leave p, m and v as they are)."""
    if use_triton(p):
        K.adamw_step(p, m, v, g, scale, **hyper)
    else:
        adamw_step_ref(p, m, v, g, scale, **hyper)


def local_shard(t: Tensor) -> Tensor:
    """A DTensor's local shard (AdamW is elementwise: each rank updates its own shards); a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def clip_coefficient(norm: Tensor, max_norm: float) -> Tensor:
    """clip_grad_norm_'s coefficient for a total gradient norm: min(1, max_norm / (norm + 1e-6))."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


class FusedClipAdamW(torch.optim.AdamW):
    """torch.optim.AdamW (moments in the parameter's dtype) whose update runs through adamw_step, with the
    gradient-clipping coefficient applied inside the update: set `clip_coef` (a one-element fp32 tensor on the
    parameters' device, min(1, max_norm / (norm + 1e-6)), which multiplies the gradients: not torch's GradScaler
    `grad_scale`, which divides) before step() instead of scaling the gradients; step() uses it once. The
    gradients themselves are left unscaled. Checkpoints are interchangeable with torch.optim.AdamW's (same state
    keys; the step count stays a host tensor, so no update reads the device; novatune.train.optim.live_group_flags
    keeps each optimizer's own implementation flags on a load).

    `found_inf` (as torch's fused AdamW reads it from GradScaler: a one-element fp32 tensor on the device, nonzero
    when the step's loss or gradient norm is not finite), set before step() and used once, makes the update leave
    every weight and moment as it is, decided on the device. The host step count still advances (the host never
    reads the flag): the trainer uses it only where a non-finite step ends the run (train.on_nonfinite stop)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        # foreach / fused left unset: step() reads neither, and a checkpoint of this optimizer then lets
        # torch.optim.AdamW resume it on torch's own default path
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        self.clip_coef: Tensor | None = None
        self.found_inf: Tensor | None = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:  # run as torch's optimizers run it, with gradients on
            with torch.enable_grad():
                loss = closure()
        scale, self.clip_coef = self.clip_coef, None
        found_inf, self.found_inf = self.found_inf, None
        scales = {} if scale is None else {scale.device: scale}  # a model spread over GPUs: one copy per device
        flags = {} if found_inf is None else {found_inf.device: found_inf.float()}
        for group in self.param_groups:  # every parameter checked before any is updated
            if group.get("amsgrad") or group.get("maximize"):
                raise RuntimeError("novatune's AdamW kernel runs AdamW without amsgrad or maximize; set "
                                   "train.adamw_kernel: torch (or leave the trainer's optimizer to torch)")
            for p in group["params"]:
                if p.grad is not None and (p.grad.is_sparse or p.dtype not in (torch.bfloat16, torch.float32)):
                    raise RuntimeError(f"novatune's AdamW kernel takes dense bf16 or fp32 parameters, got {p.dtype}"
                                       f"{' (sparse gradient)' if p.grad.is_sparse else ''}; set "
                                       "train.adamw_kernel: torch (or leave the trainer's optimizer to torch)")
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:  # torch.optim.AdamW's state; moments shaped and sharded as the parameter (DTensors)
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                # a new host tensor each step: a loaded state_dict's step tensor may be shared with its source (and
                # a fused torch.optim.AdamW's lives on the GPU, where reading it would wait for the device)
                st["step"] = st["step"].detach().to("cpu", torch.float32) + 1
                weight = local_shard(p.data)
                dense = weight if weight.is_contiguous() else weight.contiguous()  # the kernel reads flat memory
                if scale is not None and dense.device not in scales:
                    scales[dense.device] = scale.to(dense.device, non_blocking=True)
                if found_inf is not None and dense.device not in flags:
                    flags[dense.device] = found_inf.to(dense.device, torch.float32, non_blocking=True)
                adamw_step(dense, local_shard(st["exp_avg"]), local_shard(st["exp_avg_sq"]),
                           local_shard(p.grad).contiguous(), scales.get(dense.device), lr=float(group["lr"]),
                           beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                           step=int(st["step"]), found_inf=flags.get(dense.device))
                if dense is not weight:
                    weight.copy_(dense)
        return loss


def trains_most_weights(model) -> bool:
    """At least half of the model's parameters (by count) train: full fine-tuning, whose AdamW is a long pass over
    large tensors (the kernel's case), not adapters (many small tensors, which torch's multi-tensor launches suit)."""
    total = trainable = 0
    for p in model.parameters():
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return total > 0 and 2 * trainable >= total
