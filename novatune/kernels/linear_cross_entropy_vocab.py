"""mode="vocab" of the fused linear cross-entropy (novatune.kernels.linear_cross_entropy's docstring: two passes
over vocab slices, 4 GEMMs, grad_W written slice by slice), and the per-row Triton helpers that module's token-chunk
kernel shares with it: the online max / sum-exp merge (with the token statistics' sum p*z and first argmax), their
store, and the gradient over a row's logits.

`tile` = (rows per program, vocab columns per block) overrides the per-device row tiling (tests run the GPU one).
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from novatune.kernels.linear_cross_entropy_lowmem import fp32_addmm_available

_HALF = (torch.bfloat16, torch.float16)


@triton.jit
def _online_stats(z, off, m, s, t, top, STATS: tl.constexpr):
    """Merge one (ROWS, BLOCK_V) block of fp32 logits (masked lanes -inf), its first column `off`, into the running
    max m and sum s of exp(z - m) per row; with STATS also t = sum exp(z - m) * z and the first argmax `top`
    (a later block takes it only with a strictly larger max: ties keep the lowest column, as torch.argmax).
    m_ref = 0 while a row has seen no finite value so exp() never sees -inf - -inf."""
    b_max = tl.max(z, axis=1)
    m_new = tl.maximum(m, b_max)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    e = tl.exp(z - m_ref[:, None])
    rescale = tl.exp(m - m_ref)
    s = s * rescale + tl.sum(e, axis=1)
    if STATS:
        t = t * rescale + tl.sum(e * tl.where(z == float("-inf"), 0.0, z), axis=1)
        top = tl.where(b_max > m, off + tl.argmax(z, axis=1).to(tl.int64), top)
    return m_new, s, t, top


@triton.jit
def _store_stats(lse_ptr, ent_ptr, top_ptr, rows, lse, s, t, top, active, in_range):
    """Per row: lse, the entropy lse - t / s (= -sum p log p, TRL's formula) and the first argmax; 0, 0 and -1 on
    ignored rows."""
    ent = lse - t / tl.where(active, s, 1.0)
    tl.store(lse_ptr + rows, tl.where(active, lse, 0.0), mask=in_range)
    tl.store(ent_ptr + rows, tl.where(active, ent, 0.0), mask=in_range)
    tl.store(top_ptr + rows, tl.where(active, top, -1), mask=in_range)


@triton.jit
def _tanh(x):
    """tanh through the sigmoid (tanh x = 2 sigmoid(2x) - 1): the same on every Triton version and in the
    interpreter; absolute error ~1e-7 in fp32."""
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _grad_over_logits(z_rows, cols, n_cols, label_col, lse, active, in_range, divisor_ptr, Z_DTYPE: tl.constexpr,
                      BLOCK_V: tl.constexpr, softcap=1.0, CAPPED: tl.constexpr = False):
    """z <- dL/dz = (softmax - onehot) / D over the rows' n_cols logits, in place, in the logits' dtype; 0 on
    ignored rows. label_col: each row's label column in these logits (may lie outside them: no -1 term then).
    CAPPED: the loss saw softcap * tanh(z / softcap) (lse is theirs); the chain rule multiplies by 1 - tanh^2."""
    d = tl.load(divisor_ptr).to(tl.float32)  # D = 0 with active rows gives inf, as sum / 0 would
    inv = tl.where(active, 1.0 / tl.where(active, d, 1.0), 0.0)  # (ROWS,)
    lse_ref = tl.where(active, lse, 0.0)
    for off in range(0, n_cols, BLOCK_V):
        c = off + cols
        z = tl.load(z_rows + c, mask=active[:, None] & (c < n_cols), other=0.0).to(tl.float32)
        if CAPPED:
            t = _tanh(z / softcap)
            p = tl.exp(softcap * t - lse_ref[:, None])
            g = tl.where(c == label_col[:, None], p - 1.0, p) * inv[:, None] * (1.0 - t * t)
        else:
            p = tl.exp(z - lse_ref[:, None])
            g = tl.where(c == label_col[:, None], p - 1.0, p) * inv[:, None]
        g = tl.where(active[:, None], g, 0.0)
        tl.store(z_rows + c, g.to(Z_DTYPE), mask=in_range[:, None] & (c < n_cols))


@triton.jit
def _ce_slice_kernel(z_ptr, stride_z, labels_ptr, stats_ptr, loss_ptr, divisor_ptr, lse_ptr, ent_ptr, top_ptr,
                     n_rows, n_cols, col_off, V, ignore_index, softcap, ROWS: tl.constexpr, BLOCK_V: tl.constexpr,
                     FIRST: tl.constexpr, STATS: tl.constexpr, FINAL: tl.constexpr, GRAD: tl.constexpr,
                     TOKEN_STATS: tl.constexpr, CAPPED: tl.constexpr = False):
    """mode="vocab": ROWS rows of one vocab slice Z (n_rows, n_cols) = logits[:, col_off : col_off + n_cols].

    stats (3, n_rows) fp32 (4 with TOKEN_STATS): running max m, sum of exp(z - m), z_{y_t} (picked up by the slice
    holding y_t) and t = sum exp(z - m) * z; top_ptr the running first argmax. STATS: merge the slice into them
    (FIRST: start from (-inf, 0, 0) instead of loading them); FINAL (with STATS, on the last slice): lse_t into
    stats[0], loss_t into loss_ptr and, with TOKEN_STATS, the token statistics (_store_stats).
    GRAD: Z <- dL/dZ in place from stats[0] (lse; with FINAL, the lse just computed). Ignored rows are masked out
    of every load, get loss 0 and a zero gradient row. CAPPED: every statistic and the gradient are those of
    softcap * tanh(z / softcap) (Gemma 2's final logit soft-capping), computed from the raw logits in fp32."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    in_range = rows < n_rows
    label = tl.load(labels_ptr + rows, mask=in_range, other=ignore_index).to(tl.int64)  # (ROWS,)
    active = in_range & (label != ignore_index)
    local = label - col_off  # the label's column in this slice (may be outside it)
    in_slice = active & (local >= 0) & (local < n_cols)  # implies 0 <= label < V
    z_rows = z_ptr + rows[:, None] * stride_z  # (ROWS, 1) row pointers
    cols = tl.arange(0, BLOCK_V)[None, :]  # (1, BLOCK_V)
    m_ptr = stats_ptr + rows
    s_ptr = stats_ptr + n_rows + rows
    y_ptr = stats_ptr + 2 * n_rows + rows

    if STATS:
        # z_y read before the loop: its reductions (block-wide barriers) order the read before GRAD's stores.
        z_l = tl.load(z_ptr + rows * stride_z + tl.where(in_slice, local, 0), mask=in_slice, other=0.0)
        z_l = z_l.to(tl.float32)
        if CAPPED:
            z_l = softcap * _tanh(z_l / softcap)
        t_ptr = stats_ptr + 3 * n_rows + rows
        if FIRST:
            m = tl.full([ROWS], float("-inf"), tl.float32)
            s = tl.zeros([ROWS], dtype=tl.float32)
            z_y = tl.zeros([ROWS], dtype=tl.float32)
            t = tl.zeros([ROWS], dtype=tl.float32)
            top = tl.full([ROWS], -1, tl.int64)
        else:
            m = tl.load(m_ptr, mask=in_range, other=float("-inf"))
            s = tl.load(s_ptr, mask=in_range, other=0.0)
            z_y = tl.load(y_ptr, mask=in_range, other=0.0)
            if TOKEN_STATS:
                t = tl.load(t_ptr, mask=in_range, other=0.0)
                top = tl.load(top_ptr + rows, mask=in_range, other=-1)
            else:
                t = tl.zeros([ROWS], dtype=tl.float32)
                top = tl.full([ROWS], -1, tl.int64)
        z_y = tl.where(in_slice, z_l, z_y)
        for off in range(0, n_cols, BLOCK_V):  # online max / sum-exp (and t, argmax), fp32
            c = off + cols
            z = tl.load(z_rows + c, mask=active[:, None] & (c < n_cols), other=float("-inf")).to(tl.float32)
            if CAPPED:  # masked lanes stay -inf
                z = tl.where(z == float("-inf"), z, softcap * _tanh(z / softcap))
            m, s, t, top = _online_stats(z, col_off + off, m, s, t, top, TOKEN_STATS)
        if FINAL:
            lse = m + tl.log(tl.where(active, s, 1.0))  # -inf on inactive rows (unused there; no log(0))
            valid = (label >= 0) & (label < V)
            loss = tl.where(valid, lse - z_y, float("nan"))
            tl.store(loss_ptr + rows, tl.where(active, loss, 0.0), mask=in_range)
            tl.store(m_ptr, lse, mask=in_range)  # for pass 2's launches
            if TOKEN_STATS:
                _store_stats(lse_ptr, ent_ptr, top_ptr, rows, lse, s, t, top, active, in_range)
        else:
            tl.store(m_ptr, m, mask=in_range)
            tl.store(s_ptr, s, mask=in_range)
            tl.store(y_ptr, z_y, mask=in_range)
            if TOKEN_STATS:
                tl.store(t_ptr, t, mask=in_range)
                tl.store(top_ptr + rows, top, mask=in_range)

    if GRAD:
        if not FINAL:
            lse = tl.load(m_ptr, mask=active, other=0.0)
        _grad_over_logits(z_rows, cols, n_cols, local, lse, active, in_range, divisor_ptr,
                          z_ptr.dtype.element_ty, BLOCK_V, softcap, CAPPED)


def _slice_triton(z: torch.Tensor, labels: torch.Tensor, stats: torch.Tensor, loss_rows: torch.Tensor,
                  divisor: torch.Tensor, col_off: int, V: int, ignore_index: int, *, first: bool, update: bool,
                  final: bool, grad: bool, token_stats=None, tile=None, softcap: float | None = None) -> None:
    n_rows, n_cols = z.shape
    if n_rows == 0:
        return
    # GPU: one row per program, 4096-column blocks; the interpreter: 16 rows x up to 8192 columns per program
    rows, block_v = tile or ((1, 4096) if z.is_cuda else (16, 8192))
    block_v = min(triton.next_power_of_2(n_cols), block_v)
    lse, ent, top = token_stats if token_stats is not None else (stats,) * 3  # unused pointers without them
    _ce_slice_kernel[(triton.cdiv(n_rows, rows),)](z, z.stride(0), labels, stats, loss_rows, divisor, lse, ent, top,
                                                   n_rows, n_cols, col_off, V, ignore_index, float(softcap or 1.0),
                                                   ROWS=rows, BLOCK_V=block_v, FIRST=first, STATS=update,
                                                   FINAL=final, GRAD=grad, TOKEN_STATS=token_stats is not None,
                                                   CAPPED=softcap is not None, num_warps=8)


def _slice_torch(z: torch.Tensor, labels: torch.Tensor, stats: torch.Tensor, loss_rows: torch.Tensor,
                 divisor: torch.Tensor, col_off: int, V: int, ignore_index: int, *, first: bool, update: bool,
                 final: bool, grad: bool, token_stats=None, softcap: float | None = None) -> None:
    """Same contract as _ce_slice_kernel in plain PyTorch (the CPU path: z is fp32 there). Statistics are kept
    for ignored rows too (finite), and only masked at the end."""
    n_rows, n_cols = z.shape
    active = labels != ignore_index
    local = labels.long() - col_off
    in_slice = active & (local >= 0) & (local < n_cols)
    safe = local.clamp(0, max(n_cols - 1, 0)).unsqueeze(1)  # (rows, 1)
    zf = z.float()
    if softcap is not None:
        tanh = torch.tanh(zf / softcap)
        zf = tanh * softcap
    lse = None
    if update:
        if first:
            m = torch.full((n_rows,), float("-inf"), device=z.device)
            s, z_y, t = (torch.zeros(n_rows, device=z.device) for _ in range(3))
            top = torch.full((n_rows,), -1, device=z.device, dtype=torch.int64)
        else:
            m, s, z_y = stats[0].clone(), stats[1].clone(), stats[2].clone()
            if token_stats is not None:
                t, top = stats[3].clone(), token_stats[2].clone()
            else:  # unused without the statistics
                t, top = torch.zeros_like(s), torch.full((n_rows,), -1, device=z.device, dtype=torch.int64)
        z_y = torch.where(in_slice, zf.gather(1, safe).squeeze(1), z_y)
        b_max = zf.amax(1)
        m_new = torch.maximum(m, b_max)
        m_ref = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        e = torch.exp(zf - m_ref.unsqueeze(1))
        s = s * torch.exp(m - m_ref) + e.sum(1)
        if token_stats is not None:  # as _online_stats
            t = t * torch.exp(m - m_ref) + (e * zf).sum(1)
            top = torch.where(b_max > m, col_off + zf.argmax(1), top)
        if final:
            lse = m_new + torch.log(s)
            valid = (labels >= 0) & (labels < V)
            loss = torch.where(valid, lse - z_y, torch.full_like(lse, float("nan")))
            loss_rows.copy_(torch.where(active, loss, torch.zeros_like(loss)))
            stats[0].copy_(lse)
            if token_stats is not None:
                token_stats[0].copy_(torch.where(active, lse, 0.0))
                token_stats[1].copy_(torch.where(active, lse - t / s, 0.0))
                token_stats[2].copy_(torch.where(active, top, -1))
        else:
            stats[0].copy_(m_new)
            stats[1].copy_(s)
            stats[2].copy_(z_y)
            if token_stats is not None:
                stats[3].copy_(t)
                token_stats[2].copy_(top)
    if grad:
        lse = stats[0] if lse is None else lse
        scale = torch.where(active, 1.0 / divisor.float(), torch.zeros_like(lse))  # (rows,)
        g = torch.exp(zf - lse.unsqueeze(1))
        g.scatter_add_(1, safe, torch.where(in_slice, -1.0, 0.0).to(g.dtype).unsqueeze(1))
        if softcap is not None:
            g *= 1.0 - tanh * tanh  # d(cap * tanh(z / cap)) / dz
        z.copy_(g * scale.unsqueeze(1))


def fwd_vocab(hidden, weight, bias, labels, divisor, loss_rows, gh, gb_acc, ignore_index, grad_hidden,
              grad_weight, grad_bias, Vc, use_triton, dweight, token_stats=None, tile=None, softcap=None):
    """mode="vocab": slices of Vc vocab columns, two passes. Fills loss_rows, gh, gb_acc; returns grad_W.
    softcap: the loss of softcap * tanh(logits / softcap), applied inside both passes."""
    T, H = hidden.shape
    V = weight.shape[0]
    dev, dt = hidden.device, hidden.dtype
    slice_op = functools.partial(_slice_triton, tile=tile) if use_triton else _slice_torch
    grad = grad_hidden or grad_weight or grad_bias
    Vc = min(Vc, max(V, 1))
    n = math.ceil(V / Vc) if T else 0
    gw = None
    if grad_weight:  # written slice by slice, every row exactly once: no zero-fill, no accumulator
        gw = dweight if (dweight is not None and use_triton) else torch.empty(V, H, device=dev, dtype=dt)
        if n == 0:
            gw.zero_()
    # grad_h sums over slices: in gh itself for fp32, else in an fp32 (T, H) buffer - accumulated by the GEMM
    # (aten::addmm.dtype_out) or, without it, from half partials written to gh (each rounded once).
    acc = direct = None
    if grad_hidden and dt in _HALF and n:
        acc = torch.empty(T, H, device=dev, dtype=torch.float32)
        direct = fp32_addmm_available(dev, dt)
    # running max, sum-exp, z_label (then lse) and, for the token statistics, sum exp(z - m) * z
    stats = torch.empty(3 if token_stats is None else 4, T, device=dev, dtype=torch.float32)
    z_flat = torch.empty(T * Vc if n else 0, device=dev, dtype=dt)  # the only logits buffer, both passes

    def logits(j):
        s, e = j * Vc, min((j + 1) * Vc, V)
        z = z_flat[: T * (e - s)].view(T, e - s)  # contiguous (T, e - s) view: the ragged last slice too
        w_t = weight[s:e].t()  # (H, e - s) view of rows s:e of W
        if bias is None:
            torch.mm(hidden, w_t, out=z)
        else:
            torch.addmm(bias[s:e], hidden, w_t, out=z)
        return s, e, z

    def consume(k, s, e, z):  # z = dL/dZ of slice (s, e); k = how many slices were consumed before
        if grad_weight:
            torch.mm(z.t(), hidden, out=gw[s:e])  # one GEMM over all T tokens: fp32 inside cuBLAS, one rounding
        if grad_bias:
            torch.sum(z, 0, dtype=torch.float32, out=gb_acc[s:e])
        if grad_hidden:
            w_j = weight[s:e]
            if acc is None:  # fp32 (or the fp32 reference path): accumulate in the output itself
                if k == 0:
                    torch.mm(z, w_j, out=gh)
                else:
                    gh.addmm_(z, w_j)
            elif direct:
                torch.addmm(acc, z, w_j, out_dtype=torch.float32, beta=0 if k == 0 else 1, out=acc)
            else:
                torch.mm(z, w_j, out=gh)
                if k == 0:
                    acc.copy_(gh)
                else:
                    acc.add_(gh)

    for j in range(n):  # pass 1: statistics; the last slice also gets its gradient (its logits are at hand)
        last = j == n - 1
        s, e, z = logits(j)
        slice_op(z, labels, stats, loss_rows, divisor, s, V, ignore_index, first=j == 0, update=True, final=last,
                 grad=grad and last, token_stats=token_stats, softcap=softcap)
    if grad and n:
        consume(0, s, e, z)
        for k, j in enumerate(range(n - 2, -1, -1), start=1):  # pass 2, backwards: slice n-1 is done
            s, e, z = logits(j)
            slice_op(z, labels, stats, loss_rows, divisor, s, V, ignore_index, first=False, update=False,
                     final=False, grad=True, softcap=softcap)
            consume(k, s, e, z)
    z_flat = z = None
    if acc is not None:
        gh.copy_(acc)
    elif grad_hidden and n == 0:
        gh.zero_()
    if n == 0:
        loss_rows.zero_()
    return gw
