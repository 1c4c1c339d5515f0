"""Linear cross-entropy fused with the lm_head: loss and gradients without the (tokens x vocab) logits in fp32.

Math, for one row t with hidden h_t, logits z = h_t W^T (+ b), label y_t, divisor D:

    lse_t     = log sum_v exp(z_v)                       (online max / sum-exp over vocab blocks, fp32)
    loss      = sum_{t: y_t != ignore} (lse_t - z_{y_t}) / D
    dL/dz_t   = (softmax(z_t) - onehot(y_t)) / D         (0 for ignored rows)
    dL/dh_t   = dL/dz_t @ W          dL/dW = sum_t dL/dz_t^T h_t          dL/db = sum_t dL/dz_t

D = number of non-ignored labels ("mean"), 1 ("sum") or the caller's normalizer. With the normalizer = target
tokens of the whole accumulated batch (HF's num_items_in_batch), micro-batch gradients *sum* to the large-batch
gradient exactly (the gradient-accumulation bug, trl #2175). D is a device tensor: no host sync.

Plan (Liger-style: the forward computes the gradients; the backward only scales them by grad_output):

    for each chunk c of tokens:
        Z        = h_c @ W^T          input dtype, like HF whose bf16 logits are upcast with .float() afterwards
        kernel   : per row, online max/sum-exp in fp32 -> loss_t; then overwrites Z with dL/dZ in place
        grad_h_c = Z @ W              (rows are disjoint: no accumulation)
        grad_W  += Z^T @ h_c          fp32 across chunks (Liger #512/#827: bf16 accumulation loses precision)

Memory invariants (T tokens, H hidden, V vocab, e bytes per input element; Qwen3-4B: H 2560, V 151936, bf16):
* logits exist only as one (chunk, V) buffer in the input dtype, reused as dL/dZ - never in fp32, never twice.
* grad_W: one GEMM per chunk. With >1 chunk and a half-precision weight it is accumulated in an fp32 (V, H)
  buffer (1.56 GB at Qwen3-4B) and cast to the weight dtype at the end. On CUDA the GEMM accumulates into it
  directly (aten::addmm.dtype_out, probed at first use: torch versions differ on accepting an fp32 `self`);
  otherwise the chunk's partial product goes to the bf16 output buffer (rounded once) and is added to the fp32
  buffer - no compounding of bf16 roundings either way.
* That fp32 buffer costs more than it saves at small T: 4096 tokens of bf16 logits (1.24 GB) are smaller than
  the accumulator (1.56 GB). `plan_chunk_tokens` therefore picks the plan with the lower peak: one chunk (one
  GEMM for grad_W, fp32 accumulation inside the GEMM, no accumulator, no fp32 read-modify-write traffic) while
  T*V*e + V*H*e <= V*H*4 + max(chunk*V*e, V*H*e), chunks of ~CHUNK_LOGITS_BYTES otherwise. At Qwen3-4B: one
  chunk up to 5120 tokens (4096: 2.02 GB extra, of which 0.78 GB is grad_W itself); beyond, ~1700-token chunks
  and a flat 2.33 GB whatever T is (16384 tokens: 10 chunks; HF would hold 5 GB of bf16 + 10 GB of fp32 logits).
  Pass chunk_tokens to force a size.

Labels outside [0, V) that are not ignore_index give a NaN loss row (a visible error without a host sync).
`linear_cross_entropy_ref` is the plain fp32 reference (F.cross_entropy on fp32 logits).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

CHUNK_LOGITS_BYTES = 512 * 2**20  # per-chunk logits budget (bytes) when chunking is chosen
_CHUNK_ALIGN = 64  # chunk rows rounded up to a multiple of this (GEMM tile friendly)
_HALF = (torch.bfloat16, torch.float16)
_TILE_OVERRIDE: tuple[int, int] | None = None  # (rows, block_v) for the row kernel; tests run the GPU tiling


@triton.jit
def _ce_rows_kernel(z_ptr, stride_z, labels_ptr, loss_ptr, divisor_ptr, n_rows, V, ignore_index,
                    ROWS: tl.constexpr, BLOCK_V: tl.constexpr, WRITE_GRAD: tl.constexpr):
    """ROWS rows of Z (n_rows, V) per program: loss_t to loss_ptr; if WRITE_GRAD, Z[t] <- dL/dZ[t] in place.

    Ignored rows are masked out of every load (no HBM traffic for them: masked lanes are not fetched), get loss 0
    and, with WRITE_GRAD, a zero gradient row."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    in_range = rows < n_rows
    label = tl.load(labels_ptr + rows, mask=in_range, other=ignore_index).to(tl.int64)  # (ROWS,)
    active = in_range & (label != ignore_index)
    valid = (label >= 0) & (label < V)
    z_rows = z_ptr + rows[:, None] * stride_z  # (ROWS, 1) row pointers
    cols = tl.arange(0, BLOCK_V)[None, :]  # (1, BLOCK_V)

    # Pass 1: online max m and sum s of exp(z - m) per row, fp32. m_ref = 0 while a row has seen no finite
    # value (inactive rows; never for an active row after its first block) so exp() never sees -inf - -inf.
    m = tl.full([ROWS], float("-inf"), tl.float32)
    s = tl.zeros([ROWS], dtype=tl.float32)
    for off in range(0, V, BLOCK_V):
        c = off + cols
        z = tl.load(z_rows + c, mask=active[:, None] & (c < V), other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(z - m_ref[:, None]), axis=1)
        m = m_new
    lse = m + tl.log(tl.where(active, s, 1.0))  # (ROWS,) -inf on inactive rows (unused there; no log(0))
    z_y = tl.load(z_ptr + rows * stride_z + tl.where(valid, label, 0), mask=active & valid, other=0.0)
    loss = tl.where(valid, lse - z_y.to(tl.float32), float("nan"))  # read z_y before pass 2 overwrites it
    tl.store(loss_ptr + rows, tl.where(active, loss, 0.0), mask=in_range)

    if WRITE_GRAD:
        # Pass 2: dL/dz = (softmax - onehot) / D, stored over the logits in the input dtype; 0 on ignored rows.
        d = tl.load(divisor_ptr).to(tl.float32)  # D = 0 with active rows gives inf, as sum / 0 would
        inv = tl.where(active, 1.0 / tl.where(active, d, 1.0), 0.0)  # (ROWS,)
        lse_ref = tl.where(active, lse, 0.0)
        for off in range(0, V, BLOCK_V):
            c = off + cols
            z = tl.load(z_rows + c, mask=active[:, None] & (c < V), other=0.0).to(tl.float32)
            p = tl.exp(z - lse_ref[:, None])
            g = tl.where(c == label[:, None], p - 1.0, p) * inv[:, None]
            g = tl.where(active[:, None], g, 0.0)
            tl.store(z_rows + c, g.to(z_ptr.dtype.element_ty), mask=in_range[:, None] & (c < V))


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


def _rows_triton(z: torch.Tensor, labels: torch.Tensor, loss_rows: torch.Tensor, divisor: torch.Tensor,
                 ignore_index: int, write_grad: bool) -> None:
    n_rows, V = z.shape
    if n_rows == 0:
        return
    # GPU: one row per program, 4096-column blocks (16 elements per thread at 8 warps; V = 151936 gives 38
    # blocks). The interpreter pays per operation, not per element: 16 rows x up to 8192 columns per program.
    rows, block_v = _TILE_OVERRIDE or ((1, 4096) if z.is_cuda else (16, 8192))
    block_v = min(triton.next_power_of_2(V), block_v)
    _ce_rows_kernel[(triton.cdiv(n_rows, rows),)](z, z.stride(0), labels, loss_rows, divisor, n_rows, V,
                                                  ignore_index, ROWS=rows, BLOCK_V=block_v,
                                                  WRITE_GRAD=write_grad, num_warps=8)


def _rows_torch(z: torch.Tensor, labels: torch.Tensor, loss_rows: torch.Tensor, divisor: torch.Tensor,
                ignore_index: int, write_grad: bool) -> None:
    """Same contract as the kernel in plain PyTorch (the CPU path; z is fp32 there, so this is exact fp32)."""
    rows, V = z.shape
    ignored = labels == ignore_index
    valid = (labels >= 0) & (labels < V)
    safe = torch.where(valid, labels, torch.zeros_like(labels)).long().unsqueeze(1)  # (rows, 1)
    zf = z.float()
    lse = torch.logsumexp(zf, dim=1)  # (rows,)
    loss = torch.where(valid, lse - zf.gather(1, safe).squeeze(1), torch.full_like(lse, float("nan")))
    loss_rows.copy_(torch.where(ignored, torch.zeros_like(loss), loss))
    if write_grad:
        scale = torch.where(ignored, torch.zeros_like(lse), 1.0 / divisor.float())  # (rows,)
        g = torch.exp(zf - lse.unsqueeze(1))
        g.scatter_add_(1, safe, torch.where(valid, -1.0, 0.0).to(g.dtype).unsqueeze(1).expand(rows, 1))
        z.copy_(g * scale.unsqueeze(1))


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


def linear_cross_entropy_fwd(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             divisor: torch.Tensor, *, bias: torch.Tensor | None = None, ignore_index: int = -100,
                             grad_hidden: bool = True, grad_weight: bool = True, grad_bias: bool = False,
                             chunk_tokens: int | None = None, loss_rows: torch.Tensor | None = None,
                             dhidden: torch.Tensor | None = None, dweight: torch.Tensor | None = None,
                             dbias: torch.Tensor | None = None, use_triton: bool = True):
    """Chunked loss (and gradients, already divided by `divisor`) of CE(hidden @ weight.T + bias, labels).

    hidden (T, H), weight (V, H), labels (T,) int, divisor 0-dim fp32 (device). Returns
    (loss 0-dim fp32, loss_rows (T,) fp32, dhidden (T, H) | None, dweight (V, H) | None, dbias (V,) | None);
    gradients come in the input dtypes. loss_rows / dhidden / dweight / dbias may be preallocated (contiguous).
    use_triton=False runs the same chunk loop in fp32 with plain PyTorch rows (the CPU reference path).
    """
    T, H = hidden.shape
    V = weight.shape[0]
    out_dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
    if not use_triton:  # fp32 everywhere: the CPU path computes reference numbers (cast once, V x H x 4 bytes)
        hidden, weight = hidden.float(), weight.float()
        bias = None if bias is None else bias.float()
    rows_op = _rows_triton if use_triton else _rows_torch
    dev, dt = hidden.device, hidden.dtype
    labels = labels.contiguous()
    divisor = divisor.to(device=dev, dtype=torch.float32)
    grad = grad_hidden or grad_weight or grad_bias
    C = int(chunk_tokens) if chunk_tokens else plan_chunk_tokens(T, V, H, dt, grad_weight)
    C = max(1, min(C, T))
    n_chunks = math.ceil(T / C) if T else 0

    if loss_rows is None:
        loss_rows = torch.empty(T, device=dev, dtype=torch.float32)
    gh = gw = gb = None
    if grad_hidden:
        gh = dhidden if (dhidden is not None and use_triton) else torch.empty(T, H, device=dev, dtype=dt)
    # fp32 accumulator only where it is needed: half-precision weight and more than one GEMM to sum.
    use_acc = grad_weight and dt in _HALF and n_chunks > 1
    direct_acc = use_acc and fp32_addmm_available(dev, dt)
    acc = torch.empty(V, H, device=dev, dtype=torch.float32) if use_acc else None
    if grad_weight and not direct_acc:  # also the scratch for each chunk's partial in the indirect path
        gw = dweight if (dweight is not None and use_triton) else torch.empty(V, H, device=dev, dtype=dt)
    gb_acc = torch.zeros(V, device=dev, dtype=torch.float32) if grad_bias else None

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
        rows_op(z, labels[s:e], loss_rows[s:e], divisor, ignore_index, grad)  # z is now dL/dz
        if not grad:
            continue
        if grad_hidden:
            torch.mm(z, weight, out=gh[s:e])
        if grad_bias:
            gb_acc += z.sum(0, dtype=torch.float32)
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

    loss = loss_rows.sum() / divisor
    if not use_triton:  # back to the caller's dtypes (into the preallocated buffers when given)
        gh = _cast_into(gh, out_dtypes[0], dhidden)
        gw = _cast_into(gw, out_dtypes[1], dweight)
    if grad_bias:
        gb = _cast_into(gb_acc, out_dtypes[2], dbias)
    return loss, loss_rows, gh, gw, gb


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


def linear_cross_entropy_ref(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             ignore_index: int = -100, reduction: str = "mean", normalizer=None,
                             bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 reference: F.cross_entropy(hidden @ weight.T + bias) with logits in fp32 (differentiable)."""
    H = hidden.shape[-1]
    logits = hidden.float().reshape(-1, H) @ weight.float().t()  # (T, V) fp32
    if bias is not None:
        logits = logits + bias.float()
    y = labels.reshape(-1).to(logits.device)
    if normalizer is not None:
        return F.cross_entropy(logits, y, ignore_index=ignore_index, reduction="sum") / normalizer
    return F.cross_entropy(logits, y, ignore_index=ignore_index, reduction=reduction)
