"""Rotary position embedding (HF "rotate_half" / NeoX style) on q and k in one launch, forward and backward.

Math (per token t, per head, head_dim d even, half = d // 2, x = [x1, x2] split at half, c = cos[t], s = sin[t]):

    HF:        y = x * c + rotate_half(x) * s,        rotate_half([x1, x2]) = [-x2, x1]
    forward:   y1 = x1 * c1 - x2 * s1                 y2 = x2 * c2 + x1 * s2
    backward:  dx = dy * c + rotate_half^T(dy * s),   rotate_half^T([z1, z2]) = [z2, -z1]
               dx1 = dy1 * c1 + dy2 * s2              dx2 = dy2 * c2 - dy1 * s1

With HF's tables (cos = cat(f, f).cos(), so c1 == c2 and s1 == s2) the backward is the rotation by -theta. The
kernel reads both halves of cos/sin anyway, so it matches HF's formula for *any* (b, s, d) tables, and the backward
is the exact transpose of the forward for any tables. cos/sin get no gradient: HF builds them under
torch.no_grad() from position_ids, so nothing upstream needs one.

Layout: everything is addressed as (batch, seq, heads, head_dim) through strides, so HF's (b, h, s, d) tensors
(unsqueeze_dim=1) are passed with their seq and head strides swapped and novatune's own (b, s, h, d) layout
(unsqueeze_dim=2) as is; only the last dim must be contiguous (no copies; a tensor whose last stride is not 1,
e.g. an expanded grad, is copied once). cos/sin are (b or broadcast, s, d) with a batch stride that may be 0.
Positions live in the tables, so packed rows whose positions restart at each document need nothing special.

Host cost: the launcher runs ~36 layers x 3 times per micro-step, so everything that depends only on shapes
(validation, block sizes, grid) is computed once per shape key and cached (_CONFIGS); a call then costs a dict
lookup, a few stride reads and the launch - no view tensors, no triton.cdiv / next_power_of_2 calls.

Kernel: grid (b * s tokens, head splits). A program loads the token's cos/sin once (fp32), then rotates a block of
q heads and a block of k heads (GQA: hk may differ from hq) as (heads, half) tiles: fp32 math, one rounding to the
output dtype. Head splits only exist to give short sequences enough programs (each split re-reads the token's
cos/sin, 4 * d bytes, from L2); at training shapes one program covers all 32 + 8 heads of a token.

Partial rotary (Phi-4-mini: partial_rotary_factor 0.75): the tables are (b, s, r) with r < d even, and HF rotates
only the first r features of each head (rotate_half over those r) and passes the last d - r through. The kernel
rotates the first r the same way (HALF = r // 2) and copies the tail unchanged in both directions (the pass-through
is the identity, so its transpose is too); every output element is written.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from novatune.kernels.launch import cdiv, lean, next_pow2
from novatune.kernels.rms_norm import _round_to  # fp32 -> dtype, round-to-nearest-even on the interpreter too

MAX_HEAD_DIM = 256


@triton.jit
def _load_heads(x_ptr, x_tok, sh, H, pid_h, HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr):
    """Both halves of the heads of block pid_h of one token, as fp32 (BLOCK_H, BLOCK_D) tiles."""
    h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)                       # (BLOCK_H,)
    dd = tl.arange(0, BLOCK_D)                                        # (BLOCK_D,)
    mask = (h[:, None] < H) & (dd[None, :] < HALF)                    # (BLOCK_H, BLOCK_D)
    off = x_tok + h[:, None].to(tl.int64) * sh + dd[None, :]
    x1 = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + off + HALF, mask=mask, other=0.0).to(tl.float32)
    return x1, x2


@triton.jit
def _store_heads(o_ptr, o_tok, osh, H, pid_h, x1, x2, c1, c2, a, b,
                 HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, SOFT_RNE: tl.constexpr):
    """o = [x1 * c1 + x2 * a, x2 * c2 + x1 * b] (a, b carry the direction's signs), one rounding."""
    h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    dd = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < H) & (dd[None, :] < HALF)
    off = o_tok + h[:, None].to(tl.int64) * osh + dd[None, :]
    y1 = x1 * c1[None, :] + x2 * a[None, :]
    y2 = x2 * c2[None, :] + x1 * b[None, :]
    tl.store(o_ptr + off, _round_to(y1, o_ptr.dtype.element_ty, SOFT_RNE), mask=mask)
    tl.store(o_ptr + off + HALF, _round_to(y2, o_ptr.dtype.element_ty, SOFT_RNE), mask=mask)


@triton.jit
def _copy_tail(x_ptr, x_tok, sh, o_ptr, o_tok, osh, H, pid_h, ROT: tl.constexpr, PASS: tl.constexpr,
               BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr):
    """The features [ROT, ROT + PASS) of the heads of block pid_h of one token, copied unchanged (partial rotary)."""
    h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    dd = tl.arange(0, BLOCK_P)
    mask = (h[:, None] < H) & (dd[None, :] < PASS)
    x = tl.load(x_ptr + x_tok + h[:, None].to(tl.int64) * sh + ROT + dd[None, :], mask=mask, other=0.0)
    tl.store(o_ptr + o_tok + h[:, None].to(tl.int64) * osh + ROT + dd[None, :], x.to(o_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, S, HQ, HK,
                 q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, qo_sb, qo_ss, qo_sh, ko_sb, ko_ss, ko_sh, c_sb, c_ss,
                 HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                 BACKWARD: tl.constexpr, SOFT_RNE: tl.constexpr, PASS: tl.constexpr, BLOCK_P: tl.constexpr):
    tok = tl.program_id(0)
    pid_h = tl.program_id(1)
    bi = (tok // S).to(tl.int64)   # int64: b * stride overflows int32 at long packed batches
    si = (tok % S).to(tl.int64)
    # all loads (q, k, tables) are issued before any store: the compiler cannot move a load past a store it
    # cannot prove disjoint, and one round trip per program instead of two keeps more bytes in flight
    q1, q2 = _load_heads(q_ptr, bi * q_sb + si * q_ss, q_sh, HQ, pid_h, HALF, BLOCK_D, BLOCK_HQ)
    k1, k2 = _load_heads(k_ptr, bi * k_sb + si * k_ss, k_sh, HK, pid_h, HALF, BLOCK_D, BLOCK_HK)
    dd = tl.arange(0, BLOCK_D)
    dmask = dd < HALF
    # cos/sin read once per token, reused by every q and k head of this program
    c_off = bi * c_sb + si * c_ss + dd
    c1 = tl.load(cos_ptr + c_off, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + c_off + HALF, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + c_off, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + c_off + HALF, mask=dmask, other=0.0).to(tl.float32)
    if BACKWARD:  # transpose of the forward rotation: rotation by -theta
        a = s2
        b = -s1
    else:
        a = -s1
        b = s2
    _store_heads(qo_ptr, bi * qo_sb + si * qo_ss, qo_sh, HQ, pid_h, q1, q2, c1, c2, a, b, HALF, BLOCK_D, BLOCK_HQ,
                 SOFT_RNE)
    _store_heads(ko_ptr, bi * ko_sb + si * ko_ss, ko_sh, HK, pid_h, k1, k2, c1, c2, a, b, HALF, BLOCK_D, BLOCK_HK,
                 SOFT_RNE)
    if PASS > 0:  # partial rotary: the features past the tables' width pass through
        _copy_tail(q_ptr, bi * q_sb + si * q_ss, q_sh, qo_ptr, bi * qo_sb + si * qo_ss, qo_sh, HQ, pid_h,
                   2 * HALF, PASS, BLOCK_P, BLOCK_HQ)
        _copy_tail(k_ptr, bi * k_sb + si * k_ss, k_sh, ko_ptr, bi * ko_sb + si * ko_ss, ko_sh, HK, pid_h,
                   2 * HALF, PASS, BLOCK_P, BLOCK_HK)


# on CUDA the compiled kernel is called directly once Triton has picked it (novatune.kernels.launch)
_ROPE = lean(_rope_kernel)


def normalize_unsqueeze_dim(unsqueeze_dim: int) -> int:
    u = unsqueeze_dim + 4 if unsqueeze_dim < 0 else unsqueeze_dim   # HF unsqueezes a 3-d table into 4-d
    if u not in (1, 2):
        raise ValueError(f"unsqueeze_dim must be 1 ((b, h, s, d) layout) or 2 ((b, s, h, d)), got {unsqueeze_dim}")
    return u


def _bsh(dims: tuple, u: int) -> tuple:
    """The (batch, seq, heads) entries of a 4-d shape or stride tuple in layout u - what a (b, s, h, d) view of
    the tensor would report, without creating the view (the kernel only needs the pointer and these strides)."""
    return (dims[0], dims[2], dims[1]) if u == 1 else (dims[0], dims[1], dims[2])


def check_shapes(q_shape, k_shape, cos_shape, sin_shape, unsqueeze_dim):
    """The op's shape contract, on every path (the references broadcast where this refuses): q and k 4-d with
    the same batch, sequence and an even head_dim <= MAX_HEAD_DIM; cos/sin (b or 1, s, r) or (s, r) with an even
    rotary width r <= head_dim. Returns (u, (B, S, HQ), (HK, D, R))."""
    u = normalize_unsqueeze_dim(unsqueeze_dim)
    if len(q_shape) != 4 or len(k_shape) != 4:
        raise ValueError(f"q and k must be 4-d, got {tuple(q_shape)} and {tuple(k_shape)}")
    (B, S, HQ), (kb, ks, HK), D = _bsh(q_shape, u), _bsh(k_shape, u), q_shape[3]
    if kb != B or ks != S or k_shape[3] != D:
        raise ValueError(f"q {tuple(q_shape)} and k {tuple(k_shape)} disagree on batch, seq or head_dim")
    if D % 2 or D > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be even and <= {MAX_HEAD_DIM}, got {D}")
    R = cos_shape[-1]   # rotary width: d, or r < d with partial rotary
    if R % 2 or not 0 < R <= D:
        raise ValueError(f"cos/sin width (rotary dim) must be even and in (0, head_dim={D}], got {R}")
    for t in (cos_shape, sin_shape):   # (b or 1, s, r), or (s, r) from older HF code paths
        t3 = (1, *t) if len(t) == 2 else tuple(t)
        if len(t3) != 3 or t3[2] != R or t3[1] != S or t3[0] not in (1, B):
            raise ValueError(f"cos/sin must be (b, s, r) = ({B}, {S}, {R}) or broadcastable (1, s, r); "
                             f"got {tuple(t)}")
    return u, (B, S, HQ), (HK, D, R)


def _launch_config(q_shape, k_shape, cos_shape, sin_shape, unsqueeze_dim, on_gpu, backward, split, num_warps):
    """Validate the shapes (check_shapes) and choose the launch. Depends on shapes and overrides only (no strides,
    no dtype), so _launch caches it. Returns (u, (B, S, R), (HQ, HK), (cos, sin) batch-broadcast flags, grid,
    constexprs); grid is None when there are no tokens."""
    u, (B, S, HQ), (HK, D, R) = check_shapes(q_shape, k_shape, cos_shape, sin_shape, unsqueeze_dim)
    bcast = tuple(len(t) == 2 or t[0] == 1 for t in (cos_shape, sin_shape))
    n_tok = B * S
    if n_tok == 0:
        return u, (B, S, R), (HQ, HK), bcast, None, None
    half = R // 2
    block_d = next_pow2(half)
    if split is None:
        # one program per token at training shapes; split heads when the token count alone cannot fill the GPU,
        # or when a (heads, half) tile would exceed ~4096 fp32 values per half (register pressure). The CPU
        # interpreter runs programs one after another, so there fewer, larger programs are simply faster.
        split = 1
        while on_gpu and split < max(HQ, HK) and (
                n_tok * split < 2048 or next_pow2(cdiv(HQ, split)) * block_d > 4096):
            split *= 2
    bhq = next_pow2(cdiv(HQ, split))
    bhk = next_pow2(cdiv(HK, split))
    split = max(cdiv(HQ, bhq), cdiv(HK, bhk))
    if num_warps is None:
        num_warps = 4 if (bhq + bhk) * block_d <= 2048 else 8
    meta = dict(HALF=half, BLOCK_D=block_d, BLOCK_HQ=bhq, BLOCK_HK=bhk, BACKWARD=backward, num_warps=num_warps,
                PASS=D - R, BLOCK_P=next_pow2(max(D - R, 1)))
    return u, (B, S, R), (HQ, HK), bcast, (n_tok, split), meta


# _launch_config results by (q/k/cos/sin shapes, unsqueeze_dim, on GPU, backward, split, num_warps). A training
# run sees a handful of keys; the size cap only guards against unbounded growth (e.g. every sequence length).
_CONFIGS: dict[tuple, tuple] = {}
_CONFIGS_MAX = 4096


def _unit_last(x: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """x and its strides; x is copied first if head_dim is not contiguous (e.g. an expanded grad), since the
    kernel needs unit stride there (vector loads)."""
    st = x.stride()
    if st[-1] != 1:
        x = x.contiguous()
        st = x.stride()
    return x, st


def _table_strides(t: torch.Tensor, bcast: bool) -> tuple | None:
    """(batch, seq) strides of a cos/sin table as the kernel reads it (batch stride 0 when broadcast over the
    batch); None if its last dim is not contiguous."""
    st = t.stride()
    if st[-1] != 1:
        return None
    return (0 if bcast else st[0]), st[-2]


def _launch(q, k, cos, sin, unsqueeze_dim, q_out, k_out, backward, split=None, num_warps=None):
    # Hot path: one dict lookup for the validated config, then only per-call stride reads. No views are created:
    # the kernel gets the tensors themselves (same data pointer as any view) and (b, s, h) strides via _bsh.
    key = (q.shape, k.shape, cos.shape, sin.shape, unsqueeze_dim, q.is_cuda, backward, split, num_warps)
    cfg = _CONFIGS.get(key)
    if cfg is None:
        cfg = _launch_config(*key)
        if len(_CONFIGS) >= _CONFIGS_MAX:
            _CONFIGS.clear()
        _CONFIGS[key] = cfg
    u, (B, S, R), (HQ, HK), (c_bcast, s_bcast), grid, meta = cfg
    q, q_st = _unit_last(q)
    k, k_st = _unit_last(k)
    q_out = torch.empty_like(q) if q_out is None else q_out   # dense, same stride order as q (like HF eager)
    k_out = torch.empty_like(k) if k_out is None else k_out
    qo_st, ko_st = q_out.stride(), k_out.stride()
    assert q_out.shape == q.shape and k_out.shape == k.shape and qo_st[-1] == 1 and ko_st[-1] == 1
    if grid is None:
        return q_out, k_out
    c_st = _table_strides(cos, c_bcast)
    if c_st is None or c_st != _table_strides(sin, s_bcast):
        # the kernel shares one set of table strides: materialise both as dense (B, S, R) (rare: odd tables)
        cos, sin = (t.reshape(-1, S, R).expand(B, S, R).contiguous() for t in (cos, sin))
        c_st = (S * R, R)
    _ROPE[grid](
        q, k, q_out, k_out, cos, sin, S, HQ, HK,
        *_bsh(q_st, u), *_bsh(k_st, u), *_bsh(qo_st, u), *_bsh(ko_st, u), *c_st,
        SOFT_RNE=not q.is_cuda, **meta)  # the interpreter truncates fp32 -> bf16; round to nearest as the GPU
    return q_out, k_out


def rope_fwd(q, k, cos, sin, unsqueeze_dim=1, q_out=None, k_out=None, split=None, num_warps=None):
    """(q_embed, k_embed) = HF apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim), fp32 math, one rounding.

    q (b, hq, s, d) / k (b, hk, s, d) for unsqueeze_dim=1, (b, s, h, d) for 2; any strides with a unit last
    stride. cos/sin (b or 1, s, r), r = d or (partial rotary) r < d: the last d - r features pass through.
    q_out/k_out: optional preallocated outputs (tests poison them).
    split/num_warps: tuning overrides (heads split over split programs per token).
    """
    return _launch(q, k, cos, sin, unsqueeze_dim, q_out, k_out, False, split, num_warps)


def rope_bwd(dq_embed, dk_embed, cos, sin, unsqueeze_dim=1, dq=None, dk=None, split=None, num_warps=None):
    """(dq, dk) from the output grads: the transposed rotation (by -theta), same layout rules as rope_fwd."""
    return _launch(dq_embed, dk_embed, cos, sin, unsqueeze_dim, dq, dk, True, split, num_warps)
