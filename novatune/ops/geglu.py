"""GeGLU (gelu_tanh(gate) * up) as registered ops, the functional and the fused gated-MLP helper Gemma binds.

    y = gelu_tanh(gate) * up                 (novatune.ops.geglu; HF's gelu_pytorch_tanh gated MLP)
    mlp(x) = down_proj(geglu(gate_proj(x), up_proj(x)))        (novatune.ops.geglu_mlp)

The kernels are the SwiGLU kernels with the gelu_tanh gate (novatune.kernels.swiglu, activation="gelu_tanh"): one
elementwise forward, one backward that recomputes the gate from g, so autograd keeps gate and up only. The eager
autograd Function is swiglu's `make_function` over these launchers (the same in-place backward option: the
gradients written over gate and up, their last use).

Ops (`mutates_args=()`, fake impls for torch.compile / FSDP2):
  novatune::geglu_fwd(gate, up) -> y
  novatune::geglu_bwd(dy, gate, up) -> (dgate, dup)
Device rule (novatune.ops._backend): CUDA -> Triton; CPU -> the fp32 reference cast to the input dtype (the
kernels under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from novatune.kernels import swiglu as K
from novatune.ops import dispatch
from novatune.ops._backend import use_triton
from novatune.ops.contract import Candidate, OpSpec, compiled, triton_reason, variant_grid
from novatune.ops.linear import output_hooked, project
from novatune.ops.swiglu import gated_floor_bytes, gated_poison_call, make_function, require_float
from novatune.reference import geglu as _ref

__all__ = ["geglu", "geglu_mlp", "geglu_fwd", "geglu_bwd"]
_ACT = "gelu_tanh"


def _fwd(gate: Tensor, up: Tensor, out: Tensor | None = None, **cfg) -> Tensor:
    if use_triton(gate):
        return K.swiglu_fwd(gate, up, out, activation=_ACT, **cfg)
    y = _ref.geglu_ref(gate, up).to(gate.dtype).contiguous()
    return y if out is None else out.copy_(y)


def _bwd(dy: Tensor, gate: Tensor, up: Tensor, dgate: Tensor | None = None, dup: Tensor | None = None,
         **cfg) -> tuple[Tensor, Tensor]:
    if use_triton(gate):
        return K.swiglu_bwd(dy, gate, up, dgate, dup, activation=_ACT, **cfg)  # reads each element before writing
    g, u = _ref.geglu_bwd_ref(dy, gate, up)
    g, u = g.to(gate.dtype).contiguous(), u.to(up.dtype).contiguous()
    return (g if dgate is None else dgate.copy_(g)), (u if dup is None else dup.copy_(u))


# ----------------------------------------------------------------------------------------------- registered ops
@torch.library.custom_op("novatune::geglu_fwd", mutates_args=())
def geglu_fwd(gate: Tensor, up: Tensor) -> Tensor:
    return _fwd(gate, up)


@geglu_fwd.register_fake
def _geglu_fwd_fake(gate: Tensor, up: Tensor) -> Tensor:
    torch._check(gate.shape == up.shape, lambda: "geglu: gate and up must have the same shape")
    return gate.new_empty(gate.shape)


@torch.library.custom_op("novatune::geglu_bwd", mutates_args=())
def geglu_bwd(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    return _bwd(dy, gate, up)


@geglu_bwd.register_fake
def _geglu_bwd_fake(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy: Tensor):
    gate, up = ctx.saved_tensors
    return torch.ops.novatune.geglu_bwd(dy, gate, up)


geglu_fwd.register_autograd(_backward, setup_context=_setup_context)

_eager = make_function(_fwd, _bwd)


# ----------------------------------------------------------------------------------------------- public API
def geglu(gate: Tensor, up: Tensor, *, inplace_backward: bool = False) -> Tensor:
    """gelu_tanh(gate) * up, differentiable (transformers' gelu_pytorch_tanh gated MLP). inplace_backward: see
    novatune.ops.swiglu.make_function."""
    if gate.shape != up.shape:
        raise ValueError(f"geglu: gate and up must have the same shape, got {tuple(gate.shape)} and "
                         f"{tuple(up.shape)}")
    require_float("geglu", gate, up)
    if gate.dtype != up.dtype:
        dt = torch.result_type(gate, up)
        gate, up = gate.to(dt), up.to(dt)
    if torch.compiler.is_compiling():
        return torch.ops.novatune.geglu_fwd(gate, up)
    if (hook := dispatch.ACTIVE) is not None and (out := hook("geglu", gate, up, inplace_backward)) is not None:
        return out
    return _eager(gate, up, inplace_backward)


def geglu_mlp(x: Tensor, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module,
              inplace_backward: bool = True, wgrad_in_place: bool = False,
              down_wgrad_in_place: bool | None = None) -> Tensor:
    """down_proj(gelu_tanh(gate_proj(x)) * up_proj(x)): Gemma's MLP forward with the fused activation.
    inplace_backward, wgrad_in_place, down_wgrad_in_place: as swiglu_mlp's."""
    inplace_backward = inplace_backward and not (output_hooked(gate_proj) or output_hooked(up_proj))
    gate, up = project(gate_proj, x, wgrad_in_place), project(up_proj, x, wgrad_in_place)
    down = wgrad_in_place if down_wgrad_in_place is None else down_wgrad_in_place
    return project(down_proj, geglu(gate, up, inplace_backward=inplace_backward), down)


# ----------------------------------------------------------------------------------------------- the contract
def _make_inputs(shape, dtype, device, gen, inplace_backward: bool = False, magnitude: float = 1.0) -> dict:
    """gate 3 x N(0, 1) (both tails of the gate and its negative dip), up N(0, 1), times `magnitude`."""
    g = 3.0 * torch.randn(*shape, generator=gen) * magnitude
    u = torch.randn(*shape, generator=gen) * magnitude
    return {"gate": g.to(device=device, dtype=dtype), "up": u.to(device=device, dtype=dtype),
            "inplace_backward": inplace_backward}


def _call_cases(dtype, device, gen) -> list:
    mk = functools.partial(_make_inputs, dtype=dtype, device=device, gen=gen)
    return [("MLP (b, s, i) inplace_backward=True", mk((2, 37, 96), inplace_backward=True)),
            ("(b, s, i)", mk((3, 11, 80))), ("2-D odd", mk((7, 33))), ("|x| ~ 1e3", mk((2, 19, 64), magnitude=300)),
            ("rows > 65,535", mk((1, 65_541, 4), inplace_backward=True))]


def _triton_pair(cfg):
    from types import SimpleNamespace

    return SimpleNamespace(fwd=functools.partial(_fwd, **cfg), bwd=functools.partial(_bwd, **cfg))


def _candidates(shape, dtype, device: str) -> list:
    out = [Candidate("geglu", "hf_eager", "eager", make=lambda: _ref.hf_geglu),
           Candidate("geglu", "novatune_default", "default", make=lambda: _eager),
           Candidate("geglu", "torch_compile", "compile", make=lambda: compiled(_ref.hf_geglu), deterministic=False)]
    tvars = [dict(block=1024, num_warps=4), dict(block=4096, num_warps=8)]
    out += variant_grid("geglu", "triton", tvars, _triton_pair, make_function, triton_reason(device))
    return out


SPEC = OpSpec(
    trace_kind="activation",
    name="geglu", tensor_args=("gate", "up"), make_inputs=_make_inputs, reference=_ref.geglu_ref,
    stock=_ref.hf_geglu, floor_bytes=gated_floor_bytes, candidates=_candidates, make_function=make_function,
    call_cases=_call_cases, poison_call=gated_poison_call, layout="contiguous", keyword_args=("inplace_backward",),
    shape_of=lambda gate, up, *_: (gate.numel() // max(gate.shape[-1], 1), gate.shape[-1]),
    dtype_of=lambda gate, up, *_: str(gate.dtype)[6:],
    signature="geglu(gate, up, *, inplace_backward: bool = False) -> gelu_tanh(gate) * up (gate's shape and dtype); "
              "differentiable in gate and up",
)
