"""Mixture-of-experts data movement and activation as Triton kernels (the GEMMs are torch's grouped_mm).

Shapes: T tokens, K experts per token, S = T * K rows in expert order, H hidden, I expert intermediate.
`pos[t, k]` is the row (in expert order) that holds token t's k-th choice; `rows[r]` the token of row r.

    permute            xs[r] = x[rows[r]]                                  (gather; no weighted copy)
    combine            out[t] = sum_k w[t, k] * y[pos[t, k]]               (unpermute + weighted sum, fp32 acc)
    combine backward   dy[pos[t, k]] = w[t, k] * dout[t]                   (each row written exactly once)
                       dw[t, k] = <y[pos[t, k]], dout[t]>                  (fp32 dot over H)
    permute backward   dx[t] = sum_k dxs[pos[t, k]]                        (= combine with w = 1)
    glu                a = silu(gate) * up read straight from the fused (S, 2I) gate_up output, [gate; up]
                       (concatenated) or (g0, u0, g1, u1, ...) (interleaved): no split copies
    glu backward       dh from da and h (sigmoid recomputed, nothing else saved)

So neither the weighted copy of the expert outputs nor the inverse-permuted copy exists: the combine reads each
expert output row once and writes each token once. Every kernel accumulates in fp32 and rounds once at the store
(round-to-nearest-even, bit-identical under the interpreter). Launchers take optional preallocated outputs so tests
can poison them; all tensors are contiguous (the launchers make them so).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from novatune.kernels.rms_norm import _round_to  # fp32 -> dtype with round-to-nearest-even, interpreter too


def default_block(n: int) -> int:
    """Columns per program: the row width rounded up to a power of two, between 64 and 1024 (16-byte vectors,
    a whole 2048-wide row in two passes)."""
    return max(64, min(1024, triton.next_power_of_2(n)))


# ----------------------------------------------------------------------------------------------- kernels
@triton.jit
def _gather_rows_kernel(X, ROWS, OUT, H, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    src = tl.load(ROWS + r).to(tl.int64)
    v = tl.load(X + src * H + cols, mask=mask, other=0.0)
    tl.store(OUT + r * H + cols, v, mask=mask)


@triton.jit
def _combine_kernel(Y, POS, W, OUT, H, K, HAS_W: tl.constexpr, BLOCK: tl.constexpr, SOFT_RNE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(K):
        p = tl.load(POS + t * K + j).to(tl.int64)
        v = tl.load(Y + p * H + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            v = v * tl.load(W + t * K + j).to(tl.float32)
        acc += v
    tl.store(OUT + t * H + cols, _round_to(acc, OUT.dtype.element_ty, SOFT_RNE), mask=mask)


@triton.jit
def _combine_bwd_kernel(DOUT, Y, POS, W, DY, DW, H, K, BLOCK: tl.constexpr, SOFT_RNE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    for j in range(K):
        p = tl.load(POS + t * K + j).to(tl.int64)
        w = tl.load(W + t * K + j).to(tl.float32)
        dot = tl.zeros((BLOCK,), dtype=tl.float32)
        for c0 in range(0, H, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            mask = cols < H
            d = tl.load(DOUT + t * H + cols, mask=mask, other=0.0).to(tl.float32)
            y = tl.load(Y + p * H + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(DY + p * H + cols, _round_to(w * d, DY.dtype.element_ty, SOFT_RNE), mask=mask)
            dot += y * d
        tl.store(DW + t * K + j, tl.sum(dot, axis=0))


@triton.jit
def _glu_fwd_kernel(HB, A, n, N_INTER, INTERLEAVED: tl.constexpr, BLOCK: tl.constexpr, SOFT_RNE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # flat index into a (S, N_INTER)
    mask = offs < n
    r = offs // N_INTER
    c = offs % N_INTER
    if INTERLEAVED:
        gi = r * 2 * N_INTER + 2 * c
        ui = gi + 1
    else:
        gi = r * 2 * N_INTER + c
        ui = gi + N_INTER
    g = tl.load(HB + gi, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(HB + ui, mask=mask, other=0.0).to(tl.float32)
    tl.store(A + offs, _round_to(g * tl.sigmoid(g) * u, A.dtype.element_ty, SOFT_RNE), mask=mask)


@triton.jit
def _glu_bwd_kernel(DA, HB, DH, n, N_INTER, INTERLEAVED: tl.constexpr, BLOCK: tl.constexpr, SOFT_RNE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    r = offs // N_INTER
    c = offs % N_INTER
    if INTERLEAVED:
        gi = r * 2 * N_INTER + 2 * c
        ui = gi + 1
    else:
        gi = r * 2 * N_INTER + c
        ui = gi + N_INTER
    da = tl.load(DA + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(HB + gi, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(HB + ui, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)  # recomputed from the saved gate_up output
    silu = g * sig
    tl.store(DH + ui, _round_to(da * silu, DH.dtype.element_ty, SOFT_RNE), mask=mask)
    tl.store(DH + gi, _round_to(da * u * (sig + silu * (1.0 - sig)), DH.dtype.element_ty, SOFT_RNE), mask=mask)


# ----------------------------------------------------------------------------------------------- launchers
def _out(buf, shape, like: torch.Tensor, dtype=None) -> torch.Tensor:
    dtype = dtype or like.dtype
    if buf is None:
        return torch.empty(shape, dtype=dtype, device=like.device)
    if tuple(buf.shape) != tuple(shape) or buf.dtype != dtype or not buf.is_contiguous():
        raise ValueError(f"output buffer must be contiguous {tuple(shape)} {dtype}, got {tuple(buf.shape)} "
                         f"{buf.dtype}")
    return buf


def gather_rows(x: torch.Tensor, rows: torch.Tensor, out: torch.Tensor | None = None, *,
                block: int | None = None) -> torch.Tensor:
    """out[r] = x[rows[r]]: x (T, H), rows (S,) integer -> (S, H) in x's dtype."""
    x, rows = x.contiguous(), rows.contiguous()
    s, h = rows.shape[0], x.shape[1]
    out = _out(out, (s, h), x)
    block = block or default_block(h)
    if s:
        _gather_rows_kernel[(s, triton.cdiv(h, block))](x, rows, out, h, BLOCK=block)
    return out


def combine(y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor | None, out: torch.Tensor | None = None, *,
            out_dtype: torch.dtype | None = None, block: int | None = None) -> torch.Tensor:
    """out[t] = sum_k w[t, k] * y[pos[t, k]] (w = 1 when weights is None): y (S, H), pos (T, K) -> (T, H)."""
    y, pos = y.contiguous(), pos.contiguous()
    t, k = pos.shape
    h = y.shape[1]
    out = _out(out, (t, h), y, out_dtype)
    block = block or default_block(h)
    w = pos if weights is None else weights.contiguous()  # unused when HAS_W is False
    if t:
        _combine_kernel[(t, triton.cdiv(h, block))](y, pos, w, out, h, k, HAS_W=weights is not None, BLOCK=block,
                                                    SOFT_RNE=not y.is_cuda)
    return out


def combine_bwd(dout: torch.Tensor, y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor,
                dy: torch.Tensor | None = None, dw: torch.Tensor | None = None, *,
                block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dy (S, H) in y's dtype, dw (T, K) fp32) of `combine` with weights."""
    dout, y, pos, weights = dout.contiguous(), y.contiguous(), pos.contiguous(), weights.contiguous()
    t, k = pos.shape
    h = y.shape[1]
    dy = _out(dy, tuple(y.shape), y)
    dw = _out(dw, (t, k), y, torch.float32)
    block = block or default_block(h)
    if t:
        _combine_bwd_kernel[(t,)](dout, y, pos, weights, dy, dw, h, k, BLOCK=block, SOFT_RNE=not y.is_cuda)
    return dy, dw


_GLU_BLOCK = 1024


def glu_fwd(h: torch.Tensor, interleaved: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up from the fused gate_up output h (S, 2I) -> (S, I) in h's dtype."""
    h = h.contiguous()
    s, i = h.shape[0], h.shape[1] // 2
    out = _out(out, (s, i), h)
    n = s * i
    if n:
        _glu_fwd_kernel[(triton.cdiv(n, _GLU_BLOCK),)](h, out, n, i, INTERLEAVED=interleaved, BLOCK=_GLU_BLOCK,
                                                      SOFT_RNE=not h.is_cuda)
    return out


def glu_bwd(da: torch.Tensor, h: torch.Tensor, interleaved: bool, dh: torch.Tensor | None = None) -> torch.Tensor:
    """d(gate_up output) (S, 2I) from da (S, I) and h."""
    da, h = da.contiguous(), h.contiguous()
    s, i = h.shape[0], h.shape[1] // 2
    dh = _out(dh, tuple(h.shape), h)
    n = s * i
    if n:
        _glu_bwd_kernel[(triton.cdiv(n, _GLU_BLOCK),)](da, h, dh, n, i, INTERLEAVED=interleaved, BLOCK=_GLU_BLOCK,
                                                      SOFT_RNE=not h.is_cuda)
    return dh
