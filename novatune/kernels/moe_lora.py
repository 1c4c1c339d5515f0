"""The low-rank half of an expert adapter's product, added in place (novatune.ops.moe_lora):

    y[r, :] += scale * u[r, :] @ M[expert[r]]          y (S, N), u (S, R), M (E, R, N) any strides, R small

on rows sorted by expert (S rows; `expert` (S,) the expert of each row, any integer dtype). It serves the three
places where an adapter's thin (S, R) product meets a wide (S, N) tensor: the forward's s * (u A^T) B^T added to the
base GEMM's output (M = B^T), and the backward's (s dy B) A added to an input gradient (M = A), in bf16 or fp32.
torch's grouped GEMM would write an (S, N) product to be added afterwards (a second pass over it, and S x N bytes of
temporary: 128 MiB for 32,768 rows of 2,048 in bf16); here each program reads its rows of y once, accumulates the R
products in fp32 and rounds once at the store (round-to-nearest-even, bit-identical under the interpreter).

Each program takes BLOCK_M rows by BLOCK_N columns and gathers every row's own expert slice of M, so a tile may span
experts (rows are sorted: neighbouring rows mostly share an expert and its slice stays in cache). The R products are
done on the CUDA cores: R x N multiply-adds per row (32k for R 16, N 2048) are a small fraction of the bytes the
tile moves, so the kernel runs at the speed of reading and writing y.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from novatune.kernels.launch import cdiv, lean
from novatune.kernels.rms_norm import _round_to  # fp32 -> dtype with round-to-nearest-even, interpreter too

BLOCK_M, BLOCK_N = 32, 128


@triton.jit
def _lowrank_add_kernel(Y, U, M, EXPERT, S, N, R, stride_ys, stride_us, stride_me, stride_mr, stride_mn, scale,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFT_RNE: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < S
    mask = rmask[:, None] & (cols < N)[None, :]
    e = tl.load(EXPERT + rows, mask=rmask, other=0).to(tl.int64)
    m_ptrs = M + e[:, None] * stride_me + cols[None, :] * stride_mn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, R):
        u_k = tl.load(U + rows * stride_us + k, mask=rmask, other=0.0).to(tl.float32)
        m_k = tl.load(m_ptrs + k * stride_mr, mask=mask, other=0.0).to(tl.float32)
        acc += u_k[:, None] * m_k
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
    expert = expert.contiguous()
    if s and n:
        _LOWRANK_ADD[(cdiv(s, BLOCK_M), cdiv(n, BLOCK_N))](
            y, u, m, expert, s, n, r, y.stride(0), u.stride(0), m.stride(0), m.stride(1), m.stride(2), float(scale),
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, SOFT_RNE=not y.is_cuda)
    return y
