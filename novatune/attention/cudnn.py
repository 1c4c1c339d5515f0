"""cuDNN's fused attention over packed rows, through torch's own aten ops (no extra package).

torch ships `aten._cudnn_attention_forward` / `aten._cudnn_attention_backward`: cuDNN's SDPA graph (an FA3-class
kernel on Hopper) with ragged offsets. Given `cum_seq_q` / `cum_seq_k` (the document offsets) it reads q (tokens, hq,
d) and k, v (tokens, hk, d) in place, one "batch entry" per document, with a padding mask at each document's length
and the causal diagonal at its top left: document-causal attention, nothing across documents. The query and kv head
counts are separate graph dimensions, so GQA runs without repeating K/V (query head h reads kv head h // (hq / hk),
the backward sums dK/dV over each group).

Graph reuse. torch builds one cuDNN graph per (documents, longest document, heads, strides) and caches it by that
key in some versions, rebuilds it on every call in others. Packed batches change both numbers every step, so the
offsets are padded to a bucket: the document count up to a power of two (empty documents at the end, the layout
PackedBatch.graph_static uses for FlashAttention) and the longest document up to a power of two (only a bound: the
padding mask reads each real length). A few graphs then serve every batch. `BUCKETS = False` passes the exact
layout (the GPU tests check both).

The log-sum-exp's layout differs between torch versions ((tokens, hq, 1) or (hq, tokens)); it only travels from
this forward to this backward, untouched, so any layout works. Inputs are made contiguous (older builds derive the
ragged offsets from tokens * heads * d) and the incoming gradient too (older builds read dO with O's offsets).
"""
from __future__ import annotations

import functools

import torch

from novatune.attention.packed import PackedBatch

__all__ = ["cudnn_attention", "cudnn_why_not", "cudnn_detail", "BUCKETS"]

_aten = torch.ops.aten  # one name for the two cuDNN ops (a CPU test stands in for them here)
BUCKETS = True
# cuDNN's ragged SDPA kernels are measured and supported by torch's own varlen path up to head_dim 128 on sm90
MAX_HEAD_DIM = 128
_MIN_SLOTS, _MIN_MAX_LEN = 16, 256  # torch's varlen rejects cuDNN at a longest document <= 128: keep the bound above
_GQA = "native"  # "repeat" once a build rejects hk != hq (recorded in the detail)


@functools.cache
def _op_why_not() -> str | None:
    """None when this torch has both aten ops with ragged offsets (feature detection, not a version string)."""
    for name in ("_cudnn_attention_forward", "_cudnn_attention_backward"):
        try:
            args = {a.name for a in getattr(_aten, name).default._schema.arguments}
        except (AttributeError, RuntimeError):
            return f"torch {torch.__version__} has no aten.{name}; upgrade torch or use backend='varlen'"
        if not {"cum_seq_q", "cum_seq_k", "max_q"} <= args:
            return f"torch {torch.__version__}'s aten.{name} takes no ragged offsets (cum_seq_q); upgrade torch"
    return None


def cudnn_why_not(q: torch.Tensor, k: torch.Tensor, packed: PackedBatch, window: int | None) -> str | None:
    """Why the cudnn backend cannot run these inputs (None: it can)."""
    why = _op_why_not() or _device_why_not(q.device)
    if why is not None:
        return why
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"cuDNN's fused attention takes fp16/bf16, got {q.dtype}; cast the model or use backend='reference'"
    d = q.shape[-1]
    if d % 8 or d > MAX_HEAD_DIM:
        return f"head_dim {d}: the cudnn backend takes head_dim % 8 == 0 and <= {MAX_HEAD_DIM}; use backend='varlen'"
    if window is not None:
        return "aten's cuDNN attention takes no sliding window; use backend='varlen' or 'flex'"
    if packed.lengths is None:
        return "a CUDA-graph static PackedBatch carries no host offsets to pad; only the varlen backend runs on it"
    return None


def _device_why_not(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "cuDNN attention is CUDA-only; use backend='sdpa_docs' / 'reference' on the CPU"
    if not torch.backends.cudnn.is_available():
        return f"this torch build ({torch.__version__}) has no cuDNN; use backend='varlen'"
    version = torch.backends.cudnn.version() or 0
    if version < 90000:
        return f"cuDNN {version} is too old: ragged (packed) fused attention needs cuDNN >= 9.0; use backend='varlen'"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "cuDNN's fused attention needs an sm80+ GPU (Ampere or newer); use backend='flex' or 'sdpa_docs'"
    return None


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def layout(packed: PackedBatch) -> tuple[torch.Tensor, int]:
    """(offsets, longest-document bound) handed to cuDNN: bucketed (see the module docstring) or exact."""
    if not BUCKETS:
        return packed.cu_seqlens, packed.max_seqlen
    return packed.padded_offsets(max(_MIN_SLOTS, _pow2(packed.num_docs))), max(_MIN_MAX_LEN, _pow2(packed.max_seqlen))


class _CudnnAttention(torch.autograd.Function):
    """Document-causal attention: forward and backward are the two aten cuDNN ops on the same ragged offsets."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_len: int, scale: float, need_lse: bool):
        out, lse, _cq, _ck, _mq, _mk, seed, offset, _dbg = _aten._cudnn_attention_forward(
            query=q, key=k, value=v, attn_bias=None, cum_seq_q=cu, cum_seq_k=cu, max_q=max_len, max_k=max_len,
            compute_log_sumexp=need_lse, dropout_p=0.0, is_causal=True, return_debug_mask=False, scale=scale)
        if need_lse:
            ctx.save_for_backward(q, k, v, out, lse, cu, seed, offset)
        ctx.max_len, ctx.scale = max_len, scale
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse, cu, seed, offset = ctx.saved_tensors
        dq, dk, dv = _aten._cudnn_attention_backward(
            grad_out=g.contiguous(), query=q, key=k, value=v, out=out, logsumexp=lse, philox_seed=seed,
            philox_offset=offset, attn_bias=None, cum_seq_q=cu, cum_seq_k=cu, max_q=ctx.max_len, max_k=ctx.max_len,
            dropout_p=0.0, is_causal=True, scale=ctx.scale)
        return dq, dk, dv, None, None, None, None


def cudnn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: PackedBatch, scale: float,
                    window: int | None = None) -> torch.Tensor:
    """(tokens, hq, d) document-causal attention by cuDNN; k, v (tokens, hk, d) with hk dividing hq."""
    global _GQA
    if window is not None:
        raise ValueError("the cudnn backend takes no sliding window (why_unavailable says so)")
    cu, max_len = layout(packed)
    need_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    q, k, v = (t.contiguous() for t in (q, k, v))
    if k.shape[1] != q.shape[1] and _GQA == "native":
        try:
            return _CudnnAttention.apply(q, k, v, cu, max_len, scale, need_lse)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:
            _GQA = "repeat"  # this build rejects hk != hq: repeat K/V from now on (an unrelated error re-raises
            # from the call below)
    if k.shape[1] != q.shape[1]:
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return _CudnnAttention.apply(q, k, v, cu, max_len, scale, need_lse)


def cudnn_detail() -> str:
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    pad = (f"offsets bucketed (documents to a power of two >= {_MIN_SLOTS}, longest to a power of two >= "
           f"{_MIN_MAX_LEN})" if BUCKETS else "exact offsets")
    return f"cuDNN {version} fused attention via aten._cudnn_attention_forward/backward; {pad}; GQA {_GQA}"
