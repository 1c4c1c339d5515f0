"""The low-rank half of an expert adapter's product, added in place (novatune.ops.moe_lora):

    y[r, :] += scale * u[r, :] @ M[expert[r]]          y (S, N), u (S, R), M (E, R, N) any strides, R small

on rows sorted by expert (S rows; `expert` (S,) the expert of each row, any integer dtype). It serves the three
places where an adapter's thin (S, R) product meets a wide (S, N) tensor: the forward's s * (u A^T) B^T added to the
base GEMM's output (M = B^T), and the backward's (s dy B) A added to an input gradient (M = A), in bf16 or fp32.
torch's grouped GEMM would write an (S, N) product to be added afterwards (a second pass over it, and S x N bytes of
temporary: 128 MiB for 32,768 rows of 2,048 in bf16); here each program reads its rows of y once, accumulates the R
products in fp32 and rounds once at the store (round-to-nearest-even, bit-identical under the interpreter).

Each program takes BLOCK_M rows by BLOCK_N columns. Rows are sorted by expert, so a tile's rows belong to the experts
from its first row's to its last row's (mostly one or two): for each of them the tile multiplies its rows of u (the
others zeroed) by that expert's (R, BLOCK_N) slice of M on the tensor cores (R zero-padded to 16, the smallest dot;
fp32 operands without TF32). The products are few beside the bytes of y the tile reads and writes once, so the kernel
runs at about the speed of a pass over y.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from novatune.kernels.launch import cdiv, lean, next_pow2
from novatune.kernels.rms_norm import _round_to  # fp32 -> dtype with round-to-nearest-even, interpreter too

BLOCK_M, BLOCK_N = 64, 128


@triton.jit
def _lowrank_add_kernel(Y, U, M, EXPERT, S, N, R, stride_ys, stride_us, stride_me, stride_mr, stride_mn, scale,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
                        SOFT_RNE: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK_M
    rows = start + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_R)
    rmask = rows < S
    mask = rmask[:, None] & (cols < N)[None, :]
    e = tl.load(EXPERT + rows, mask=rmask, other=0).to(tl.int64)
    u = tl.load(U + rows[:, None] * stride_us + ks[None, :], mask=rmask[:, None] & (ks < R)[None, :], other=0.0)
    # rows are sorted by expert: the tile's experts run from its first row's to its last row's
    first = tl.load(EXPERT + start).to(tl.int64)  # int64 bounds: the expert offsets below are int64
    last = tl.load(EXPERT + tl.minimum(start + BLOCK_M, S) - 1).to(tl.int64)
    m_mask = (ks < R)[:, None] & (cols < N)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ex in range(first, last + 1):
        mine = tl.where((rmask & (e == ex))[:, None], u, tl.zeros_like(u))
        m = tl.load(M + ex * stride_me + ks[:, None] * stride_mr + cols[None, :] * stride_mn,
                    mask=m_mask, other=0.0)
        if IEEE or SOFT_RNE:
            # fp32 operands (no TF32), or the CPU interpreter, whose bf16 dot is wrong (Triton 3.9): there bf16 is
            # widened first, exact (a bf16 x bf16 product fits fp32), the same math as the GPU's bf16 MMA
            acc += tl.dot(mine.to(tl.float32), m.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(mine, m)
    y_ptrs = Y + rows[:, None] * stride_ys + cols[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, _round_to(y + scale * acc, Y.dtype.element_ty, SOFT_RNE), mask=mask)


_LOWRANK_ADD = lean(_lowrank_add_kernel)


def lowrank_add_(y: torch.Tensor, u: torch.Tensor, m: torch.Tensor, expert: torch.Tensor,
                 scale: float = 1.0) -> torch.Tensor:
    """y[r] += scale * u[r] @ m[expert[r]] in place (module docstring); returns y. y (S, N) with unit column
    stride, u (S, R) with unit column stride, m (E, R, N) of any strides, expert (S,) integers in [0, E)."""
    s, n = y.shape
    r = u.shape[1]
    if u.shape[0] != s or m.dim() != 3 or m.shape[1:] != (r, n) or expert.shape != (s,):
        raise ValueError(f"lowrank_add_: y {tuple(y.shape)}, u {tuple(u.shape)}, m {tuple(m.shape)}, expert "
                         f"{tuple(expert.shape)} are not (S, N), (S, R), (E, R, N), (S,)")
    if y.stride(1) != 1 or u.stride(1) != 1:
        raise ValueError("lowrank_add_: y and u need unit column strides (y is written in place)")
    if u.dtype != m.dtype:
        raise ValueError(f"lowrank_add_: u is {u.dtype} and m {m.dtype}; cast the factors to one dtype")
    expert = expert.contiguous()
    if s and n:
        _LOWRANK_ADD[(cdiv(s, BLOCK_M), cdiv(n, BLOCK_N))](
            y, u, m, expert, s, n, r, y.stride(0), u.stride(0), m.stride(0), m.stride(1), m.stride(2), float(scale),
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=max(16, next_pow2(r)), IEEE=u.dtype == torch.float32,
            SOFT_RNE=not y.is_cuda)
    return y
