"""Linear cross-entropy fused with the lm_head: loss and gradients without the (tokens x vocab) logits in fp32.

Math, for one row t with hidden h_t, logits z = h_t W^T (+ b), label y_t, divisor D:

    lse_t     = log sum_v exp(z_v)                       (online max / sum-exp over vocab blocks, fp32)
    loss      = sum_{t: y_t != ignore} (lse_t - z_{y_t}) / D
    dL/dz_t   = (softmax(z_t) - onehot(y_t)) / D         (0 for ignored rows)
    dL/dh_t   = dL/dz_t @ W          dL/dW = sum_t dL/dz_t^T h_t          dL/db = sum_t dL/dz_t

D = number of non-ignored labels ("mean"), 1 ("sum") or the caller's normalizer. With the normalizer = target
tokens of the whole accumulated batch (HF's num_items_in_batch), micro-batch gradients *sum* to the large-batch
gradient exactly (the gradient-accumulation bug, trl #2175). D is a device tensor: no host sync.

The forward computes the gradients (Liger-style); the backward only scales them by grad_output. Three plans
(`mode`), all exact (fp32 softmax statistics, fp32 accumulation of every sum over tokens or vocab slices):

mode="tokens" - chunks of tokens, each against the whole vocab:

    for each chunk c of tokens:
        Z        = h_c @ W^T          input dtype, like HF whose bf16 logits are upcast with .float() afterwards
        kernel   : per row, online max/sum-exp in fp32 -> loss_t; then overwrites Z with dL/dZ in place
        grad_h_c = Z @ W              (rows are disjoint: no accumulation)
        grad_W  += Z^T @ h_c          fp32 across chunks (Liger #512/#827: bf16 accumulation loses precision)

  3 GEMMs. grad_W with >1 chunk and a half-precision weight is accumulated in an fp32 (V, H) buffer (1.56 GB at
  Qwen3-4B) and cast at the end; on CUDA the GEMM accumulates into it directly (aten::addmm.dtype_out, probed
  by `fp32_addmm_available`: torch versions differ), otherwise each chunk's partial is rounded once to the
  weight dtype and added in fp32. That buffer costs more than it saves at small T, so `plan_chunk_tokens` picks
  one chunk (one GEMM for grad_W, fp32 accumulation inside the GEMM) while T*V*e + V*H*e <= V*H*4 +
  max(chunk*V*e, V*H*e), chunks of ~CHUNK_LOGITS_BYTES otherwise. At Qwen3-4B that is ONE chunk up to 5120
  tokens: at 4096 the full bf16 logits (1.24 GB) + grad_W (0.78 GB) = 2.02 GB extra; beyond, a flat 2.33 GB.

mode="vocab" (novatune.kernels.linear_cross_entropy_vocab) - slices of the vocab (Vc columns = rows Vc of W,
contiguous), every token at once:

    pass 1, j = 0 .. n-1:   Z_j = h @ W_j^T  (one (T, Vc) buffer, input dtype)
                            kernel: merges Z_j into running fp32 (max, sum-exp) per row and picks z_{y_t} when
                            y_t falls in slice j; after the last slice: lse_t, loss rows
    pass 2, j = n-1 .. 0:   Z_j recomputed (not for j = n-1: pass 1 left it in the buffer), kernel writes
                            dL/dZ_j in place; grad_W[j] = dL/dZ_j^T @ h straight into rows j of the output
                            (ONE GEMM over all T tokens: fp32 accumulation inside cuBLAS, one rounding - no fp32
                            (V, H) buffer); grad_h += dL/dZ_j @ W_j in an fp32 (T, H) buffer (directly with
                            aten::addmm.dtype_out where available, else a half partial added in fp32)

  4 GEMMs (3 + the recompute, minus 1/n of one). Extra memory: grad_W + one (T, Vc) slice + fp32 grad_h + grad_h.
  `plan_vocab_slice` sizes Vc so a slice is <= VOCAB_SLICE_BYTES (128 MiB; at least _VOCAB_MIN_SLICE columns),
  slices balanced and multiples of 128 but the last. Qwen3-4B, 4096 tokens: Vc = 15232 (10 slices, 119 MiB),
  extra = 742 MiB grad_W + 119 MiB slice + 40 MiB fp32 grad_h + 20 MiB grad_h = 0.90 GiB (tokens: 1.95 GiB).

mode="inplace" (novatune.kernels.linear_cross_entropy_lowmem, with the placement proof) - TRANSPOSED logits z^T
  (V, T) in A = empty(V, H) + B (the other T*V - V*H elements, rounded up to whole rows; needs T >= H), 2 GEMMs;
  Triton sweeps over blocks of tokens give lse, the loss and dL/dz^T in place; grad_h = dz @ W (2 GEMMs, fp32
  accumulator); then grad_W = dz^T @ h by row blocks in ascending order (ONE GEMM over all T tokens per block)
  written into A - over logits already consumed (a small temp + copy for the first rows). B is freed, A IS grad_W.
  3 GEMM-equivalents; extra = T*V*e + grad_h + max(fp32 grad_h, 16 MiB temp): 1.22 GiB at Qwen3-4B x 4096
  (tokens: 1.95 GiB). T < H -> "tokens"; no grad_W wanted -> token chunks as in "auto". vocab_slice = the temp's rows.

mode="auto" (default; `plan_mode`): "inplace" when grad_W is wanted, T >= H and its logits exceed grad_W by at
most AUTO_INPLACE_EXTRA_BYTES ((T-H)*V*e <= 1 GiB: Qwen3-4B up to ~6100 tokens). Otherwise, when the full logits are
small (T*V*e <= AUTO_LOGITS_BYTES, 256 MiB; FROZEN_HEAD_LOGITS_BYTES, 128 MiB, without grad_W) one token chunk;
otherwise "vocab" when grad_W is wanted (the tokens plan would hold the full logits or an fp32 (V, H) accumulator),
and "tokens" with chunks of about FROZEN_HEAD_LOGITS_BYTES when it is not (eval, LoRA's frozen lm_head: no
accumulator to avoid, so no recompute is worth paying; the chunk sits at the top of a LoRA forward's memory). An
explicit chunk_tokens means "tokens", an explicit vocab_slice "vocab" (with mode="inplace": the temp block's rows).

Token statistics (`token_stats`, every mode): the same pass over the logits also gives per token the log-sum-exp,
the entropy lse - sum_v p_v z_v (the online sum of exp(z - m) * z beside the sum-exp) and the first argmax, which
is what TRL's fused head reports (log p, entropy, is the label the top-1); no second lm_head GEMM.

Final logit soft-capping (`softcap`, Gemma 2): the loss is that of c * tanh(z / c). The row kernels read the raw
logits, cap them in fp32 for the statistics and, in the gradient pass, multiply dL/d(capped z) by 1 - tanh^2;
modes "tokens" and "vocab" only ("inplace" consumes the raw logits it would need; "auto" never plans it then).

Labels outside [0, V) that are not ignore_index give a NaN loss row (a visible error without a host sync).
The fp32 oracle (F.cross_entropy on fp32 logits) is novatune.reference.linear_cross_entropy.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from novatune.kernels import linear_cross_entropy_lowmem as _lowmem
from novatune.kernels import linear_cross_entropy_vocab as _vocab
from novatune.kernels.linear_cross_entropy_lowmem import (  # noqa: F401 - re-exported
    fp32_addmm_available,
    inplace_layout,
    plan_inplace_block,
)
from novatune.kernels.linear_cross_entropy_vocab import _grad_over_logits, _online_stats, _store_stats, _tanh

CHUNK_LOGITS_BYTES = 512 * 2**20  # mode="tokens": per-chunk logits budget (bytes) when chunking is chosen
VOCAB_SLICE_BYTES = 128 * 2**20  # mode="vocab": budget of the one (T, Vc) logits slice
AUTO_LOGITS_BYTES = 256 * 2**20  # mode="auto": the most logits allowed to exist at once (else split)
# ... when lm_head is frozen (LoRA, QLoRA): nothing accumulates across token chunks, and the chunk sits at the top of
# the forward's memory (measured: the peak of the MoE LoRA cut, session 22), so the chunks are halved: 448 tokens
# (rounded up to 64 rows, 130 MiB) of Qwen3's 151,936-entry vocabulary, GEMMs still large enough to fill the GPU
FROZEN_HEAD_LOGITS_BYTES = 128 * 2**20
AUTO_INPLACE_EXTRA_BYTES = 2**30  # mode="auto": "inplace" while its logits exceed grad_W by <= this, (T-H)*V*e
MODES = ("auto", "tokens", "vocab", "inplace")
_VOCAB_ALIGN = 128  # slice width rounded to a multiple of this (GEMM tile / 16-byte leading-dimension friendly)
_VOCAB_MIN_SLICE = 2048  # narrower slices make grad_W[j]'s GEMM too small to fill the GPU (so above
#                          T = VOCAB_SLICE_BYTES / (2048 e), 32768 bf16 tokens, a slice exceeds the budget)
_CHUNK_ALIGN = 64  # chunk rows rounded up to a multiple of this (GEMM tile friendly)
# grad_W added into an existing .grad (`into`): per-chunk logits budget. Smaller chunks hold less at the loss (the
# forward's peak under accumulation) but round into .grad once more each: 256 MiB is ~860 tokens of Qwen3's
# 151,936-entry vocab (5 chunks of 4,096 tokens), ~650 of GPT-OSS's 201,088 (7 chunks)
INTO_LOGITS_BYTES = 256 * 2**20
_HALF = (torch.bfloat16, torch.float16)
_TILE_OVERRIDE: tuple[int, int] | None = None  # (rows, block_v) for the row kernel; tests run the GPU tiling


@triton.jit
def _ce_rows_kernel(z_ptr, stride_z, labels_ptr, loss_ptr, divisor_ptr, lse_ptr, ent_ptr, top_ptr, n_rows, V,
                    ignore_index, softcap, ROWS: tl.constexpr, BLOCK_V: tl.constexpr, WRITE_GRAD: tl.constexpr,
                    STATS: tl.constexpr, CAPPED: tl.constexpr = False):
    """ROWS rows of Z (n_rows, V) per program: loss_t to loss_ptr; if WRITE_GRAD, Z[t] <- dL/dZ[t] in place; if
    STATS, the token statistics of the same pass (_store_stats).

    Ignored rows are masked out of every load (no HBM traffic for them: masked lanes are not fetched), get loss 0
    and, with WRITE_GRAD, a zero gradient row. CAPPED: the loss sees softcap * tanh(z / softcap) (Gemma 2's final
    logit soft-capping), computed here in fp32 from the raw logits in both passes."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    in_range = rows < n_rows
    label = tl.load(labels_ptr + rows, mask=in_range, other=ignore_index).to(tl.int64)  # (ROWS,)
    active = in_range & (label != ignore_index)
    valid = (label >= 0) & (label < V)
    z_rows = z_ptr + rows[:, None] * stride_z  # (ROWS, 1) row pointers
    cols = tl.arange(0, BLOCK_V)[None, :]  # (1, BLOCK_V)
    # z_y is read before pass 1: pass 1's reductions (block-wide barriers) then order this read before any
    # thread's pass-2 store over the same element.
    z_y = tl.load(z_ptr + rows * stride_z + tl.where(valid, label, 0), mask=active & valid, other=0.0)
    z_y = z_y.to(tl.float32)
    if CAPPED:
        z_y = softcap * _tanh(z_y / softcap)

    # Pass 1: online max m and sum s of exp(z - m) per row, fp32 (and the statistics' t and argmax)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    s = tl.zeros([ROWS], dtype=tl.float32)
    t = tl.zeros([ROWS], dtype=tl.float32)
    top = tl.full([ROWS], -1, tl.int64)
    for off in range(0, V, BLOCK_V):
        c = off + cols
        z = tl.load(z_rows + c, mask=active[:, None] & (c < V), other=float("-inf")).to(tl.float32)
        if CAPPED:  # masked lanes stay -inf (tanh would make them -softcap)
            z = tl.where(z == float("-inf"), z, softcap * _tanh(z / softcap))
        m, s, t, top = _online_stats(z, off, m, s, t, top, STATS)
    lse = m + tl.log(tl.where(active, s, 1.0))  # (ROWS,) -inf on inactive rows (unused there; no log(0))
    loss = tl.where(valid, lse - z_y, float("nan"))
    tl.store(loss_ptr + rows, tl.where(active, loss, 0.0), mask=in_range)
    if STATS:
        _store_stats(lse_ptr, ent_ptr, top_ptr, rows, lse, s, t, top, active, in_range)

    if WRITE_GRAD:  # pass 2
        _grad_over_logits(z_rows, cols, V, label, lse, active, in_range, divisor_ptr, z_ptr.dtype.element_ty,
                          BLOCK_V, softcap, CAPPED)


@triton.jit
def _scale_kernel(x_ptr, g_ptr, n, BLOCK: tl.constexpr):
    """x *= g (a 0-dim fp32 tensor) in place, math in fp32: one rounding, g not rounded to x's dtype first.
    g == 1 (the usual grad_output of a loss) is decided on the device: no traffic, and no host sync to know it."""
    g = tl.load(g_ptr).to(tl.float32)
    if g != 1.0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(x_ptr + offs, (x * g).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scale_add_kernel(dst_ptr, x_ptr, g_ptr, n, BLOCK: tl.constexpr):
    """dst += x * g (g a 0-dim fp32 tensor), math in fp32, one rounding into dst's dtype."""
    g = tl.load(g_ptr).to(tl.float32)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(dst_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst_ptr + offs, (d + x * g).to(dst_ptr.dtype.element_ty), mask=mask)


def _rows_triton(z: torch.Tensor, labels: torch.Tensor, loss_rows: torch.Tensor, divisor: torch.Tensor,
                 ignore_index: int, write_grad: bool, stats=None, softcap: float | None = None) -> None:
    n_rows, V = z.shape
    if n_rows == 0:
        return
    lse, ent, top = stats if stats is not None else (loss_rows,) * 3  # unused pointers without STATS
    # GPU: one row per program, 4096-column blocks (16 elements per thread at 8 warps; V = 151936 gives 38
    # blocks). The interpreter pays per operation, not per element: 16 rows x up to 8192 columns per program.
    rows, block_v = _TILE_OVERRIDE or ((1, 4096) if z.is_cuda else (16, 8192))
    block_v = min(triton.next_power_of_2(V), block_v)
    _ce_rows_kernel[(triton.cdiv(n_rows, rows),)](z, z.stride(0), labels, loss_rows, divisor, lse, ent, top, n_rows,
                                                  V, ignore_index, float(softcap or 1.0), ROWS=rows, BLOCK_V=block_v,
                                                  WRITE_GRAD=write_grad, STATS=stats is not None,
                                                  CAPPED=softcap is not None, num_warps=8)


def _stats_torch(zf: torch.Tensor, lse: torch.Tensor, active: torch.Tensor, stats) -> None:
    """The token statistics of fp32 logits zf (rows, V) (their CPU path; see _store_stats) into stats = (lse,
    entropy, first argmax), each (rows,)."""
    lse_out, ent, top = stats
    p = torch.exp(zf - lse.unsqueeze(1))
    lse_out.copy_(torch.where(active, lse, 0.0))
    ent.copy_(torch.where(active, lse - (p * zf).sum(1), 0.0))
    top.copy_(torch.where(active, zf.argmax(1), -1))


def _rows_torch(z: torch.Tensor, labels: torch.Tensor, loss_rows: torch.Tensor, divisor: torch.Tensor,
                ignore_index: int, write_grad: bool, stats=None, softcap: float | None = None) -> None:
    """Same contract as the kernel in plain PyTorch (the CPU path; z is fp32 there, so this is exact fp32)."""
    rows, V = z.shape
    ignored = labels == ignore_index
    valid = (labels >= 0) & (labels < V)
    safe = torch.where(valid, labels, torch.zeros_like(labels)).long().unsqueeze(1)  # (rows, 1)
    zf = z.float()
    if softcap is not None:
        tanh = torch.tanh(zf / softcap)
        zf = tanh * softcap
    lse = torch.logsumexp(zf, dim=1)  # (rows,)
    loss = torch.where(valid, lse - zf.gather(1, safe).squeeze(1), torch.full_like(lse, float("nan")))
    loss_rows.copy_(torch.where(ignored, torch.zeros_like(loss), loss))
    if stats is not None:
        _stats_torch(zf, lse, ~ignored, stats)
    if write_grad:
        scale = torch.where(ignored, torch.zeros_like(lse), 1.0 / divisor.float())  # (rows,)
        g = torch.exp(zf - lse.unsqueeze(1))
        g.scatter_add_(1, safe, torch.where(valid, -1.0, 0.0).to(g.dtype).unsqueeze(1).expand(rows, 1))
        if softcap is not None:
            g *= 1.0 - tanh * tanh  # d(cap * tanh(z / cap)) / dz
        z.copy_(g * scale.unsqueeze(1))


def plan_chunk_tokens(T: int, V: int, H: int, dtype: torch.dtype, grad_weight: bool,
                      budget: int = CHUNK_LOGITS_BYTES) -> int:
    """Tokens per chunk: the plan with the lower peak of extra memory (see the module docstring)."""
    if T <= 1:
        return max(T, 1)
    e = torch.finfo(dtype).bits // 8
    rows = max(1, budget // (V * e))
    if rows >= T:
        return T
    n = math.ceil(T / rows)
    chunk = min(T, math.ceil(math.ceil(T / n) / _CHUNK_ALIGN) * _CHUNK_ALIGN)  # balanced chunks
    if grad_weight and dtype in _HALF:
        gw = V * H * e
        peak_single = T * V * e + gw
        peak_chunked = V * H * 4 + max(chunk * V * e, gw)
        if peak_single <= peak_chunked:
            return T
    return chunk


def plan_into_chunk(T: int, V: int, dtype: torch.dtype, budget: int | None = None) -> int:
    """Tokens per chunk where grad_W goes into an existing .grad (`into`): a (chunk, V) logits block of at most
    INTO_LOGITS_BYTES, balanced over the chunks and aligned; no fp32 (V, H) buffer to weigh against."""
    e = torch.finfo(dtype).bits // 8
    rows = max(_CHUNK_ALIGN, (budget or INTO_LOGITS_BYTES) // max(V * e, 1) // _CHUNK_ALIGN * _CHUNK_ALIGN)
    if rows >= T:
        return max(T, 1)
    n = math.ceil(T / rows)
    return min(rows, math.ceil(math.ceil(T / n) / _CHUNK_ALIGN) * _CHUNK_ALIGN)


def plan_vocab_slice(T: int, V: int, dtype: torch.dtype, budget: int = VOCAB_SLICE_BYTES) -> int:
    """mode="vocab": columns per slice. As many as fit `budget` for a (T, Vc) slice in `dtype` (at least
    _VOCAB_MIN_SLICE), then balanced over the slices this needs and rounded up to _VOCAB_ALIGN (never above the
    budget's width: that is a multiple of _VOCAB_ALIGN); only the last slice is ragged."""
    e = torch.finfo(dtype).bits // 8
    cols = budget // max(T * e, 1)
    cols = max(cols // _VOCAB_ALIGN * _VOCAB_ALIGN, _VOCAB_MIN_SLICE)
    if cols >= V:
        return max(V, 1)
    n = math.ceil(V / cols)
    return min(V, math.ceil(math.ceil(V / n) / _VOCAB_ALIGN) * _VOCAB_ALIGN)


def plan_mode(T: int, V: int, H: int, dtype: torch.dtype, grad_weight: bool, mode: str = "auto",
              chunk_tokens: int | None = None, vocab_slice: int | None = None,
              softcap: float | None = None) -> tuple[str, int]:
    """(mode, size): ("tokens", tokens per chunk), ("vocab", columns per slice) or ("inplace", rows of its temp
    block). See the module docstring; vocab_slice sets the size for "vocab" and "inplace". With `softcap`
    "tokens" and "vocab" apply it: "auto" plans as without it but never "inplace"; "inplace" raises."""
    if mode not in MODES:
        raise ValueError(f"linear_cross_entropy: mode must be one of {MODES}, got {mode!r}")
    for name, size in (("chunk_tokens", chunk_tokens), ("vocab_slice", vocab_slice)):
        if size is not None and size <= 0:  # a size of 0 or less would loop forever or index backwards
            raise ValueError(f"linear_cross_entropy: {name} must be positive (or None: planned), got {size}")
    if softcap is not None and mode == "inplace":
        raise ValueError("linear_cross_entropy: final logit soft-capping runs in modes 'tokens' and 'vocab' (its "
                         "in-place plan overwrites the logits the capped gradient needs); use mode='auto'")
    e = torch.finfo(dtype).bits // 8
    budget = AUTO_LOGITS_BYTES if grad_weight else FROZEN_HEAD_LOGITS_BYTES
    if mode == "auto":
        if chunk_tokens:
            mode = "tokens"
        elif vocab_slice:
            mode = "vocab"
        elif grad_weight and T >= H and (T - H) * V * e <= AUTO_INPLACE_EXTRA_BYTES and softcap is None:
            mode = "inplace"  # 3 GEMMs, grad_W written over the logits: less memory than one token chunk
        elif T * V * e <= budget:
            return "tokens", max(T, 1)  # the whole logits are small: one chunk, 3 GEMMs
        elif grad_weight:
            mode = "vocab"
        else:  # nothing to accumulate over chunks: token chunks within the budget, no recompute
            return "tokens", plan_chunk_tokens(T, V, H, dtype, grad_weight, budget=budget)
    if mode == "inplace":
        if not grad_weight:  # no grad_W to write into the logits' memory: token chunks as "auto" does
            return "tokens", plan_chunk_tokens(T, V, H, dtype, grad_weight, budget=budget)
        if T < H:  # the logits are smaller than grad_W: no room for it in them
            return "tokens", plan_chunk_tokens(T, V, H, dtype, grad_weight)
        return "inplace", int(vocab_slice) if vocab_slice else plan_inplace_block(V, H, dtype)
    if mode == "tokens":
        return "tokens", int(chunk_tokens) if chunk_tokens else plan_chunk_tokens(T, V, H, dtype, grad_weight)
    return "vocab", int(vocab_slice) if vocab_slice else plan_vocab_slice(T, V, dtype)


def linear_cross_entropy_fwd(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             divisor: torch.Tensor, *, bias: torch.Tensor | None = None, ignore_index: int = -100,
                             grad_hidden: bool = True, grad_weight: bool = True, grad_bias: bool = False,
                             chunk_tokens: int | None = None, mode: str = "auto", vocab_slice: int | None = None,
                             loss_rows: torch.Tensor | None = None, dhidden: torch.Tensor | None = None,
                             dweight: torch.Tensor | None = None, dbias: torch.Tensor | None = None,
                             use_triton: bool = True, token_stats: tuple | None = None,
                             softcap: float | None = None, into: torch.Tensor | None = None, alpha: float = 1.0):
    """Loss (and gradients, already divided by `divisor`) of CE(hidden @ weight.T + bias, labels).

    hidden (T, H), weight (V, H), labels (T,) int, divisor 0-dim fp32 (device). Returns
    (loss 0-dim fp32, loss_rows (T,) fp32, dhidden (T, H) | None, dweight (V, H) | None, dbias (V,) | None);
    gradients come in the input dtypes. loss_rows / dhidden / dweight / dbias may be preallocated (contiguous).
    mode "auto" | "tokens" | "vocab" | "inplace" with chunk_tokens / vocab_slice forcing the split size
    (`plan_mode`). mode "inplace" returns A itself as dweight's buffer: a preallocated dweight is used as A.
    use_triton=False runs the same loops in fp32 with plain PyTorch rows (the CPU reference path).
    token_stats: (lse, entropy, argmax), each (T,) (fp32, fp32, int64, contiguous), filled from the same pass over
    the logits: per token log-sum-exp, entropy -sum p log p = lse - sum p z (TRL's formula) and the first argmax
    (torch.argmax's tie rule); 0, 0, -1 on ignored tokens. The token's log-prob is -loss_rows.
    softcap: the loss sees softcap * tanh(z / softcap) (Gemma 2's final logit soft-capping), applied in fp32 inside
    the row passes (modes "tokens" and "vocab"; plan_mode): the capped logits never exist either.
    into: an existing (V, H) weight gradient (`.grad` under accumulation) that grad_W x `alpha` is added into,
    chunk by chunk, instead of grad_W coming back (grad_weight must be False): token chunks of INTO_LOGITS_BYTES
    (`plan_into_chunk`), so no (V, H) buffer and no full logits exist; one rounding into `into` per chunk (more
    roundings than grad_W's one GEMM and autograd's add: a precision cost the caller chooses).
    """
    T, H = hidden.shape
    V = weight.shape[0]
    out_dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
    if into is not None:
        if grad_weight or into.shape != (V, H):
            raise ValueError(f"linear_cross_entropy: `into` {tuple(into.shape)} must be the ({V}, {H}) weight "
                             f"gradient, with grad_weight False")
        mode, chunk_tokens, vocab_slice = "tokens", chunk_tokens or plan_into_chunk(T, V, hidden.dtype), None
    plan, size = plan_mode(T, V, H, hidden.dtype, grad_weight, mode, chunk_tokens, vocab_slice, softcap)
    if not use_triton:  # fp32 everywhere: the CPU path computes reference numbers (cast once, V x H x 4 bytes)
        hidden, weight = hidden.float(), weight.float()
        bias = None if bias is None else bias.float()
    dev, dt = hidden.device, hidden.dtype
    labels = labels.contiguous()
    divisor = divisor.to(device=dev, dtype=torch.float32)
    if loss_rows is None:
        loss_rows = torch.empty(T, device=dev, dtype=torch.float32)
    gh = gw = gb = None
    if grad_hidden:
        gh = dhidden if (dhidden is not None and use_triton) else torch.empty(T, H, device=dev, dtype=dt)
    gb_acc = torch.zeros(V, device=dev, dtype=torch.float32) if grad_bias else None
    args = (hidden, weight, bias, labels, divisor, loss_rows, gh, gb_acc, ignore_index, grad_hidden, grad_weight,
            grad_bias, max(1, int(size)), use_triton, dweight, token_stats)
    if into is not None:
        gw = _fwd_tokens(*args, softcap=None if softcap is None else float(softcap), into=into, alpha=float(alpha))
    elif softcap is not None:  # plan_mode never plans "inplace" with a soft-cap
        gw = {"tokens": _fwd_tokens, "vocab": _fwd_vocab}[plan](*args, softcap=float(softcap))
    else:
        gw = {"tokens": _fwd_tokens, "vocab": _fwd_vocab, "inplace": _fwd_inplace}[plan](*args)

    loss = loss_rows.sum() / divisor
    if not use_triton:  # back to the caller's dtypes (into the preallocated buffers when given)
        gh = _cast_into(gh, out_dtypes[0], dhidden)
        gw = _cast_into(gw, out_dtypes[1], dweight)
    if grad_bias:
        gb = _cast_into(gb_acc, out_dtypes[2], dbias)
    return loss, loss_rows, gh, gw, gb


def _fwd_tokens(hidden, weight, bias, labels, divisor, loss_rows, gh, gb_acc, ignore_index, grad_hidden,
                grad_weight, grad_bias, C, use_triton, dweight, token_stats=None, softcap=None, into=None,
                alpha=1.0):
    """mode="tokens": chunks of C tokens. Fills loss_rows, gh, gb_acc; returns grad_W (or None). `into` (with
    grad_weight False): each chunk's grad_W times `alpha` is added into it (an existing .grad) by the chunk's GEMM."""
    T, H = hidden.shape
    V = weight.shape[0]
    dev, dt = hidden.device, hidden.dtype
    rows_op = _rows_triton if use_triton else _rows_torch
    grad = grad_hidden or grad_weight or grad_bias or into is not None
    C = min(C, max(T, 1))
    n_chunks = math.ceil(T / C) if T else 0
    gw = None
    # fp32 accumulator only where it is needed: half-precision weight and more than one GEMM to sum.
    use_acc = grad_weight and dt in _HALF and n_chunks > 1
    direct_acc = use_acc and fp32_addmm_available(dev, dt)
    acc = torch.empty(V, H, device=dev, dtype=torch.float32) if use_acc else None
    if grad_weight and not direct_acc:  # also the scratch for each chunk's partial in the indirect path
        gw = dweight if (dweight is not None and use_triton) else torch.empty(V, H, device=dev, dtype=dt)

    z_buf = torch.empty(C, V, device=dev, dtype=dt) if n_chunks else None  # the only logits buffer
    w_t = weight.t()  # (H, V) view: cuBLAS reads it transposed, no copy
    z = z_t = h_c = None
    for i in range(n_chunks):
        s, e = i * C, min((i + 1) * C, T)
        h_c = hidden[s:e]  # (rows, H)
        z = z_buf[: e - s]  # (rows, V) contiguous
        if bias is None:
            torch.mm(h_c, w_t, out=z)
        else:
            torch.addmm(bias, h_c, w_t, out=z)
        stats = None if token_stats is None else tuple(x[s:e] for x in token_stats)
        rows_op(z, labels[s:e], loss_rows[s:e], divisor, ignore_index, grad, stats, softcap)  # z is now dL/dz
        if not grad:
            continue
        if grad_hidden:
            torch.mm(z, weight, out=gh[s:e])
        if grad_bias:
            gb_acc += z.sum(0, dtype=torch.float32)
        if into is not None:  # fp32 accumulation inside the GEMM, one rounding into .grad per chunk
            if into.dtype == z.dtype:
                into.addmm_(z.t(), h_c, alpha=alpha)
            else:  # the CPU's fp32 path over a half-precision .grad
                into.copy_(torch.addmm(into.float(), z.t(), h_c, alpha=alpha))
        if grad_weight:
            z_t = z.t()  # (V, rows)
            if direct_acc:
                torch.addmm(acc, z_t, h_c, out_dtype=torch.float32, beta=0 if i == 0 else 1, out=acc)
            elif use_acc:  # partial rounded once to the weight dtype, summed in fp32
                torch.mm(z_t, h_c, out=gw)
                if i == 0:
                    acc.copy_(gw)
                else:
                    acc.add_(gw)
            elif i == 0:  # one chunk (fp32 accumulation inside the GEMM) or an fp32 weight
                torch.mm(z_t, h_c, out=gw)
            else:
                gw.addmm_(z_t, h_c)
    z_buf = z = z_t = h_c = None  # drop every view of the logits before the final cast allocates grad_W
    if grad_weight:
        if gw is None:
            gw = dweight if (dweight is not None and use_triton) else torch.empty(V, H, device=dev, dtype=dt)
        if acc is not None:
            gw.copy_(acc)
        elif n_chunks == 0:
            gw.zero_()
        del acc
    return gw


def _fwd_vocab(*args, softcap=None):
    """mode="vocab": novatune.kernels.linear_cross_entropy_vocab.fwd_vocab (the row tiling set here)."""
    return _vocab.fwd_vocab(*args, tile=_TILE_OVERRIDE, softcap=softcap)


def _fwd_inplace(*args):
    """mode="inplace": novatune.kernels.linear_cross_entropy_lowmem.fwd_inplace (same arguments as _fwd_vocab)."""
    return _lowmem.fwd_inplace(*args)


def _cast_into(t: torch.Tensor | None, dtype, out: torch.Tensor | None):
    if t is None:
        return None
    if out is not None:
        return out.copy_(t)
    return t.to(dtype)


def linear_cross_entropy_bwd(grad_output: torch.Tensor, *grads: torch.Tensor | None, use_triton: bool = True):
    """Chain rule through the scalar loss: every gradient from the forward is multiplied by grad_output, IN PLACE
    (each is a (V, H)-sized buffer at the backward's memory peak; a copy would add 0.78 GB at Qwen3-4B)."""
    g = grad_output.detach().to(torch.float32).reshape(())
    for x in grads:
        if x is None or x.numel() == 0:
            continue
        if use_triton:
            block = 4096 if x.is_cuda else 2**16  # the interpreter pays per program
            _scale_kernel[(triton.cdiv(x.numel(), block),)](x, g, x.numel(), BLOCK=block, num_warps=8)
        else:
            x.copy_(x.float() * g)
    return grads


def linear_cross_entropy_bwd_into(grad_output: torch.Tensor, grad: torch.Tensor, into: torch.Tensor,
                                  use_triton: bool = True) -> None:
    """into += grad * grad_output in one pass (fp32 math, one rounding): the chain rule and autograd's accumulation
    together, for a weight whose `.grad` already exists (into is that .grad: same shape and dtype, contiguous)."""
    if grad.shape != into.shape or grad.dtype != into.dtype or not (grad.is_contiguous() and into.is_contiguous()):
        raise ValueError(f"into {tuple(into.shape)} {into.dtype} must match grad {tuple(grad.shape)} {grad.dtype}, "
                         "both contiguous")
    g = grad_output.detach().to(torch.float32).reshape(())
    if grad.numel() == 0:
        return
    if use_triton:
        block = 4096 if grad.is_cuda else 2**16  # the interpreter pays per program
        _scale_add_kernel[(triton.cdiv(grad.numel(), block),)](into, grad, g, grad.numel(), BLOCK=block,
                                                               num_warps=8)
    else:
        into.copy_(into.float() + grad.float() * g)
