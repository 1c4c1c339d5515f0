"""Mixture-of-experts routing: router logits -> (weights, expert ids) with Hugging Face's arithmetic, and a one-kernel
backward on the Triton path.

    route(logits, top_k, scoring=, renormalize=, softmax_fp32=, weights_dtype=) -> (weights (T, K), ids (T, K))

The expert MLP that takes the ids and weights is novatune.ops.moe.moe_experts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from novatune.kernels import moe as K
from novatune.ops._backend import use_triton

__all__ = ["route"]


def route(logits: Tensor, top_k: int, *, scoring: str = "softmax_topk", renormalize: bool = False,
          softmax_fp32: bool = True, weights_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """Router logits (T, E) -> (weights (T, K), expert ids (T, K)), the arithmetic of Hugging Face's routers:

    scoring "softmax_topk": softmax over the E experts (in fp32 when softmax_fp32), top-k, optionally divided by
    their sum (Qwen3-MoE with norm_topk_prob, Mixtral); "topk_softmax": top-k of the logits, softmax over those K
    (GPT-OSS). weights_dtype: the weights' dtype (default: the logits'; Mixtral keeps fp32). Ties resolve as
    torch.topk resolves them, the same call stock makes.

    The forward is stock's torch calls (bit for bit). When the logits need a gradient on the Triton path, the
    backward is one kernel (novatune.kernels.moe.route_bwd) instead of autograd's chain through the cast, the
    division and sum, the top-k and the softmax (up to a dozen launches per layer)."""
    if scoring not in ("softmax_topk", "topk_softmax"):
        raise ValueError(f"routing scoring {scoring!r}: choose 'softmax_topk' or 'topk_softmax'")
    if not 0 < top_k <= logits.shape[-1]:
        raise ValueError(f"route: top_k={top_k} must be in [1, {logits.shape[-1]}] (the experts in the router's "
                         f"last dimension, logits {tuple(logits.shape)})")
    recipe = (top_k, scoring == "topk_softmax", renormalize, softmax_fp32, weights_dtype or logits.dtype)
    if (logits.requires_grad and torch.is_grad_enabled() and use_triton(logits)
            and not torch.compiler.is_compiling()):
        return _RouteFunction.apply(logits, *recipe)
    weights, ids, _ = _route_fwd(logits, *recipe)
    return weights, ids


def _route_fwd(logits: Tensor, top_k: int, topk_softmax: bool, renormalize: bool, softmax_fp32: bool,
               weights_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """(weights, ids, the softmax output the backward needs: over the E experts, or over the K chosen logits)."""
    softmax_dtype = torch.float32 if softmax_fp32 else None
    if topk_softmax:
        top, ids = torch.topk(logits, top_k, dim=-1)
        probs = top = F.softmax(top, dim=-1, dtype=softmax_dtype)
    else:
        probs = F.softmax(logits, dim=-1, dtype=softmax_dtype)
        top, ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            top = top / top.sum(dim=-1, keepdim=True)
    return top.to(weights_dtype), ids, probs


class _RouteFunction(torch.autograd.Function):
    """route with a one-kernel backward; saves what autograd's chain saves (a softmax output and the ids)."""

    @staticmethod
    def forward(ctx, logits, top_k: int, topk_softmax: bool, renormalize: bool, softmax_fp32: bool,
                weights_dtype: torch.dtype):
        weights, ids, probs = _route_fwd(logits, top_k, topk_softmax, renormalize, softmax_fp32, weights_dtype)
        ctx.save_for_backward(probs, ids)
        ctx.recipe = (logits.shape[-1], topk_softmax, renormalize, logits.dtype)
        ctx.mark_non_differentiable(ids)
        ctx.set_materialize_grads(False)  # no zeros for the ids' gradient
        return weights, ids

    @staticmethod
    @once_differentiable  # one kernel, no graph of its own: a second-order gradient must raise, not be missing
    def backward(ctx, dweights, _dids):
        if dweights is None:
            return (None,) * 6
        probs, ids = ctx.saved_tensors
        num_experts, topk_softmax, renormalize, dtype = ctx.recipe
        dlogits = K.route_bwd(dweights, probs, ids, num_experts, topk_softmax=topk_softmax, renormalize=renormalize,
                              out_dtype=dtype)
        return dlogits, None, None, None, None, None
