"""GPT-OSS's clamped SwiGLU as registered torch.library ops, the eager autograd path and the op's SPEC.

    y = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g),  g = min(gate, limit)
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]        (novatune.ops.clamped_swiglu; HF's GptOssExperts)

It takes the experts' gate/up projection output as it comes (interleaved columns, (..., 2I)) and returns (..., I);
the gradient is one (..., 2I) tensor laid out like gate_up, exactly zero where a clamp is active. The MoE experts
op calls it between its grouped GEMMs; models call nothing else of it today.

Ops (`mutates_args=()`, fake impls for torch.compile / FSDP2):
  novatune::clamped_swiglu_fwd(gate_up, alpha, limit) -> y
  novatune::clamped_swiglu_bwd(dy, gate_up, alpha, limit) -> dgate_up
Device rule (novatune.ops._backend): CUDA -> the Triton kernels in novatune.kernels.clamped_swiglu; CPU -> the
fp32 reference cast to the input dtype (the Triton kernels under TRITON_INTERPRET=1). Eager calls go through a
plain autograd Function over the same implementations (less host time than the registered op's dispatch, as in
ops/swiglu.py); under torch.compile the registered op is used.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from novatune.kernels import clamped_swiglu as K
from novatune.ops import dispatch
from novatune.ops._backend import use_triton
from novatune.ops.contract import (
    Candidate,
    OpSpec,
    compiled,
    element_size,
    fill_nan_like,
    launchers,
    triton_reason,
    variant_grid,
)
from novatune.reference import clamped_swiglu as _ref

ALPHA, LIMIT = _ref.GPT_OSS_ALPHA, _ref.GPT_OSS_LIMIT


def _fwd_impl(gate_up: Tensor, alpha: float, limit: float, on_triton: bool) -> Tensor:
    if on_triton:
        return K.clamped_swiglu_fwd(gate_up, alpha, limit)
    return _ref.clamped_swiglu_ref(gate_up, alpha, limit).to(gate_up.dtype).contiguous()


def _bwd_impl(dy: Tensor, gate_up: Tensor, alpha: float, limit: float, on_triton: bool) -> Tensor:
    if on_triton:
        return K.clamped_swiglu_bwd(dy, gate_up, alpha, limit)
    return _ref.clamped_swiglu_bwd_ref(dy, gate_up, alpha, limit).to(gate_up.dtype).contiguous()


# ----------------------------------------------------------------------------------------------- registered ops
def _out_shape(gate_up: Tensor) -> tuple:
    return (*gate_up.shape[:-1], gate_up.shape[-1] // 2)


@torch.library.custom_op("novatune::clamped_swiglu_fwd", mutates_args=())
def clamped_swiglu_fwd(gate_up: Tensor, alpha: float, limit: float) -> Tensor:
    return _fwd_impl(gate_up, alpha, limit, use_triton(gate_up))


@clamped_swiglu_fwd.register_fake
def _fwd_fake(gate_up: Tensor, alpha: float, limit: float) -> Tensor:
    torch._check(gate_up.shape[-1] % 2 == 0, lambda: "clamped_swiglu: gate_up needs an even last dimension")
    return gate_up.new_empty(_out_shape(gate_up))


@torch.library.custom_op("novatune::clamped_swiglu_bwd", mutates_args=())
def clamped_swiglu_bwd(dy: Tensor, gate_up: Tensor, alpha: float, limit: float) -> Tensor:
    return _bwd_impl(dy, gate_up, alpha, limit, use_triton(gate_up))


@clamped_swiglu_bwd.register_fake
def _bwd_fake(dy: Tensor, gate_up: Tensor, alpha: float, limit: float) -> Tensor:
    return gate_up.new_empty(gate_up.shape)


def _setup_context(ctx, inputs, output) -> None:
    gate_up, alpha, limit = inputs
    ctx.save_for_backward(gate_up)
    ctx.alpha, ctx.limit = alpha, limit


def _backward(ctx, dy: Tensor):
    (gate_up,) = ctx.saved_tensors
    return torch.ops.novatune.clamped_swiglu_bwd(dy, gate_up, ctx.alpha, ctx.limit), None, None


clamped_swiglu_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------- autograd glue
def _default_fwd(gate_up: Tensor, alpha: float, limit: float, out: Tensor | None = None) -> Tensor:
    if use_triton(gate_up):
        return K.clamped_swiglu_fwd(gate_up, alpha, limit, out)
    y = _fwd_impl(gate_up, alpha, limit, False)
    return y if out is None else out.copy_(y)


def _default_bwd(dy: Tensor, gate_up: Tensor, alpha: float, limit: float, dgate_up: Tensor | None = None) -> Tensor:
    if use_triton(gate_up):
        return K.clamped_swiglu_bwd(dy, gate_up, alpha, limit, dgate_up)
    d = _bwd_impl(dy, gate_up, alpha, limit, False)
    return d if dgate_up is None else dgate_up.copy_(d)


def make_function(fwd, bwd):
    """Functional clamped_swiglu(gate_up, alpha, limit) from fwd(gate_up, alpha, limit, out=None) -> y and
    bwd(dy, gate_up, alpha, limit, dgate_up=None) -> dgate_up: the op's eager path and every kernel candidate."""

    class _ClampedSwiGLUFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, gate_up: Tensor, alpha: float, limit: float) -> Tensor:
            ctx.save_for_backward(gate_up)  # y is not needed: the backward recomputes the clamps and sigmoid
            ctx.alpha, ctx.limit = alpha, limit
            return fwd(gate_up, alpha, limit)

        @staticmethod
        def backward(ctx, dy: Tensor):
            (gate_up,) = ctx.saved_tensors
            return bwd(dy, gate_up, ctx.alpha, ctx.limit), None, None

    def clamped_swiglu_fn(gate_up: Tensor, alpha: float = ALPHA, limit: float = LIMIT) -> Tensor:
        return _ClampedSwiGLUFunction.apply(gate_up, float(alpha), float(limit))

    return clamped_swiglu_fn


_eager = make_function(_default_fwd, _default_bwd)


# ----------------------------------------------------------------------------------------------- public API
def clamped_swiglu(gate_up: Tensor, alpha: float = ALPHA, limit: float = LIMIT) -> Tensor:
    """GPT-OSS's gated activation of the interleaved gate/up output (..., 2I) -> (..., I), differentiable.
    Defaults: GPT-OSS's swiglu_alpha 1.702 and swiglu_limit 7.0 (pass the model config's values)."""
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"clamped_swiglu: gate_up must have an even last dimension (interleaved gate/up columns), "
                         f"got shape {tuple(gate_up.shape)}")
    if not limit > 0:
        raise ValueError(f"clamped_swiglu: limit must be > 0, got {limit}")
    if not gate_up.is_floating_point():  # the clamps and sigmoid of an integer tensor would be truncated
        raise TypeError(f"clamped_swiglu: gate_up must be floating point, got {gate_up.dtype}")
    if torch.compiler.is_compiling():
        return torch.ops.novatune.clamped_swiglu_fwd(gate_up, float(alpha), float(limit))
    if (hook := dispatch.ACTIVE) is not None and (
            out := hook("clamped_swiglu", gate_up, float(alpha), float(limit))) is not None:
        return out
    return _eager(gate_up, alpha, limit)


# ----------------------------------------------------------------------------------------------- the contract
def _make_inputs(shape, dtype, device, gen, alpha: float = ALPHA, limit: float = LIMIT) -> dict:
    """shape key (rows, I): gate_up (rows, 2I) at 4 x N(0, 1), so a share of both columns lies past +-7 and
    every clamp branch is taken."""
    rows, inter = shape
    gu = 4.0 * torch.randn(rows, 2 * inter, generator=gen)
    return {"gate_up": gu.to(device=device, dtype=dtype), "alpha": alpha, "limit": limit}


def _call_cases(dtype, device, gen) -> list:
    mk = functools.partial(_make_inputs, dtype=dtype, device=device, gen=gen)
    three_d = mk((3 * 11, 40))
    three_d["gate_up"] = three_d["gate_up"].view(3, 11, 80)
    return [("experts (tokens, 2I)", mk((37, 48))), ("3-D (b, s, 2I)", three_d), ("one row", mk((1, 5))),
            ("other alpha and limit", mk((19, 16), alpha=1.0, limit=2.5)),
            ("rows > 65,535", mk((65_541, 2)))]


def _floor(shape, dtype) -> int:
    rows, inter = shape
    # fwd reads 2I, writes I; bwd reads dy (I) and 2I, writes 2I: 8 I elements per row
    return 8 * rows * inter * element_size(dtype)


def _poison(kernels, inputs, dy) -> dict:
    gu, a, lim = inputs["gate_up"], inputs["alpha"], inputs["limit"]
    y = kernels.fwd(gu, a, lim, out=fill_nan_like(dy))
    d = kernels.bwd(dy, gu, a, lim, dgate_up=fill_nan_like(gu))
    return {"out": y, "gate_up": d}


def _triton_pair(cfg):
    return launchers(K.clamped_swiglu_fwd, K.clamped_swiglu_bwd, cfg, cfg)


def _candidates(shape, dtype, device: str) -> list:
    out = [Candidate("clamped_swiglu", "hf_eager", "eager", make=lambda: _ref.hf_clamped_swiglu),
           Candidate("clamped_swiglu", "novatune_default", "default", make=lambda: _eager),
           Candidate("clamped_swiglu", "torch_compile", "compile", make=lambda: compiled(_ref.hf_clamped_swiglu),
                     deterministic=False)]
    tvars = [dict(block=512, num_warps=4), dict(block=1024, num_warps=4), dict(block=2048, num_warps=8)]
    out += variant_grid("clamped_swiglu", "triton", tvars, _triton_pair, make_function, triton_reason(device))
    return out


SPEC = OpSpec(
    trace_kind="activation",
    name="clamped_swiglu", tensor_args=("gate_up",), make_inputs=_make_inputs, reference=_ref.clamped_swiglu_ref,
    stock=_ref.hf_clamped_swiglu, floor_bytes=_floor, candidates=_candidates, make_function=make_function,
    call_cases=_call_cases, poison_call=_poison, layout="contiguous, interleaved gate/up columns",
    shape_of=lambda gate_up, *_: (gate_up.numel() // max(gate_up.shape[-1], 1), gate_up.shape[-1] // 2),
    dtype_of=lambda gate_up, *_: str(gate_up.dtype)[6:],
    dy_shape=lambda shape: (shape[0], shape[1]),
    signature="clamped_swiglu(gate_up (..., 2I), alpha: float, limit: float) -> (..., I) in gate_up's dtype: "
              "g = min(gate_up[..., ::2], limit), u = clamp(gate_up[..., 1::2], -limit, limit), "
              "(u + 1) * g * sigmoid(alpha * g); differentiable in gate_up",
)
