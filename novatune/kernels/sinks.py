"""Attention sinks' scale around a FlashAttention call, one pass each way (novatune/attention/sinks.py has the math).

Rows are (token, query head) pairs of the attention output (tokens, hq, d); per row, with L its log-sum-exp and s
the head's sink logit, c = sigmoid(L - s):

    forward    out' = round(out * c)                                        out's dtype
    backward   dout = round(g * c),   r = (1 - c) * <g, out'>               dout in g's dtype, r fp32 per row;
               the sink's gradient is -sum over tokens of r (a (tokens, hq) -> (hq,) sum in torch: a fixed order)

Each is what the torch formulas compute (fp32 products, one rounding at the store), without their fp32 copies of
the (tokens, hq, d) output and gradient: the forward reads out and writes out', the backward reads g and out' and
writes dout and r. The log-sum-exp may be a strided view (FlashAttention-2 returns it as (hq, tokens)).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from novatune.kernels.launch import cdiv, lean, next_pow2
from novatune.kernels.rms_norm import _round_to

ROWS = 32  # (token, head) rows per program: 32 x 64 features at GPT-OSS's head size, 2 KiB of bf16 per tensor


@triton.jit
def _rows_and_scale(LSE, SINKS, n_rows, HQ, stride_lt, stride_lh, D, BR: tl.constexpr, BD: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    rmask = rows < n_rows
    t, h = rows // HQ, rows % HQ
    lse = tl.load(LSE + t * stride_lt + h * stride_lh, mask=rmask, other=0.0).to(tl.float32)
    sink = tl.load(SINKS + h, mask=rmask, other=0.0).to(tl.float32)
    c = tl.sigmoid(lse - sink)
    cols = tl.arange(0, BD)
    mask = rmask[:, None] & (cols < D)[None, :]
    return rows, rmask, c, rows[:, None] * D + cols[None, :], mask


@triton.jit
def _sink_fwd_kernel(OUT, LSE, SINKS, SUNK, n_rows, HQ, stride_lt, stride_lh, D, BR: tl.constexpr,
                     BD: tl.constexpr, SOFT_RNE: tl.constexpr):
    rows, rmask, c, at, mask = _rows_and_scale(LSE, SINKS, n_rows, HQ, stride_lt, stride_lh, D, BR, BD)
    out = tl.load(OUT + at, mask=mask, other=0.0).to(tl.float32)
    tl.store(SUNK + at, _round_to(out * c[:, None], SUNK.dtype.element_ty, SOFT_RNE), mask=mask)


@triton.jit
def _sink_bwd_kernel(G, SUNK, LSE, SINKS, DOUT, R, n_rows, HQ, stride_lt, stride_lh, D, BR: tl.constexpr,
                     BD: tl.constexpr, SOFT_RNE: tl.constexpr):
    rows, rmask, c, at, mask = _rows_and_scale(LSE, SINKS, n_rows, HQ, stride_lt, stride_lh, D, BR, BD)
    g = tl.load(G + at, mask=mask, other=0.0).to(tl.float32)
    sunk = tl.load(SUNK + at, mask=mask, other=0.0).to(tl.float32)
    tl.store(DOUT + at, _round_to(g * c[:, None], DOUT.dtype.element_ty, SOFT_RNE), mask=mask)
    tl.store(R + rows, (1.0 - c) * tl.sum(g * sunk, axis=1), mask=rmask)


_FWD, _BWD = lean(_sink_fwd_kernel), lean(_sink_bwd_kernel)


def _check(x: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    if x.dim() != 3 or not x.is_contiguous() or lse.shape != x.shape[:2] or sinks.shape != (x.shape[1],):
        raise ValueError(f"sink scale: a contiguous (tokens, hq, d) tensor, lse (tokens, hq) and sinks (hq,) "
                         f"expected; got {tuple(x.shape)} (contiguous={x.is_contiguous()}), {tuple(lse.shape)}, "
                         f"{tuple(sinks.shape)}")


def _launch(kernel, x: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, *tensors) -> None:
    tokens, hq, d = x.shape
    n = tokens * hq
    if n:  # d = 0 still writes r (zeros)
        kernel[(cdiv(n, ROWS),)](*tensors, n, hq, lse.stride(0), lse.stride(1), d, BR=ROWS,
                                 BD=max(16, next_pow2(d)),
                                 SOFT_RNE=not x.is_cuda)


def sink_scale_fwd(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor,
                   sunk: torch.Tensor | None = None) -> torch.Tensor:
    """out * sigmoid(lse - sinks[head]) per (token, head) row, in out's dtype (a new tensor, or `sunk`)."""
    out, sinks = out.contiguous(), sinks.contiguous()
    _check(out, lse, sinks)
    sunk = torch.empty_like(out) if sunk is None else sunk
    _check(sunk, lse, sinks)
    _launch(_FWD, out, lse, sinks, out, lse, sinks, sunk)
    return sunk


def sink_scale_bwd(g: torch.Tensor, sunk: torch.Tensor, lse: torch.Tensor,
                   sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dout = g * c in g's dtype, the sinks' gradient (hq,) fp32) for out' = out * c, c = sigmoid(lse - sinks)."""
    g, sinks = g.contiguous(), sinks.contiguous()
    _check(g, lse, sinks)
    _check(sunk, lse, sinks)
    dout = torch.empty_like(g)
    r = torch.empty(g.shape[:2], dtype=torch.float32, device=g.device)
    _launch(_BWD, g, lse, sinks, g, sunk, lse, sinks, dout, r)
    return dout, -r.sum(0)
