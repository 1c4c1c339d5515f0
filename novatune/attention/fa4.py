"""FlashAttention-4's CuTe-DSL kernels over packed rows (the "fa4" attention backend; FA3-class on Hopper).

    fa4_attention(q, k, v, packed, scale, window=None) -> (tokens, hq, d)

The `flash-attn-4` package (`pip install flash-attn-4`; its runtime is NVIDIA's CUTLASS DSL) compiles its kernels
for the GPU it finds: on Hopper (sm90) warp-specialised TMA/WGMMA forward and backward kernels (FlashAttention-3's
design), on Blackwell (sm100) its own. Its varlen entry point takes the same contract as the flash backend:
q (tokens, hq, d) and k, v (tokens, hk, d) read in place, one offsets tensor (cu_seqlens, int32) for queries and
keys, causal inside each document and nothing across one, GQA native (query head h reads kv head h // (hq / hk),
the backward sums dK and dV over each group). A sliding window of `window` keys is the (window - 1, 0) window of
FlashAttention. The first call of each configuration compiles its kernels (seconds; cached per process).

Training. As for the cudnn backend (self_check.py): the backward trains where it is known to match the fp32
reference: on a stack in MEASURED_BACKWARD (package version, GPU capability), or, on any other stack, after one
gradient self-check on the device, once per process and head shape. A failed check refuses the training call
with the measured error; forward-only calls run either way.

Not applied here: logit soft-capping and attention sinks (the package has both; they are not validated through
this backend, so the dispatcher refuses such calls for it, and they run on flex / flash).
"""
from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch

from novatune.attention.packed import PackedBatch
from novatune.attention.self_check import check_gradients

__all__ = ["fa4_attention", "fa4_why_not", "fa4_detail", "backward_why_not", "gradient_self_check",
           "MEASURED_BACKWARD", "CAPABILITIES"]

PACKAGE = "flash-attn-4"
# GPU generations with a kernel of the package's own design (sm90 Hopper, sm100/sm110 Blackwell). Its sm80 and
# sm120 paths are FlashAttention-2-class: the flash backend already runs those kernels.
CAPABILITIES = (9, 10, 11)
# the head sizes its sm90 kernels take (8..256, a multiple of 16 bytes): the same bound on Blackwell covers the
# common head sizes (64, 128); anything else it rejects itself and the dispatcher falls back
MAX_HEAD_DIM = 256

# The backward as measured on the GPU against the fp32 reference (tests/attention/test_fa4.py), keyed by (package
# version, GPU capability) -> None (passed) or the measured failure. Other stacks check themselves once.
MEASURED_BACKWARD: dict[tuple[str, tuple[int, int]], str | None] = {}


@functools.cache
def _package() -> tuple[Callable[..., Any] | None, str, str]:
    """(flash_attn_varlen_func, version, "") or (None, "", why it cannot be used)."""
    try:
        module = importlib.import_module("flash_attn.cute.interface")
        fn = module.flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001 - absent or broken package (its CUDA runtime included): say which
        return None, "", f"{PACKAGE} is not usable ({type(e).__name__}: {str(e)[:160]})"
    try:
        from importlib.metadata import version
        ver = version(PACKAGE)
    except Exception:  # noqa: BLE001 - imported from a source tree: no distribution metadata
        ver = "source"
    return fn, ver, ""


def fa4_why_not(q: torch.Tensor, k: torch.Tensor, packed: PackedBatch, window: int | None) -> str | None:
    """Why the fa4 backend cannot run these inputs (None: it can)."""
    if q.device.type != "cuda":
        return "FlashAttention-4 is CUDA-only; use backend='sdpa_docs' / 'reference' on the CPU"
    major, minor = torch.cuda.get_device_capability(q.device)
    if major not in CAPABILITIES:
        return (f"FlashAttention-4's own kernels target sm90 / sm100; this GPU is sm{major}{minor} (the flash backend "
                "runs FlashAttention-2 there)")
    fn, _, missing = _package()
    if fn is None:
        return f"{missing}; pip install {PACKAGE}, or use backend='flash'"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"FlashAttention-4 takes fp16/bf16, got {q.dtype}; cast the model or use backend='reference'"
    d = q.shape[-1]
    if d % 8 or not 8 <= d <= MAX_HEAD_DIM:
        return f"head_dim {d}: the fa4 backend takes head_dim % 8 == 0 in [8, {MAX_HEAD_DIM}]; use backend='flex'"
    if packed.lengths is None:
        return ("a CUDA-graph static PackedBatch: the fa4 backend is not validated inside graph capture (its first "
                "call compiles); the varlen backend runs there")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return backward_why_not(q, k)
    return None


def _stack(device: torch.device) -> tuple[str, tuple[int, int]]:
    """(package version, GPU capability): MEASURED_BACKWARD's key."""
    major, minor = torch.cuda.get_device_capability(device)
    return _package()[1], (major, minor)


def backward_why_not(q: torch.Tensor, k: torch.Tensor) -> str | None:
    """None when the backward may train here (a measured stack that passed, or this stack's self-check), else the
    reason with the measured error."""
    stack = _stack(q.device)
    if stack in MEASURED_BACKWARD:
        failure = MEASURED_BACKWARD[stack]
    elif torch.cuda.is_current_stream_capturing():
        failure = "its gradient self-check cannot run inside a CUDA-graph capture"
    else:
        failure = gradient_self_check(stack, q.device, q.dtype, q.shape[1], k.shape[1], q.shape[2])
    if failure is None:
        return None
    return (f"the fa4 backend's backward ({PACKAGE} {stack[0]}, sm{stack[1][0]}{stack[1][1]}) does not match the "
            f"fp32 reference: {failure}; it runs forward-only calls: train with backend='flash'")


@functools.cache
def gradient_self_check(stack: tuple, device: torch.device, dtype: torch.dtype, hq: int, hk: int,
                        d: int) -> str | None:
    """self_check.check_gradients of this backend, once per process, stack and head shape."""
    return check_gradients(fa4_attention, device, dtype, hq, hk, d)


def fa4_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: PackedBatch, scale: float,
                  window: int | None = None) -> torch.Tensor:
    """(tokens, hq, d) document-causal attention by FlashAttention-4; k, v (tokens, hk, d) with hk dividing hq."""
    fn = _package()[0]
    if fn is None:
        raise RuntimeError(f"the fa4 backend is unavailable: {_package()[2]}")
    cu, longest = packed.cu_seqlens, packed.max_seqlen
    out, _lse = fn(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest,
                   softmax_scale=scale, causal=True, window_size=(None, None) if window is None else (window - 1, 0))
    return out


def fa4_detail() -> str:
    _, ver, missing = _package()
    return f"{PACKAGE} {ver} flash_attn_varlen_func (CuTe DSL), GQA native" if not missing else missing
