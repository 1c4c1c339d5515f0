"""What the tune engine knows about each tunable op: how to make inputs, the fp32 reference, the HBM floor, the
dispatch signature, and how to call a kernel pair with preallocated (poisoned) outputs.

Every candidate of an op is a *functional* with the public op's signature (rms_norm(x, weight, eps) -> y;
swiglu(gate, up[, inplace_backward]) -> y), differentiable in its tensor inputs. Kernel candidates additionally expose the raw
fwd/bwd launchers with `out=` buffers, which the validator fills with NaN first (`poison_call`).

Inputs are built so that each planted bug shows: weights far from 1 (a skipped weight is visible), rows of very
different magnitude down to mean(x^2) ~ eps (a wrong eps is visible), gate values into both tails of the sigmoid.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class OpSpec:
    name: str
    tensor_args: tuple[str, ...]       # differentiable tensor inputs, in call order
    make_inputs: Callable               # (shape, dtype, device, generator) -> dict (call order; non-tensors too)
    reference: Callable                 # fp32 functional, differentiable
    floor_bytes: Callable               # (shape, dtype) -> bytes fwd+bwd must move
    shape_of: Callable                  # call args -> the shape tuple the cache stores
    dtype_of: Callable                  # call args -> the dtype(s) string the cache stores
    poison_call: Callable               # (kernels, inputs, dy) -> {name: tensor written into poisoned buffers}
    noncontiguous: Callable             # inputs -> same values, strided layouts
    layout: str                         # the layout timed (what the cache key records)
    dy_shape: Callable | None = None    # shape -> the incoming gradient's shape (None: the shape itself)
    odd_shapes: Callable | None = None  # (shape, device type) -> shapes to validate, the real one first
    nan_rule: Callable | None = None    # (inputs, ref_nan, got_nan) -> reason or None (None: exact NaN pattern)
    nan_arg: str | None = None          # the input the NaN check poisons (None: the first tensor argument)
    applied_by: str = "dispatch"        # "dispatch": the ops' OVERRIDE hook; "patch": a setting on the model
    memory_rule: bool = False           # never pick a candidate whose peak memory exceeds the default's
    # names of the outputs: one ("out") for most ops; ops returning a tuple (rope: (q_embed, k_embed)) name each,
    # and their dy_shape returns one shape per output (the incoming gradient is then a tuple too)
    outputs: tuple[str, ...] = ("out",)

    def grad_shape(self, shape) -> tuple:
        return tuple(self.dy_shape(shape)) if self.dy_shape is not None else tuple(shape)


def make_dy(spec: OpSpec, shape, dtype, device, gen):
    """A random incoming gradient for one fwd+bwd at `shape`: a tensor, or a tuple of one per output."""
    if len(spec.outputs) == 1:
        return torch.randn(spec.grad_shape(shape), generator=gen).to(device=device, dtype=dtype)
    return tuple(torch.randn(tuple(s), generator=gen).to(device=device, dtype=dtype) for s in spec.dy_shape(shape))


def map_dy(f: Callable, dy):
    """f applied to a gradient that may be a tuple (multi-output ops)."""
    return tuple(f(t) for t in dy) if isinstance(dy, tuple) else f(dy)


def _fill_like(t: Tensor) -> Tensor:
    return torch.full_like(t, float("nan"), memory_format=torch.contiguous_format)


# ----------------------------------------------------------------------------------------------- rms_norm
def _rms_inputs(shape, dtype, device, gen) -> dict:
    rows, n = shape
    x = torch.randn(rows, n, generator=gen, dtype=torch.float32)
    # per-row scales from 1e-3 to 10: mean(x^2) spans ~1e-6 (comparable to eps) to 1e2
    scale = torch.logspace(-3, 1, rows, dtype=torch.float32)[torch.randperm(rows, generator=gen)]
    x = x * scale[:, None]
    w = 1.0 + 0.5 * torch.randn(n, generator=gen)
    return {"x": x.to(device=device, dtype=dtype), "weight": w.to(device=device, dtype=dtype), "eps": 1e-6}


def _rms_reference(x, weight, eps):
    xf = x.float()
    return weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))


def _rms_floor(shape, dtype) -> int:
    rows, n = shape
    # fwd reads x, writes y; bwd reads dy and x, writes dx (weight, rstd and dw partials are negligible)
    return 5 * rows * n * torch.tensor([], dtype=dtype).element_size()


def _rms_poison(kernels, inputs, dy) -> dict:
    x, w, eps = inputs["x"], inputs["weight"], inputs["eps"]
    y = _fill_like(x.to(torch.promote_types(x.dtype, w.dtype)))
    rstd = torch.full(x.shape[:-1], float("nan"), dtype=torch.float32, device=x.device)
    y, rstd = kernels.fwd(x, w, eps, out=y, rstd=rstd)
    dx, dw = _fill_like(x), _fill_like(w)
    dx, dw = kernels.bwd(dy, x, w, rstd, dx=dx, dw=dw)
    return {"out": y, "x": dx, "weight": dw}


def _rms_noncontig(inputs) -> dict:
    x = inputs["x"]
    pad = torch.zeros(x.shape[0], x.shape[1] + 8, dtype=x.dtype, device=x.device)
    pad[:, 4:4 + x.shape[1]] = x
    return dict(inputs, x=pad[:, 4:4 + x.shape[1]])  # row stride N + 8, first element 8 bytes off: not aligned


RMS_NORM = OpSpec(
    name="rms_norm", tensor_args=("x", "weight"), make_inputs=_rms_inputs, reference=_rms_reference,
    floor_bytes=_rms_floor,
    shape_of=lambda x, weight, eps: (x.numel() // max(x.shape[-1], 1), x.shape[-1]),
    dtype_of=lambda x, weight, eps: f"{str(x.dtype)[6:]}/{str(weight.dtype)[6:]}",
    poison_call=_rms_poison, noncontiguous=_rms_noncontig, layout="rows contiguous",
)


# ----------------------------------------------------------------------------------------------- swiglu
def _swiglu_inputs(shape, dtype, device, gen) -> dict:
    g = 3.0 * torch.randn(*shape, generator=gen)  # into both tails of the sigmoid
    u = torch.randn(*shape, generator=gen)
    return {"gate": g.to(device=device, dtype=dtype), "up": u.to(device=device, dtype=dtype)}


def _swiglu_reference(gate, up):
    g = gate.float()
    return torch.nn.functional.silu(g) * up.float()


def _swiglu_floor(shape, dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    # fwd reads g, u, writes y; bwd reads dy, g, u, writes dg, du
    return 8 * n * torch.tensor([], dtype=dtype).element_size()


def _swiglu_poison(kernels, inputs, dy) -> dict:
    g, u = inputs["gate"], inputs["up"]
    y = kernels.fwd(g, u, out=_fill_like(g))
    dg, du = kernels.bwd(dy, g, u, dgate=_fill_like(g), dup=_fill_like(u))
    return {"out": y, "gate": dg, "up": du}


def _swiglu_noncontig(inputs) -> dict:
    g, u = inputs["gate"], inputs["up"]
    fused = torch.cat([g, u], dim=-1)  # the (tokens, 2 * I) output of a fused gate_up projection, viewed in halves
    n = g.shape[-1]
    return {"gate": fused[..., :n], "up": fused[..., n:]}


SWIGLU = OpSpec(
    name="swiglu", tensor_args=("gate", "up"), make_inputs=_swiglu_inputs, reference=_swiglu_reference,
    floor_bytes=_swiglu_floor,
    shape_of=lambda gate, up, *_: (gate.numel() // max(gate.shape[-1], 1), gate.shape[-1]),
    dtype_of=lambda gate, up, *_: str(gate.dtype)[6:],
    poison_call=_swiglu_poison, noncontiguous=_swiglu_noncontig, layout="contiguous",
)

from novatune.tune.opspecs_model import ATTENTION, LINEAR_CE  # noqa: E402 - needs OpSpec defined above
from novatune.tune.opspecs_rope import QK_NORM_ROPE, ROPE  # noqa: E402 - needs OpSpec defined above

OPS: dict[str, OpSpec] = {s.name: s for s in (RMS_NORM, SWIGLU, LINEAR_CE, ATTENTION, ROPE, QK_NORM_ROPE)}

# Ops the profiler can see but the registry has no candidates for yet, with why (listed in the report). Empty
# now that rope and qk_norm_rope have candidates; kept so the report can name future gaps.
NOT_IN_REGISTRY: dict[str, str] = {}


def signature(op: str, shape, dtype: str, device_type: str) -> tuple:
    """The dispatch key of a call: (op, shape, dtype string, device type) - the same fields the cache stores."""
    return (op, tuple(shape), dtype, device_type)


def call_signature(spec: OpSpec, args: tuple) -> tuple:
    return signature(spec.name, spec.shape_of(*args), spec.dtype_of(*args), args[0].device.type)


def shape_str(shape) -> str:
    return "x".join(str(s) for s in shape)
