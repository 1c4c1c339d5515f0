"""Qwen3's q/k per-head RMSNorm + RoPE as one op: registered custom ops, an eager fast path and the functional.

    q_out, k_out = novatune.ops.qk_norm_rope.qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin)

equals HF's
    q_out = apply_rotary_pos_emb(Qwen3RMSNorm(q), Qwen3RMSNorm(k), cos, sin, unsqueeze_dim=2)   # (b, s, h, d)
with q (b, s, hq, d), k (b, s, hk, d) (last dim contiguous; other strides free, e.g. views of a fused projection),
weights (d,), cos/sin (b, s, d), (1, s, d) or (s, d) from the model's rotary embedding (per-token positions, so
packed rows with restarting position_ids need nothing special). Outputs: new contiguous (b, s, h, d) tensors in
promote(x.dtype, weight.dtype) (cos/sin's dtype does not enter, as in novatune.ops.apply_rope). Rounding: n and
w * n exactly as HF's Qwen3RMSNorm, the rotation in fp32 rounded once (HF rounds three times); see
novatune/kernels/qk_norm_rope.py for the exact sequence and the bound against HF.

Gradients flow to q, k, q_weight, k_weight (weight grads accumulated in fp32); cos/sin get none (HF builds them under
torch.no_grad()).

Registered ops (torch.compile, FSDP2, opcheck):
    torch.ops.novatune.qk_norm_rope_fwd(q, k, q_weight, k_weight, eps, cos, sin) -> (q_out, k_out, rstd_q, rstd_k)
    torch.ops.novatune.qk_norm_rope_bwd(dq_out, dk_out, q, k, q_weight, k_weight, rstd_q, rstd_k, cos, sin)
        -> (dq, dk, dq_weight, dk_weight)
rstd_* are (b, s, h) fp32, saved for the backward together with q, k, the weights and cos/sin (no extra copies).
Eager calls take an autograd.Function around the same implementations (identical numbers, tested): custom-op
dispatch with registered autograd costs ~100+ µs of host time per fwd+bwd, which would show in wall time at 36
layers. Under torch.compile (torch.compiler.is_compiling()) the registered op is used.

Device rule (novatune.ops._backend.use_triton): CUDA -> Triton kernels; CPU -> the fp32 reference (same rounding
sequence as the kernels); CPU under TRITON_INTERPRET=1 -> the kernels.
"""
from __future__ import annotations

import torch
from torch import Tensor

from novatune.kernels import qk_norm_rope as _k
from novatune.ops import _backend
from novatune.ops._backend import use_triton

__all__ = ["qk_norm_rope", "qk_norm_rope_fwd", "qk_norm_rope_bwd"]


def _check(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"qk_norm_rope: q and k must be (b, s, h, d), got {tuple(q.shape)} and {tuple(k.shape)}")
    d = q.shape[-1]
    if k.shape[-1] != d or q_weight.shape != (d,) or k_weight.shape != (d,):
        raise ValueError(f"qk_norm_rope: head_dim of q {tuple(q.shape)}, k {tuple(k.shape)} and the weights "
                         f"{tuple(q_weight.shape)}/{tuple(k_weight.shape)} must agree")
    if cos.shape != sin.shape or cos.shape[-1] != d:
        raise ValueError(f"qk_norm_rope: cos/sin {tuple(cos.shape)}/{tuple(sin.shape)} must be (b, s, {d}) "
                         f"(partial rotary is not supported)")
    if d % 2 or d > _k.MAX_HEAD_DIM:
        raise ValueError(f"qk_norm_rope: head_dim must be even and <= {_k.MAX_HEAD_DIM}, got {d}")


def _fwd_impl(q, k, q_weight, k_weight, eps, cos, sin):
    if use_triton(q):
        return _k.qk_norm_rope_fwd(q, k, q_weight, k_weight, eps, cos, sin)
    # contiguous: the fake impl promises contiguous outputs whatever the inputs' layout
    return tuple(t.contiguous() for t in _k.qk_norm_rope_ref(q, k, q_weight, k_weight, eps, cos, sin,
                                                               return_rstd=True))


def _bwd_impl(dq_out, dk_out, q, k, q_weight, k_weight, rstd_q, rstd_k, cos, sin):
    if use_triton(q):
        return _k.qk_norm_rope_bwd(dq_out, dk_out, q, k, q_weight, k_weight, rstd_q, rstd_k, cos, sin)
    return tuple(t.contiguous() for t in _k.qk_norm_rope_bwd_ref(dq_out, dk_out, q, k, q_weight, k_weight, rstd_q,
                                                                   rstd_k, cos, sin))


# ----------------------------------------------------------------------------------------------- registered ops
@torch.library.custom_op("novatune::qk_norm_rope_fwd", mutates_args=())
def qk_norm_rope_fwd(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, cos: Tensor,
                     sin: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(q_out, k_out, rstd_q, rstd_k): outputs contiguous (b, s, h, d) in promote(x, weight); rstd (b, s, h) fp32."""
    return _fwd_impl(q, k, q_weight, k_weight, eps, cos, sin)


@qk_norm_rope_fwd.register_fake
def _qk_norm_rope_fwd_fake(q, k, q_weight, k_weight, eps, cos, sin):
    return (q.new_empty(q.shape, dtype=torch.promote_types(q.dtype, q_weight.dtype)),
            k.new_empty(k.shape, dtype=torch.promote_types(k.dtype, k_weight.dtype)),
            q.new_empty(q.shape[:-1], dtype=torch.float32), k.new_empty(k.shape[:-1], dtype=torch.float32))


@torch.library.custom_op("novatune::qk_norm_rope_bwd", mutates_args=())
def qk_norm_rope_bwd(dq_out: Tensor, dk_out: Tensor, q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor,
                     rstd_q: Tensor, rstd_k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dq_weight, dk_weight): dq/dk contiguous in q's/k's dtype, weight grads in the weights' dtypes."""
    return _bwd_impl(dq_out, dk_out, q, k, q_weight, k_weight, rstd_q, rstd_k, cos, sin)


@qk_norm_rope_bwd.register_fake
def _qk_norm_rope_bwd_fake(dq_out, dk_out, q, k, q_weight, k_weight, rstd_q, rstd_k, cos, sin):
    return q.new_empty(q.shape), k.new_empty(k.shape), q_weight.new_empty(q_weight.shape), \
        k_weight.new_empty(k_weight.shape)


def _setup_context(ctx, inputs, output):
    q, k, q_weight, k_weight, _eps, cos, sin = inputs
    _qo, _ko, rstd_q, rstd_k = output
    ctx.save_for_backward(q, k, q_weight, k_weight, rstd_q, rstd_k, cos, sin)


def _grads_or_zeros(dq_out, dk_out, q, k, q_weight, k_weight):
    # an unused output (e.g. only q_out reaches the loss) may arrive as None: its grad is zero
    if dq_out is None:
        dq_out = torch.zeros(q.shape, dtype=torch.promote_types(q.dtype, q_weight.dtype), device=q.device)
    if dk_out is None:
        dk_out = torch.zeros(k.shape, dtype=torch.promote_types(k.dtype, k_weight.dtype), device=k.device)
    return dq_out, dk_out


def _backward(ctx, dq_out, dk_out, _drstd_q, _drstd_k):
    # rstd_* are auxiliary outputs for the backward; a gradient flowing into them is not supported (ignored)
    q, k, q_weight, k_weight, rstd_q, rstd_k, cos, sin = ctx.saved_tensors
    dq_out, dk_out = _grads_or_zeros(dq_out, dk_out, q, k, q_weight, k_weight)
    dq, dk, dwq, dwk = torch.ops.novatune.qk_norm_rope_bwd(dq_out, dk_out, q, k, q_weight, k_weight, rstd_q,
                                                           rstd_k, cos, sin)
    return dq, dk, dwq, dwk, None, None, None  # no grad for eps, cos, sin


qk_norm_rope_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------- eager fast path
class _QKNormRopeFunction(torch.autograd.Function):
    """Same implementations as the registered ops, without the custom-op dispatch overhead (eager only)."""

    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, eps, cos, sin):
        q_out, k_out, rstd_q, rstd_k = _fwd_impl(q, k, q_weight, k_weight, eps, cos, sin)
        ctx.save_for_backward(q, k, q_weight, k_weight, rstd_q, rstd_k, cos, sin)
        return q_out, k_out

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        q, k, q_weight, k_weight, rstd_q, rstd_k, cos, sin = ctx.saved_tensors
        dq_out, dk_out = _grads_or_zeros(dq_out, dk_out, q, k, q_weight, k_weight)
        dq, dk, dwq, dwk = _bwd_impl(dq_out, dk_out, q, k, q_weight, k_weight, rstd_q, rstd_k, cos, sin)
        need = ctx.needs_input_grad
        return (dq if need[0] else None, dk if need[1] else None, dwq if need[2] else None,
                dwk if need[3] else None, None, None, None)


# ----------------------------------------------------------------------------------------------- public API
def qk_norm_rope(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, cos: Tensor,
                 sin: Tensor) -> tuple[Tensor, Tensor]:
    """HF Qwen3's q_norm/k_norm followed by apply_rotary_pos_emb(unsqueeze_dim=2), in one op for q and k.

    q (b, s, hq, d), k (b, s, hk, d) (GQA: hk may differ), last dim contiguous; q_weight, k_weight (d,); eps the
    norms' variance_epsilon (one value for both: Qwen3 uses config.rms_norm_eps for q_norm and k_norm); cos/sin
    (b, s, d), (1, s, d) or (s, d); d even, <= 256. Returns new contiguous (q_out, k_out), (b, s, h, d), dtype
    promote(x, weight). Differentiable in q, k and both weights.
    """
    _check(q, k, q_weight, k_weight, cos, sin)
    if torch.compiler.is_compiling():
        return tuple(torch.ops.novatune.qk_norm_rope_fwd(q, k, q_weight, k_weight, eps, cos, sin)[:2])
    # an implementation `novatune tune` selected for this shape (OVERRIDE is None: nothing tuned, one global read)
    if (hook := _backend.OVERRIDE) is not None and (
            out := hook("qk_norm_rope", q, k, q_weight, k_weight, eps, cos, sin)) is not None:
        return out
    return _QKNormRopeFunction.apply(q, k, q_weight, k_weight, eps, cos, sin)
