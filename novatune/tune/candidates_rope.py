"""Candidates of RoPE and the fused q/k-norm + RoPE (specs: opspecs_rope.py), applied through the ops' dispatch hook.

rope          hf_eager (HF apply_rotary_pos_emb in the input dtype: the baseline, never chosen: it is what patch
              replaced), novatune_default (novatune.ops.rope's untuned path), triton_v* (the same kernel with
              other (split, num_warps): the launcher's tuning overrides), torch_compile (the fp32 reference
              formulation, cast to the input dtype, compiled)
qk_norm_rope  hf_eager (Qwen3RMSNorm + apply_rotary_pos_emb; baseline), novatune_default, triton_v* (forward
              block_t / split / num_warps and backward rows / num_warps / stages overrides of
              novatune.kernels.qk_norm_rope, around qk_norm_rope_config's defaults), torch_compile (the kernel's
              fp32 reference formulation, kernels.qk_norm_rope.qk_norm_rope_ref, compiled)
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from types import SimpleNamespace

import torch

from novatune.tune.candidates import Candidate, _compiled, _kernel_candidate, _triton_reason


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


# ----------------------------------------------------------------------------------------------- stock formulas
def hf_apply_rope(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb (Llama / Qwen3), as a function."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def hf_qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin):
    """Qwen3Attention's q_norm / k_norm (Qwen3RMSNorm on (b, s, h, d)) then apply_rotary_pos_emb, in (b, s, h, d)."""
    def norm(x, w):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return w * h.to(x.dtype)
    return hf_apply_rope(norm(q, q_weight), norm(k, k_weight), cos, sin, unsqueeze_dim=2)


def _rope_ref_in_dtype(q, k, cos, sin, unsqueeze_dim=1):
    from novatune.kernels.rope import rope_ref

    qe, ke = rope_ref(q, k, cos, sin, unsqueeze_dim)   # fp32 math
    return qe.to(q.dtype), ke.to(k.dtype)              # one rounding, as the kernel


def _qk_ref(q, k, q_weight, k_weight, eps, cos, sin):
    from novatune.kernels.qk_norm_rope import qk_norm_rope_ref

    return qk_norm_rope_ref(q, k, q_weight, k_weight, eps, cos, sin)  # outputs in promote(x, weight)


# ----------------------------------------------------------------------------------------------- autograd glue
def _rope_function(fwd: Callable, bwd: Callable) -> Callable:
    """Functional apply_rope(q, k, cos, sin, unsqueeze_dim) from raw fwd/bwd launchers (no grad for the tables)."""

    class _Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, cos, sin, u):
            ctx.save_for_backward(cos, sin)
            ctx.u = u
            return fwd(q, k, cos, sin, u)

        @staticmethod
        def backward(ctx, dq_embed, dk_embed):
            cos, sin = ctx.saved_tensors
            dq, dk = bwd(dq_embed, dk_embed, cos, sin, ctx.u)
            return dq, dk, None, None, None

    return lambda q, k, cos, sin, unsqueeze_dim=1: _Fn.apply(q, k, cos, sin, unsqueeze_dim)


def _qk_function(fwd: Callable, bwd: Callable) -> Callable:
    """Functional qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin) from raw fwd/bwd launchers."""

    class _Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, wq, wk, eps, cos, sin):
            qo, ko, rq, rk = fwd(q, k, wq, wk, eps, cos, sin)
            ctx.save_for_backward(q, k, wq, wk, rq, rk, cos, sin)
            return qo, ko

        @staticmethod
        def backward(ctx, dq_out, dk_out):
            q, k, wq, wk, rq, rk, cos, sin = ctx.saved_tensors
            dq, dk, dwq, dwk = bwd(dq_out, dk_out, q, k, wq, wk, rq, rk, cos, sin)
            return dq, dk, dwq, dwk, None, None, None

    return lambda q, k, q_weight, k_weight, eps, cos, sin: _Fn.apply(q, k, q_weight, k_weight, eps, cos, sin)


# ----------------------------------------------------------------------------------------------- rope
def _rope_default() -> Callable:
    from novatune.ops.rope import _RopeFunction  # the untuned path itself, bypassing the dispatch hook

    return lambda q, k, cos, sin, unsqueeze_dim=1: _RopeFunction.apply(q, k, cos, sin, unsqueeze_dim)


def _launchers(fwd: Callable, bwd: Callable, fwd_cfg: dict, bwd_cfg: dict) -> SimpleNamespace:
    """A kernel pair with fixed launch configs: .fwd / .bwd take the launchers' own arguments (outputs included)."""
    return SimpleNamespace(fwd=lambda *a, **kw: fwd(*a, **kw, **fwd_cfg), bwd=lambda *a, **kw: bwd(*a, **kw, **bwd_cfg))


def _rope_triton_kernels(cfg: dict):
    from novatune.kernels import rope as K

    return _launchers(K.rope_fwd, K.rope_bwd, cfg, cfg)


def rope_candidates(shape, dtype: torch.dtype, device: str, families=None) -> list[Candidate]:
    op = "rope"
    tr = _triton_reason(device)
    out = [
        Candidate(op, "hf_eager", "eager", make=lambda: hf_apply_rope, selectable=False),
        Candidate(op, "novatune_default", "default", make=_rope_default),
        Candidate(op, "torch_compile", "compile", make=lambda: _compiled(_rope_ref_in_dtype), deterministic=False),
    ]
    # (heads split over programs per token, num_warps) around the launcher's default: split 1 and 8 warps at
    # Qwen3-4B's 32 + 8 heads x 128 on >= 2048 tokens (4 warps when the (heads, half) tile is <= 2048 values)
    for i, cfg in enumerate([dict(split=1, num_warps=4), dict(split=1, num_warps=16), dict(split=2, num_warps=4),
                             dict(split=2, num_warps=8), dict(split=4, num_warps=4)]):
        out.append(_kernel_candidate(op, f"triton_v{i}", "triton", cfg,
                                     functools.partial(_rope_triton_kernels, cfg), _rope_function, tr))
    return [c for c in out if families is None or c.family in families]


# ----------------------------------------------------------------------------------------------- qk_norm_rope
def _qk_default() -> Callable:
    from novatune.ops.qk_norm_rope import (
        _QKNormRopeFunction,  # the untuned path itself, bypassing the dispatch hook
    )

    return lambda q, k, q_weight, k_weight, eps, cos, sin: _QKNormRopeFunction.apply(q, k, q_weight, k_weight, eps,
                                                                                      cos, sin)


def _qk_triton_kernels(fwd_cfg: dict, bwd_cfg: dict):
    from novatune.kernels import qk_norm_rope as K

    return _launchers(K.qk_norm_rope_fwd, K.qk_norm_rope_bwd, fwd_cfg, bwd_cfg)


def qk_norm_rope_candidates(shape, dtype: torch.dtype, device: str, families=None) -> list[Candidate]:
    op = "qk_norm_rope"
    tr = _triton_reason(device)
    out = [
        Candidate(op, "hf_eager", "eager", make=lambda: hf_qk_norm_rope, selectable=False),
        Candidate(op, "novatune_default", "default", make=_qk_default),
        Candidate(op, "torch_compile", "compile", make=lambda: _compiled(_qk_ref), deterministic=False),
    ]
    # Around kernels/qk_norm_rope_config.py's H200 defaults at Qwen3-4B's shape (forward 2 tokens x all heads per
    # program on 4 warps; backward 32 head rows per item, 4 warps, cp.async pipeliner with 3 stages): one token or
    # four per forward program, more warps, and 16 / 64 rows or register prefetch (stages 0) in the backward.
    # An empty dict keeps that direction's default heuristic (per shape).
    tvars = [(dict(block_t=1, num_warps=4), {}), (dict(block_t=4, num_warps=8), {}),
             (dict(block_t=1, num_warps=8), {}), ({}, dict(rows=16, num_warps=4, stages=3)),
             ({}, dict(rows=64, num_warps=8, stages=3)), ({}, dict(rows=32, num_warps=4, stages=0)),
             ({}, dict(rows=32, num_warps=8, stages=3))]
    for i, (f, b) in enumerate(tvars):
        out.append(_kernel_candidate(op, f"triton_v{i}", "triton", {"fwd": f, "bwd": b},
                                     functools.partial(_qk_triton_kernels, f, b), _qk_function, tr))
    return [c for c in out if families is None or c.family in families]
