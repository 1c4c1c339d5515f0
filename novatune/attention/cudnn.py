"""cuDNN's fused attention over packed rows (an FA3-class kernel on Hopper), document-causal, GQA without repeating K/V.

cuDNN's SDPA graph takes ragged ("THD") inputs: q (tokens, hq, d) and k, v (tokens, hk, d) read in place, one batch
entry per document found from the offsets, a padding mask at each document's length and the causal diagonal at its
top left. So attention stays causal inside each document and never crosses one. The query and kv head counts are
separate graph dimensions: query head h reads kv head h // (hq / hk), the backward sums dK/dV over each group.

Two ways to reach it, chosen by IMPL (environment NOVATUNE_CUDNN_IMPL; "auto": the first that imports):
  frontend  `cudnn.sdpa_torch` of NVIDIA's cudnn-frontend package (`pip install --no-deps nvidia-cudnn-frontend`:
            its graph API and torch ops; the CuTe-DSL dependencies serve other kernels and are optional). Torch custom
            ops with autograd; the built graphs are cached by shape.
  aten      torch's own `aten._cudnn_attention_forward` / `_backward` with `cum_seq_q` (no extra package), in an
            autograd.Function here. torch builds whose ragged path does not cache its cuDNN graphs rebuild one on
            every call (tens of ms), so this path is only fast on newer torch; `bench/bench_attention.py` shows it.

Graph reuse. A cuDNN graph is built per (documents, longest document, heads, strides): packed batches change both
numbers every step, so the offsets are padded to a bucket: the document count up to a power of two (empty documents
at the end, the layout PackedBatch.graph_static uses for FlashAttention) and the longest document up to a power of
two (only a bound: the padding mask reads each real length). A few graphs then serve every batch. BUCKETS = False
passes the exact layout (the GPU tests check both).

Training. A route's backward trains only where it is known to match the fp32 reference: on a stack in
MEASURED_BACKWARD (the route, cuDNN's version, the frontend's or torch's version, as measured on the GPU), or, on
any other stack, after `gradient_self_check` (one forward + backward on a small ragged problem on the device,
against novatune.reference.attention; once per process and head shape, cached). A failed check refuses the
training call with the measured error; forward-only calls run either way.

The aten path makes its inputs contiguous (older builds derive the ragged offsets from tokens * heads * d) and the
incoming gradient too (older builds read dO with O's offsets). The log-sum-exp's layout differs between torch
versions; it only travels from this forward to this backward, untouched.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import os
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from novatune.attention.packed import PackedBatch
from novatune.attention.self_check import check_gradients

__all__ = ["cudnn_attention", "cudnn_why_not", "cudnn_detail", "backward_why_not", "gradient_self_check", "overrides",
           "IMPL", "BUCKETS", "MEASURED_BACKWARD"]

IMPL = os.environ.get("NOVATUNE_CUDNN_IMPL", "auto")  # "frontend" | "aten" | "auto"
if IMPL not in ("auto", "frontend", "aten"):
    raise ValueError(f"NOVATUNE_CUDNN_IMPL={IMPL!r}: choose auto, frontend or aten")
BUCKETS = True
_aten = torch.ops.aten  # one name for torch's two cuDNN ops (a CPU test stands in for them here)
# cuDNN's ragged SDPA is supported by torch's own varlen path up to head_dim 128; larger needs newer GPUs / builds
MAX_HEAD_DIM = 128
_MIN_MAX_LEN = 256  # torch's varlen refuses cuDNN at a longest document <= 128: keep the bound above it
_GQA = "native"  # aten path: "repeat" once a build rejects hk != hq (recorded in the detail)


@contextlib.contextmanager
def overrides(impl: str | None = None, buckets: bool | None = None):
    """IMPL / BUCKETS changed inside the block (the bench and the tests compare the variants)."""
    global IMPL, BUCKETS
    saved = IMPL, BUCKETS
    IMPL = saved[0] if impl is None else impl
    BUCKETS = saved[1] if buckets is None else buckets
    try:
        yield
    finally:
        IMPL, BUCKETS = saved


# ------------------------------------------------------------------------------------------------ availability
@functools.cache
def _frontend() -> tuple[Any, str]:
    """(the cudnn-frontend module, "") or (None, why it cannot be used)."""
    try:
        module = importlib.import_module("cudnn")
        module.sdpa_torch  # noqa: B018 - registers torch.ops.cudnn.sdpa_fwd / sdpa_bwd with their autograd
    except Exception as e:  # noqa: BLE001 - absent or broken package: the aten path may still serve
        return None, f"nvidia-cudnn-frontend is not usable ({type(e).__name__}: {str(e)[:120]})"
    return module, ""


@functools.cache
def _op_why_not() -> str | None:
    """None when this torch has both aten ops with ragged offsets (feature detection, not a version string)."""
    for name in ("_cudnn_attention_forward", "_cudnn_attention_backward"):
        try:
            args = {a.name for a in getattr(_aten, name).default._schema.arguments}
        except (AttributeError, RuntimeError):
            return f"torch {torch.__version__} has no aten.{name}"
        if not {"cum_seq_q", "cum_seq_k", "max_q"} <= args:
            return f"torch {torch.__version__}'s aten.{name} takes no ragged offsets (cum_seq_q)"
    return None


def _impl() -> str:
    if IMPL != "auto":
        return IMPL
    return "frontend" if _frontend()[0] is not None else "aten"


def _impl_why_not(impl: str) -> str | None:
    if impl == "frontend":
        missing = _frontend()[1]
        return f"{missing}; pip install --no-deps nvidia-cudnn-frontend" if missing else None
    why = _op_why_not()
    if why is None:
        return None
    also = f", and {_frontend()[1]}" if IMPL == "auto" else ""
    return f"{why}{also}; pip install --no-deps nvidia-cudnn-frontend, or use backend='varlen'"


# Each route's backward as measured on the GPU against the fp32 reference (tests/attention/test_cudnn.py), keyed by
# the stack it ran on: (route, cuDNN version as torch reports it, the route's own version: the frontend package's
# for "frontend", torch's for "aten") -> None (it passed) or the measured failure. Measured on an H200 (torch
# 2.11.0+cu130, cuDNN 9.19, nvidia-cudnn-frontend 1.32.0), bucketed and exact offsets. On any other stack the route
# checks itself once before it trains (backward_why_not).
MEASURED_BACKWARD: dict[tuple[str, int, str], str | None] = {
    ("frontend", 91900, "1.32.0"): None,
    ("aten", 91900, "2.11.0+cu130"): "a wrong query gradient (dq relative error 4.3 with bucketed offsets, 2.7e20 "
                                     "with exact ones)",
}


def cudnn_why_not(q: torch.Tensor, k: torch.Tensor, packed: PackedBatch, window: int | None) -> str | None:
    """Why the cudnn backend cannot run these inputs (None: it can)."""
    why = _device_why_not(q.device) or _impl_why_not(_impl())
    if why is not None:
        return why
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"cuDNN's fused attention takes fp16/bf16, got {q.dtype}; cast the model or use backend='reference'"
    d = q.shape[-1]
    if d % 8 or d > MAX_HEAD_DIM:
        return f"head_dim {d}: the cudnn backend takes head_dim % 8 == 0 and <= {MAX_HEAD_DIM}; use backend='varlen'"
    if window is not None:
        return "the cudnn backend takes no sliding window; use backend='varlen' or 'flex'"
    if packed.lengths is None:
        return "a CUDA-graph static PackedBatch carries no host offsets to pad; only the varlen backend runs on it"
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return backward_why_not(q, k)
    return None


def _stack() -> tuple[str, int, str]:
    """(route, cuDNN version, the route's own version): MEASURED_BACKWARD's key for this process."""
    impl = _impl()
    own = str(getattr(_frontend()[0], "__version__", "?")) if impl == "frontend" else torch.__version__
    return impl, int(torch.backends.cudnn.version() or 0), own


def backward_why_not(q: torch.Tensor, k: torch.Tensor) -> str | None:
    """None when the route's backward may train here: its stack passed in MEASURED_BACKWARD, or (on a stack not
    measured) its gradient self-check on this device, run once per process and problem shape. Else the reason,
    with the measured error."""
    stack = _stack()
    if stack in MEASURED_BACKWARD:
        failure = MEASURED_BACKWARD[stack]
    elif torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        failure = "its gradient self-check cannot run inside a CUDA-graph capture"
    else:
        failure = gradient_self_check(stack, q.device, q.dtype, q.shape[1], k.shape[1], q.shape[2])
    if failure is None:
        return None
    impl, version, own = stack
    owner = "nvidia-cudnn-frontend" if impl == "frontend" else "torch"
    other = (", or install nvidia-cudnn-frontend (pip install --no-deps nvidia-cudnn-frontend) for the frontend "
             "route" if impl == "aten" else "")
    return (f"the cudnn backend's backward ({impl} route, cuDNN {version}, {owner} {own}) does not match the fp32 "
            f"reference: {failure}; it runs forward-only calls: train with backend='varlen'{other}")


@functools.cache
def gradient_self_check(stack: tuple, device: torch.device, dtype: torch.dtype, hq: int, hk: int,
                        d: int) -> str | None:
    """self_check.check_gradients of the route, cached per process: `stack` is part of the key so a changed route
    checks again."""
    return check_gradients(cudnn_attention, device, dtype, hq, hk, d)


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


# ------------------------------------------------------------------------------------------------ the call
def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def layout(packed: PackedBatch) -> tuple[torch.Tensor, int]:
    """(offsets, longest-document bound) handed to cuDNN: bucketed (see the module docstring) or exact."""
    if not BUCKETS:
        return packed.cu_seqlens, packed.max_seqlen
    return packed.padded_offsets(_pow2(packed.num_docs)), max(_MIN_MAX_LEN, _pow2(packed.max_seqlen))


class _AtenCudnnAttention(torch.autograd.Function):
    """Document-causal attention: forward and backward are torch's two cuDNN ops on the same ragged offsets."""

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
    @once_differentiable  # cuDNN's backward has no derivative of its own: a second order must raise
    def backward(ctx, g):
        q, k, v, out, lse, cu, seed, offset = ctx.saved_tensors
        dq, dk, dv = _aten._cudnn_attention_backward(
            grad_out=g.contiguous(), query=q, key=k, value=v, out=out, logsumexp=lse, philox_seed=seed,
            philox_offset=offset, attn_bias=None, cum_seq_q=cu, cum_seq_k=cu, max_q=ctx.max_len, max_k=ctx.max_len,
            dropout_p=0.0, is_causal=True, scale=ctx.scale)
        return dq, dk, dv, None, None, None, None


def _via_aten(q, k, v, cu, max_len: int, scale: float, need_lse: bool) -> torch.Tensor:
    global _GQA
    q, k, v = (t.contiguous() for t in (q, k, v))
    if k.shape[1] != q.shape[1] and _GQA == "native":
        try:
            return _AtenCudnnAttention.apply(q, k, v, cu, max_len, scale, need_lse)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:
            _GQA = "repeat"  # this build rejects hk != hq: repeat K/V from now on (an unrelated error re-raises
            # from the call below)
    if k.shape[1] != q.shape[1]:
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return _AtenCudnnAttention.apply(q, k, v, cu, max_len, scale, need_lse)


def _via_frontend(q, k, v, cu, max_len: int, scale: float, need_lse: bool) -> torch.Tensor:
    sdpa: Callable[..., Any] = _frontend()[0].sdpa_torch
    # the frontend's autograd consumes the forward's log-sum-exp: ask for it exactly when a gradient is wanted
    out = sdpa(q, k, v, scale=scale, is_causal=True, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len,
               max_seqlen_kv=max_len, return_lse=need_lse)
    return out[0] if need_lse else out


def cudnn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: PackedBatch, scale: float,
                    window: int | None = None) -> torch.Tensor:
    """(tokens, hq, d) document-causal attention by cuDNN; k, v (tokens, hk, d) with hk dividing hq."""
    if window is not None:
        raise ValueError("the cudnn backend takes no sliding window (why_unavailable says so)")
    cu, max_len = layout(packed)
    need_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if need_lse and not (q.requires_grad or k.requires_grad):
        why = backward_why_not(q, k)  # cudnn_why_not asks for q and k; here v alone wants a gradient
        if why is not None:
            raise RuntimeError(why)
    run = _via_frontend if _impl() == "frontend" else _via_aten
    return run(q, k, v, cu, max_len, scale, need_lse)


def cudnn_detail() -> str:
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    pad = ("offsets bucketed (documents and longest document to powers of two)" if BUCKETS else "exact offsets")
    if _impl() == "frontend":
        how = f"nvidia-cudnn-frontend {getattr(_frontend()[0], '__version__', '?')} cudnn.sdpa_torch, GQA native"
    else:
        how = f"torch {torch.__version__} aten._cudnn_attention_forward/backward, GQA {_GQA}"
    return f"cuDNN {version} fused attention via {how}; {pad}"
