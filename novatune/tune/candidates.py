"""The candidate registry: every implementation the engine may pick for an op at a shape.

Families, from simplest to most involved (`complexity`: the lower wins when timings are within noise):
    0 eager     the stock Hugging Face formula in eager PyTorch (the baseline; its error sets the bound)
    1 native    torch's own fused op (torch.nn.functional.rms_norm)
    2 default   novatune's current kernels with their default launch configs (what ops run untuned)
    3 triton    the same Triton kernels with other launch configs (rows per program, num_warps, pipelining)
    4 compile   torch.compile of the stock formula (static shapes; compile time counts against the tune budget)
    5 cuda      CUDA C++ kernels through PyBind11 (novatune/kernels/cuda): 16-byte vector I/O, fp32 warp/block
                reductions, a two-stage fp32 dweight reduction; built on first use and cached on disk

A candidate is a differentiable functional with the public op's signature; kernel candidates also carry their
raw fwd/bwd launchers (`kernels`) so the validator can hand them NaN-poisoned output buffers. `unavailable` says
why a candidate cannot run here (no GPU, no nvcc, ...): such candidates are recorded as skipped, never timed.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch import Tensor

FAMILY_COMPLEXITY = {"eager": 0, "native": 1, "default": 2, "triton": 3, "compile": 4, "cuda": 5}


@dataclass
class Candidate:
    op: str
    name: str
    family: str
    params: dict = field(default_factory=dict)
    make: Callable[[], Callable] | None = None      # -> functional (may build/compile; may raise)
    kernels: Callable[[], object] | None = None     # -> object with fwd/bwd taking out buffers (kernel families)
    deterministic: bool = True                       # run-twice bitwise identity is promised (and checked)
    unavailable: str | None = None
    selectable: bool = True                          # False: a baseline only (patch cannot apply it)
    _fn: Callable | None = field(default=None, repr=False)

    @property
    def complexity(self) -> int:
        return FAMILY_COMPLEXITY[self.family]

    def functional(self) -> Callable:
        if self._fn is None:
            self._fn = self.make()
        return self._fn

    def describe(self) -> str:
        extra = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.name} ({self.family}{': ' + extra if extra else ''})"


# ----------------------------------------------------------------------------------------------- autograd glue
def _rms_function(fwd: Callable, bwd: Callable) -> Callable:
    """Functional rms_norm(x, weight, eps) from fwd(x, w, eps) -> (y, rstd) and bwd(dy, x, w, rstd) -> (dx, dw).
    save_for_backward (not ctx attributes), so gradient checkpointing still frees and recomputes activations."""

    class _Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, eps):
            y, rstd = fwd(x, weight, eps)
            ctx.save_for_backward(x, weight, rstd)
            return y

        @staticmethod
        def backward(ctx, dy):
            x, weight, rstd = ctx.saved_tensors
            dx, dw = bwd(dy, x, weight, rstd)
            return dx, dw, None

    return lambda x, weight, eps: _Fn.apply(x, weight, eps)


def _swiglu_function(fwd: Callable, bwd: Callable) -> Callable:
    """Functional swiglu(gate, up, inplace_backward=False); with inplace_backward the gradients are written over
    gate/up (the kernels read every element before writing it), as novatune's default MLP path does."""

    class _Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, gate, up, inplace):
            ctx.save_for_backward(gate, up)
            ctx.inplace = inplace and gate.is_contiguous() and up.is_contiguous()
            return fwd(gate, up)

        @staticmethod
        def backward(ctx, dy):
            gate, up = ctx.saved_tensors
            if ctx.inplace:
                dg, du = bwd(dy, gate, up, dgate=gate, dup=up)
                torch.autograd.graph.increment_version(gate)
                torch.autograd.graph.increment_version(up)
            else:
                dg, du = bwd(dy, gate, up)
            return dg, du, None

    return lambda gate, up, inplace_backward=False: _Fn.apply(gate, up, inplace_backward)


# ----------------------------------------------------------------------------------------------- stock formulas
def hf_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' LlamaRMSNorm / Qwen3RMSNorm forward, as a function."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def hf_swiglu(gate: Tensor, up: Tensor, inplace_backward: bool = False) -> Tensor:
    """act_fn(gate_proj(x)) * up_proj(x) of HF's MLP, with the projections done."""
    return torch.nn.functional.silu(gate) * up


def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=False)


# ----------------------------------------------------------------------------------------------- availability
def _triton_reason(device: str) -> str | None:
    from novatune.ops._backend import interpreter_on

    if device == "cuda" or interpreter_on():
        return None
    return "Triton kernels need a CUDA GPU (or TRITON_INTERPRET=1)"


@functools.cache
def _cuda_reason() -> str | None:
    from novatune.kernels import cuda as nt_cuda

    return nt_cuda.unavailable_reason()


def _cuda_ext():
    from novatune.kernels import cuda as nt_cuda

    return nt_cuda.load()


# ----------------------------------------------------------------------------------------------- rms_norm
def _rms_default() -> Callable:
    from novatune.ops.rms_norm import (
        _RMSNormFunction,  # the untuned path itself, bypassing the dispatch hook
    )

    return lambda x, weight, eps: _RMSNormFunction.apply(x, weight, eps)


def _rms_triton_kernels(fwd_cfg: dict, bwd_cfg: dict):
    from novatune.kernels import rms_norm as K

    def fwd(x, w, eps, out=None, rstd=None):
        return K.rms_norm_fwd(x, w, eps, out=out, rstd=rstd, **fwd_cfg)

    def bwd(dy, x, w, rstd, dx=None, dw=None):
        return K.rms_norm_bwd(dy, x, w, rstd, dx=dx, dw=dw, **bwd_cfg)

    return SimpleNamespace(fwd=fwd, bwd=bwd)


def _rms_cuda_kernels(fwd_cfg: dict, bwd_cfg: dict):
    ext = _cuda_ext()

    def fwd(x, w, eps, out=None, rstd=None):
        y, r = ext.rms_norm_fwd(x, w, float(eps), out, rstd, **fwd_cfg)
        return y, r

    def bwd(dy, x, w, rstd, dx=None, dw=None):
        gx, gw = ext.rms_norm_bwd(dy, x, w, rstd, dx, dw, **bwd_cfg)
        return gx, gw

    return SimpleNamespace(fwd=fwd, bwd=bwd)


def _kernel_candidate(op, name, family, params, kernels_fn, to_functional, unavailable=None) -> Candidate:
    def make():
        k = kernels_fn()
        return to_functional(k.fwd, k.bwd)

    return Candidate(op, name, family, params, make=make, kernels=kernels_fn, unavailable=unavailable)


def rms_norm_candidates(shape, dtype: torch.dtype, device: str, families=None) -> list[Candidate]:
    _rows, n = shape
    tr = _triton_reason(device)
    out = [
        Candidate("rms_norm", "hf_eager", "eager", make=lambda: hf_rms_norm),
        Candidate("rms_norm", "torch_native", "native", make=lambda: (
            lambda x, weight, eps: torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)),
            unavailable=None if hasattr(torch.nn.functional, "rms_norm") else "torch has no F.rms_norm"),
        Candidate("rms_norm", "novatune_default", "default", make=_rms_default),  # whatever ops run untuned
        Candidate("rms_norm", "torch_compile", "compile", make=lambda: _compiled(hf_rms_norm), deterministic=False),
    ]
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
    for i, (f, b) in enumerate(tvars):
        out.append(_kernel_candidate("rms_norm", f"triton_v{i}", "triton", {"fwd": f, "bwd": b},
                                     functools.partial(_rms_triton_kernels, f, b), _rms_function, tr))
    # CUDA variants. blocks_per_sm 0 = as many blocks as the occupancy calculator fits (a persistent grid);
    # unroll = rows in flight per thread group (bytes outstanding per SM); items = 16-byte vectors per thread.
    if n * torch.tensor([], dtype=dtype).element_size() >= 1024:
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
    cr = "CUDA kernels need a CUDA device" if device != "cuda" else _cuda_reason()
    for i, (f, b) in enumerate(cvars):
        out.append(_kernel_candidate("rms_norm", f"cuda_v{i}", "cuda", {"fwd": f, "bwd": b},
                                     functools.partial(_rms_cuda_kernels, f, b), _rms_function, cr))
    return [c for c in out if families is None or c.family in families]


# ----------------------------------------------------------------------------------------------- swiglu
def _swiglu_default() -> Callable:
    from novatune.ops.swiglu import (
        _SwiGLUFunction,  # the untuned path itself, bypassing the dispatch hook
    )

    return lambda gate, up, inplace_backward=False: _SwiGLUFunction.apply(gate, up, inplace_backward)


def _swiglu_triton_kernels(cfg: dict):
    from novatune.kernels import swiglu as K

    def fwd(g, u, out=None):
        return K.swiglu_fwd(g, u, out, **cfg)

    def bwd(dy, g, u, dgate=None, dup=None):
        return K.swiglu_bwd(dy, g, u, dgate, dup, **cfg)

    return SimpleNamespace(fwd=fwd, bwd=bwd)


def _swiglu_cuda_kernels(cfg: dict):
    ext = _cuda_ext()

    def fwd(g, u, out=None):
        return ext.swiglu_fwd(g, u, out, **cfg)

    def bwd(dy, g, u, dgate=None, dup=None):
        dg, du = ext.swiglu_bwd(dy, g, u, dgate, dup, **cfg)
        return dg, du

    return SimpleNamespace(fwd=fwd, bwd=bwd)


def swiglu_candidates(shape, dtype: torch.dtype, device: str, families=None) -> list[Candidate]:
    tr = _triton_reason(device)
    out = [
        Candidate("swiglu", "hf_eager", "eager", make=lambda: hf_swiglu),
        Candidate("swiglu", "novatune_default", "default", make=_swiglu_default),  # whatever ops run untuned
        Candidate("swiglu", "torch_compile", "compile", make=lambda: _compiled(hf_swiglu), deterministic=False),
    ]
    # (BLOCK elements per program, num_warps) around novatune.kernels.swiglu.default_config's (4096, 8)
    for i, cfg in enumerate([dict(block=2048, num_warps=4), dict(block=8192, num_warps=8),
                             dict(block=4096, num_warps=4), dict(block=8192, num_warps=16)]):
        out.append(_kernel_candidate("swiglu", f"triton_v{i}", "triton", cfg,
                                     functools.partial(_swiglu_triton_kernels, cfg), _swiglu_function, tr))
    cr = "CUDA kernels need a CUDA device" if device != "cuda" else _cuda_reason()
    for i, cfg in enumerate([dict(threads=256, vecs=2), dict(threads=256, vecs=4), dict(threads=512, vecs=2),
                             dict(threads=128, vecs=4)]):
        out.append(_kernel_candidate("swiglu", f"cuda_v{i}", "cuda", cfg,
                                     functools.partial(_swiglu_cuda_kernels, cfg), _swiglu_function, cr))
    return [c for c in out if families is None or c.family in families]


from novatune.tune.candidates_model import (  # noqa: E402 - needs Candidate defined above
    attention_candidates,
    linear_ce_candidates,
)
from novatune.tune.candidates_rope import (  # noqa: E402 - needs Candidate defined above
    qk_norm_rope_candidates,
    rope_candidates,
)

REGISTRY: dict[str, Callable] = {"rms_norm": rms_norm_candidates, "swiglu": swiglu_candidates,
                                 "linear_cross_entropy": linear_ce_candidates, "attention": attention_candidates,
                                 "rope": rope_candidates, "qk_norm_rope": qk_norm_rope_candidates}


def candidates(op: str, shape, dtype: torch.dtype, device: str, families=None) -> list[Candidate]:
    """All candidates for `op` at `shape`/`dtype` on `device` ("cuda" or "cpu"), optionally only some families."""
    if op not in REGISTRY:
        raise KeyError(f"no candidate registry for op {op!r} (registered: {', '.join(REGISTRY)})")
    return REGISTRY[op](tuple(shape), dtype, device, families)
