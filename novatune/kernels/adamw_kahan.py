"""Triton kernel of AdamW with a compensated (Kahan) weight update, in place, one launch per parameter.

The math and its reason: novatune/reference/adamw_kahan.py (the fp32 oracle). One pass reads w, c, g (storage
dtype) and m, v (fp32) and writes w, c, m, v: 2 + 2 + 2 + 4 + 4 bytes read and 2 + 2 + 4 + 4 written per bf16
parameter. fp contraction is off so `y - (w' - w)` is evaluated as written (the compensation depends on it), and
bf16 results are rounded to nearest even on the bits (_to_bf16_rne), whatever the backend's cast does.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 1024


@triton.jit
def _to_bf16_rne(x):
    """fp32 -> (the nearest bf16, ties to even, as an fp32 value; its 16 bits as int32). Integer rounding on the
    bits, as kernels/nf4.py's _store_out: the GPU's cvt.rn result, and the Triton interpreter (whose .to(bf16)
    truncates) computes it too. The compensation must see the rounding the GPU does: a truncating cast drops up to
    a whole spacing each step and the stored c then loses up to 2^-7 of it, every step, in one direction."""
    bits = x.to(tl.int32, bitcast=True)
    hi = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    hi = tl.where(x != x, 0x7FC0, hi)  # NaN stays NaN (its bits + 0x7FFF would carry into the sign: +-0)
    return (hi << 16).to(tl.float32, bitcast=True), hi


@triton.jit
def _adamw_kahan_kernel(w_ptr, c_ptr, w_bits_ptr, c_bits_ptr, m_ptr, v_ptr, g_ptr, n, lr, beta1, one_minus_beta1,
                        beta2, one_minus_beta2, eps, lr_weight_decay, bc1, bc2_sqrt, HAS_C: tl.constexpr,
                        BF16: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    # 1 - beta and lr * weight_decay come from the host in fp64, rounded once: 1 - beta2 computed here from an fp32
    # beta2 = 0.999 would be off by 1.3e-5 relative. Division and square root round to nearest, as torch's do.
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * g * g
    u = tl.div_rn(-lr * tl.div_rn(m, bc1), tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps) - lr_weight_decay * w
    if HAS_C:
        y = u + tl.load(c_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if BF16:
            new, new_bits = _to_bf16_rne(w + y)
            _, c_bits = _to_bf16_rne(y - (new - w))
            tl.store(w_bits_ptr + offs, new_bits.to(tl.int16), mask=mask)
            tl.store(c_bits_ptr + offs, c_bits.to(tl.int16), mask=mask)
        else:
            new = (w + y).to(w_ptr.dtype.element_ty)
            tl.store(c_ptr + offs, (y - (new.to(tl.float32) - w)).to(c_ptr.dtype.element_ty), mask=mask)
            tl.store(w_ptr + offs, new, mask=mask)
    else:
        tl.store(w_ptr + offs, (w + u).to(w_ptr.dtype.element_ty), mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)


def adamw_kahan_step(w: Tensor, c: Tensor | None, m: Tensor, v: Tensor, g: Tensor, *, lr: float, beta1: float,
                     beta2: float, eps: float, weight_decay: float, step: int) -> None:
    """One in-place step (the reference's contract): w, c (or None), g of w's shape and dtype; m, v fp32; all
    contiguous on one device."""
    tensors = [t for t in (w, c, m, v, g) if t is not None]
    if any(not t.is_contiguous() or t.shape != w.shape or t.device != w.device for t in tensors):
        raise ValueError("adamw_kahan_step: w, c, m, v and g must be contiguous tensors of one shape on one device")
    if m.dtype != torch.float32 or v.dtype != torch.float32:
        raise TypeError(f"adamw_kahan_step: m and v are fp32 state, got {m.dtype} and {v.dtype}")
    n = w.numel()
    if n == 0:
        return
    bc1, bc2_sqrt = 1.0 - beta1 ** step, math.sqrt(1.0 - beta2 ** step)
    bits = (w, w)
    if c is not None and w.dtype == torch.bfloat16:
        bits = (w.view(torch.int16), c.view(torch.int16))  # int16 views: where the rounded bits are stored
    _adamw_kahan_kernel[(triton.cdiv(n, BLOCK),)](
        w, c if c is not None else w, *bits, m, v, g, n, lr, beta1, 1.0 - beta1, beta2, 1.0 - beta2, eps,
        lr * weight_decay, bc1, bc2_sqrt,
        HAS_C=c is not None, BF16=bits[0] is not w, BLOCK=BLOCK, enable_fp_fusion=False)
