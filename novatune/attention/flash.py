"""FlashAttention-2 over packed rows through aten's own ops, with no wrapper between autograd and the kernels.

    flash_attention(q, k, v, packed, scale, window=None) -> (tokens, hq, d)       the "flash" attention backend
    flash_fwd(...) -> (out, L),  flash_bwd(dout, ..., out, L) -> (dq, dk, dv)    the (out, log-sum-exp) pair that
                                                                                  attention sinks build on (sinks.py)

torch's `varlen_attn` runs the same two ops (aten._flash_attention_forward / _backward, FlashAttention-2 inside
torch) with the same arguments, from inside a `torch.library` custom op: each call then passes the op's Python
registration, its autograd wrapper and setup_context. In a profile of the Qwen3-30B-A3B MoE cut's micro-step (H200,
LOG.md session 14) varlen_attn's forward took 0.39 ms of host time per call around 0.07 ms for the aten op, in a
forward whose GPU waits on the host. `flash_attention` calls the ops from a plain autograd.Function: the same
kernels, arguments and saved tensors (q, k, v, out, L), so the same numbers as varlen_attn, for less host time.

The ops' contract as this module uses it: varlen over cu_seqlens (int32, the same tensor for q and k), causal or a
(left, right) window (HF's sliding window of `window` keys is left = window - 1, right = 0), GQA native (query
head h reads kv head h // (hq / hk); the backward sums dK and dV over each group), the log-sum-exp laid out
(hq, tokens), dropout 0 (the random state the backward takes is never read). CUDA, fp16/bf16, head_dim % 8 == 0
and <= 256, sm80+ (flash_why_not). On the CPU tests stand in for `_aten` with the reference math.
"""
from __future__ import annotations

import functools

import torch
from torch.autograd.function import once_differentiable

from novatune.attention.packed import PackedBatch

__all__ = ["flash_attention", "flash_fwd", "flash_bwd", "flash_why_not", "flash2_inputs_why_not"]

_aten = torch.ops.aten  # one name for the two FlashAttention ops (a CPU test stands in for them here)


@functools.cache
def _flash_kwargs() -> frozenset:
    """Keyword arguments of aten._flash_attention_forward in this torch build (the window arrived in 2.5)."""
    try:
        schema = torch.ops.aten._flash_attention_forward.default._schema
    except (AttributeError, RuntimeError):
        return frozenset()
    return frozenset(a.name for a in schema.arguments)


def _flash_window(window: int | None) -> tuple[bool, int, int]:
    """(is_causal, left, right) as torch's varlen_attn passes them: causal, or keys [i - window + 1, i]."""
    return (True, -1, 0) if window is None else (False, window - 1, 0)


def flash_fwd(q, k, v, packed: PackedBatch, scale: float, window: int | None):
    causal, left, right = _flash_window(window)
    cu, mx = packed.cu_seqlens, packed.max_seqlen
    out, lse = _aten._flash_attention_forward(
        q, k, v, cu, cu, mx, mx, 0.0, causal, False, scale=scale, window_size_left=left,
        window_size_right=right)[:2]
    if lse.shape == (q.shape[1], q.shape[0]):   # FlashAttention-2's varlen layout (hq, tokens): a view, no copy
        return out, lse.transpose(0, 1)
    raise RuntimeError(f"aten._flash_attention_forward returned a log-sum-exp of shape {tuple(lse.shape)} for "
                       f"{q.shape[0]} tokens x {q.shape[1]} heads; this build's layout is not supported")


def flash_bwd(dout, q, k, v, out, lse, packed: PackedBatch, scale: float, window: int | None):
    causal, left, right = _flash_window(window)
    cu, mx = packed.cu_seqlens, packed.max_seqlen
    raw = lse.transpose(0, 1).contiguous()  # back to (hq, tokens): the forward's own tensor, no copy
    # dropout 0: the random state is never read (torch's varlen_attn passes the same placeholders)
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = _aten._flash_attention_backward(
        dout, q, k, v, out, raw, cu, cu, mx, mx, 0.0, causal, rng, unused, scale=scale, window_size_left=left,
        window_size_right=right)
    return dq, dk, dv


@functools.lru_cache(maxsize=8)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def flash_why_not(q: torch.Tensor, k: torch.Tensor, window: int | None) -> str | None:
    """None when the flash implementation can run these inputs, else why not (the sink-capable varlen backend)."""
    if "window_size_left" not in _flash_kwargs():
        return (f"torch {torch.__version__}'s aten._flash_attention_forward takes no window_size_left; "
                "upgrade torch or use backend='reference'")
    if q.device.type != "cuda":
        return "FlashAttention is CUDA-only; use backend='reference' on the CPU"
    if torch.version.hip:
        return "ROCm's flash attention returns a padded log-sum-exp layout; use backend='reference'"
    return flash2_inputs_why_not(q, "FlashAttention")


def flash2_inputs_why_not(q: torch.Tensor, name: str) -> str | None:
    """Why FlashAttention-2 (`name`: torch's varlen_attn, or aten's flash ops) cannot take q's dtype, head size
    or GPU, or None."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"{name} needs fp16/bf16 inputs, got {q.dtype}"
    d = q.shape[-1]
    if d % 8 or d > 256:
        return f"{name} needs head_dim % 8 == 0 and <= 256, got {d}"
    if _capability(q.device) < (8, 0):
        return f"{name} (FlashAttention-2) needs sm80 or newer"
    return None


class _FlashAttention(torch.autograd.Function):
    """Document-causal attention through aten's FlashAttention-2 ops; saves what varlen_attn saves."""

    @staticmethod
    def forward(ctx, q, k, v, packed, scale, window):
        out, lse = flash_fwd(q, k, v, packed, scale, window)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = (packed, scale, window)
        return out

    @staticmethod
    @once_differentiable  # out and L are saved forward outputs: a second-order gradient would miss them
    def backward(ctx, g):
        q, k, v, out, lse = ctx.saved_tensors
        packed, scale, window = ctx.meta
        dq, dk, dv = flash_bwd(g.contiguous(), q, k, v, out, lse, packed, scale, window)
        return dq, dk, dv, None, None, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: PackedBatch, scale: float,
                    window: int | None = None) -> torch.Tensor:
    """Document-causal attention (a sliding window of `window` keys, or the whole document before the query) by
    FlashAttention-2 through aten's ops. q (tokens, hq, d), k and v (tokens, hk, d); returns (tokens, hq, d),
    differentiable in q, k and v once. Inputs as varlen_attention checks them; flash_why_not says where it runs."""
    return _FlashAttention.apply(q, k, v, packed, scale, window)
