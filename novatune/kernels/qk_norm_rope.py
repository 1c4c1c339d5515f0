"""Qwen3's per-head q/k RMSNorm followed by RoPE, for q and k together: one forward launch, one backward launch
(+ a tiny weight-grad reduction), so q and k are read once and written once per pass.

Math (per token t, per head row x of head_dim d = 2 * half, x = [x1, x2]; X = dtype(x), O = promote(X, dtype(w));
c = cos[t], s = sin[t], both (d,), split the same way):

    rstd = 1 / sqrt(sum_j x_j^2 / d + eps)                 fp32, one per head row, saved for the backward
    n    = round_X(x * rstd)                                HF's Qwen3RMSNorm: normalised value rounded to X first
    qn   = round_O(w * n)                                   ... then the weight multiply, rounded to O (HF's tensor)
    y1   = round_O(qn1 * c1 - qn2 * s1)                     HF's qn * cos + rotate_half(qn) * sin, in fp32,
    y2   = round_O(qn2 * c2 + qn1 * s2)                     rounded ONCE

Rounding sequence vs HF's two-op composition (bf16 everything): n and qn are HF's values bit for bit whenever rstd
agrees to the last fp32 bit (the row sum is added in another order, so rarely it does not, and n flips by one bf16
ulp near a rounding boundary). HF then rounds a = qn*c, b = rotate_half(qn)*s and a + b to bf16 (three roundings);
here the two products are exact in fp32 (bf16 x bf16 fits in 24 bits) and their sum is rounded once to fp32 and
once to bf16, i.e. each output is HF's exact expression correctly rounded. |ours - HF| <= 2^-8 (|a| + |b| + |a + b|)
<= 2^-7 (|a| + |b|) (unit roundoff 2^-8 per bf16 rounding): one or two ulps of y unless a and b cancel, where HF's
own rounding error is the larger one. Measured on Qwen3 tables: max 0.0078 (|a| + |b|), ~13% of elements differ.
novatune's rms_norm + apply_rope composition rounds exactly as here (bit-identical on the GPU up to the rstd flips).

Backward (fp32 throughout; dy = grad of y, in its own dtype):

    dqn1 = dy1 * c1 + dy2 * s2          dqn2 = dy2 * c2 - dy1 * s1          transpose of the rotation
    xhat = x * rstd,  g = dqn * w,  m = mean_j g_j * xhat_j
    dx   = rstd * (g - xhat * m)                                            (round_X, round_O: straight-through,
    dw   = sum over all (token, head) rows of dqn * round_X(xhat)            as in novatune's rms_norm)

dqn stays in fp32 between the two steps (the separate ops round it to bf16 in between). cos/sin get no gradient.

Layout: q (b, s, hq, d), k (b, s, hk, d) addressed through their (b, s, h) strides (views of a fused projection
work; the last dim must be contiguous). cos/sin (b or 1, s, d), batch stride 0 when broadcast. Outputs q_out,
k_out, dq, dk are new contiguous (b, s, h, d) tensors; rstd_q / rstd_k are (b, s, h) fp32.

Forward kernel: one program per work item = (a block of BLOCK_T tokens) x (a block of heads): tiles
(BLOCK_T, BLOCK_H, BLOCK_D) per half for q and for k (GQA: hk may differ from hq), cos/sin loaded once per token
(BLOCK_T, BLOCK_D) and broadcast over heads; all loads issued before any store. At Qwen3-4B's shape (32 + 8 heads,
d 128) an item is two tokens with all 40 heads (10240 elements) on 4 warps (H200 sweep: 25.9 us vs 28.9 us for one
token on 8 warps); few heads get more tokens per item, very many heads a split.

Backward kernel: persistent (G ~ resident programs). Program pid runs two phases, q then k; each loops over that
tensor's items pid, pid + G, ... of `rows` head rows (default rows = 32: q 1 token x 32 heads, k 4 tokens x 8
heads), through Triton's cp.async pipeliner (stages 3; stages 0 instead issues the next item's loads into registers
before computing the current one), and keeps one fp32 dw accumulator tile. Separate phases give each tensor a tile
with whole head rows per warp and only one tile's registers live at a time. Each program writes its row of a
(G, 2, d) fp32 partial buffer ([q | k]); one small kernel sums the G rows in fp32 and casts once to each weight's
dtype. Deterministic (no atomics).

Comparing with another implementation (tests): rstd is computed in another order elsewhere (torch sums the whole row;
on CUDA torch.rsqrt is not even correctly rounded), so it can differ in its last bits, and then n = round_X(x * rstd)
flips by one ulp where x * rstd lies next to a rounding boundary (~1e-5 of the elements at Qwen3's shape). The
output moves by at most ~2^-6 (|a| + |b|) there, which is MANY ulps of y wherever a and b nearly cancel (47 ulps
seen on the H200): bound such differences by |a| + |b|, never by ulps of y. Given the same rstd the kernel's outputs
are the reference sequence's bit for bit (16-bit outputs and tables: both products are exact in fp32).

Nothing here imports torch.autograd or transformers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from novatune.kernels.launch import cdiv, empty_f32, lean, next_pow2, remember

# shared launch machinery; RESIDENCY (device, dtypes, meta) -> (programs per SM, how) holds rms_norm's entries too,
# this file's keys start with "qk_norm_rope_bwd"
from novatune.kernels.rms_norm import RESIDENCY, _persistent_grid, _resident_per_sm, _round_to, num_sms  # noqa: F401

MAX_HEAD_DIM = 256
from novatune.kernels.qk_norm_rope_config import (  # noqa: E402,F401 - launch configs live beside
    _BWD_PER_THREAD,
    _BWD_STAGES,
    _BWD_TILE,
    _FWD_MAX_TOKEN_TILE,
    _FWD_PER_THREAD,
    _FWD_TILE,
    _INTERP_TILE,
    _floor_pow2,
    _head_blocks,
    _item_elems,
    _rows_tile,
    qk_norm_rope_bwd_config,
    qk_norm_rope_fwd_config,
)


# ----------------------------------------------------------------------------------------------- kernel helpers
@triton.jit
def _item(w, T, S, BLOCK_T: tl.constexpr, SPLIT: tl.constexpr):
    """Work item w -> its tokens (int64 flat index, in-range mask, batch and seq index) and its head block."""
    hb = w % SPLIT
    t = (w // SPLIT) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,) flat token index b * S + s
    t_ok = t < T
    bi = (t // S).to(tl.int64)  # int64: b * stride passes 2^31 at long packed batches
    si = (t % S).to(tl.int64)
    return t.to(tl.int64), t_ok, bi, si, hb


@triton.jit
def _mask3(t_ok, h_ok, HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    dd = tl.arange(0, BLOCK_D)
    return t_ok[:, None, None] & h_ok[None, :, None] & (dd < HALF)[None, None, :]  # (BLOCK_T, BLOCK_H, BLOCK_D)


@triton.jit
def _load_halves(X, bi, si, sb, ss, sh, t_ok, hb, H, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_H: tl.constexpr):
    """Both halves of the item's heads of a strided (b, s, h, d) tensor, in its own dtype."""
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)  # (BLOCK_H,)
    dd = tl.arange(0, BLOCK_D)
    mask = _mask3(t_ok, h < H, HALF, BLOCK_D)
    off = (bi * sb + si * ss)[:, None, None] + (h.to(tl.int64) * sh)[None, :, None] + dd[None, None, :]
    return tl.load(X + off, mask=mask, other=0.0), tl.load(X + off + HALF, mask=mask, other=0.0)


@triton.jit
def _store_halves(OUT, t64, t_ok, hb, H, v1, v2, HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                  SOFT_RNE: tl.constexpr):
    """Store fp32 halves into a contiguous (tokens, H, 2 * HALF) tensor, rounded to its dtype."""
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    dd = tl.arange(0, BLOCK_D)
    mask = _mask3(t_ok, h < H, HALF, BLOCK_D)
    off = (t64 * (H * 2 * HALF))[:, None, None] + (h * (2 * HALF))[None, :, None] + dd[None, None, :]
    tl.store(OUT + off, _round_to(v1, OUT.dtype.element_ty, SOFT_RNE), mask=mask)
    tl.store(OUT + off + HALF, _round_to(v2, OUT.dtype.element_ty, SOFT_RNE), mask=mask)


@triton.jit
def _rstd_ptrs(RSTD, t64, t_ok, hb, H, BLOCK_H: tl.constexpr):
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    return RSTD + t64[:, None] * H + h[None, :], t_ok[:, None] & (h < H)[None, :]  # (BLOCK_T, BLOCK_H)


@triton.jit
def _load_tables(COS, SIN, bi, si, c_sb, c_ss, t_ok, HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    """cos/sin halves of the item's tokens, (BLOCK_T, BLOCK_D) each, in the tables' dtype: once per token."""
    dd = tl.arange(0, BLOCK_D)
    m = t_ok[:, None] & (dd < HALF)[None, :]
    off = (bi * c_sb + si * c_ss)[:, None] + dd[None, :]
    return (tl.load(COS + off, mask=m, other=0.0), tl.load(COS + off + HALF, mask=m, other=0.0),
            tl.load(SIN + off, mask=m, other=0.0), tl.load(SIN + off + HALF, mask=m, other=0.0))


@triton.jit
def _load_weight(W, HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    dd = tl.arange(0, BLOCK_D)
    m = dd < HALF
    return (tl.load(W + dd, mask=m, other=0.0).to(tl.float32),
            tl.load(W + dd + HALF, mask=m, other=0.0).to(tl.float32))


@triton.jit
def _fwd_math(x1r, x2r, w1, w2, c1, c2, s1, s2, D, eps, X_DTYPE: tl.constexpr, O_DTYPE: tl.constexpr,
              SOFT_RNE: tl.constexpr):
    """(y1, y2, rstd) of one tile: RMSNorm with HF's roundings, then the rotation in fp32 (module docstring)."""
    x1 = x1r.to(tl.float32)
    x2 = x2r.to(tl.float32)
    # per-row ops correctly rounded (div_rn, sqrt_rn), as in rms_norm: torch's mean and rsqrt; padding adds 0
    var = tl.div_rn(tl.sum(x1 * x1, axis=2) + tl.sum(x2 * x2, axis=2), D * 1.0)  # (BLOCK_T, BLOCK_H)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
    r = rstd[:, :, None]
    n1 = _round_to(x1 * r, X_DTYPE, SOFT_RNE).to(tl.float32)
    n2 = _round_to(x2 * r, X_DTYPE, SOFT_RNE).to(tl.float32)
    qn1 = _round_to(w1[None, None, :] * n1, O_DTYPE, SOFT_RNE).to(tl.float32)
    qn2 = _round_to(w2[None, None, :] * n2, O_DTYPE, SOFT_RNE).to(tl.float32)
    y1 = qn1 * c1[:, None, :] - qn2 * s1[:, None, :]
    y2 = qn2 * c2[:, None, :] + qn1 * s2[:, None, :]
    return y1, y2, rstd


@triton.jit
def _bwd_math(x1r, x2r, g1r, g2r, rstd, w1, w2, c1, c2, s1, s2, D, X_DTYPE: tl.constexpr, SOFT_RNE: tl.constexpr):
    """(dx1, dx2, dw1, dw2) of one tile in fp32; padded rows/columns give 0 everywhere (x = dy = rstd = w = 0)."""
    dy1 = g1r.to(tl.float32)
    dy2 = g2r.to(tl.float32)
    # undo the rotation: dqn = dy * cos + rotate_half^T(dy * sin), rotate_half^T([z1, z2]) = [z2, -z1]
    dn1 = dy1 * c1[:, None, :] + dy2 * s2[:, None, :]
    dn2 = dy2 * c2[:, None, :] - dy1 * s1[:, None, :]
    r = rstd[:, :, None]
    xh1 = x1r.to(tl.float32) * r
    xh2 = x2r.to(tl.float32) * r
    gw1 = dn1 * w1[None, None, :]
    gw2 = dn2 * w2[None, None, :]
    m = (tl.sum(gw1 * xh1, axis=2) + tl.sum(gw2 * xh2, axis=2)) / D  # approximate division: fine here
    dx1 = (gw1 - xh1 * m[:, :, None]) * r
    dx2 = (gw2 - xh2 * m[:, :, None]) * r
    # dqn/dw is the rounded normalised value the forward multiplied by w
    dw1 = dn1 * _round_to(xh1, X_DTYPE, SOFT_RNE).to(tl.float32)
    dw2 = dn2 * _round_to(xh2, X_DTYPE, SOFT_RNE).to(tl.float32)
    return dx1, dx2, dw1, dw2


# ----------------------------------------------------------------------------------------------- kernels
@triton.jit
def _qk_norm_rope_fwd_kernel(
    Q, K, WQ, WK, COS, SIN, QO, KO, RSTD_Q, RSTD_K,  # QO/KO (T, H, D) contiguous; RSTD_* (T, H) fp32
    T, S, HQ, HK, D, eps,
    q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, c_sb, c_ss,
    HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr, SPLIT: tl.constexpr, SOFT_RNE: tl.constexpr,
):
    t64, t_ok, bi, si, hb = _item(tl.program_id(0), T, S, BLOCK_T, SPLIT)
    # every load (q, k, tables, weights) is issued before any store: one memory round trip per program
    q1, q2 = _load_halves(Q, bi, si, q_sb, q_ss, q_sh, t_ok, hb, HQ, HALF, BLOCK_D, BLOCK_HQ)
    k1, k2 = _load_halves(K, bi, si, k_sb, k_ss, k_sh, t_ok, hb, HK, HALF, BLOCK_D, BLOCK_HK)
    c1, c2, s1, s2 = _load_tables(COS, SIN, bi, si, c_sb, c_ss, t_ok, HALF, BLOCK_D)
    c1 = c1.to(tl.float32)
    c2 = c2.to(tl.float32)
    s1 = s1.to(tl.float32)
    s2 = s2.to(tl.float32)
    wq1, wq2 = _load_weight(WQ, HALF, BLOCK_D)
    wk1, wk2 = _load_weight(WK, HALF, BLOCK_D)

    y1, y2, rstd = _fwd_math(q1, q2, wq1, wq2, c1, c2, s1, s2, D, eps, Q.dtype.element_ty, QO.dtype.element_ty,
                             SOFT_RNE)
    _store_halves(QO, t64, t_ok, hb, HQ, y1, y2, HALF, BLOCK_D, BLOCK_HQ, SOFT_RNE)
    p, m = _rstd_ptrs(RSTD_Q, t64, t_ok, hb, HQ, BLOCK_HQ)
    tl.store(p, rstd, mask=m)

    y1, y2, rstd = _fwd_math(k1, k2, wk1, wk2, c1, c2, s1, s2, D, eps, K.dtype.element_ty, KO.dtype.element_ty,
                             SOFT_RNE)
    _store_halves(KO, t64, t_ok, hb, HK, y1, y2, HALF, BLOCK_D, BLOCK_HK, SOFT_RNE)
    p, m = _rstd_ptrs(RSTD_K, t64, t_ok, hb, HK, BLOCK_HK)
    tl.store(p, rstd, mask=m)


@triton.jit
def _bwd_load(w, DY, X, RSTD, COS, SIN, T, S, H, dy_sb, dy_ss, dy_sh, x_sb, x_ss, x_sh, c_sb, c_ss,
              HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
              SPLIT: tl.constexpr):
    """Every load of one backward item (raw dtypes; fully masked when w is past the last item)."""
    t64, t_ok, bi, si, hb = _item(w, T, S, BLOCK_T, SPLIT)
    x1, x2 = _load_halves(X, bi, si, x_sb, x_ss, x_sh, t_ok, hb, H, HALF, BLOCK_D, BLOCK_H)
    g1, g2 = _load_halves(DY, bi, si, dy_sb, dy_ss, dy_sh, t_ok, hb, H, HALF, BLOCK_D, BLOCK_H)
    p, m = _rstd_ptrs(RSTD, t64, t_ok, hb, H, BLOCK_H)
    r = tl.load(p, mask=m, other=0.0)  # padded rows: rstd 0 -> dx 0, dw += 0
    c1, c2, s1, s2 = _load_tables(COS, SIN, bi, si, c_sb, c_ss, t_ok, HALF, BLOCK_D)
    return x1, x2, g1, g2, r, c1, c2, s1, s2


@triton.jit
def _bwd_step(w, x1, x2, g1, g2, r, c1, c2, s1, s2, w1, w2, DX, T, S, H, D, X_DTYPE: tl.constexpr,
              HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
              SPLIT: tl.constexpr, SOFT_RNE: tl.constexpr):
    """Stores dx of one item; returns its dw contributions (two fp32 halves)."""
    t64, t_ok, _bi, _si, hb = _item(w, T, S, BLOCK_T, SPLIT)
    dx1, dx2, dw1, dw2 = _bwd_math(x1, x2, g1, g2, r, w1, w2, c1.to(tl.float32), c2.to(tl.float32),
                                   s1.to(tl.float32), s2.to(tl.float32), D, X_DTYPE, SOFT_RNE)
    _store_halves(DX, t64, t_ok, hb, H, dx1, dx2, HALF, BLOCK_D, BLOCK_H, SOFT_RNE)
    return dw1, dw2


@triton.jit
def _bwd_phase(pid, G, DY, X, W, RSTD, DX, COS, SIN, DW_ROW, T, S, H, D, n_items,
               dy_sb, dy_ss, dy_sh, x_sb, x_ss, x_sh, c_sb, c_ss,
               HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
               SPLIT: tl.constexpr, PREFETCH: tl.constexpr, STAGES: tl.constexpr, SOFT_RNE: tl.constexpr):
    """One tensor (q or k): items pid, pid + G, ... of its (BLOCK_T tokens x BLOCK_H heads) items; dx stored,
    this program's dw partial (fp32, the two halves) written to DW_ROW."""
    w1, w2 = _load_weight(W, HALF, BLOCK_D)
    a1 = tl.zeros([BLOCK_T, BLOCK_H, BLOCK_D], dtype=tl.float32)  # dw accumulators, reduced only at the end
    a2 = tl.zeros([BLOCK_T, BLOCK_H, BLOCK_D], dtype=tl.float32)
    if PREFETCH:
        # the next item's loads are issued before the current item is computed: two items in flight per program,
        # held in registers in their own dtype (works the same on every Triton version)
        x1, x2, g1, g2, r, c1, c2, s1, s2 = _bwd_load(
            pid, DY, X, RSTD, COS, SIN, T, S, H, dy_sb, dy_ss, dy_sh, x_sb, x_ss, x_sh, c_sb, c_ss,
            HALF, BLOCK_D, BLOCK_T, BLOCK_H, SPLIT)
        for w in range(pid, n_items, G):
            nx1, nx2, ng1, ng2, nr, nc1, nc2, ns1, ns2 = _bwd_load(
                w + G, DY, X, RSTD, COS, SIN, T, S, H, dy_sb, dy_ss, dy_sh, x_sb, x_ss, x_sh, c_sb, c_ss,
                HALF, BLOCK_D, BLOCK_T, BLOCK_H, SPLIT)
            d1, d2 = _bwd_step(w, x1, x2, g1, g2, r, c1, c2, s1, s2, w1, w2, DX, T, S, H, D, X.dtype.element_ty,
                               HALF, BLOCK_D, BLOCK_T, BLOCK_H, SPLIT, SOFT_RNE)
            a1 += d1
            a2 += d2
            x1 = nx1
            x2 = nx2
            g1 = ng1
            g2 = ng2
            r = nr
            c1 = nc1
            c2 = nc2
            s1 = ns1
            s2 = ns2
    else:
        # STAGES >= 2: Triton's software pipeliner, STAGES - 1 items in flight through cp.async into shared memory
        # (no register cost; what rms_norm's backward uses for one-row tiles); STAGES 0/1: plain loop
        for w in tl.range(pid, n_items, G, num_stages=STAGES):
            x1, x2, g1, g2, r, c1, c2, s1, s2 = _bwd_load(
                w, DY, X, RSTD, COS, SIN, T, S, H, dy_sb, dy_ss, dy_sh, x_sb, x_ss, x_sh, c_sb, c_ss,
                HALF, BLOCK_D, BLOCK_T, BLOCK_H, SPLIT)
            d1, d2 = _bwd_step(w, x1, x2, g1, g2, r, c1, c2, s1, s2, w1, w2, DX, T, S, H, D, X.dtype.element_ty,
                               HALF, BLOCK_D, BLOCK_T, BLOCK_H, SPLIT, SOFT_RNE)
            a1 += d1
            a2 += d2
    dd = tl.arange(0, BLOCK_D)
    dm = dd < HALF
    tl.store(DW_ROW + dd, tl.sum(tl.sum(a1, axis=0), axis=0), mask=dm)
    tl.store(DW_ROW + HALF + dd, tl.sum(tl.sum(a2, axis=0), axis=0), mask=dm)


@triton.jit
def _qk_norm_rope_bwd_kernel(
    DQO, DKO, Q, K, WQ, WK, RSTD_Q, RSTD_K, COS, SIN, DQ, DK, DW_PARTIAL,  # DW_PARTIAL (G, 2, D) fp32
    T, S, HQ, HK, D, n_items_q, n_items_k,
    dqo_sb, dqo_ss, dqo_sh, dko_sb, dko_ss, dko_sh, q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, c_sb, c_ss,
    HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_TQ: tl.constexpr, BLOCK_HQ: tl.constexpr,
    SPLIT_Q: tl.constexpr, BLOCK_TK: tl.constexpr, BLOCK_HK: tl.constexpr, SPLIT_K: tl.constexpr,
    PREFETCH: tl.constexpr, STAGES: tl.constexpr, SOFT_RNE: tl.constexpr,
):
    # Persistent: program pid handles the q items pid, pid + G, ..., then the k items pid, pid + G, ..., and owns
    # row pid of DW_PARTIAL. q and k run as two phases with their own tile shapes (same rows per item), so each
    # phase's tile has whole head rows per warp (intra-warp reductions, full-width vector loads) and only one
    # phase's registers are live at a time.
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    row = DW_PARTIAL + pid.to(tl.int64) * (2 * D)
    _bwd_phase(pid, G, DQO, Q, WQ, RSTD_Q, DQ, COS, SIN, row, T, S, HQ, D, n_items_q,
               dqo_sb, dqo_ss, dqo_sh, q_sb, q_ss, q_sh, c_sb, c_ss,
               HALF, BLOCK_D, BLOCK_TQ, BLOCK_HQ, SPLIT_Q, PREFETCH, STAGES, SOFT_RNE)
    _bwd_phase(pid, G, DKO, K, WK, RSTD_K, DK, COS, SIN, row + D, T, S, HK, D, n_items_k,
               dko_sb, dko_ss, dko_sh, k_sb, k_ss, k_sh, c_sb, c_ss,
               HALF, BLOCK_D, BLOCK_TK, BLOCK_HK, SPLIT_K, PREFETCH, STAGES, SOFT_RNE)


@triton.jit
def _sum_partials_kernel(
    P, DWQ, DWK, G, D,  # P (G, 2 * D) fp32 partials [q | k]; DWQ, DWK (D,) in their weights' dtypes
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, SOFT_RNE: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # over 2 * D
    col_ok = cols < 2 * D
    acc = tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32)
    for g0 in range(0, G, BLOCK_G):
        g = g0 + tl.arange(0, BLOCK_G)
        m = (g < G)[:, None] & col_ok[None, :]
        acc += tl.load(P + g.to(tl.int64)[:, None] * (2 * D) + cols[None, :], mask=m, other=0.0)
    s = tl.sum(acc, axis=0)
    is_q = cols < D
    tl.store(DWQ + tl.where(is_q, cols, 0), _round_to(s, DWQ.dtype.element_ty, SOFT_RNE), mask=col_ok & is_q)
    tl.store(DWK + tl.where(is_q, 0, cols - D), _round_to(s, DWK.dtype.element_ty, SOFT_RNE),
             mask=col_ok & (cols >= D))


# ----------------------------------------------------------------------------------------------- launchers
# Launch wrappers: on CUDA the compiled kernel is called directly once Triton has picked it (novatune.kernels.launch)
_FWD, _BWD, _SUM = lean(_qk_norm_rope_fwd_kernel), lean(_qk_norm_rope_bwd_kernel), lean(_sum_partials_kernel)
# Validated launch plans by (shapes, dtypes, device, overrides): checks, configs and the measured residency run
# once per key; a call then reads only strides. The cap only bounds growth (e.g. every sequence length).
_FWD_PLANS: dict[tuple, tuple] = {}
_BWD_PLANS: dict[tuple, tuple] = {}


def _check_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int, int, int]:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be 4-d (b, s, h, d), got {tuple(q.shape)} and {tuple(k.shape)}")
    b, s, hq, d = q.shape
    if k.shape[0] != b or k.shape[1] != s or k.shape[3] != d:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch, seq or head_dim")
    if d % 2 or d > MAX_HEAD_DIM or d == 0:
        raise ValueError(f"head_dim must be even and <= {MAX_HEAD_DIM}, got {d}")
    return b, s, hq, k.shape[2], d


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _tables(cos: torch.Tensor, sin: torch.Tensor, b: int, s: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin as (b, s, d) views (batch stride 0 when broadcast), last dim contiguous, sharing strides."""
    out = []
    for t in (cos, sin):
        if t.dim() == 2:  # (s, d)
            t = t.unsqueeze(0)
        if t.dim() != 3 or t.shape[1:] != (s, d) or t.shape[0] not in (1, b):
            raise ValueError(f"cos/sin must be (b, s, d) = ({b}, {s}, {d}), (1, s, d) or (s, d); got "
                             f"{tuple(t.shape)} (partial rotary is not supported)")
        out.append(_unit_last(t).expand(b, s, d))
    if out[0].stride() != out[1].stride():  # the kernels share one set of table strides
        out = [t.contiguous() for t in out]
    return out[0], out[1]


def _table_args(cos: torch.Tensor, sin: torch.Tensor, b: int, s: int) -> tuple:
    """(cos, sin, batch stride, seq stride) as the kernels read the tables: what _tables' views give, without
    building them for the usual layout (3-d tables of one shape and layout, contiguous last dim; their shapes are
    checked by the plan)."""
    st = cos.stride()
    if cos.dim() == 3 and st[-1] == 1 and st == sin.stride() and cos.shape == sin.shape:
        return cos, sin, (0 if cos.shape[0] != b else st[0]), st[1]
    c, sn = _tables(cos, sin, b, s, cos.shape[-1])
    return c, sn, c.stride(0), c.stride(1)


def _check_weight(w: torch.Tensor, d: int, name: str) -> torch.Tensor:
    if w.shape != (d,):
        raise ValueError(f"{name} must have shape ({d},), got {tuple(w.shape)}")
    return w.contiguous()


def _check_out(t: torch.Tensor, shape, dtype, name: str) -> None:
    assert t.shape == tuple(shape) and t.dtype == dtype and t.is_contiguous(), (
        f"{name}: need contiguous {tuple(shape)} {dtype}, "
        f"got {tuple(t.shape)} {t.dtype} contiguous={t.is_contiguous()}")


def _new_like(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_like(t, dtype=dtype, memory_format=torch.contiguous_format)


def _given(t: torch.Tensor, shape, dtype, name: str) -> torch.Tensor:
    _check_out(t, shape, dtype, name)
    return t


def _fwd_plan(q, k, q_weight, k_weight, cos, sin, block_t, split, num_warps) -> tuple:
    key = (q.shape, k.shape, q_weight.shape, k_weight.shape, cos.shape, sin.shape, q.dtype, k.dtype,
           q_weight.dtype, k_weight.dtype, q.device, block_t, split, num_warps)
    plan = _FWD_PLANS.get(key)
    if plan is None:
        b, s, hq, hk, d = _check_qk(q, k)
        _check_weight(q_weight, d, "q_weight"), _check_weight(k_weight, d, "k_weight")
        _tables(cos, sin, b, s, d)  # shape checks
        qdt, kdt = torch.promote_types(q.dtype, q_weight.dtype), torch.promote_types(k.dtype, k_weight.dtype)
        n_tok = b * s
        grid = meta = None
        if n_tok:
            cfg = qk_norm_rope_fwd_config(n_tok, hq, hk, d, q.is_cuda, num_sms(q.device))
            bt = block_t or cfg["block_t"]
            block_d, bhq, bhk, sp = _head_blocks(hq, hk, d, split or cfg["split"])
            grid = (cdiv(n_tok, bt) * sp,)
            meta = dict(HALF=d // 2, BLOCK_D=block_d, BLOCK_T=bt, BLOCK_HQ=bhq, BLOCK_HK=bhk, SPLIT=sp,
                        SOFT_RNE=not q.is_cuda, num_warps=num_warps or cfg["num_warps"])
        plan = remember(_FWD_PLANS, key, (b, s, hq, hk, d, qdt, kdt, grid, meta))
    return plan


def qk_norm_rope_fwd(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                     eps: float, cos: torch.Tensor, sin: torch.Tensor, *, q_out: torch.Tensor | None = None,
                     k_out: torch.Tensor | None = None, rstd_q: torch.Tensor | None = None,
                     rstd_k: torch.Tensor | None = None, block_t: int | None = None, split: int | None = None,
                     num_warps: int | None = None):
    """(q_out, k_out, rstd_q, rstd_k): q_out (b, s, hq, d) contiguous in promote(q, q_weight) dtype (k alike),
    rstd_* (b, s, h) fp32. Preallocated outputs must be contiguous; block_t/split/num_warps override the config."""
    b, s, hq, hk, d, qdt, kdt, grid, meta = _fwd_plan(q, k, q_weight, k_weight, cos, sin, block_t, split, num_warps)
    wq, wk = q_weight.contiguous(), k_weight.contiguous()
    c, sn, c_sb, c_ss = _table_args(cos, sin, b, s)
    q, k = _unit_last(q), _unit_last(k)
    f32 = torch.float32
    q_out = _given(q_out, q.shape, qdt, "q_out") if q_out is not None else _new_like(q, qdt)
    k_out = _given(k_out, k.shape, kdt, "k_out") if k_out is not None else _new_like(k, kdt)
    rstd_q = _given(rstd_q, q.shape[:3], f32, "rstd_q") if rstd_q is not None else empty_f32(q.shape[:3], q.device)
    rstd_k = _given(rstd_k, k.shape[:3], f32, "rstd_k") if rstd_k is not None else empty_f32(k.shape[:3], k.device)
    if grid is None:
        return q_out, k_out, rstd_q, rstd_k
    _FWD[grid](q, k, wq, wk, c, sn, q_out, k_out, rstd_q, rstd_k, b * s, s, hq, hk, d, eps,
               *q.stride()[:3], *k.stride()[:3], c_sb, c_ss, **meta)
    return q_out, k_out, rstd_q, rstd_k


def _bwd_setup(dq_out, dk_out, q, k, q_weight, k_weight, rstd_q, rstd_k, cos, sin, overrides):
    b, s, hq, hk, d = _check_qk(q, k)
    if dq_out.shape != q.shape or dk_out.shape != k.shape:
        raise ValueError(f"grads {tuple(dq_out.shape)}/{tuple(dk_out.shape)} do not match q/k "
                         f"{tuple(q.shape)}/{tuple(k.shape)}")
    if rstd_q.shape != q.shape[:3] or rstd_k.shape != k.shape[:3]:
        raise ValueError("rstd_q/rstd_k must be (b, s, h) as returned by qk_norm_rope_fwd")
    wq, wk = _check_weight(q_weight, d, "q_weight"), _check_weight(k_weight, d, "k_weight")
    c, sn = _tables(cos, sin, b, s, d)
    dq_out, dk_out, q, k = (_unit_last(t) for t in (dq_out, dk_out, q, k))
    n_tok = b * s
    sms = num_sms(q.device)
    cfg = qk_norm_rope_bwd_config(n_tok, hq, hk, d, q.is_cuda)
    rows = overrides.get("rows") or cfg["rows"]
    (btq, bhq, spq), (btk, bhk, spk) = _rows_tile(hq, rows, n_tok), _rows_tile(hk, rows, n_tok)
    stages = cfg["stages"] if overrides.get("stages") is None else int(overrides["stages"])
    meta = dict(HALF=d // 2, BLOCK_D=next_pow2(d // 2), BLOCK_TQ=btq, BLOCK_HQ=bhq, SPLIT_Q=spq,
                BLOCK_TK=btk, BLOCK_HK=bhk, SPLIT_K=spk, PREFETCH=stages == 0, STAGES=max(stages, 1),
                SOFT_RNE=not q.is_cuda, num_warps=overrides.get("num_warps") or cfg["num_warps"])
    n_q, n_k = cdiv(n_tok, btq) * spq, cdiv(n_tok, btk) * spk
    args = [dq_out, dk_out, q, k, wq, wk, rstd_q.contiguous(), rstd_k.contiguous(), c, sn, None, None, None,
            n_tok, s, hq, hk, d, n_q, n_k, *dq_out.stride()[:3], *dk_out.stride()[:3], *q.stride()[:3],
            *k.stride()[:3], c.stride(0), c.stride(1)]
    n_items = max(n_q, n_k, 1)
    g = overrides.get("num_programs")
    if g is None:
        key = ("qk_norm_rope_bwd", q.device, dq_out.dtype, dk_out.dtype, q.dtype, k.dtype, wq.dtype, wk.dtype,
               c.dtype, *meta.values())
        wargs = list(args)
        wargs[10], wargs[11], wargs[12] = q, k, args[6]  # warmup needs only the signature (dtypes)
        per_sm = _resident_per_sm(lambda: _qk_norm_rope_bwd_kernel.warmup(*wargs, grid=(1,), **meta), key,
                                  meta["num_warps"], q.device)
        g = _persistent_grid(n_items, sms, per_sm)
    return args, meta, max(1, min(int(g), n_items)), (n_q, n_k)


def _bwd_plan(dq_out, dk_out, q, k, q_weight, k_weight, rstd_q, rstd_k, cos, sin, overrides) -> tuple:
    """(meta, G, (n_q, n_k), sum grid, sum meta), validated and measured once per key by _bwd_setup."""
    key = (dq_out.shape, dk_out.shape, q.shape, k.shape, q_weight.shape, k_weight.shape, rstd_q.shape,
           rstd_k.shape, cos.shape, sin.shape, dq_out.dtype, dk_out.dtype, q.dtype, k.dtype, q_weight.dtype,
           k_weight.dtype, cos.dtype, sin.dtype, q.device, tuple(sorted(overrides.items())))
    plan = _BWD_PLANS.get(key)
    if plan is None:
        _, meta, g, items = _bwd_setup(dq_out, dk_out, q, k, q_weight, k_weight, rstd_q, rstd_k, cos, sin,
                                       overrides)
        # the weight-grad reduction: column strips of 16 fp32, each program reading all G rows in one ~8K-element
        # tile (as rms_norm's reduction); the interpreter takes all columns in one program
        two_d = 2 * q.shape[-1]
        rb_n = min(next_pow2(two_d), 16 if q.is_cuda else 512)
        rb_g = max(16, min(next_pow2(g), 8192 // rb_n))
        plan = remember(_BWD_PLANS, key, (meta, g, items, (cdiv(two_d, rb_n),),
                                           dict(BLOCK_G=rb_g, BLOCK_N=rb_n, SOFT_RNE=not q.is_cuda, num_warps=8)))
    return plan


def qk_norm_rope_bwd_launch_config(dq_out, dk_out, q, k, q_weight, k_weight, rstd_q, rstd_k, cos, sin,
                                   **overrides) -> dict:
    """The config qk_norm_rope_bwd would launch (defaults, measured residency, overrides applied): rows,
    num_warps, num_programs, stages, and per tensor its (block_t, block_h, split) tile and item count."""
    _, m, g, (n_q, n_k) = _bwd_setup(dq_out, dk_out, q, k, q_weight, k_weight, rstd_q, rstd_k, cos, sin, overrides)
    rows = overrides.get("rows") or qk_norm_rope_bwd_config(q.shape[0] * q.shape[1], q.shape[2], k.shape[2],
                                                            q.shape[3], q.is_cuda)["rows"]
    return {"rows": rows, "num_warps": m["num_warps"], "num_programs": g,
            "stages": 0 if m["PREFETCH"] else m["STAGES"],
            "q_tile": (m["BLOCK_TQ"], m["BLOCK_HQ"], m["SPLIT_Q"]),
            "k_tile": (m["BLOCK_TK"], m["BLOCK_HK"], m["SPLIT_K"]), "items": (n_q, n_k)}


def qk_norm_rope_bwd(dq_out: torch.Tensor, dk_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     q_weight: torch.Tensor, k_weight: torch.Tensor, rstd_q: torch.Tensor, rstd_k: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, *, dq: torch.Tensor | None = None,
                     dk: torch.Tensor | None = None, dq_weight: torch.Tensor | None = None,
                     dk_weight: torch.Tensor | None = None, **overrides):
    """(dq, dk, dq_weight, dk_weight): dq/dk contiguous (b, s, h, d) in q's/k's dtype, weight grads in the weights'
    dtypes (accumulated in fp32). Overrides: rows, num_warps, num_programs, stages (0: prefetch the next item in
    registers; 1: no prefetch; >= 2: Triton's cp.async pipeliner with that many stages)."""
    bad = set(overrides) - {"rows", "num_warps", "num_programs", "stages"}
    if bad:
        raise TypeError(f"unknown overrides {sorted(bad)}")
    outs = []
    for t, like, name in ((dq, q, "dq"), (dk, k, "dk"), (dq_weight, q_weight, "dq_weight"),
                          (dk_weight, k_weight, "dk_weight")):
        if t is None:
            t = torch.empty_like(like, memory_format=torch.contiguous_format)
        else:
            _check_out(t, like.shape, like.dtype, name)
        outs.append(t)
    dq, dk, dq_weight, dk_weight = outs
    b, s = q.shape[0], q.shape[1]
    if b * s == 0:
        _check_qk(q, k)
        dq_weight.zero_()
        dk_weight.zero_()
        return dq, dk, dq_weight, dk_weight
    meta, g, (n_q, n_k), sum_grid, sum_meta = _bwd_plan(dq_out, dk_out, q, k, q_weight, k_weight, rstd_q, rstd_k,
                                                        cos, sin, overrides)
    c, sn, c_sb, c_ss = _table_args(cos, sin, b, s)
    dq_out, dk_out, q, k = _unit_last(dq_out), _unit_last(dk_out), _unit_last(q), _unit_last(k)
    d = q.shape[-1]
    partial = torch.empty(g, 2 * d, dtype=torch.float32, device=q.device)  # (G, [q | k] x d)
    _BWD[(g,)](dq_out, dk_out, q, k, q_weight.contiguous(), k_weight.contiguous(),
               rstd_q if rstd_q.is_contiguous() else rstd_q.contiguous(),
               rstd_k if rstd_k.is_contiguous() else rstd_k.contiguous(), c, sn, dq, dk, partial,
               b * s, s, q.shape[2], k.shape[2], d, n_q, n_k, *dq_out.stride()[:3], *dk_out.stride()[:3],
               *q.stride()[:3], *k.stride()[:3], c_sb, c_ss, **meta)
    _SUM[sum_grid](partial, dq_weight, dk_weight, g, d, **sum_meta)
    return dq, dk, dq_weight, dk_weight
