"""Triton kernel of AdamW with the moments in the parameter's dtype, in place, one launch per parameter, with an
optional gradient scale (the clipping coefficient) read from the device.

The math: novatune/reference/adamw.py. One pass reads p, g, m, v and writes p, m, v (7 values of the storage dtype
per parameter; torch's fused AdamW moves the same bytes, in multi-tensor launches that reach ~2.7 TB/s on an H200).
The arithmetic is fp32, in the reference's order, with no fused multiply-adds (enable_fp_fusion=False) and the
square root and divisions rounded to nearest (tl.sqrt_rn, tl.div_rn): the kernel gives the reference's values to the
bit. torch's fused kernel mixes its double hyperparameters into some products, so it and this one can differ in
the last bit of a stored value; the GPU test measures how often.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from novatune.kernels.adamw_kahan import _to_bf16_rne

BLOCK = 2048
NUM_WARPS = 8


@triton.jit
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, p_out, m_out, v_out, scale_ptr, found_inf_ptr, n, beta1,
                  one_minus_beta1, beta2, one_minus_beta2, eps, lr_weight_decay, step_size, bc2_sqrt,
                  HAS_SCALE: tl.constexpr, HAS_FOUND_INF: tl.constexpr, HAS_DECAY: tl.constexpr, BF16: tl.constexpr,
                  BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if HAS_FOUND_INF:  # a step found non-finite: no element is in range, so nothing is read or written
        n = tl.where(tl.load(found_inf_ptr) == 0, n, 0)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = g * tl.load(scale_ptr)
    if HAS_DECAY:
        p = p - lr_weight_decay * p
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p - tl.div_rn(step_size * m, denom)
    if BF16:  # rounded to nearest even on the bits, stored through int16 views (the interpreter's cast truncates)
        tl.store(p_out + offs, _to_bf16_rne(p)[1].to(tl.int16), mask=mask)
        tl.store(m_out + offs, _to_bf16_rne(m)[1].to(tl.int16), mask=mask)
        tl.store(v_out + offs, _to_bf16_rne(v)[1].to(tl.int16), mask=mask)
    else:
        tl.store(p_out + offs, p.to(p_out.dtype.element_ty), mask=mask)
        tl.store(m_out + offs, m.to(m_out.dtype.element_ty), mask=mask)
        tl.store(v_out + offs, v.to(v_out.dtype.element_ty), mask=mask)


def adamw_step(p: Tensor, m: Tensor, v: Tensor, g: Tensor, scale: Tensor | None = None, *, lr: float, beta1: float,
               beta2: float, eps: float, weight_decay: float, step: int, found_inf: Tensor | None = None) -> None:
    """One in-place step (the reference's contract): p, m, v, g contiguous, of one shape, dtype and device; scale a
    0-dim fp32 tensor on that device or None. found_inf (torch's GradScaler convention: a one-element fp32 tensor on
    the device, nonzero when the step's loss or gradients were not finite) makes the step leave p, m and v as they
    are, decided on the device: the host never waits for the value."""
    if not p.is_contiguous() or any(not t.is_contiguous() or t.shape != p.shape or t.device != p.device
                                    or t.dtype != p.dtype for t in (m, v, g)):
        raise ValueError("adamw_step: p, m, v and g must be contiguous tensors of one shape, dtype and device")
    if scale is not None and (scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != p.device):
        raise ValueError("adamw_step: scale is a one-element fp32 tensor on the parameter's device")
    if found_inf is not None and (found_inf.numel() != 1 or found_inf.dtype != torch.float32
                                  or found_inf.device != p.device):
        raise ValueError("adamw_step: found_inf is a one-element fp32 tensor on the parameter's device")
    n = p.numel()
    if n == 0:
        return
    if p.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"adamw_step: bf16 or fp32 parameters, got {p.dtype}")
    bc1, bc2_sqrt = 1.0 - beta1 ** step, math.sqrt(1.0 - beta2 ** step)
    bf16 = p.dtype == torch.bfloat16
    outs = (p.view(torch.int16), m.view(torch.int16), v.view(torch.int16)) if bf16 else (p, m, v)
    _adamw_kernel[(triton.cdiv(n, BLOCK),)](
        p, g, m, v, *outs, scale if scale is not None else p, found_inf if found_inf is not None else p, n, beta1,
        1.0 - beta1, beta2, 1.0 - beta2, eps, lr * weight_decay, lr / bc1, bc2_sqrt, HAS_SCALE=scale is not None,
        HAS_FOUND_INF=found_inf is not None, HAS_DECAY=weight_decay != 0.0, BF16=bf16, BLOCK=BLOCK,
        num_warps=NUM_WARPS, enable_fp_fusion=False)
