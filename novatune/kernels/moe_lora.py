"""An expert adapter's thin kernels (novatune.ops.moe_lora), on rows sorted by expert:

    lowrank_add_(y, u, M, expert, s)     y[r, :] += s * u[r, :] @ M[expert[r]]   y (S, N), u (S, R), M (E, R, N)
    lowrank_project(x, M, ends, s)       u[r, :] = s * x[r, :] @ M[e]            x (S, K), M (E, K, R), rows of e
    expert_major(B, dtype, rp)           PEFT's lora_B, stored with the expert fastest, as (E, N, rp) in `dtype`

R (the rank) is small; M has any strides and float dtype, read in the other operand's dtype (rounded to nearest even
as it loads: the cast PEFT makes before forming its delta). All accumulate in fp32 and round once at the store
(round-to-nearest-even, bit-identical under the interpreter).

lowrank_add_ serves the three places where an adapter's thin (S, R) product meets a wide (S, N) tensor: the
forward's s * (u A^T) B^T added to the base GEMM's output (M = B^T), and the backward's (s dy B) A added to an input
gradient (M = A), in bf16 or fp32. torch's grouped GEMM would write an (S, N) product to be added afterwards (a
second pass over it, and S x N bytes of temporary: 128 MiB for 32,768 rows of 2,048 in bf16); here each program
reads its rows of y once. Each program takes BLOCK_M rows by BLOCK_N columns. Rows are sorted by expert, so a
tile's rows belong to the experts from its first row's to its last row's (mostly one or two): for each of them the
tile multiplies its rows of u (the others zeroed) by that expert's (R, BLOCK_N) slice of M on the tensor cores (R
zero-padded to 16, the smallest dot; fp32 operands without TF32). The products are few beside the bytes of y the
tile reads and writes once, so the kernel runs at about the speed of a pass over y.

lowrank_project forms the thin half (the forward's u A^T, the backward's s dy B): one read of x. Its tiles hold one
expert's rows each (the tile's expert found in the kernel from the cumulative ends, no host sync), so the K loop is
a plain pipelined GEMM: on an H200 at S = 32,768 it reads x at ~70% of the card's copy bandwidth where torch's
grouped GEMM reaches ~50% (experiments.jsonl moe_lora_thin, session23-4: 43 against 60 us at K = 2,048).

expert_major casts PEFT's lora_B ((out, r * E) storage, B_e's column j at j * E + e) for the GEMMs: torch's copy of
that permuted view reads across the expert stride; this kernel reads (out, r, E) blocks along the expert and writes
each expert's rows as one run (21-22 us against 23-29 for torch's copy at Qwen3-30B-A3B's shapes:
experiments.jsonl moe_lora_thin, session23-5).
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
        m = _round_to(m.to(tl.float32), U.dtype.element_ty, SOFT_RNE)  # the factor in u's dtype, as a cast would
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
    stride, u (S, R) bf16 or fp32 with unit column stride, m (E, R, N) of any strides and float dtype (read in u's
    dtype, rounded to nearest even: a factor kept in fp32 needs no cast copy), expert (S,) integers in [0, E)."""
    s, n = y.shape
    r = u.shape[1]
    if u.shape[0] != s or m.dim() != 3 or m.shape[1:] != (r, n) or expert.shape != (s,):
        raise ValueError(f"lowrank_add_: y {tuple(y.shape)}, u {tuple(u.shape)}, m {tuple(m.shape)}, expert "
                         f"{tuple(expert.shape)} are not (S, N), (S, R), (E, R, N), (S,)")
    if y.stride(1) != 1 or u.stride(1) != 1:
        raise ValueError("lowrank_add_: y and u need unit column strides (y is written in place)")
    if u.dtype not in (torch.bfloat16, torch.float32) or not m.dtype.is_floating_point:
        raise ValueError(f"lowrank_add_: u is {u.dtype} and m {m.dtype}; u bf16 or fp32, m a float tensor")
    expert = expert.contiguous()
    if s and n:
        _LOWRANK_ADD[(cdiv(s, BLOCK_M), cdiv(n, BLOCK_N))](
            y, u, m, expert, s, n, r, y.stride(0), u.stride(0), m.stride(0), m.stride(1), m.stride(2), float(scale),
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=max(16, next_pow2(r)), IEEE=u.dtype == torch.float32,
            SOFT_RNE=not y.is_cuda)
    return y


@triton.jit
def _lowrank_project_kernel(X, M, OUT, ENDS, E, K, R, stride_xs, stride_me, stride_mk, stride_mr, stride_os, scale,
                            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                            BLOCK_E: tl.constexpr, IEEE: tl.constexpr, SOFT_RNE: tl.constexpr):
    # tile t of the grid -> (expert e, its block b of BLOCK_M rows), from the cumulative ends: each tile holds one
    # expert's rows only, so the K loop is a plain pipelined GEMM (no per-expert masking inside it)
    es = tl.arange(0, BLOCK_E)
    ends = tl.load(ENDS + es, mask=es < E, other=0).to(tl.int64)
    starts = tl.load(ENDS + es - 1, mask=(es > 0) & (es < E), other=0).to(tl.int64)
    tiles = tl.where(es < E, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    before = tl.cumsum(tiles, 0) - tiles  # tiles of the experts before each
    t = tl.program_id(0)
    if t < tl.sum(tiles, 0):
        e = tl.sum((before + tiles <= t).to(tl.int32), 0)  # the expert whose tiles hold t
        mine = es == e
        end = tl.sum(tl.where(mine, ends, 0), 0)
        row0 = tl.sum(tl.where(mine, starts, 0), 0) + (t - tl.sum(tl.where(mine, before, 0), 0)) * BLOCK_M
        rows = row0 + tl.arange(0, BLOCK_M)
        rmask = rows < end
        rs = tl.arange(0, BLOCK_R)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(X + rows[:, None] * stride_xs + ks[None, :], mask=rmask[:, None] & (ks < K)[None, :],
                        other=0.0)
            m = tl.load(M + e.to(tl.int64) * stride_me + ks[:, None] * stride_mk + rs[None, :] * stride_mr,
                        mask=(ks < K)[:, None] & (rs < R)[None, :], other=0.0)
            m = _round_to(m.to(tl.float32), X.dtype.element_ty, SOFT_RNE)  # the factor in x's dtype, as a cast
            if IEEE or SOFT_RNE:  # as in _lowrank_add_kernel
                acc += tl.dot(x.to(tl.float32), m.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(x, m)
        out_ptrs = OUT + rows[:, None] * stride_os + rs[None, :]
        tl.store(out_ptrs, _round_to(scale * acc, OUT.dtype.element_ty, SOFT_RNE),
                 mask=rmask[:, None] & (rs < R)[None, :])


_LOWRANK_PROJECT = lean(_lowrank_project_kernel)
# (rows, K step, warps, stages): one expert's rows per tile, the K loop pipelined
PROJECT_CONFIG = (64, 128, 4, 4)


def lowrank_project(x: torch.Tensor, m: torch.Tensor, ends: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """u[r] = scale * x[r] @ m[e] for the rows r of each expert e -> u (S, R) in x's dtype: the thin half of an
    adapter's product (the forward's u A^T, the backward's s * dy B), one read of x (module docstring). x (S, K) bf16
    or fp32 with unit column stride, rows sorted by expert; m (E, K, R) of any strides and float dtype (read in x's
    dtype, as lowrank_add_ reads its factor); ends (E,) int32 cumulative group ends (grouped_mm's offsets; read on
    the device, no host sync) whose last is S: rows past it are not written. fp32 accumulation, one rounding at the
    store."""
    s, k = x.shape
    if m.dim() != 3 or m.shape[1] != k or ends.shape != (m.shape[0],) or ends.dtype != torch.int32:
        raise ValueError(f"lowrank_project: x {tuple(x.shape)}, m {tuple(m.shape)}, ends {tuple(ends.shape)} "
                         f"{ends.dtype} are not (S, K), (E, K, R), int32 (E,)")
    if x.stride(1) != 1 or x.dtype not in (torch.bfloat16, torch.float32) or not m.dtype.is_floating_point:
        raise ValueError(f"lowrank_project: x ({x.dtype}) bf16 or fp32 with a unit column stride, m ({m.dtype}) "
                         "a float tensor")
    e, r = m.shape[0], m.shape[2]
    out = x.new_empty(s, r)
    if s and r and e:
        block_m, block_k, warps, stages = PROJECT_CONFIG
        _LOWRANK_PROJECT[(cdiv(s, block_m) + e,)](  # at most one partial tile per expert beyond S / BLOCK_M
            x, m, out, ends.contiguous(), e, k, r, x.stride(0), m.stride(0), m.stride(1), m.stride(2),
            out.stride(0), float(scale), BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=max(16, next_pow2(r)),
            BLOCK_E=max(16, next_pow2(e)), IEEE=x.dtype == torch.float32, SOFT_RNE=not x.is_cuda,
            num_warps=warps, num_stages=stages)
    return out


@triton.jit
def _expert_major_kernel(SRC, DST, E, N, R, stride_se, stride_sn, stride_sr, BLOCK_E: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SOFT_RNE: tl.constexpr):
    es = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    ns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, BLOCK_R)
    # a (BLOCK_N, BLOCK_R, BLOCK_E) block read along the source's fastest dimension (PEFT's: the expert)
    src = (SRC + ns[:, None, None].to(tl.int64) * stride_sn + rs[None, :, None] * stride_sr
           + es[None, None, :].to(tl.int64) * stride_se)
    mask = (ns < N)[:, None, None] & (rs < R)[None, :, None] & (es < E)[None, None, :]
    v = _round_to(tl.load(src, mask=mask, other=0.0).to(tl.float32), DST.dtype.element_ty, SOFT_RNE)
    # written expert-major: each expert's (BLOCK_N, BLOCK_R) rows are one contiguous run; ranks R.. are zeros
    v = tl.permute(v, (2, 0, 1))
    dst = DST + (es[:, None, None].to(tl.int64) * N + ns[None, :, None]) * BLOCK_R + rs[None, None, :]
    tl.store(dst, v, mask=(es < E)[:, None, None] & (ns < N)[None, :, None])


_EXPERT_MAJOR = lean(_expert_major_kernel)


def expert_major(m: torch.Tensor, dtype: torch.dtype, padded_rank: int) -> torch.Tensor:
    """m (E, N, R) of any strides and float dtype -> (E, N, padded_rank) contiguous in `dtype`, ranks R.. zero: one
    pass that reads PEFT's lora_B storage (out, r * E), whose fastest index is the expert, in its own order and
    writes each expert's rows contiguously (torch's copy of that permuted view reads across the expert stride).
    padded_rank: a power of two >= R."""
    e, n, r = m.shape
    if padded_rank < r or padded_rank & (padded_rank - 1):
        raise ValueError(f"expert_major: padded_rank {padded_rank} must be a power of two >= the rank {r}")
    out = torch.empty(e, n, padded_rank, dtype=dtype, device=m.device)
    if out.numel():
        block_e, block_n = 32, max(1, 512 // padded_rank)
        _EXPERT_MAJOR[(cdiv(n, block_n), cdiv(e, block_e))](
            m, out, e, n, r, m.stride(0), m.stride(1), m.stride(2), BLOCK_E=block_e, BLOCK_N=block_n,
            BLOCK_R=padded_rank, SOFT_RNE=not m.is_cuda, num_warps=8)
    return out
