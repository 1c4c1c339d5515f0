"""Gemma's RMSNorm as registered ops, with the functional the patch binds on Gemma, Gemma 2 and Gemma 3 norms.

    y = (x.float() * rsqrt(mean(x.float()^2, -1) + eps) * (offset + weight.float())).to(x.dtype)

transformers' GemmaRMSNorm stores the weight zero-centred and multiplies by (1 + w) (offset 1.0), and rounds once,
after the weight, in x's dtype (Llama rounds the normalised value first, then multiplies in promote(x, w): a
different number in bf16). offset 0.0 is the one-rounding norm of GPT-OSS. One contract: x of any rank, weight
(h,), output x's dtype; dw = sum over rows of dy * x_hat in fp32, cast once to weight's dtype.

Kernels: novatune.kernels.rms_norm with `offset` and round_normalised=False (the same fused forward and persistent
backward as rms_norm). Registered ops (opcheck-able, traceable by torch.compile / FSDP2):
    torch.ops.novatune.offset_rms_norm_fwd(x, weight, eps, offset) -> (y, rstd)
    torch.ops.novatune.offset_rms_norm_bwd(dy, x, weight, rstd, offset) -> (dx, dw)
Eager calls take the lighter autograd Function over the same implementations (as novatune.ops.rms_norm).
Device rule (novatune.ops._backend): CUDA -> Triton; CPU -> the fp32 reference; CPU under TRITON_INTERPRET=1 -> the
kernels.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from novatune.kernels import rms_norm as _k
from novatune.ops import dispatch
from novatune.ops._backend import use_triton
from novatune.ops.contract import (
    Candidate,
    OpSpec,
    compiled,
    element_size,
    fill_nan_like,
    launchers,
    row_scales,
    triton_reason,
    variant_grid,
)
from novatune.reference import rms_norm as _ref

__all__ = ["offset_rms_norm", "offset_rms_norm_fwd", "offset_rms_norm_bwd"]


def _fwd_impl(x: Tensor, weight: Tensor, eps: float, offset: float) -> tuple[Tensor, Tensor]:
    if use_triton(x) and x.shape[-1] <= _k.MAX_FUSED_N:
        return _k.rms_norm_fwd(x, weight, eps, offset=offset, round_normalised=False)
    y, rstd = _ref.offset_rms_norm_ref(x, weight, eps, offset, return_rstd=True)
    return y.contiguous(), rstd.contiguous()


def _bwd_impl(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, offset: float) -> tuple[Tensor, Tensor]:
    if use_triton(x) and x.shape[-1] <= _k.MAX_FUSED_N:
        return _k.rms_norm_bwd(dy, x, weight, rstd, offset=offset, round_normalised=False)
    dx, dw = _ref.offset_rms_norm_bwd_ref(dy, x, weight, rstd, offset)
    return dx.contiguous(), dw.contiguous()


# ----------------------------------------------------------------------------------------------- registered ops
@torch.library.custom_op("novatune::offset_rms_norm_fwd", mutates_args=())
def offset_rms_norm_fwd(x: Tensor, weight: Tensor, eps: float, offset: float) -> tuple[Tensor, Tensor]:
    """(y, rstd): y has x's shape and dtype; rstd is fp32 with shape x.shape[:-1]."""
    _k.check_inputs(x, weight, "offset_rms_norm")
    return _fwd_impl(x, weight, eps, offset)


@offset_rms_norm_fwd.register_fake
def _fwd_fake(x: Tensor, weight: Tensor, eps: float, offset: float) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("novatune::offset_rms_norm_bwd", mutates_args=())
def offset_rms_norm_bwd(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, offset: float) -> tuple[Tensor, Tensor]:
    """(dx, dw): dx has x's shape and dtype, dw weight's (accumulated in fp32)."""
    return _bwd_impl(dy, x, weight, rstd, offset)


@offset_rms_norm_bwd.register_fake
def _bwd_fake(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, offset: float) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    x, weight, _eps, offset = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.offset = offset


def _backward(ctx, dy: Tensor, _drstd: Tensor | None):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = torch.ops.novatune.offset_rms_norm_bwd(dy, x, weight, rstd, ctx.offset)
    return dx, dw, None, None


offset_rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------- autograd glue
def make_function(fwd, bwd):
    """Functional offset_rms_norm(x, weight, eps, offset) from fwd(x, w, eps, offset) -> (y, rstd) and
    bwd(dy, x, w, rstd, offset) -> (dx, dw): the op's eager path and every kernel candidate."""

    class _Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: Tensor, weight: Tensor, eps: float, offset: float) -> Tensor:
            y, rstd = fwd(x, weight, eps, offset)
            ctx.save_for_backward(x, weight, rstd)
            ctx.offset = offset
            return y

        @staticmethod
        @once_differentiable  # rstd is a saved forward output: a second-order gradient would miss its dependence
        def backward(ctx, dy: Tensor):
            x, weight, rstd = ctx.saved_tensors
            dx, dw = bwd(dy, x, weight, rstd, ctx.offset)
            return (dx if ctx.needs_input_grad[0] else None), (dw if ctx.needs_input_grad[1] else None), None, None

    def offset_rms_norm_fn(x: Tensor, weight: Tensor, eps: float, offset: float = 1.0) -> Tensor:
        return _Fn.apply(x, weight, eps, offset)

    return offset_rms_norm_fn


_eager = make_function(_fwd_impl, _bwd_impl)


def offset_rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, offset: float = 1.0) -> Tensor:
    """transformers' GemmaRMSNorm over the last dim of x (offset 1.0), differentiable in x and weight; x's dtype.
    x and weight floating point, weight (x.shape[-1],) on x's device, on every path (as rms_norm)."""
    _k.check_inputs(x, weight, "offset_rms_norm")
    offset = float(offset)
    if torch.compiler.is_compiling():
        return torch.ops.novatune.offset_rms_norm_fwd(x, weight, eps, offset)[0]
    if (hook := dispatch.ACTIVE) is not None and (out := hook("offset_rms_norm", x, weight, eps, offset)) is not None:
        return out
    return _eager(x, weight, eps, offset)


# ----------------------------------------------------------------------------------------------- the contract
def _make_inputs(shape, dtype, device, gen, eps: float = 1e-6, offset: float = 1.0, magnitude: float = 1.0) -> dict:
    """x with per-row scales 1e-3..10 (mean(x^2) down to ~eps), a zero-centred weight as Gemma stores it (a dropped
    offset or weight shows)."""
    n = shape[-1]
    rows = 1
    for s in shape[:-1]:
        rows *= s
    x = torch.randn(rows, n, generator=gen) * row_scales(rows, gen)[:, None] * magnitude
    w = 0.5 * torch.randn(n, generator=gen)
    return {"x": x.reshape(shape).to(device=device, dtype=dtype), "weight": w.to(device=device, dtype=dtype),
            "eps": eps, "offset": offset}


def _call_cases(dtype, device, gen) -> list:
    """Gemma's calls: (b, s, h) hidden states (pre/post norms), (b, s, heads, d) q/k norms (Gemma 3), odd shapes,
    one row, rows past 65,535, |x| ~ 1e4, and offset 0 (GPT-OSS's one-rounding norm)."""
    mk = functools.partial(_make_inputs, dtype=dtype, device=device, gen=gen)
    return [("hidden (b, s, h)", mk((2, 37, 96))), ("q/k heads (b, s, h, d)", mk((2, 9, 4, 32))),
            ("single row", mk((1, 1, 40))), ("|x| ~ 1e4", mk((2, 19, 64), magnitude=1e4)),
            ("rows > 65,535", mk((1, 65_541, 8))), ("offset 0", mk((3, 11, 80), offset=0.0))]


def _floor(shape, dtype) -> int:
    rows = 1
    for s in shape[:-1]:
        rows *= s
    return 5 * rows * shape[-1] * element_size(dtype)  # as rms_norm: x, y, dy, x, dx


def _poison(kernels, inputs, dy) -> dict:
    x, w, eps, offset = inputs["x"], inputs["weight"], inputs["eps"], inputs["offset"]
    rstd = torch.full(x.shape[:-1], float("nan"), dtype=torch.float32, device=x.device)
    y, rstd = kernels.fwd(x, w, eps, offset, out=fill_nan_like(x), rstd=rstd)
    dx, dw = kernels.bwd(dy, x, w, rstd, offset, dx=fill_nan_like(x), dw=fill_nan_like(w))
    return {"out": y, "x": dx, "weight": dw}


def _triton_pair(variant):
    f, b = variant

    def fwd(x, w, eps, offset, **kw):
        return _k.rms_norm_fwd(x, w, eps, offset=offset, round_normalised=False, **kw, **f)

    def bwd(dy, x, w, rstd, offset, **kw):
        return _k.rms_norm_bwd(dy, x, w, rstd, offset=offset, round_normalised=False, **kw, **b)

    return launchers(fwd, bwd, {}, {})


def _candidates(shape, dtype, device: str) -> list:
    out = [Candidate("offset_rms_norm", "hf_eager", "eager", make=lambda: _ref.hf_gemma_rms_norm),
           Candidate("offset_rms_norm", "novatune_default", "default", make=lambda: _eager),
           Candidate("offset_rms_norm", "torch_compile", "compile", make=lambda: compiled(_ref.hf_gemma_rms_norm),
                     deterministic=False)]
    tvars = ([({}, dict(block_m=1, num_warps=4, stages=3)), ({}, dict(stages=5))] if shape[-1] >= 1024 else
             [({}, dict(block_m=32, num_warps=8, stages=0)), (dict(block_m=64, num_warps=8), {})])
    out += variant_grid("offset_rms_norm", "triton", tvars, _triton_pair, make_function, triton_reason(device))
    return out


SPEC = OpSpec(
    trace_kind="norm",
    name="offset_rms_norm", tensor_args=("x", "weight"), make_inputs=_make_inputs,
    reference=_ref.offset_rms_norm_fp32, stock=_ref.hf_gemma_rms_norm, floor_bytes=_floor, candidates=_candidates,
    make_function=make_function, call_cases=_call_cases, poison_call=_poison, layout="rows contiguous",
    shape_of=lambda x, weight, eps, offset: (x.numel() // max(x.shape[-1], 1), x.shape[-1]),
    dtype_of=lambda x, weight, eps, offset: f"{str(x.dtype)[6:]}/{str(weight.dtype)[6:]}",
    signature="offset_rms_norm(x (..., h), weight (h,), eps: float, offset: float) -> y (x's shape and dtype) = "
              "round(x_hat * (offset + w)) computed in fp32; differentiable in x and weight",
)
