"""The contract of an op, declared once in its ops/<op>.py as `SPEC` and collected in novatune.ops.registry.

A SPEC tells everything a consumer (tests, benchmarks, `novatune tune`, the implementation checker) needs:

    name, tensor_args     the op's name and its differentiable tensor inputs, in call order
    reference, stock      the fp32 oracle and the Hugging Face stock formula (both from novatune.reference)
    make_inputs           (shape, dtype, device, generator, **flags) -> {arg: value} in call order, values built so
                          that planted bugs show (weights far from 1, rows of very different magnitude, ...)
    call_cases            (dtype, device, generator) -> [(label, inputs)]: the calls models really make (ranks,
                          eps values, flags, strides) plus adversarial ones (odd shapes, > 65,535 rows, |x| ~ 1e4)
    floor_bytes           (shape, dtype) -> bytes one fwd+bwd must move (the HBM floor)
    candidates            (shape, dtype, device) -> [Candidate]: stock, default, the launch-variant grid, CUDA C++
    make_function         (fwd, bwd) -> the differentiable functional (the op's own path and every kernel candidate)
    signature             the functional's call signature, in words (what a user's implementation must accept)

Adding an op = a kernel file, an op file with its SPEC (and an entry in the registry), tests; the tuner iterates
the registry and names no op.
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
    """One implementation of an op: a differentiable functional with the op's signature. Kernel candidates also
    carry their raw fwd/bwd launchers (`kernels`) so the validator can hand them NaN-poisoned output buffers;
    `unavailable` says why one cannot run here (no GPU, no nvcc): recorded as skipped, never timed."""

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
            if self.make is None:
                raise ValueError(f"candidate {self.op}/{self.name} has no `make`: nothing builds its functional")
            self._fn = self.make()
        return self._fn

    def describe(self) -> str:
        extra = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.name} ({self.family}{': ' + extra if extra else ''})"


@dataclass(frozen=True)
class OpSpec:
    name: str
    tensor_args: tuple[str, ...]
    make_inputs: Callable
    reference: Callable
    stock: Callable
    floor_bytes: Callable
    shape_of: Callable                  # call args -> the shape key the dispatch table and the cache store
    dtype_of: Callable                  # call args -> the dtype(s) string they store
    candidates: Callable                # (shape, dtype, device type) -> list[Candidate]
    signature: str                      # the functional's signature, for users writing their own implementation
    make_function: Callable | None = None
    call_cases: Callable | None = None
    poison_call: Callable | None = None   # (kernels, inputs, dy) -> {name: tensor written into poisoned buffers}
    noncontiguous: Callable | None = None  # inputs -> same values, strided layouts (as the model produces them)
    layout: str = "contiguous"
    dy_shape: Callable | None = None    # shape -> the incoming gradient's shape(s) (None: the shape itself)
    odd_shapes: Callable | None = None  # (shape, device type) -> shapes to validate, the real one first
    nan_rule: Callable | None = None    # (inputs, ref_nan, got_nan) -> reason or None (None: exact NaN pattern)
    nan_arg: str | None = None          # the input the NaN check poisons (None: the first tensor argument)
    memory_rule: bool = False           # never pick a candidate whose peak memory exceeds the default's
    outputs: tuple[str, ...] = ("out",)
    tolerance_scale: float = 1.0        # widens the checker's dtype floors (attention: blockwise softmax in bf16)
    keyword_args: tuple[str, ...] = ()  # flags the public functional takes by keyword only (swiglu's inplace_backward)
    # model-level ops (applied as a setting on the patched model, not per call): the module attribute patch
    # reads, the candidate parameter that holds its value, and (config, tokens, docs) -> the shape key
    setting: tuple[str, str] | None = None
    model_shape: Callable | None = None
    trace_kind: str = ""                # the profiler's kernel kind this op's time shows under (tune/profile.py)
    once_per_step: bool = False         # called once per forward (the loss), not once per layer

    @property
    def applied_by(self) -> str:
        return "patch" if self.setting is not None else "dispatch"

    def call(self, fn: Callable, inputs: dict):
        """fn on `inputs` (a dict in call order), the keyword-only flags by keyword: the one way every consumer
        (dispatch, tune, the checker) calls an implementation, so one written to the public signature works."""
        pos = [v for k, v in inputs.items() if k not in self.keyword_args]
        return fn(*pos, **{k: v for k, v in inputs.items() if k in self.keyword_args})

    def call_args(self, fn: Callable, args: tuple):
        """`call` for arguments in call order as the public functional passes them on: the keyword-only flags
        last (make_inputs orders its dict the same way)."""
        n_pos = len(args) - len(self.keyword_args)
        named = {f"arg{i}": a for i, a in enumerate(args[:n_pos])}
        named.update(zip(self.keyword_args, args[n_pos:]))
        return self.call(fn, named)

    def grad_shape(self, shape) -> tuple:
        return tuple(self.dy_shape(shape)) if self.dy_shape is not None else tuple(shape)

    def table_key(self, shape, dtype: str, device_type: str) -> tuple:
        """(op, shape key, dtype string, device type): the dispatch table's and the tune cache's key."""
        return (self.name, tuple(shape), dtype, device_type)

    def call_signature(self, args: tuple) -> tuple:
        """The table key of a call (args in call order)."""
        return self.table_key(self.shape_of(*args), self.dtype_of(*args), args[0].device.type)


# ----------------------------------------------------------------------------------------------- helpers
def fill_nan_like(t: Tensor) -> Tensor:
    return torch.full_like(t, float("nan"), memory_format=torch.contiguous_format)


def element_size(dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def row_scales(n: int, gen, lo: float = -3, hi: float = 1) -> Tensor:
    """n shuffled scales from 10**lo to 10**hi: rows whose mean(x^2) reaches eps (a wrong eps shows)."""
    return torch.logspace(lo, hi, n, dtype=torch.float32)[torch.randperm(n, generator=gen)]


def compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=False)


def triton_reason(device: str) -> str | None:
    from novatune.ops._backend import interpreter_on

    if device == "cuda" or interpreter_on():
        return None
    return "Triton kernels need a CUDA GPU (or TRITON_INTERPRET=1)"


@functools.cache
def _cuda_ext_reason() -> str | None:
    from novatune.kernels import cuda as nt_cuda

    return nt_cuda.unavailable_reason()


def cuda_reason(device: str) -> str | None:
    return "CUDA kernels need a CUDA device" if device != "cuda" else _cuda_ext_reason()


def cuda_ext():
    from novatune.kernels import cuda as nt_cuda

    return nt_cuda.load()


def launchers(fwd: Callable, bwd: Callable, fwd_cfg: dict, bwd_cfg: dict) -> SimpleNamespace:
    """A kernel pair with fixed launch configs: .fwd / .bwd take the launchers' own arguments (outputs included)."""
    return SimpleNamespace(fwd=lambda *a, **kw: fwd(*a, **kw, **fwd_cfg), bwd=lambda *a, **kw: bwd(*a, **kw, **bwd_cfg))


def kernel_candidate(op: str, name: str, family: str, params: dict, kernels_fn: Callable,
                     make_function: Callable, unavailable: str | None = None) -> Candidate:
    """A candidate built from a kernel pair: its functional is make_function(fwd, bwd), the op's own wrapper."""
    def make():
        k = kernels_fn()
        return make_function(k.fwd, k.bwd)

    return Candidate(op, name, family, params, make=make, kernels=kernels_fn, unavailable=unavailable)


def variant_grid(op: str, family: str, variants: list, kernels_for: Callable, make_function: Callable,
                 unavailable: str | None) -> list[Candidate]:
    """Candidates `<family>_v<i>` for each launch variant; kernels_for(variant) -> the kernel pair."""
    return [kernel_candidate(op, f"{family}_v{i}", family, v if isinstance(v, dict) else {"fwd": v[0], "bwd": v[1]},
                             functools.partial(kernels_for, v), make_function, unavailable)
            for i, v in enumerate(variants)]


def doc_lengths(tokens: int, docs: int) -> list[int]:
    """`docs` documents of uneven lengths (growing ~linearly) summing to `tokens`; equal split if that fails."""
    docs = max(1, min(docs, tokens))
    tri = docs * (docs + 1) // 2
    cu = [round(tokens * (k * (k + 1) // 2) / tri) for k in range(docs + 1)]
    lens = [b - a for a, b in zip(cu, cu[1:])]
    if min(lens) < 1:
        lens = [tokens // docs + (1 if i < tokens % docs else 0) for i in range(docs)]
    return lens


def rope_tables(batch: int, tokens: int, d: int, dtype, device, theta: float = 1e6) -> tuple[Tensor, Tensor]:
    """HF rotary tables (batch, T, d) for packed rows: positions restart per document (at least 3 documents when
    there are 3 tokens, else one per ~1024 tokens), inv_freq with rope_theta `theta` (Qwen3: 1e6)."""
    docs = min(tokens, max(3, tokens // 1024))
    pos = torch.cat([torch.arange(n, dtype=torch.float32) for n in doc_lengths(tokens, docs)])
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[None].expand(batch, tokens, d)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def odd_token_shapes(shape, device_type: str) -> list:
    """For shape keys (tokens, ...): the real shape, 37 tokens and 1 token; 4097 too on a GPU when the real count
    is larger (a tail block in every tiling)."""
    t, rest = shape[0], tuple(shape[1:])
    extra = [(37, *rest), (1, *rest)] + ([(4097, *rest)] if device_type == "cuda" and t > 4097 else [])
    out = [tuple(shape)]
    for s in extra:
        if s not in out:
            out.append(s)
    return out
