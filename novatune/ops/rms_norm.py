"""RMSNorm as registered ops, with a functional and a drop-in module for HF's Llama/Qwen3RMSNorm.

    y = weight * (x.float() * rsqrt(mean(x.float()^2, -1) + eps)).to(x.dtype)     # dtype promote(x, weight)

Math, rounding and gradient conventions: novatune/kernels/rms_norm.py (dx is straight-through the rounding of the
normalised value to x's dtype, exactly as PyTorch autograd treats HF's `.to(input_dtype)`; dw uses the rounded value).

Registered ops (visible to torch.compile, FSDP2, opcheck):
    torch.ops.novatune.rms_norm_fwd(x, weight, eps) -> (y, rstd)        rstd: x.shape[:-1], fp32
    torch.ops.novatune.rms_norm_bwd(dy, x, weight, rstd) -> (dx, dw)    dx: x's dtype, dw: weight's dtype
with fake impls and autograd registered on the forward. Once differentiable on every path (the backward reads rstd
saved from the forward): a second-order gradient raises instead of missing rstd's dependence on x.

Eager calls take a lighter path: a torch.autograd.Function around the same two implementations (identical numbers,
tested), because a custom op with registered autograd costs 2-4x the host time of a Function per fwd+bwd (measured
on the CPU, torch 2.13: ~130 vs ~35-60 µs), which shows in wall time on small norms (Qwen3-4B runs 145 RMSNorms per
forward: 72 of them q/k-norms). Under torch.compile (torch.compiler.is_compiling()) the registered op is used.

Device rule (novatune.ops._backend.use_triton): CUDA -> Triton kernels; CPU -> the fp32 reference, which runs the
same op sequence as HF's module and so gives HF's numbers bit for bit; CPU under TRITON_INTERPRET=1 -> the kernels.
"""
from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from novatune.kernels import rms_norm as _k
from novatune.ops import dispatch, recipes
from novatune.ops._backend import use_triton
from novatune.ops.contract import (
    Candidate,
    OpSpec,
    compiled,
    cuda_ext,
    cuda_reason,
    element_size,
    fill_nan_like,
    launchers,
    row_scales,
    triton_reason,
    variant_grid,
)
from novatune.reference import rms_norm as _ref

__all__ = ["rms_norm", "NovaRMSNorm", "rms_norm_fwd", "rms_norm_bwd"]


def _fwd_impl(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    if use_triton(x) and x.shape[-1] <= _k.MAX_FUSED_N:
        return _k.rms_norm_fwd(x, weight, eps)
    y, rstd = _ref.rms_norm_ref(x, weight, eps, return_rstd=True)
    # contiguous: the fake impl promises contiguous outputs whatever x's layout
    return y.contiguous(), rstd.contiguous()


def _bwd_impl(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    if use_triton(x) and x.shape[-1] <= _k.MAX_FUSED_N:
        return _k.rms_norm_bwd(dy, x, weight, rstd)
    dx, dw = _ref.rms_norm_bwd_ref(dy, x, weight, rstd)
    return dx.contiguous(), dw.contiguous()


# ----------------------------------------------------------------------------------------------- registered ops
@torch.library.custom_op("novatune::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(y, rstd): y has x's shape and dtype promote(x, weight); rstd is fp32 with shape x.shape[:-1]."""
    _k.check_inputs(x, weight)
    return _fwd_impl(x, weight, eps)


@rms_norm_fwd.register_fake
def _rms_norm_fwd_fake(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    y = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    return y, x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("novatune::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """(dx, dw): dx has x's shape and dtype, dw weight's (accumulated in fp32)."""
    return _bwd_impl(dy, x, weight, rstd)


@rms_norm_bwd.register_fake
def _rms_norm_bwd_fake(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    x, weight, _eps = inputs
    _y, rstd = output
    ctx.save_for_backward(x, weight, rstd)


def _backward(ctx, dy: Tensor, _drstd: Tensor | None):
    # rstd is an auxiliary output for the backward; a gradient flowing into it is not supported (ignored)
    x, weight, rstd = ctx.saved_tensors
    dx, dw = torch.ops.novatune.rms_norm_bwd(dy, x, weight, rstd)
    return dx, dw, None


rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------- autograd glue
def make_function(fwd, bwd):
    """Functional rms_norm(x, weight, eps) from fwd(x, w, eps) -> (y, rstd) and bwd(dy, x, w, rstd) -> (dx, dw):
    the op's own eager path and every kernel candidate of `novatune tune`. A torch.autograd.Function, lighter
    than the registered op's dispatch (see the module docstring); save_for_backward, so gradient checkpointing
    still frees and recomputes activations."""

    class _Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
            y, rstd = fwd(x, weight, eps)
            ctx.save_for_backward(x, weight, rstd)
            if recipes.active():  # a kept layer: consumers that save y may keep this recipe instead (ops/recipes.py)
                xd, wd = x.detach(), weight.detach()
                recipes.offer((y,), lambda: (fwd(xd, wd, eps)[0],), (xd, wd))
            return y

        @staticmethod
        @once_differentiable  # rstd is a saved forward output: a second-order gradient would miss its dependence
        def backward(ctx, dy: Tensor):
            x, weight, rstd = ctx.saved_tensors
            dx, dw = bwd(dy, x, weight, rstd)
            return (dx if ctx.needs_input_grad[0] else None), (dw if ctx.needs_input_grad[1] else None), None

    def rms_norm_fn(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return _Fn.apply(x, weight, eps)

    return rms_norm_fn


# the untuned eager path: the same implementations as the registered ops, without the custom-op dispatch
_eager = make_function(_fwd_impl, _bwd_impl)


# ----------------------------------------------------------------------------------------------- public API
def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """HF-exact RMSNorm over the last dim of x (any leading dims); differentiable in x and weight.

    Output dtype is torch.promote_types(x.dtype, weight.dtype) (e.g. fp32 weight with bf16 x gives fp32).
    x and weight floating point, weight (x.shape[-1],) on x's device (TypeError / ValueError otherwise, on every
    path: the fp32 reference would broadcast a (1,) weight where the kernel refuses it).
    """
    _k.check_inputs(x, weight)
    if torch.compiler.is_compiling():
        return torch.ops.novatune.rms_norm_fwd(x, weight, eps)[0]
    # an implementation `novatune tune` selected for this shape
    # (dispatch.ACTIVE is None: nothing tuned, one global read)
    if (hook := dispatch.ACTIVE) is not None and (out := hook("rms_norm", x, weight, eps)) is not None:
        return out
    return _eager(x, weight, eps)


class NovaRMSNorm(nn.Module):
    """Drop-in for transformers' LlamaRMSNorm / Qwen3RMSNorm: same parameter name (`weight`), same
    `variance_epsilon` attribute, same state_dict, same forward values."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps

    @classmethod
    def from_module(cls, module: nn.Module) -> NovaRMSNorm:
        """A NovaRMSNorm sharing an HF-style norm's `weight` (the same Parameter object, so optimisers and FSDP
        still see it) and its `variance_epsilon` (or a float `eps`)."""
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        weight = getattr(module, "weight", None)
        if not isinstance(eps, float) or not isinstance(weight, nn.Parameter) or weight.dim() != 1:
            raise ValueError(f"{type(module).__name__} is not an HF-style RMSNorm (1-D weight, float epsilon)")
        new = cls(weight.shape[0], eps, device="meta")
        new.weight = weight
        return new

    def forward(self, hidden_states: Tensor) -> Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


# ----------------------------------------------------------------------------------------------- the contract
def _make_inputs(shape, dtype, device, gen, eps: float = 1e-6, magnitude: float = 1.0) -> dict:
    """x of `shape` (any rank; rows = all leading dims) with per-row scales 1e-3..10 times `magnitude` (mean(x^2)
    down to ~eps: a wrong eps shows), weight (shape[-1],) far from 1 (a skipped weight shows)."""
    n = shape[-1]
    rows = 1
    for s in shape[:-1]:
        rows *= s
    x = torch.randn(rows, n, generator=gen) * row_scales(rows, gen)[:, None] * magnitude
    w = 1.0 + 0.5 * torch.randn(n, generator=gen)
    return {"x": x.reshape(shape).to(device=device, dtype=dtype), "weight": w.to(device=device, dtype=dtype),
            "eps": eps}


def _call_cases(dtype, device, gen) -> list:
    """The calls models make: (b, s, h) hidden states (Qwen3 eps 1e-6, Llama 1e-5), (b, s, heads, d) q/k norms,
    plus odd shapes, a single row, rows past 65,535 (grid limits) and |x| ~ 1e4."""
    mk = functools.partial(_make_inputs, dtype=dtype, device=device, gen=gen)
    cases = [("hidden (b, s, h) eps 1e-6", mk((2, 37, 96))), ("hidden (b, s, h) eps 1e-5", mk((3, 11, 80), eps=1e-5)),
             ("q/k heads (b, s, h, d)", mk((2, 9, 4, 32))), ("single row", mk((1, 1, 40))),
             ("|x| ~ 1e4", mk((2, 19, 64), magnitude=1e4)), ("rows > 65,535", mk((1, 65_541, 8), eps=1e-5))]
    strided = mk((2, 21, 48))
    cases.append(("rows not contiguous (row stride h + 8)", _noncontig(strided)))
    return cases


def _floor(shape, dtype) -> int:
    rows = 1
    for s in shape[:-1]:
        rows *= s
    # fwd reads x, writes y; bwd reads dy and x, writes dx (weight, rstd and dw partials are negligible)
    return 5 * rows * shape[-1] * element_size(dtype)


def _poison(kernels, inputs, dy) -> dict:
    x, w, eps = inputs["x"], inputs["weight"], inputs["eps"]
    y = fill_nan_like(x.to(torch.promote_types(x.dtype, w.dtype)))
    rstd = torch.full(x.shape[:-1], float("nan"), dtype=torch.float32, device=x.device)
    y, rstd = kernels.fwd(x, w, eps, out=y, rstd=rstd)
    dx, dw = kernels.bwd(dy, x, w, rstd, dx=fill_nan_like(x), dw=fill_nan_like(w))
    return {"out": y, "x": dx, "weight": dw}


def _noncontig(inputs) -> dict:
    x = inputs["x"]
    pad = torch.zeros(*x.shape[:-1], x.shape[-1] + 8, dtype=x.dtype, device=x.device)
    pad[..., 4:4 + x.shape[-1]] = x
    return dict(inputs, x=pad[..., 4:4 + x.shape[-1]])  # row stride N + 8, first element 8 bytes off: misaligned


def _triton_pair(variant):
    f, b = variant
    return launchers(_k.rms_norm_fwd, _k.rms_norm_bwd, f, b)


def _cuda_pair(variant):
    f, b = variant
    ext = cuda_ext()
    return SimpleNamespace(fwd=lambda x, w, eps, out=None, rstd=None: tuple(ext.rms_norm_fwd(x, w, float(eps), out,
                                                                                             rstd, **f)),
                           bwd=lambda dy, x, w, rstd, dx=None, dw=None: tuple(ext.rms_norm_bwd(dy, x, w, rstd, dx, dw,
                                                                                               **b)))


def _torch_rms_norm(x, weight, eps):
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)


def _candidates(shape, dtype, device: str) -> list:
    n = shape[-1]
    out = [Candidate("rms_norm", "hf_eager", "eager", make=lambda: _ref.hf_rms_norm),
           Candidate("rms_norm", "torch_native", "native",
                     make=lambda: _torch_rms_norm),
           Candidate("rms_norm", "novatune_default", "default", make=lambda: _eager),
           Candidate("rms_norm", "torch_compile", "compile", make=lambda: compiled(_ref.hf_rms_norm),
                     deterministic=False)]
    # Triton launch variants around the defaults (novatune.kernels.rms_norm.*_config): more rows per program,
    # other warp counts, register prefetch (stages 0) vs Triton's cp.async pipeliner (stages 3-5).
    if n >= 1024:
        tvars = [({}, dict(block_m=2, num_warps=8, stages=3)), ({}, dict(block_m=1, num_warps=4, stages=3)),
                 ({}, dict(block_m=2, num_warps=16, stages=0)), ({}, dict(block_m=1, num_warps=16, stages=3)),
                 (dict(block_m=2, num_warps=8), dict(block_m=2, num_warps=8, stages=3)),
                 ({}, dict(stages=3)), ({}, dict(stages=5))]
    else:
        tvars = [({}, dict(block_m=32, num_warps=8, stages=0)), ({}, dict(block_m=64, num_warps=8, stages=0)),
                 ({}, dict(block_m=32, num_warps=4, stages=0)), (dict(block_m=64, num_warps=8), {})]
    out += variant_grid("rms_norm", "triton", tvars, _triton_pair, make_function, triton_reason(device))
    # CUDA C++ variants. blocks_per_sm 0 = as many blocks as the occupancy calculator fits (a persistent grid);
    # unroll = rows in flight per thread group; items = 16-byte vectors per thread.
    if n * element_size(dtype) >= 1024:
        cvars = [(dict(items=1, unroll=1), dict(items=1, unroll=1, blocks_per_sm=0)),
                 (dict(items=1, unroll=2), dict(items=1, unroll=2, blocks_per_sm=0)),
                 (dict(items=1, unroll=2), dict(items=1, unroll=4, blocks_per_sm=0)),
                 (dict(items=2, unroll=2), dict(items=2, unroll=2, blocks_per_sm=0)),
                 (dict(items=1, unroll=4), dict(items=1, unroll=2, blocks_per_sm=2))]
    else:
        cvars = [(dict(unroll=2, block_threads=256), dict(unroll=2, block_threads=256, blocks_per_sm=0)),
                 (dict(unroll=4, block_threads=256), dict(unroll=4, block_threads=256, blocks_per_sm=0)),
                 (dict(unroll=2, block_threads=128), dict(unroll=1, block_threads=128, blocks_per_sm=0)),
                 (dict(unroll=4, block_threads=512), dict(unroll=2, block_threads=512, blocks_per_sm=4))]
    out += variant_grid("rms_norm", "cuda", cvars, _cuda_pair, make_function, cuda_reason(device))
    return out


SPEC = OpSpec(
    trace_kind="norm",
    name="rms_norm", tensor_args=("x", "weight"), make_inputs=_make_inputs, reference=_ref.rms_norm_fp32,
    stock=_ref.hf_rms_norm, floor_bytes=_floor, candidates=_candidates, make_function=make_function,
    call_cases=_call_cases, poison_call=_poison, noncontiguous=_noncontig, layout="rows contiguous",
    shape_of=lambda x, weight, eps: (x.numel() // max(x.shape[-1], 1), x.shape[-1]),
    dtype_of=lambda x, weight, eps: f"{str(x.dtype)[6:]}/{str(weight.dtype)[6:]}",
    signature="rms_norm(x (..., h), weight (h,), eps: float) -> y (x's shape, dtype promote(x, weight)); "
              "differentiable in x and weight",
)
