"""The experts' biases (GPT-OSS) over rows sorted by expert, as Triton kernels: no gathered (S, N) copy of the bias
and no fp32 copy of the gradient.

Rows r = 0 .. S-1 are in expert order; `expert` (S,) holds each row's expert id (the routing's sorted keys, any
integer dtype), so the rows of one expert are contiguous.

    bias add       y[r, :] += b[expert[r], :]                       in place, fp32 sum rounded once to y's dtype
                   (what `y + b[expert]` computes, without the gathered (S, N) bias)
    column sums    sums[e, :] = sum_{r in e} s_r * dy[r, :]         (E, N) fp32: the bias gradient, s_r the row's
                   routing weight when the bias sits before it (the down projection's) or 1
    row dot        dot[r] += <dy[r, :], b[expert[r], :]>            the bias's part of the routing weight's
                                                                   gradient (<y, dout> with y = a W^T + b)

A column-sums program takes a (BLOCK_M rows x BLOCK_N columns) tile, sums its rows per expert in fp32 (the tile
spans one expert, or a few at a boundary: the loop runs from its first row's expert to its last one's) and adds
each partial into `sums` with an atomic add. Atomic adds make the fp32 sums' order vary from run to run (as
index_add_'s on CUDA does, which they replace). A row-dot program owns its rows and walks all columns: a fixed
order, so the routing weight's gradient is the same on every run.
The fp32 references are novatune.reference.moe.expert_bias_add_ref / expert_column_sums_ref.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from novatune.kernels.launch import cdiv, lean
from novatune.kernels.rms_norm import _round_to

BLOCK_M, BLOCK_N = 64, 128


@triton.jit
def _tile(S, N, BM: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    rmask, cmask = rows < S, cols < N
    return rows, cols, rmask, cmask, rmask[:, None] & cmask[None, :]


@triton.jit
def _bias_add_kernel(Y, EXPERT, B, S, N, stride_y, BM: tl.constexpr, BN: tl.constexpr, SOFT_RNE: tl.constexpr):
    rows, cols, rmask, cmask, mask = _tile(S, N, BM, BN)
    e = tl.load(EXPERT + rows, mask=rmask, other=0).to(tl.int64)
    at = Y + rows[:, None] * stride_y + cols[None, :]  # grouped_mm pads its rows to 16 bytes: a row stride >= N
    y = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + e[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(at, _round_to(y + b, Y.dtype.element_ty, SOFT_RNE), mask=mask)


@triton.jit
def _column_sums_kernel(DY, EXPERT, SCALE, SUMS, S, N, HAS_SCALE: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr):
    rows, cols, rmask, cmask, mask = _tile(S, N, BM, BN)
    e = tl.load(EXPERT + rows, mask=rmask, other=0).to(tl.int64)
    dy = tl.load(DY + rows[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        dy = dy * tl.load(SCALE + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
    first = tl.program_id(0).to(tl.int64) * BM
    e_lo = tl.load(EXPERT + first).to(tl.int64)
    e_hi = tl.load(EXPERT + tl.minimum(first + BM, S) - 1).to(tl.int64)
    for ex in range(e_lo, e_hi + 1):  # sorted rows: the tile's experts are e_lo .. e_hi
        part = tl.sum(tl.where((e == ex)[:, None] & mask, dy, 0.0), axis=0)
        tl.atomic_add(SUMS + ex * N + cols, part, mask=cmask)


@triton.jit
def _row_dot_kernel(DY, EXPERT, B, DOT, S, N, BM: tl.constexpr, BN: tl.constexpr):
    # one program owns its rows and walks every column: a fixed order, the same sums on every run
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    rmask = rows < S
    e = tl.load(EXPERT + rows, mask=rmask, other=0).to(tl.int64)
    acc = tl.zeros((BM,), dtype=tl.float32)
    for c0 in range(0, N, BN):
        cols = c0 + tl.arange(0, BN)
        mask = rmask[:, None] & (cols < N)[None, :]
        dy = tl.load(DY + rows[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        b = tl.load(B + e[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += tl.sum(dy * b, axis=1)
    tl.store(DOT + rows, tl.load(DOT + rows, mask=rmask, other=0.0) + acc, mask=rmask)


_BIAS_ADD, _COLUMN_SUMS, _ROW_DOT = lean(_bias_add_kernel), lean(_column_sums_kernel), lean(_row_dot_kernel)


def _check(y: torch.Tensor, expert: torch.Tensor, bias: torch.Tensor) -> None:
    if y.dim() != 2 or expert.shape != (y.shape[0],) or bias.dim() != 2 or bias.shape[1] != y.shape[1]:
        raise ValueError(f"moe_bias: rows (S, N), expert (S,) and bias (E, N) expected; got {tuple(y.shape)}, "
                         f"{tuple(expert.shape)}, {tuple(bias.shape)}")
    if expert.dtype.is_floating_point or y.stride(1) != 1 or not bias.is_contiguous():
        raise ValueError("moe_bias: integer expert ids, rows with unit column stride and a contiguous bias expected")


def expert_bias_add_(y: torch.Tensor, expert: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """y[r] += bias[expert[r]] in place (y (S, N) with unit column stride, any row stride; rows sorted or not;
    expert ids in [0, E)); returns y."""
    _check(y, expert, bias)
    s, n = y.shape
    if s and n:
        _BIAS_ADD[(cdiv(s, BLOCK_M), cdiv(n, BLOCK_N))](y, expert.contiguous(), bias, s, n, y.stride(0), BM=BLOCK_M,
                                                        BN=BLOCK_N, SOFT_RNE=not y.is_cuda)
    return y


def expert_column_sums(dy: torch.Tensor, expert: torch.Tensor, num_experts: int, *,
                       scale: torch.Tensor | None = None) -> torch.Tensor:
    """(E, N) fp32 per-expert sums of the rows of dy (S, N, contiguous), sorted by expert with ids in [0, E), each
    row times scale[r] when given. Atomic adds: the fp32 order varies between runs (as index_add_'s on CUDA)."""
    s, n = dy.shape
    sums = torch.zeros(num_experts, n, dtype=torch.float32, device=dy.device)
    _check(dy, expert, sums)
    if not dy.is_contiguous():
        raise ValueError("moe_bias: contiguous rows expected")
    if scale is not None and scale.shape != (s,):
        raise ValueError(f"moe_bias: scale must be (S,) = ({s},), got {tuple(scale.shape)}")
    if s and n:
        _COLUMN_SUMS[(cdiv(s, BLOCK_M), cdiv(n, BLOCK_N))](
            dy, expert.contiguous(), scale.contiguous() if scale is not None else sums, sums, s, n,
            HAS_SCALE=scale is not None, BM=BLOCK_M, BN=BLOCK_N)
    return sums


def expert_row_dot_(dot: torch.Tensor, dy: torch.Tensor, expert: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """dot[r] += <dy[r], bias[expert[r]]> in place (dot (S,) fp32 contiguous; dy (S, N) contiguous; ids in [0, E)),
    in a fixed order (deterministic); returns dot."""
    _check(dy, expert, bias)
    s, n = dy.shape
    if dot.shape != (s,) or dot.dtype != torch.float32 or not dot.is_contiguous() or not dy.is_contiguous():
        raise ValueError(f"moe_bias: dot must be a contiguous fp32 (S,) = ({s},) tensor and dy contiguous")
    if s and n:
        _ROW_DOT[(cdiv(s, BLOCK_M),)](dy, expert.contiguous(), bias, dot, s, n, BM=BLOCK_M, BN=BLOCK_N)
    return dot
