"""Mixture-of-experts data movement and activation as Triton kernels (the GEMMs are torch's grouped_mm).

Shapes: T tokens, K experts per token, S = T * K rows in expert order, H hidden, I expert intermediate.
`pos[t, k]` is the row (in expert order) that holds token t's k-th choice; `rows[r]` the token of row r.

    permute            xs[r] = x[order[r] // K]                            (gather; no weighted copy)
    dispatch           the permute's gather, and from the same rows the routing's inverse and group ends:
                       pos[order[r]] = r, ends[e] = number of rows whose expert <= e (grouped_mm's offsets),
                       read from the sorted expert ids (one launch instead of a scatter, an arange and a search)
    combine            out[t] = sum_k w[t, k] * y[pos[t, k]]               (unpermute + weighted sum, fp32 acc)
    permute backward   dx[t] = sum_k dxs[pos[t, k]]                        (= combine with w = 1), and optionally
                       picked[t, k] = v[pos[t, k]] of a per-row vector v in the same launch (the routing
                       weights' gradient back in (token, choice) order)
    glu                a = silu(gate) * up read straight from the fused (S, 2I) gate_up output, [gate; up]
                       (concatenated) or (g0, u0, g1, u1, ...) (interleaved): no split copies
    routed glu bwd     from h, da_u = dout[token] @ W_down (the down GEMM's input gradient WITHOUT the routing
                       weight) and the row's weight w = weights[order[r]] (read through the sort order in the
                       kernel, no gathered copy):   a = silu(gate) * up (recomputed),
                       dw_row = <a, da_u> (the routing weight's gradient: <y, dout> = <a W^T, dout> = <a, dout W>),
                       aw = w * a (the down weight gradient's operand), dh = glu'(h) * (w * da_u)

    router backward    dlogits from the weights' gradient in one launch (autograd's chain is up to a dozen ops):
                       softmax -> top-k (-> / sum): dtop = (dw - <dw, w>) / s with renormalisation (s = sum
                       of the top-k probabilities), else dw; dlogits = p * (g - <dtop, top>), g = dtop
                       scattered to the chosen experts. top-k -> softmax: dlogits = scatter(w * (dw - <dw, w>))

So neither the weighted copy of the expert outputs nor the inverse-permuted copy exists: the combine reads each
expert output row once and writes each token once; and the backward never needs the expert outputs y, so the
forward does not keep them (S x H per layer). Every kernel accumulates in fp32 and rounds once at the store
(round-to-nearest-even, bit-identical under the interpreter). Launchers take optional preallocated outputs so tests
can poison them; all tensors are contiguous (the launchers make them so). On CUDA every launch takes the lean path
(novatune.kernels.launch): the MoE layer runs eight of these launches per forward and backward, and the step is
host-bound.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from novatune.kernels.launch import cdiv, lean, next_pow2
from novatune.kernels.rms_norm import _round_to  # fp32 -> dtype with round-to-nearest-even, interpreter too


def default_block(n: int) -> int:
    """Columns per program: the row width rounded up to a power of two, between 64 and 1024 (16-byte vectors,
    a whole 2048-wide row in two passes)."""
    return max(64, min(1024, next_pow2(n)))


# ----------------------------------------------------------------------------------------------- kernels
@triton.jit
def _gather_rows_kernel(X, IDX, OUT, H, DIV, EXPERT, POS, ENDS, S, E, BLOCK: tl.constexpr, ROUTING: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    pair = tl.load(IDX + r).to(tl.int64)
    v = tl.load(X + (pair // DIV) * H + cols, mask=mask, other=0.0)
    tl.store(OUT + r * H + cols, v, mask=mask)
    if ROUTING:
        if tl.program_id(1) == 0:  # once per row: the inverse permutation and the group ends
            tl.store(POS + pair, r)
            # rows are sorted by expert: row r closes the groups e_r .. e_(r+1) - 1, each ending after r
            e = tl.load(EXPERT + r).to(tl.int32)
            # after the last row: E (not as the load's `other`, which takes the ids' dtype: 256 overflows uint8)
            e_next = tl.where(r + 1 < S, tl.load(EXPERT + r + 1, mask=r + 1 < S, other=0).to(tl.int32), E)
            for g in range(e, e_next):
                tl.store(ENDS + g, (r + 1).to(tl.int32))
            if r == 0:  # experts before the first row's receive no row
                for g in range(0, e):
                    tl.store(ENDS + g, 0)


@triton.jit
def _combine_kernel(Y, POS, W, OUT, H, K, V, PICKED, HAS_W: tl.constexpr, BLOCK: tl.constexpr,
                    SOFT_RNE: tl.constexpr, PICK: tl.constexpr):
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
        if PICK:
            if tl.program_id(1) == 0:
                v_p = tl.load(V + p).to(tl.float32)
                tl.store(PICKED + t * K + j, _round_to(v_p, PICKED.dtype.element_ty, SOFT_RNE))
    tl.store(OUT + t * H + cols, _round_to(acc, OUT.dtype.element_ty, SOFT_RNE), mask=mask)


@triton.jit
def _gate_up_index(r, c, N_INTER, INTERLEAVED: tl.constexpr):
    """Flat indices of gate and up column c of row r in the fused (S, 2 * N_INTER) gate_up output: interleaved
    (g0, u0, g1, u1, ...) or concatenated ([gate; up])."""
    if INTERLEAVED:
        gi = r * 2 * N_INTER + 2 * c
        ui = gi + 1
    else:
        gi = r * 2 * N_INTER + c
        ui = gi + N_INTER
    return gi, ui


@triton.jit
def _glu_fwd_kernel(HB, A, n, N_INTER, INTERLEAVED: tl.constexpr, BLOCK: tl.constexpr, SOFT_RNE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # flat index into a (S, N_INTER)
    mask = offs < n
    r = offs // N_INTER
    c = offs % N_INTER
    gi, ui = _gate_up_index(r, c, N_INTER, INTERLEAVED)
    g = tl.load(HB + gi, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(HB + ui, mask=mask, other=0.0).to(tl.float32)
    tl.store(A + offs, _round_to(g * tl.sigmoid(g) * u, A.dtype.element_ty, SOFT_RNE), mask=mask)


@triton.jit
def _glu_routed_bwd_kernel(DA, HB, WROW, ORDER, DH, AW, DWROW, N_INTER, alpha, limit, INTERLEAVED: tl.constexpr,
                           BLOCK: tl.constexpr, SOFT_RNE: tl.constexpr, BY_ORDER: tl.constexpr,
                           CLAMPED: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)  # one row: the dot over the intermediate axis stays in the program
    if BY_ORDER:  # WROW holds the (token, choice) pairs' weights; row r is pair ORDER[r]
        w = tl.load(WROW + tl.load(ORDER + r)).to(tl.float32)
    else:
        w = tl.load(WROW + r).to(tl.float32)
    dot = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, N_INTER, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        mask = c < N_INTER
        gi, ui = _gate_up_index(r, c, N_INTER, INTERLEAVED)
        da = tl.load(DA + r * N_INTER + c, mask=mask, other=0.0).to(tl.float32)
        gate = tl.load(HB + gi, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(HB + ui, mask=mask, other=0.0).to(tl.float32)
        dwa = w * da
        if CLAMPED:  # GPT-OSS: a = (clamp(up) + 1) * g * sigmoid(alpha g), g = min(gate, limit)
            g = tl.where(gate > limit, limit, gate)
            u = tl.where(up > limit, limit, tl.where(up < -limit, -limit, up))
            sig = tl.sigmoid(alpha * g)
            glu = g * sig
            a = (u + 1.0) * glu
            dgate = tl.where(gate <= limit, dwa * (u + 1.0) * (sig + alpha * glu * (1.0 - sig)), 0.0)
            dup = tl.where((up >= -limit) & (up <= limit), dwa * glu, 0.0)
        else:
            sig = tl.sigmoid(gate)  # recomputed from the saved gate_up output
            silu = gate * sig
            a = silu * up
            dgate = dwa * up * (sig + silu * (1.0 - sig))
            dup = dwa * silu
        dot += a * da
        tl.store(AW + r * N_INTER + c, _round_to(w * a, AW.dtype.element_ty, SOFT_RNE), mask=mask)
        tl.store(DH + ui, _round_to(dup, DH.dtype.element_ty, SOFT_RNE), mask=mask)
        tl.store(DH + gi, _round_to(dgate, DH.dtype.element_ty, SOFT_RNE), mask=mask)
    tl.store(DWROW + r, tl.sum(dot, axis=0))


@triton.jit
def _route_bwd_kernel(DW, P, IDS, DZ, E, K, TOPK_SOFTMAX: tl.constexpr, RENORM: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, SOFT_RNE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    kmask = ks < K
    ids = tl.load(IDS + t * K + ks, mask=kmask, other=-1).to(tl.int32)
    dw = tl.load(DW + t * K + ks, mask=kmask, other=0.0).to(tl.float32)
    cols = tl.arange(0, BLOCK_E)
    emask = cols < E
    if TOPK_SOFTMAX:  # P: the softmax over the K chosen logits (T, K); the other logits get no gradient
        w = tl.load(P + t * K + ks, mask=kmask, other=0.0).to(tl.float32)
        dtop = tl.where(kmask, w * (dw - tl.sum(dw * w, axis=0)), 0.0)
        dz = tl.sum(tl.where(ids[:, None] == cols[None, :], dtop[:, None], 0.0), axis=0)
    else:  # P: the softmax over all E experts (T, E); the weights are its top-k (divided by their sum: RENORM)
        top = tl.load(P + t * E + ids, mask=kmask, other=0.0).to(tl.float32)
        if RENORM:  # w = top / s
            s = tl.sum(top, axis=0)
            dtop = tl.where(kmask, (dw - tl.sum(dw * (top / s), axis=0)) / s, 0.0)
        else:
            dtop = dw
        c = tl.sum(dtop * top, axis=0)  # <g, p>: g is dtop at the chosen experts, zero elsewhere
        g = tl.sum(tl.where(ids[:, None] == cols[None, :], dtop[:, None], 0.0), axis=0)
        p = tl.load(P + t * E + cols, mask=emask, other=0.0).to(tl.float32)
        dz = p * (g - c)
    tl.store(DZ + t * E + cols, _round_to(dz, DZ.dtype.element_ty, SOFT_RNE), mask=emask)


# ----------------------------------------------------------------------------------------------- launchers
_GATHER, _COMBINE = lean(_gather_rows_kernel), lean(_combine_kernel)
_GLU_FWD, _GLU_ROUTED_BWD = lean(_glu_fwd_kernel), lean(_glu_routed_bwd_kernel)
_ROUTE_BWD = lean(_route_bwd_kernel)


def _out(buf, shape, like: torch.Tensor, dtype=None) -> torch.Tensor:
    dtype = dtype or like.dtype
    if buf is None:
        return torch.empty(shape, dtype=dtype, device=like.device)
    if tuple(buf.shape) != tuple(shape) or buf.dtype != dtype or not buf.is_contiguous():
        raise ValueError(f"output buffer must be contiguous {tuple(shape)} {dtype}, got {tuple(buf.shape)} "
                         f"{buf.dtype}")
    return buf


def gather_rows(x: torch.Tensor, idx: torch.Tensor, out: torch.Tensor | None = None, *, div: int = 1,
                block: int | None = None) -> torch.Tensor:
    """out[r] = x[idx[r] // div]: x (T, H), idx (S,) integer -> (S, H) in x's dtype (div = top-k: idx holds
    (token, choice) pair numbers)."""
    x, idx = x.contiguous(), idx.contiguous()
    s, h = idx.shape[0], x.shape[1]
    out = _out(out, (s, h), x)
    block = block or default_block(h)
    if s:  # the routing arguments are unused: constant zeros keep one compiled variant and one lean-launch key
        _GATHER[(s, cdiv(h, block))](x, idx, out, h, div, idx, idx, idx, 0, 0, BLOCK=block, ROUTING=False)
    return out


def dispatch(x: torch.Tensor, order: torch.Tensor, expert: torch.Tensor, top_k: int, num_experts: int,
             out: torch.Tensor | None = None, pos: torch.Tensor | None = None, ends: torch.Tensor | None = None, *,
             block: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the stable sort of the (T*K,) expert ids (values `expert`, indices `order`): (xs (S, H) with
    xs[r] = x[order[r] // K], pos (S,) int64 with pos[order[r]] = r, ends (E,) int32 with ends[e] = the number of
    rows whose expert is <= e), in one launch. Expert ids (any integer dtype) must lie in [0, E)."""
    x, order, expert = x.contiguous(), order.contiguous(), expert.contiguous()
    s, h = order.shape[0], x.shape[1]
    out = _out(out, (s, h), x)
    pos = _out(pos, (s,), order, torch.int64)
    ends = _out(ends, (num_experts,), order, torch.int32)
    block = block or default_block(h)
    if s:
        _GATHER[(s, cdiv(h, block))](x, order, out, h, top_k, expert, pos, ends, s, num_experts, BLOCK=block,
                                            ROUTING=True)
    else:
        ends.zero_()
    return out, pos, ends


def _combine(y, pos, weights, out, out_dtype, block, picked_from=None, picked=None, picked_dtype=None):
    y, pos = y.contiguous(), pos.contiguous()
    t, k = pos.shape
    h = y.shape[1]
    out = _out(out, (t, h), y, out_dtype)
    block = block or default_block(h)
    w = pos if weights is None else weights.contiguous()  # unused when HAS_W is False
    pick = picked_from is not None
    if pick:
        picked_from = picked_from.contiguous()
        picked = _out(picked, (t, k), picked_from, picked_dtype)
    if t:
        _COMBINE[(t, cdiv(h, block))](y, pos, w, out, h, k, picked_from if pick else pos,
                                             picked if pick else pos, HAS_W=weights is not None, BLOCK=block,
                                             SOFT_RNE=not y.is_cuda, PICK=pick)
    return out, picked


def combine(y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor | None, out: torch.Tensor | None = None, *,
            out_dtype: torch.dtype | None = None, block: int | None = None) -> torch.Tensor:
    """out[t] = sum_k w[t, k] * y[pos[t, k]] (w = 1 when weights is None): y (S, H), pos (T, K) -> (T, H)."""
    return _combine(y, pos, weights, out, out_dtype, block)[0]


def combine_and_pick(y: torch.Tensor, pos: torch.Tensor, values: torch.Tensor, values_dtype: torch.dtype,
                     out: torch.Tensor | None = None, picked: torch.Tensor | None = None, *,
                     out_dtype: torch.dtype | None = None,
                     block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out[t] = sum_k y[pos[t, k]] (T, H), picked[t, k] = values[pos[t, k]] (T, K) in values_dtype) in one launch:
    the permute's backward and a per-row vector (S,) brought back to (token, choice) order."""
    return _combine(y, pos, None, out, out_dtype, block, values, picked, values_dtype)


_GLU_BLOCK = 1024


def glu_fwd(h: torch.Tensor, interleaved: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up from the fused gate_up output h (S, 2I) -> (S, I) in h's dtype."""
    h = h.contiguous()
    s, i = h.shape[0], h.shape[1] // 2
    out = _out(out, (s, i), h)
    n = s * i
    if n:
        _GLU_FWD[(cdiv(n, _GLU_BLOCK),)](h, out, n, i, INTERLEAVED=interleaved, BLOCK=_GLU_BLOCK,
                                                SOFT_RNE=not h.is_cuda)
    return out


def glu_routed_bwd(da: torch.Tensor, h: torch.Tensor, w_row: torch.Tensor, interleaved: bool,
                   dh: torch.Tensor | None = None, aw: torch.Tensor | None = None,
                   dw_row: torch.Tensor | None = None, *, order: torch.Tensor | None = None,
                   clamp: tuple[float, float] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dh (S, 2I) and aw (S, I) in h's dtype, dw_row (S,) fp32) from da (S, I) without the routing weight,
    h (S, 2I) and each row's routing weight: w_row (S,), or with `order` (S,) the (T*K,) weights of the
    (token, choice) pairs, row r's being w_row[order[r]]. `clamp` = (alpha, limit): GPT-OSS's clamped SwiGLU
    (novatune.kernels.clamped_swiglu's formulas; gate/up interleaved) instead of silu(gate) * up."""
    da, h, w_row = da.contiguous(), h.contiguous(), w_row.contiguous()
    s, i = h.shape[0], h.shape[1] // 2
    idx = w_row if order is None else order.contiguous()  # unused without an order
    dh = _out(dh, tuple(h.shape), h)
    aw = _out(aw, (s, i), h)
    dw_row = _out(dw_row, (s,), h, torch.float32)
    if s:
        alpha, limit = clamp if clamp is not None else (0.0, 0.0)
        _GLU_ROUTED_BWD[(s,)](da, h, w_row, idx, dh, aw, dw_row, i, float(alpha), float(limit),
                              INTERLEAVED=interleaved, BLOCK=default_block(i), SOFT_RNE=not h.is_cuda,
                              BY_ORDER=order is not None, CLAMPED=clamp is not None)
    return dh, aw, dw_row


def route_bwd(dw: torch.Tensor, saved: torch.Tensor, ids: torch.Tensor, num_experts: int, *, topk_softmax: bool,
              renormalize: bool, out_dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The router logits' gradient (T, E) in out_dtype from the weights' gradient dw (T, K) and the chosen expert
    ids (T, K), distinct per row. `saved`: for "softmax_topk" (topk_softmax False) the softmax over the E
    experts (T, E), the weights being its top-k (divided by their sum when `renormalize`); for "topk_softmax" the
    softmax over the K chosen logits (T, K), which are the weights."""
    dw, saved, ids = dw.contiguous(), saved.contiguous(), ids.contiguous()
    t, k = ids.shape
    out = _out(out, (t, num_experts), saved, out_dtype)
    if t:
        _ROUTE_BWD[(t,)](dw, saved, ids, out, num_experts, k, TOPK_SOFTMAX=topk_softmax, RENORM=renormalize,
                         BLOCK_E=next_pow2(num_experts), BLOCK_K=max(2, next_pow2(k)), SOFT_RNE=not saved.is_cuda)
    return out
