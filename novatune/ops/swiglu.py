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

import torch
from torch import Tensor, nn

from novatune.kernels import swiglu as K
from novatune.ops import _backend
from novatune.ops._backend import use_triton


def _fwd_impl(gate: Tensor, up: Tensor, on_triton: bool) -> Tensor:
    if on_triton:
        return K.swiglu_fwd(gate, up)
    # .contiguous(): same layout as the kernel's output (and as the fake impl says) whatever the input strides.
    return K.swiglu_ref(gate, up).to(gate.dtype).contiguous()


def _bwd_impl(dy: Tensor, gate: Tensor, up: Tensor, on_triton: bool) -> tuple[Tensor, Tensor]:
    if on_triton:
        return K.swiglu_bwd(dy, gate, up)
    dgate, dup = K.swiglu_bwd_ref(dy, gate, up)
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


# ----------------------------------------------------------------------------------------------- eager fast path
class _SwiGLUFunction(torch.autograd.Function):
    """Same implementations as the registered ops, without the custom-op dispatch overhead (eager only).

    inplace_backward: write dgate over gate and dup over up (their last use), which saves two (tokens x
    intermediate) buffers per layer in the backward (2 x 76 MiB at Qwen3-4B x 4096 tokens) - what Liger does.
    Only for callers that own gate and up (the fused MLP: they are fresh projection outputs nobody else reads).
    The version counters are bumped, so another autograd node that saved gate or up fails loudly at its
    backward instead of reading gradients, and a second backward through this node (retain_graph) raises."""

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor, inplace_backward: bool = False) -> Tensor:
        on_triton = use_triton(gate)   # decided once: the backward runs on the same device
        ctx.save_for_backward(gate, up)  # not y: sigmoid(gate) is recomputed in the backward kernel
        ctx.on_triton = on_triton
        ctx.inplace = inplace_backward and gate.is_contiguous() and up.is_contiguous()
        ctx.done = False
        return _fwd_impl(gate, up, on_triton)

    @staticmethod
    def backward(ctx, dy: Tensor):
        if ctx.inplace and ctx.done:  # checked before unpacking, whose version check would say less
            raise RuntimeError("novatune swiglu: this MLP's backward writes its gradients over its saved "
                               "inputs, so it cannot run twice (retain_graph=True); patch with "
                               "swiglu_inplace_backward=False for double backward")
        gate, up = ctx.saved_tensors
        if not ctx.inplace:
            dgate, dup = _bwd_impl(dy, gate, up, ctx.on_triton)
        else:
            ctx.done = True
            if ctx.on_triton:
                dgate, dup = K.swiglu_bwd(dy, gate, up, dgate=gate, dup=up)  # elementwise: read before write
            else:
                g, u = _bwd_impl(dy, gate, up, False)
                dgate, dup = gate.copy_(g), up.copy_(u)
            torch.autograd.graph.increment_version(gate)
            torch.autograd.graph.increment_version(up)
        return (dgate if ctx.needs_input_grad[0] else None), (dup if ctx.needs_input_grad[1] else None), None


# ----------------------------------------------------------------------------------------------- public API
def swiglu(gate: Tensor, up: Tensor, *, inplace_backward: bool = False) -> Tensor:
    """silu(gate) * up, differentiable. gate and up: same shape (any rank). Mixed dtypes are promoted as
    eager PyTorch would (a copy; not expected in practice: both come from linears of one dtype)."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate and up must have the same shape, got {tuple(gate.shape)} and "
                         f"{tuple(up.shape)}")
    if gate.dtype != up.dtype:
        dt = torch.result_type(gate, up)
        gate, up = gate.to(dt), up.to(dt)
    if torch.compiler.is_compiling():
        return torch.ops.novatune.swiglu_fwd(gate, up)  # traced: functional, the compiler plans the buffers
    # an implementation `novatune tune` selected for this shape (OVERRIDE is None: nothing tuned, one global read)
    if (hook := _backend.OVERRIDE) is not None and (out := hook("swiglu", gate, up, inplace_backward)) is not None:
        return out
    return _SwiGLUFunction.apply(gate, up, inplace_backward)


def swiglu_mlp(x: Tensor, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module,
               inplace_backward: bool = True) -> Tensor:
    """down_proj(silu(gate_proj(x)) * up_proj(x)) - HF's LlamaMLP / Qwen3MLP forward with the fused activation.
    The projections are called (not their weights read), so LoRA / quantised wrappers keep working."""
    # gate and up are fresh projection outputs read by nothing else: their memory can take the gradients
    return down_proj(swiglu(gate_proj(x), up_proj(x), inplace_backward=inplace_backward))


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
        missing = [n for n in ("gate_proj", "up_proj", "down_proj") if not hasattr(mlp, n)]
        if missing:
            raise TypeError(f"{type(mlp).__name__} has no {', '.join(missing)}: not a gated MLP")
        return cls(mlp.gate_proj, mlp.up_proj, mlp.down_proj)

    def forward(self, x: Tensor) -> Tensor:
        return swiglu_mlp(x, self.gate_proj, self.up_proj, self.down_proj)
