"""SwiGLU as registered torch.library ops, plus the functional and the fused-MLP helpers.

    y = silu(gate) * up                      (novatune.ops.swiglu)
    mlp(x) = down_proj(swiglu(gate_proj(x), up_proj(x)))   (novatune.ops.swiglu_mlp, NovaSwiGLUMLP)

Ops (both `mutates_args=()`, with fake impls so torch.compile / FSDP2 trace them without running them):
  novatune::swiglu_fwd(gate, up) -> y
  novatune::swiglu_bwd(dy, gate, up) -> (dgate, dup)
Autograd is registered on swiglu_fwd; it saves gate and up (the backward recomputes sigmoid(gate)), so an MLP
keeps three activations (gate, up, and down_proj's input y) where HF eager keeps four (it also keeps silu(gate)).

Device rule (novatune.ops._backend): CUDA -> the Triton kernels in novatune.kernels.swiglu; CPU -> the fp32
reference cast back to the input dtype (or the Triton kernels under TRITON_INTERPRET=1). Outputs are always
contiguous tensors of the input's shape.

Two paths to the same implementation (_fwd_impl / _bwd_impl), as in novatune.ops.rms_norm: eager calls go through
a plain torch.autograd.Function that calls the launchers directly (the registered op's Python dispatch costs tens
of µs of host time per fwd+bwd: H200 wall 189 µs vs 156 µs for the raw launchers at 4096 x 9728); under
torch.compile (torch.compiler.is_compiling()) the registered op is used, which tracing needs. Identical numbers
(tested).

The MLP helpers *call* the three projection modules rather than reading their weights, so they work unchanged
for nn.Linear, PEFT LoRA-wrapped linears, quantised linears, or anything else callable.
"""
from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
from torch import Tensor, nn

from novatune.kernels import swiglu as K
from novatune.ops import dispatch
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
    triton_reason,
    variant_grid,
)
from novatune.ops.linear import output_hooked, project
from novatune.reference import swiglu as _ref


def require_float(op: str, *tensors: Tensor) -> None:
    """TypeError for integer inputs: silu of an integer tensor would be computed and truncated (or raise deep in a
    kernel), never what a model means."""
    if not all(t.is_floating_point() for t in tensors):
        raise TypeError(f"{op}: inputs must be floating point, got {[str(t.dtype) for t in tensors]}")


def _fwd_impl(gate: Tensor, up: Tensor, on_triton: bool) -> Tensor:
    if on_triton:
        return K.swiglu_fwd(gate, up)
    # .contiguous(): same layout as the kernel's output (and as the fake impl says) whatever the input strides.
    return _ref.swiglu_ref(gate, up).to(gate.dtype).contiguous()


def _bwd_impl(dy: Tensor, gate: Tensor, up: Tensor, on_triton: bool) -> tuple[Tensor, Tensor]:
    if on_triton:
        return K.swiglu_bwd(dy, gate, up)
    dgate, dup = _ref.swiglu_bwd_ref(dy, gate, up)
    return dgate.to(gate.dtype).contiguous(), dup.to(up.dtype).contiguous()


# ----------------------------------------------------------------------------------------------- registered ops
@torch.library.custom_op("novatune::swiglu_fwd", mutates_args=())
def swiglu_fwd(gate: Tensor, up: Tensor) -> Tensor:
    return _fwd_impl(gate, up, use_triton(gate))


@swiglu_fwd.register_fake
def _swiglu_fwd_fake(gate: Tensor, up: Tensor) -> Tensor:
    torch._check(gate.shape == up.shape, lambda: "swiglu: gate and up must have the same shape")
    return gate.new_empty(gate.shape)  # contiguous, like the real outputs


@torch.library.custom_op("novatune::swiglu_bwd", mutates_args=())
def swiglu_bwd(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    return _bwd_impl(dy, gate, up, use_triton(gate))


@swiglu_bwd.register_fake
def _swiglu_bwd_fake(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    torch._check(gate.shape == up.shape, lambda: "swiglu: gate and up must have the same shape")
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _setup_context(ctx, inputs, output) -> None:
    gate, up = inputs
    ctx.save_for_backward(gate, up)  # not y: sigmoid(gate) is recomputed in the backward kernel


def _backward(ctx, dy: Tensor):
    gate, up = ctx.saved_tensors
    # One launch yields both gradients; computing a grad nobody asked for costs only its store, so no branch.
    dgate, dup = torch.ops.novatune.swiglu_bwd(dy, gate, up)
    return dgate, dup


swiglu_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------- autograd glue
def _default_fwd(gate: Tensor, up: Tensor, out: Tensor | None = None) -> Tensor:
    if use_triton(gate):
        return K.swiglu_fwd(gate, up, out)
    y = _fwd_impl(gate, up, False)
    return y if out is None else out.copy_(y)


def _default_bwd(dy: Tensor, gate: Tensor, up: Tensor, dgate: Tensor | None = None,
                 dup: Tensor | None = None) -> tuple[Tensor, Tensor]:
    if use_triton(gate):
        return K.swiglu_bwd(dy, gate, up, dgate, dup)  # elementwise: reads each element before writing it
    g, u = _bwd_impl(dy, gate, up, False)
    return (g if dgate is None else dgate.copy_(g)), (u if dup is None else dup.copy_(u))


def _views_a_callers_leaf(t: Tensor) -> bool:
    """A view of a leaf that requires grad (a caller's tensor). A view of a buffer that requires none (an autograd
    Function's output viewed inside its forward, as the fused LoRA layer returns its result) is an intermediate."""
    return t._base is not None and t._base.is_leaf and t._base.requires_grad


def may_write_over(*tensors: Tensor) -> bool:
    """Whether a backward may write gradients over these saved inputs: each is contiguous and an intermediate
    (made by an autograd op, so no caller holds it as a value of its own: a leaf, or a view of one, is a user's
    tensor), and no two share memory (swiglu(h, h) would write both gradients into one buffer)."""
    if not all(t.is_contiguous() and not t.is_leaf and not _views_a_callers_leaf(t) for t in tensors):
        return False
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    return all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


def make_function(fwd, bwd):
    """Functional swiglu(gate, up, inplace_backward=False) from fwd(gate, up, out=None) -> y and
    bwd(dy, gate, up, dgate=None, dup=None) -> (dgate, dup): the op's own eager path and every kernel candidate.

    inplace_backward: write dgate over gate and dup over up (their last use), which saves two (tokens x
    intermediate) buffers per layer in the backward (2 x 76 MiB at Qwen3-4B x 4096 tokens) - what Liger does.
    Only for callers that own gate and up (the fused MLP: they are fresh projection outputs nobody else reads);
    a leaf (a user's tensor) or gate and up sharing memory keep the out-of-place backward (may_write_over).
    The version counters are bumped, so another autograd node that saved gate or up fails loudly at its
    backward instead of reading gradients, and a second backward through this node (retain_graph) raises."""

    class _SwiGLUFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, gate: Tensor, up: Tensor, inplace_backward: bool = False) -> Tensor:
            ctx.save_for_backward(gate, up)  # not y: sigmoid(gate) is recomputed in the backward
            ctx.inplace = inplace_backward and may_write_over(gate, up)
            ctx.done = False
            return fwd(gate, up)

        @staticmethod
        def backward(ctx, dy: Tensor):
            if ctx.inplace and ctx.done:  # checked before unpacking, whose version check would say less
                raise RuntimeError("novatune swiglu: this MLP's backward writes its gradients over its saved "
                                   "inputs, so it cannot run twice (retain_graph=True); patch with "
                                   "swiglu_inplace_backward=False for double backward")
            gate, up = ctx.saved_tensors
            if not ctx.inplace:
                dgate, dup = bwd(dy, gate, up)
            else:
                ctx.done = True
                dgate, dup = bwd(dy, gate, up, dgate=gate, dup=up)
                torch.autograd.graph.increment_version(gate)
                torch.autograd.graph.increment_version(up)
            return (dgate if ctx.needs_input_grad[0] else None), (dup if ctx.needs_input_grad[1] else None), None

    def swiglu_fn(gate: Tensor, up: Tensor, inplace_backward: bool = False) -> Tensor:
        return _SwiGLUFunction.apply(gate, up, inplace_backward)

    return swiglu_fn


# the untuned eager path: the same implementations as the registered ops, without the custom-op dispatch
_eager = make_function(_default_fwd, _default_bwd)


# ----------------------------------------------------------------------------------------------- public API
def swiglu(gate: Tensor, up: Tensor, *, inplace_backward: bool = False) -> Tensor:
    """silu(gate) * up, differentiable. gate and up: same shape (any rank). Mixed dtypes are promoted as
    eager PyTorch would (a copy; not expected in practice: both come from linears of one dtype)."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate and up must have the same shape, got {tuple(gate.shape)} and "
                         f"{tuple(up.shape)}")
    require_float("swiglu", gate, up)
    if gate.dtype != up.dtype:
        dt = torch.result_type(gate, up)
        gate, up = gate.to(dt), up.to(dt)
    if torch.compiler.is_compiling():
        return torch.ops.novatune.swiglu_fwd(gate, up)  # traced: functional, the compiler plans the buffers
    # an implementation `novatune tune` selected for this shape
    # (dispatch.ACTIVE is None: nothing tuned, one global read)
    if (hook := dispatch.ACTIVE) is not None and (out := hook("swiglu", gate, up, inplace_backward)) is not None:
        return out
    return _eager(gate, up, inplace_backward)


def swiglu_mlp(x: Tensor, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module,
               inplace_backward: bool = True, wgrad_in_place: bool = False,
               down_wgrad_in_place: bool | None = None) -> Tensor:
    """down_proj(silu(gate_proj(x)) * up_proj(x)) - HF's LlamaMLP / Qwen3MLP forward with the fused activation.
    The projections are called (not their weights read), so LoRA / quantised wrappers keep working.
    inplace_backward: the gradients are written over gate and up, unless a forward hook receives a projection's
    output.
    wgrad_in_place: a plain nn.Linear projection runs novatune.ops.linear (its weight gradient added into .grad
    inside the GEMM where autograd would add it). down_wgrad_in_place: the down projection's own choice (None: as
    wgrad_in_place); a checkpoint that ends at this MLP's output recomputes the down projection's GEMM only for
    novatune.ops.linear, whose saved tensors are packed after its GEMM."""
    # gate and up are fresh projection outputs read by nothing else, so their memory can take the gradients, unless
    # a forward hook receives them (it may keep them; read before the calls, which a hook may end by removing itself)
    inplace_backward = inplace_backward and not (output_hooked(gate_proj) or output_hooked(up_proj))
    gate, up = project(gate_proj, x, wgrad_in_place), project(up_proj, x, wgrad_in_place)
    down = wgrad_in_place if down_wgrad_in_place is None else down_wgrad_in_place
    return project(down_proj, swiglu(gate, up, inplace_backward=inplace_backward), down)


def _gate_up_fwd(gate_up: Tensor) -> Tensor:
    if use_triton(gate_up):
        return K.swiglu_gate_up_fwd(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return _fwd_impl(gate, up, False)


def _gate_up_bwd(dy: Tensor, gate_up: Tensor, dgate_up: Tensor | None) -> Tensor:
    if use_triton(gate_up):
        return K.swiglu_gate_up_bwd(dy, gate_up, dgate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    d = torch.cat(_bwd_impl(dy, gate, up, False), dim=-1)
    return d if dgate_up is None else dgate_up.copy_(d)


class _SwiGLUGateUpFunction(torch.autograd.Function):
    """silu(gate) * up on the two halves of one [gate | up] tensor, read in place (no split copies); the gradient
    comes back as one tensor in the same layout, written over gate_up when inplace_backward (its last use)."""

    @staticmethod
    def forward(ctx, gate_up: Tensor, inplace_backward: bool) -> Tensor:
        ctx.save_for_backward(gate_up)
        ctx.inplace = inplace_backward and may_write_over(gate_up)
        ctx.done = False
        return _gate_up_fwd(gate_up)

    @staticmethod
    def backward(ctx, dy: Tensor):
        if ctx.inplace and ctx.done:
            raise RuntimeError("novatune swiglu: this MLP's backward writes its gradients over its saved input, so "
                               "it cannot run twice (retain_graph=True); patch with swiglu_inplace_backward=False")
        (gate_up,) = ctx.saved_tensors
        if not ctx.inplace:
            return _gate_up_bwd(dy, gate_up, None), None
        ctx.done = True
        dgate_up = _gate_up_bwd(dy, gate_up, gate_up)
        torch.autograd.graph.increment_version(gate_up)
        return dgate_up, None


def swiglu_gate_up(gate_up: Tensor, *, inplace_backward: bool = False) -> Tensor:
    """silu(gate) * up with [gate | up] = gate_up's two halves along the last dim (Phi-3's fused gate_up_proj
    output), differentiable; (..., 2I) -> (..., I). Same values as swiglu(*gate_up.chunk(2, -1)) without the
    copies of the two strided halves. inplace_backward: the gradient is written over gate_up (see swiglu)."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu_gate_up: the last dimension must be even [gate | up], got {tuple(gate_up.shape)}")
    require_float("swiglu_gate_up", gate_up)
    if torch.compiler.is_compiling():
        # traced: the registered swiglu op on the two halves (the compiler plans the buffers)
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.ops.novatune.swiglu_fwd(gate, up)
    return _SwiGLUGateUpFunction.apply(gate_up, inplace_backward)


def swiglu_gate_up_mlp(x: Tensor, gate_up_proj: nn.Module, down_proj: nn.Module,
                       inplace_backward: bool = True, wgrad_in_place: bool = False,
                       down_wgrad_in_place: bool | None = None) -> Tensor:
    """down_proj(silu(gate) * up) with [gate | up] = gate_up_proj(x) - HF's Phi3MLP forward with the fused
    activation reading the halves in place. The projections are called, so LoRA / quantised wrappers keep
    working; gate_up is a fresh projection output read by nothing else, so its memory can take the gradient.
    wgrad_in_place, down_wgrad_in_place: as swiglu_mlp's."""
    inplace_backward = inplace_backward and not output_hooked(gate_up_proj)  # a forward hook may keep gate_up
    act = swiglu_gate_up(project(gate_up_proj, x, wgrad_in_place), inplace_backward=inplace_backward)
    return project(down_proj, act, wgrad_in_place if down_wgrad_in_place is None else down_wgrad_in_place)


class NovaSwiGLUMLP(nn.Module):
    """Gated-SiLU MLP using the fused activation; holds (shares) the three projection modules it is given.

    `NovaSwiGLUMLP.from_module(mlp)` wraps an existing HF MLP (anything with gate_proj / up_proj / down_proj)
    without copying weights, so parameter names under the module (gate_proj.weight, ...) and PEFT adapters are
    unchanged. The caller (a patch spec) is responsible for checking that the MLP's activation is SiLU.
    """

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module):
        super().__init__()
        self.gate_proj = gate_proj
        self.up_proj = up_proj
        self.down_proj = down_proj

    @classmethod
    def from_module(cls, mlp: nn.Module) -> NovaSwiGLUMLP:
        names = ("gate_proj", "up_proj", "down_proj")
        missing = [n for n in names if not hasattr(mlp, n)]
        if missing:
            raise TypeError(f"{type(mlp).__name__} has no {', '.join(missing)}: not a gated MLP")
        return cls(*(getattr(mlp, n) for n in names))

    def forward(self, x: Tensor) -> Tensor:
        return swiglu_mlp(x, self.gate_proj, self.up_proj, self.down_proj)


# ----------------------------------------------------------------------------------------------- the contract
def _make_inputs(shape, dtype, device, gen, inplace_backward: bool = False, magnitude: float = 1.0) -> dict:
    """gate (3 x N(0,1): into both tails of the sigmoid) and up of `shape` (any rank), times `magnitude`."""
    g = 3.0 * torch.randn(*shape, generator=gen) * magnitude
    u = torch.randn(*shape, generator=gen) * magnitude
    return {"gate": g.to(device=device, dtype=dtype), "up": u.to(device=device, dtype=dtype),
            "inplace_backward": inplace_backward}


def _noncontig(inputs) -> dict:
    """gate and up as the two halves of one fused gate_up projection's output (row stride 2 x intermediate)."""
    g, u = inputs["gate"], inputs["up"]
    fused = torch.cat([g, u], dim=-1)
    n = g.shape[-1]
    return dict(inputs, gate=fused[..., :n], up=fused[..., n:])


def _call_cases(dtype, device, gen) -> list:
    """The patched MLP's call ((b, s, intermediate), inplace_backward=True), the plain call, 2-D and odd shapes,
    rows past 65,535, |x| ~ 1e4 (gate * up ~ 1e8: fp16 arithmetic overflows) and fused gate_up halves."""
    mk = functools.partial(_make_inputs, dtype=dtype, device=device, gen=gen)
    return [("MLP (b, s, i) inplace_backward=True", mk((2, 37, 96), inplace_backward=True)),
            ("(b, s, i) inplace_backward=False", mk((3, 11, 80))), ("2-D odd", mk((7, 33))),
            ("single element row", mk((1, 1, 1), inplace_backward=True)),
            ("|x| ~ 1e4", mk((2, 19, 64), magnitude=1e4 / 3)),
            ("rows > 65,535", mk((1, 65_541, 4), inplace_backward=True)),
            ("fused gate_up halves (strided)", _noncontig(mk((2, 21, 48))))]


def gated_floor_bytes(shape, dtype) -> int:
    """HBM floor of a gated activation (SwiGLU, GeGLU): fwd reads g, u, writes y; bwd reads dy, g, u, writes dg, du."""
    n = 1
    for s in shape:
        n *= s
    return 8 * n * element_size(dtype)


def gated_poison_call(kernels, inputs, dy) -> dict:
    """A gated activation's kernels (SwiGLU, GeGLU) into NaN-poisoned output buffers."""
    g, u = inputs["gate"], inputs["up"]
    y = kernels.fwd(g, u, out=fill_nan_like(g))
    dg, du = kernels.bwd(dy, g, u, dgate=fill_nan_like(g), dup=fill_nan_like(u))
    return {"out": y, "gate": dg, "up": du}


def _triton_pair(cfg):
    return launchers(K.swiglu_fwd, K.swiglu_bwd, cfg, cfg)


def _cuda_pair(cfg):
    ext = cuda_ext()
    return SimpleNamespace(fwd=lambda g, u, out=None: ext.swiglu_fwd(g, u, out, **cfg),
                           bwd=lambda dy, g, u, dgate=None, dup=None: tuple(ext.swiglu_bwd(dy, g, u, dgate, dup,
                                                                                            **cfg)))


def _candidates(shape, dtype, device: str) -> list:
    out = [Candidate("swiglu", "hf_eager", "eager", make=lambda: _ref.hf_swiglu),
           Candidate("swiglu", "novatune_default", "default", make=lambda: _eager),
           Candidate("swiglu", "torch_compile", "compile", make=lambda: compiled(_ref.hf_swiglu),
                     deterministic=False)]
    # (BLOCK elements per program, num_warps) around novatune.kernels.swiglu.default_config's (4096, 8)
    tvars = [dict(block=2048, num_warps=4), dict(block=8192, num_warps=8), dict(block=4096, num_warps=4),
             dict(block=8192, num_warps=16)]
    out += variant_grid("swiglu", "triton", tvars, _triton_pair, make_function, triton_reason(device))
    cvars = [dict(threads=256, vecs=2), dict(threads=256, vecs=4), dict(threads=512, vecs=2),
             dict(threads=128, vecs=4)]
    out += variant_grid("swiglu", "cuda", cvars, _cuda_pair, make_function, cuda_reason(device))
    return out


SPEC = OpSpec(
    trace_kind="activation",
    name="swiglu", tensor_args=("gate", "up"), make_inputs=_make_inputs, reference=_ref.swiglu_ref,
    stock=_ref.hf_swiglu, floor_bytes=gated_floor_bytes, candidates=_candidates, make_function=make_function,
    call_cases=_call_cases, poison_call=gated_poison_call, noncontiguous=_noncontig, layout="contiguous",
    keyword_args=("inplace_backward",),
    shape_of=lambda gate, up, *_: (gate.numel() // max(gate.shape[-1], 1), gate.shape[-1]),
    dtype_of=lambda gate, up, *_: str(gate.dtype)[6:],
    signature="swiglu(gate, up, *, inplace_backward: bool = False) -> silu(gate) * up (gate's shape and dtype); "
              "differentiable in gate and up; inplace_backward=True (the patched MLP's call, contiguous inputs): "
              "the backward writes the gradients of gate and up into their own memory",
)
