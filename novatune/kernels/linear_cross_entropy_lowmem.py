"""mode="inplace" of the fused linear cross-entropy: 3 GEMMs, peak ~ T*V*e, grad_W written over dead logits.

Notation as in novatune.kernels.linear_cross_entropy (h (T, H), W (V, H), e = bytes per element). Requires T >= H
(else that module falls back to mode "tokens"). The logits are kept TRANSPOSED, z^T (V, T): row r = vocab entry r
across all tokens, row stride ld = T rounded up to 16 (16-byte aligned GEMM leading dimensions and vector loads
for any T; ld = T at T = 4096). Two allocations:

    A = empty(V, H)                 exactly grad_W, returned AS grad_W (a standalone tensor autograd can steal;
                                    a preallocated dweight is used as A)
    B = empty((V - rows_a) * ld)    rows_a = floor(V*H / ld) <= V: rows [0, rows_a) of z^T live in A (row r at
                                    A.flat[r*ld:]), rows [rows_a, V) in B; A's last V*H - rows_a*ld < ld elements
                                    hold no logits. No row straddles A/B; |A| + |B| <= ld*V + ld elements.

    1. z^T[:rows_a] = W[:rows_a] @ h^T,  z^T[rows_a:] = W[rows_a:] @ h^T     2 GEMMs, input dtype (bf16 logits,
                                                                             like stock HF), bias added by addmm
    2. Triton sweeps over blocks of TOKENS (coalesced along T), for each piece (A rows, B rows):
         stats:  per (token block, row split): online max / sum-exp, fp32 -> partials (n_parts, 2, T)
         finish: merge the partials per token -> lse_t, loss_t (0 ignored, NaN for a label outside [0, V))
         grad:   z^T <- dL/dz^T = (softmax - onehot) / D in place (0 columns for ignored tokens)
    3. grad_h = dz^T[:rows_a].T @ W[:rows_a] + dz^T[rows_a:].T @ W[rows_a:]   fp32 (T, H) accumulator
       (aten::addmm.dtype_out where available, else half partials summed in fp32); grad_b = row sums (fp32)
    4. grad_W by row blocks [a, b) in ascending order:  g = dz^T[a:b] @ h -> A.flat[a*H : b*H]  - ONE GEMM over all
       T tokens per block (fp32 accumulation inside cuBLAS, one rounding). `direct` blocks write A straight; the
       others (the first rows, where the destination overlaps the block's own logits) go through a temp of
       <= tmp_rows x H (INPLACE_TEMP_BYTES) and a copy.
    5. drop B; grad_W = A; grad_h = the fp32 accumulator cast once.

Placement proof (asserted by `_check_layout` for every layout used, unit-tested against an independent simulation).
Row r's storage: A.flat[r*ld : r*ld + T] for r < rows_a, else in B (another allocation). Step 3 has read every row
before step 4 writes anything (one stream: ordered). In step 4, block [a, b) is read by its GEMM and dead after it;
blocks go in ascending order, so when its g is written the live rows are [b, V) (and [a, b) during a direct GEMM).
  (a) the destination [a*H, b*H) lies in A (b <= V) and ends before every later row's storage: a row r >= b is in
      B, or starts at r*ld >= b*ld >= b*H because ld >= T >= H. So no live logits are overwritten.
  (b) destinations of different blocks are disjoint, and as the blocks partition [0, V) they cover [0, V*H) once -
      the tail [rows_a*ld, V*H) that held no logits included. A is all written: A IS grad_W.
  (c) a direct GEMM's output must not overlap its input rows [a*ld, b*ld): b*H <= a*ld, or a >= rows_a (input in
      B). Other blocks compute into the temp; the copy into A is enqueued after the GEMM that read the block.
      `inplace_layout` makes blocks greedily: from row a, a direct block up to b = floor(a*ld/H) when that gives
      at least tmp_rows rows, else a temp block of tmp_rows; B's rows are one direct block. Qwen3-4B x 4096
      tokens: ld/H = 1.6, tmp_rows = 3200: 2 temp blocks (31 MiB copied) and 7 direct ones (B's included).

Peak extra memory: A + B (T*V*e + < (ld - T + 1)*V*e) + grad_h (T*H*e) + the largest of: the fp32 grad_h
accumulator (T*H*4, freed after step 3), the temp (<= INPLACE_TEMP_BYTES, step 4), the sweeps' scratch (partials
n_parts*2*T*4, lse T*4). Qwen3-4B x 4096 bf16: 1187 + 20 + 40 MiB = 1.22 GiB, grad_W included (mode "tokens":
1.95 GiB measured). Time: the 3 GEMM-equivalents of mode "tokens" in 2 + 2 + 9 GEMMs, the same HBM traffic in
the sweeps (read; read + write) as its row kernel, plus the temp blocks' copies. T = H is the worst case: every
block goes through the temp (A copied once, V*H*e).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

INPLACE_TEMP_BYTES = 16 * 2**20  # the temp of step 4: tmp_rows = this / (H e), a multiple of _ALIGN
_ALIGN = 128  # temp and direct blocks rounded to multiples of this rows (but at rows_a and V)
_LD_ALIGN = 16  # z^T's row stride: T rounded up to this (16-byte aligned GEMM leading dims, vector loads)
_HALF = (torch.bfloat16, torch.float16)
# (BLOCK_R rows, BLOCK_T tokens, row splits) for the sweeps; None: per device (tests run the GPU tiling)
_COLS_TILE_OVERRIDE: tuple[int, int, int] | None = None
_POISON_SCRATCH = False  # tests: fill A, B, temp, accumulators and scratch with NaN when allocated
_SM_COUNT: dict = {}

# ------------------------------------------------------------------------------------------------ shared helpers

_FP32_ADDMM_OK: dict = {}


def fp32_addmm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Can torch.addmm accumulate a half-precision GEMM directly into an fp32 tensor here (aten::addmm.dtype_out
    with an fp32 `self`)? CPU: never (no kernel). CUDA: torch versions differ (older ones require `self` in the
    input dtype), so try it once per (device, dtype) on a small problem and check the numbers."""
    if device.type != "cuda":
        return False
    key = (device.index, dtype)
    if key not in _FP32_ADDMM_OK:
        ok = False
        try:
            gen = torch.Generator(device=device).manual_seed(0)
            a = torch.randn(64, 48, device=device, dtype=dtype, generator=gen)
            b = torch.randn(48, 32, device=device, dtype=dtype, generator=gen)
            acc = torch.full((64, 32), float("nan"), device=device, dtype=torch.float32)
            torch.addmm(acc, a, b, out_dtype=torch.float32, beta=0, out=acc)  # beta=0 must ignore the NaNs
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            ok = bool(torch.allclose(acc, 2 * (a.float() @ b.float()), rtol=1e-3, atol=1e-3))
        except (RuntimeError, TypeError, NotImplementedError):
            ok = False
        _FP32_ADDMM_OK[key] = ok
    return _FP32_ADDMM_OK[key]


def _scratch(shape, device, dtype) -> torch.Tensor:
    t = torch.empty(shape, device=device, dtype=dtype)
    return t.fill_(float("nan")) if _POISON_SCRATCH else t


# ------------------------------------------------------------------------------------------------ planning


def plan_inplace_block(V: int, H: int, dtype: torch.dtype, budget: int = INPLACE_TEMP_BYTES) -> int:
    """tmp_rows: the most rows whose (rows, H) temp fits `budget`, a multiple of _ALIGN (at least _ALIGN)."""
    e = torch.finfo(dtype).bits // 8
    rows = max(budget // max(H * e, 1) // _ALIGN * _ALIGN, _ALIGN)
    return max(1, min(V, rows))


def inplace_layout(T: int, V: int, H: int, tmp_rows: int) -> tuple[int, int, list[tuple[int, int, bool]]]:
    """(ld, rows_a, [(a, b, direct), ...]): z^T's row stride, the rows held in A, and step 4's row blocks in
    processing order (module docstring, (c)). Checked by _check_layout."""
    if T < H:
        raise ValueError(f"linear_cross_entropy mode 'inplace' needs tokens >= hidden (got T={T}, H={H})")
    R = max(1, int(tmp_rows))
    ld = max(_LD_ALIGN, math.ceil(T / _LD_ALIGN) * _LD_ALIGN)
    rows_a = min(V, (V * H) // ld)
    blocks, a = [], 0
    while a < rows_a:
        b = min(a * ld // H, rows_a)  # the end of the largest direct block from a (b*H <= a*ld)
        if b < rows_a and b - a >= _ALIGN:
            b = a + (b - a) // _ALIGN * _ALIGN
        if b - a < R:  # too small (or empty, at a = 0): a temp block
            b = min(a + R, rows_a)
        blocks.append((a, b, b * H <= a * ld))
        a = b
    if rows_a < V:
        blocks.append((rows_a, V, True))  # in B: never overlaps its destination in A
    _check_layout(ld, V, H, rows_a, blocks)
    return ld, rows_a, blocks


def _require(ok: bool, what) -> None:
    if not ok:  # not `assert`: the placement invariants must hold under python -O too
        raise AssertionError(f"linear_cross_entropy inplace layout: {what}")


def _check_layout(ld: int, V: int, H: int, rows_a: int, blocks) -> None:
    """The invariants the in-place weight-gradient writes rely on (module docstring, (a) - (c)); ld >= T >= H."""
    _require(ld >= H and 0 <= rows_a <= V and rows_a * ld <= V * H, (ld, V, H, rows_a))
    prev = 0
    for a, b, direct in blocks:
        _require(a == prev and a < b <= V, f"blocks must partition [0, V) in order: {(a, b)} after {prev}")
        _require(b <= rows_a or a >= rows_a, f"block {(a, b)} straddles the A/B boundary {rows_a}")
        # (a) the destination [a*H, b*H) is in A and ends before every later row's storage (in A: from b*ld on)
        _require(b * H <= V * H and (b >= rows_a or b * H <= b * ld), f"block {(a, b)} overwrites live rows")
        if direct:  # (c) a direct GEMM's output must not overlap its own input rows [a*ld, b*ld) in A
            _require(a >= rows_a or b * H <= a * ld, f"block {(a, b)} cannot be written into A directly")
        prev = b
    _require(prev == V, "blocks must cover the vocab")  # (b): the destinations then cover [0, V*H)


# ------------------------------------------------------------------------------------------------ kernels


@triton.jit
def _cols_stats_kernel(z_ptr, ld, part_ptr, n_out, labels_ptr, n_rows, row_off, T, rows_per_split, part_off,
                       ignore_index,
                       BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, STATS: tl.constexpr):
    """One piece z (n_rows, T), row stride ld, of z^T, its first vocab row row_off. Program (i, j): tokens
    [i*BLOCK_T, +BLOCK_T) x rows [j*rows_per_split, +rows_per_split): running max m and sum of exp(z - m) per
    token, fp32, to part[part_off + j] = (m, s) rows of T; m = -inf, s = 0 for ignored tokens. STATS (the token
    statistics): also t = sum exp(z - m) * z and the first argmax row (as fp32, exact below 2^24 rows): part rows
    (m, s, t, argmax).

    Loads are masked by rows and `tok < ld` only (ld % 16 == 0: 16-byte vector loads; a mask varying per token
    would split them into 2-byte loads), ignored tokens and the padding columns [T, ld) (never written: any value,
    NaN included) are dropped after the load by tl.where. Every column < T was written by the logits GEMM."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,)
    in_t = tok < T
    in_ld = tok < ld
    label = tl.load(labels_ptr + tok, mask=in_t, other=ignore_index)
    active = in_t & (label != ignore_index)
    split = tl.program_id(1)
    r_lo = split.to(tl.int64) * rows_per_split
    r_hi = tl.minimum(r_lo + rows_per_split, n_rows)
    ridx = tl.arange(0, BLOCK_R)
    offs = ridx[:, None] * ld + tok[None, :]  # int32 within a tile; the tile's base pointer carries the rest
    base = z_ptr + r_lo * ld  # 64-bit: r * ld exceeds 2^31 for large T x V
    # Running (max, sum-exp) per ELEMENT of the tile, merged over the rows once at the end: a per-step reduction
    # over the tile's rows crosses warps (shared memory + barriers every step) and made this sweep latency-bound
    # (1.72 ms for 1.16 GiB at Qwen3-4B x 4096, H200, LOG.md run 20); this costs a second exp per element instead.
    m = tl.full([BLOCK_R, BLOCK_T], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_R, BLOCK_T], dtype=tl.float32)
    t = tl.zeros([BLOCK_R, BLOCK_T], dtype=tl.float32)
    top = tl.full([BLOCK_R, BLOCK_T], -1, tl.int32)  # per element: the first row holding its running max
    for r0 in range(r_lo, r_hi, BLOCK_R):
        n_left = (r_hi - r0).to(tl.int32)
        z = tl.load(base + offs, mask=(ridx < n_left)[:, None] & in_ld[None, :], other=float("-inf"))
        base += BLOCK_R * ld
        z = tl.where(active[None, :], z.to(tl.float32), float("-inf"))
        m_new = tl.maximum(m, z)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf while nothing finite was seen
        e = tl.exp(z - m_ref)
        s = s * tl.exp(m - m_ref) + e
        if STATS:
            t = t * tl.exp(m - m_ref) + e * tl.where(z == float("-inf"), 0.0, z)
            top = tl.where(z > m, (r0 - r_lo).to(tl.int32) + ridx[:, None], top)
        m = m_new
    m_tok = tl.max(m, axis=0)  # (BLOCK_T,)
    m_tok_ref = tl.where(m_tok == float("-inf"), 0.0, m_tok)
    w = tl.exp(m - m_tok_ref[None, :])
    s_tok = tl.sum(s * w, axis=0)
    p = part_ptr + (part_off + split).to(tl.int64) * n_out * T + tok  # n_out rows of T per part
    tl.store(p, m_tok, mask=in_t)
    tl.store(p + T, s_tok, mask=in_t)
    if STATS:  # the lowest row among the elements holding the token's max: its first argmax
        first = tl.min(tl.where((m == m_tok[None, :]) & (top >= 0), top, 2**30), axis=0)
        row = tl.where(first < 2**30, (row_off + r_lo + first).to(tl.float32), -1.0)
        tl.store(p + 2 * T, tl.sum(t * w, axis=0), mask=in_t)
        tl.store(p + 3 * T, row, mask=in_t)


@triton.jit
def _cols_finish_kernel(part_ptr, n_parts, n_out, za_ptr, zb_ptr, ld, rows_a, labels_ptr, lse_ptr, loss_ptr, ent_ptr,
                        top_ptr, T, V, ignore_index, BLOCK_T: tl.constexpr, STATS: tl.constexpr):
    """Merge the n_parts partial (m, s) per token: lse_t (0 for ignored tokens) and loss_t = lse_t - z_{y_t}
    (0 ignored, NaN for a label outside [0, V)); z_y read from A's rows (y < rows_a) or B's. STATS: also the
    entropy lse - t / s and the first argmax (a later part, higher rows, takes it only with a larger max) to
    ent_ptr / top_ptr (0 and -1 on ignored tokens)."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_t = tok < T
    label = tl.load(labels_ptr + tok, mask=in_t, other=ignore_index).to(tl.int64)
    active = in_t & (label != ignore_index)
    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_T], dtype=tl.float32)
    t = tl.zeros([BLOCK_T], dtype=tl.float32)
    top = tl.full([BLOCK_T], -1.0, tl.float32)
    p = part_ptr + tok  # advanced by a pointer increment: 64-bit, however many partials
    for _ in range(n_parts):
        m_j = tl.load(p, mask=in_t, other=float("-inf"))
        s_j = tl.load(p + T, mask=in_t, other=0.0)
        m_new = tl.maximum(m, m_j)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_ref) + s_j * tl.exp(m_j - m_ref)
        if STATS:
            t = t * tl.exp(m - m_ref) + tl.load(p + 2 * T, mask=in_t, other=0.0) * tl.exp(m_j - m_ref)
            top = tl.where(m_j > m, tl.load(p + 3 * T, mask=in_t, other=-1.0), top)
        p += n_out * T
        m = m_new
    lse = m + tl.log(tl.where(active, s, 1.0))
    valid = (label >= 0) & (label < V)
    in_a = active & valid & (label < rows_a)
    in_b = active & valid & (label >= rows_a)
    z_a = tl.load(za_ptr + tl.where(in_a, label, 0) * ld + tok, mask=in_a, other=0.0).to(tl.float32)
    z_b = tl.load(zb_ptr + tl.where(in_b, label - rows_a, 0) * ld + tok, mask=in_b, other=0.0).to(tl.float32)
    loss = tl.where(valid, lse - tl.where(in_a, z_a, z_b), float("nan"))
    tl.store(loss_ptr + tok, tl.where(active, loss, 0.0), mask=in_t)
    tl.store(lse_ptr + tok, tl.where(active, lse, 0.0), mask=in_t)
    if STATS:
        tl.store(ent_ptr + tok, tl.where(active, lse - t / tl.where(active, s, 1.0), 0.0), mask=in_t)
        tl.store(top_ptr + tok, tl.where(active, top.to(tl.int64), -1), mask=in_t)


@triton.jit
def _cols_grad_kernel(z_ptr, ld, n_rows, row_off, labels_ptr, lse_ptr, divisor_ptr, T, rows_per_split,
                      ignore_index, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr):
    """z <- dL/dz = (exp(z - lse_t) - [row_off + r == y_t]) / D in place over one piece (n_rows, T), row stride
    ld; columns of ignored tokens and the padding [T, ld) are written 0. Grid and masking as _cols_stats_kernel."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_t = tok < T
    in_ld = tok < ld
    label = tl.load(labels_ptr + tok, mask=in_t, other=ignore_index).to(tl.int64)
    active = in_t & (label != ignore_index)
    d = tl.load(divisor_ptr).to(tl.float32)  # D = 0 with active tokens gives inf, as sum / 0 would
    inv = tl.where(active, 1.0 / tl.where(active, d, 1.0), 0.0)
    lse = tl.load(lse_ptr + tok, mask=in_t, other=0.0)
    local = label - row_off  # the label's row in this piece (may be outside it)
    r_lo = tl.program_id(1).to(tl.int64) * rows_per_split
    r_hi = tl.minimum(r_lo + rows_per_split, n_rows)
    ridx = tl.arange(0, BLOCK_R)
    offs = ridx[:, None] * ld + tok[None, :]  # as in _cols_stats_kernel
    base = z_ptr + r_lo * ld
    for r0 in range(r_lo, r_hi, BLOCK_R):
        n_left = (r_hi - r0).to(tl.int32)
        rel = tl.minimum(tl.maximum(local - r0, -1), BLOCK_R).to(tl.int32)  # the label's row in this tile
        mask = (ridx < n_left)[:, None] & in_ld[None, :]
        z = tl.load(base + offs, mask=mask, other=0.0)
        z = tl.where(active[None, :], z.to(tl.float32), 0.0)  # drops whatever the padding columns held
        p = tl.exp(z - lse[None, :])
        g = tl.where(ridx[:, None] == rel[None, :], p - 1.0, p) * inv[None, :]
        g = tl.where(active[None, :], g, 0.0)
        tl.store(base + offs, g.to(z_ptr.dtype.element_ty), mask=mask)
        base += BLOCK_R * ld


def _sm_count(device: torch.device) -> int:
    if device.index not in _SM_COUNT:
        _SM_COUNT[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device.index]


def _sweep_triton(za, zb, ld, rows_a, labels, loss_rows, divisor, V, ignore_index, grad, token_stats=None) -> None:
    """Step 2 of the module docstring over the two pieces za = z^T[:rows_a] and zb = z^T[rows_a:] (row stride ld;
    padding columns included: they are read and written, never used); token_stats (lse, entropy, argmax) filled
    from the same sweep when given."""
    T = labels.numel()
    dev = labels.device
    if _COLS_TILE_OVERRIDE is not None:
        block_r, block_t, n_split = _COLS_TILE_OVERRIDE
    elif za.is_cuda:
        # 128 tokens (256 contiguous bytes of bf16 per row) x 32 rows per step at 4 warps; enough row splits for
        # ~8 programs per SM (T = 4096: 32 token blocks x 34 splits), so the sweep runs at HBM bandwidth
        block_r, block_t = 32, 128
        n_split = max(1, math.ceil(8 * _sm_count(dev) / triton.cdiv(T, block_t)))
    else:  # the interpreter pays per operation: few large programs
        block_r, block_t, n_split = 1024, 128, 1
    rps = triton.cdiv(triton.cdiv(V, n_split), block_r) * block_r  # rows per split, a multiple of block_r
    pieces = [(z, off, z.shape[0]) for z, off in ((za, 0), (zb, rows_a)) if z.shape[0] > 0]
    splits = [triton.cdiv(n, rps) for _, _, n in pieces]
    n_tb = triton.cdiv(T, block_t)
    stats = token_stats is not None
    parts = _scratch((sum(splits), 4 if stats else 2, T), dev, torch.float32)
    lse, ent, top = token_stats if stats else (_scratch((T,), dev, torch.float32), loss_rows, loss_rows)
    part_off = 0
    for (z, off, n), ns in zip(pieces, splits):
        _cols_stats_kernel[(n_tb, ns)](z, ld, parts, parts.shape[1], labels, n, off, T, rps, part_off,
                                       ignore_index, BLOCK_R=block_r, BLOCK_T=block_t, STATS=stats, num_warps=4)
        part_off += ns
    z_any = pieces[0][0]  # a valid pointer for a piece with no rows (never loaded: masked)
    _cols_finish_kernel[(n_tb,)](parts, part_off, parts.shape[1], za if rows_a else z_any,
                                 zb if zb.shape[0] else z_any, ld, rows_a, labels, lse, loss_rows, ent, top, T, V,
                                 ignore_index, BLOCK_T=block_t, STATS=stats, num_warps=4)
    if grad:
        for (z, off, n), ns in zip(pieces, splits):
            _cols_grad_kernel[(n_tb, ns)](z, ld, n, off, labels, lse, divisor, T, rps, ignore_index,
                                          BLOCK_R=block_r, BLOCK_T=block_t, num_warps=4)


def _sweep_torch(za, zb, rows_a, labels, loss_rows, divisor, V, ignore_index, grad, block_rows,
                 token_stats=None) -> None:
    """Same contract in plain PyTorch over row blocks of <= block_rows (the CPU path: z^T is fp32 there)."""
    T = labels.numel()
    dev = labels.device
    active = labels != ignore_index
    valid = (labels >= 0) & (labels < V)
    m = torch.full((T,), float("-inf"), device=dev)
    s_sum = torch.zeros(T, device=dev)
    z_y = torch.zeros(T, device=dev)
    blocks = [(z[r: r + block_rows, :T], off + r) for z, off in ((za, 0), (zb, rows_a))
              for r in range(0, z.shape[0], block_rows)]

    def local(z, off):
        loc = labels.long() - off
        return active & (loc >= 0) & (loc < z.shape[0]), loc.clamp(0, z.shape[0] - 1).unsqueeze(0)

    t = torch.zeros(T, device=dev)
    top = torch.full((T,), -1, device=dev, dtype=torch.int64)
    for z, off in blocks:
        zf = z.float()
        hit, loc = local(z, off)
        z_y = torch.where(hit, zf.gather(0, loc).squeeze(0), z_y)
        b_max = zf.amax(0)
        m_new = torch.maximum(m, b_max)
        m_ref = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        e = torch.exp(zf - m_ref)
        s_sum = s_sum * torch.exp(m - m_ref) + e.sum(0)
        if token_stats is not None:  # as the Triton sweep: a later block takes the argmax only with a larger max
            t = t * torch.exp(m - m_ref) + (e * zf).sum(0)
            top = torch.where(b_max > m, off + zf.argmax(0), top)
        m = m_new
    lse = m + torch.log(s_sum)
    loss = torch.where(valid, lse - z_y, torch.full_like(lse, float("nan")))
    loss_rows.copy_(torch.where(active, loss, torch.zeros_like(loss)))
    if token_stats is not None:
        token_stats[0].copy_(torch.where(active, lse, 0.0))
        token_stats[1].copy_(torch.where(active, lse - t / s_sum, 0.0))
        token_stats[2].copy_(torch.where(active, top, -1))
    if grad:
        scale = torch.where(active, 1.0 / divisor.float(), torch.zeros_like(lse))  # (T,)
        lse = torch.where(active, lse, torch.zeros_like(lse))
        for z, off in blocks:
            hit, loc = local(z, off)
            # ignored tokens' logits enter as -inf, so their columns are exactly 0 (as the Triton sweep masks them):
            # exp(z - 0) of a large logit would overflow to inf, and inf * a zero scale is NaN
            g = torch.exp(torch.where(active, z.float(), float("-inf")) - lse)
            g.scatter_add_(0, loc, torch.where(hit, -1.0, 0.0).to(g.dtype).unsqueeze(0))
            z.copy_(g * scale)


# ------------------------------------------------------------------------------------------------ the plan


def fwd_inplace(hidden, weight, bias, labels, divisor, loss_rows, gh, gb_acc, ignore_index, grad_hidden,
                grad_weight, grad_bias, tmp_rows, use_triton, dweight, token_stats=None):
    """mode="inplace" (module docstring). Fills loss_rows, gh, gb_acc; returns grad_W (A itself) or None."""
    T, H = hidden.shape
    V = weight.shape[0]
    dev, dt = hidden.device, hidden.dtype
    grad = grad_hidden or grad_weight or grad_bias
    ld, rows_a, blocks = inplace_layout(T, V, H, tmp_rows)
    if dweight is not None and use_triton and grad_weight and dweight.is_contiguous():
        a_buf = dweight  # the caller's grad_W buffer is A
        if _POISON_SCRATCH:
            a_buf.fill_(float("nan"))
    else:
        a_buf = _scratch((V, H), dev, dt)
    b_buf = _scratch(((V - rows_a) * ld,), dev, dt)
    a_flat = a_buf.view(-1)
    za = a_flat[: rows_a * ld].view(rows_a, ld)  # full rows, padding columns [T, ld) included
    zb = b_buf.view(V - rows_a, ld)
    # the two pieces: (T-column view of z^T rows, rows of W, first row)
    pieces = [(z[:, :T], weight[off: off + z.shape[0]], off) for z, off in ((za, 0), (zb, rows_a)) if z.shape[0]]

    h_t = hidden.t()  # (H, T) view: cuBLAS reads it transposed
    for z, w_p, off in pieces:  # 1. the logits
        if bias is None:
            torch.mm(w_p, h_t, out=z)
        else:
            torch.addmm(bias[off: off + z.shape[0]].unsqueeze(1), w_p, h_t, out=z)
    if use_triton:  # 2. statistics, loss, dL/dz in place
        _sweep_triton(za, zb, ld, rows_a, labels, loss_rows, divisor, V, ignore_index, grad, token_stats)
    else:
        _sweep_torch(za, zb, rows_a, labels, loss_rows, divisor, V, ignore_index, grad, max(1, int(tmp_rows)),
                     token_stats)
    if not grad:
        return None

    if grad_hidden:  # 3. grad_h over all rows (read before step 4 writes anything), grad_b
        acc = _scratch((T, H), dev, torch.float32) if dt in _HALF else None
        direct_acc = acc is not None and fp32_addmm_available(dev, dt)
        for k, (z, w_p, _) in enumerate(pieces):
            if acc is None:  # fp32: accumulate in the output itself
                torch.addmm(gh, z.t(), w_p, beta=0 if k == 0 else 1, out=gh)
            elif direct_acc:
                torch.addmm(acc, z.t(), w_p, out_dtype=torch.float32, beta=0 if k == 0 else 1, out=acc)
            else:  # a half partial (rounded once) summed in fp32
                torch.mm(z.t(), w_p, out=gh)
                if k == 0:
                    acc.copy_(gh)
                else:
                    acc.add_(gh)
        if acc is not None:
            gh.copy_(acc)
        acc = None
    if grad_bias:
        for z, _, off in pieces:
            torch.sum(z, 1, dtype=torch.float32, out=gb_acc[off: off + z.shape[0]])
    if grad_weight:  # 4. grad_W block by block into A, ascending
        tmp_n = max([b - a for a, b, direct in blocks if not direct], default=0)
        tmp = _scratch((tmp_n * H,), dev, dt) if tmp_n else None
        for a, b, direct in blocks:
            d_t = (za[a:b] if b <= rows_a else zb[a - rows_a: b - rows_a])[:, :T]  # dL/dz^T rows [a, b)
            _require(b >= rows_a or b * H <= b * ld, "(a)")  # only dead logits are overwritten
            dst = a_flat[a * H: b * H].view(b - a, H)
            if direct:  # (c): no overlap with the block's own rows
                torch.mm(d_t, hidden, out=dst)
            else:  # enqueued after the GEMM that reads the block
                g = tmp[: (b - a) * H].view(b - a, H)
                torch.mm(d_t, hidden, out=g)
                dst.copy_(g)
    d_t = dst = g = tmp = za = zb = b_buf = pieces = z = None  # 5. B and every view of it go
    if not grad_weight:
        return None
    if dweight is not None and a_buf is not dweight:  # a preallocated, non-contiguous dweight: filled too
        return dweight.copy_(a_buf)
    return a_buf
