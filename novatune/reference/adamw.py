"""torch.optim.AdamW's update with the moments in the parameter's dtype (stock trainers' setting), and an optional
gradient scale folded in: the fp32 oracle of novatune.kernels.adamw.

One step, in fp32 from the storage dtypes (p, g, m, v share one dtype: bf16 or fp32), with s the gradient scale
(the clipping coefficient min(1, max_norm / (norm + 1e-6)); 1 without clipping):
    g = s * g
    p = p - lr wd p                                   (decoupled weight decay, before the moments: AdamW's order)
    m = b1 m + (1 - b1) g           v = b2 v + (1 - b2) g^2
    p = p - (lr / bc1) m / (sqrt(v) / sqrt(bc2) + eps)          bc_i = 1 - b_i^step
then p, m, v are rounded to their dtype. clip_grad_norm_ + torch's AdamW would round s * g to the gradient's dtype
first; folding s into the update skips that rounding (and the pass over the gradients that makes it).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor


def adamw_step_ref(p: Tensor, m: Tensor, v: Tensor, g: Tensor, scale: Tensor | None = None, *, lr: float,
                   beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                   found_inf: Tensor | None = None) -> None:
    """One in-place step on (p, m, v) from the gradient g; `scale` a 0-dim fp32 tensor or None (module docstring);
    a nonzero `found_inf` leaves p, m and v as they are."""
    if found_inf is not None and float(found_inf) != 0.0:
        return
    bc1, bc2_sqrt = 1.0 - beta1 ** step, math.sqrt(1.0 - beta2 ** step)
    p32, g32, m32, v32 = p.float(), g.float(), m.float(), v.float()
    if scale is not None:
        g32 = g32 * scale.float()
    if weight_decay:
        p32 = p32 - lr * weight_decay * p32
    m32 = beta1 * m32 + (1.0 - beta1) * g32
    v32 = beta2 * v32 + (1.0 - beta2) * g32 * g32
    # correctly rounded, as the kernel's sqrt_rn and div_rn: the square root in fp64 rounded once to fp32 (torch's
    # CPU fp32 sqrt may be an ulp off), and a tensor divisor (torch divides by a Python scalar as a multiplication
    # by its reciprocal). Scalars in products round to fp32, as the kernel's arguments do.
    denom = v32.double().sqrt().float() / torch.full_like(v32, bc2_sqrt) + eps
    p32 = p32 - (lr / bc1) * m32 / denom
    p.copy_(p32)
    m.copy_(m32)
    v.copy_(v32)
