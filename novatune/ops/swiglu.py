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

The MLP helpers *call* the three projection modules rather than reading their weights, so they work unchanged
for nn.Linear, PEFT LoRA-wrapped linears, quantised linears, or anything else callable.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from novatune.kernels import swiglu as K
from novatune.ops._backend import use_triton


@torch.library.custom_op("novatune::swiglu_fwd", mutates_args=())
def swiglu_fwd(gate: Tensor, up: Tensor) -> Tensor:
    if use_triton(gate):
        return K.swiglu_fwd(gate, up)
    # .contiguous(): same layout as the kernel's output (and as the fake impl says) whatever the input strides.
    return K.swiglu_ref(gate, up).to(gate.dtype).contiguous()


@swiglu_fwd.register_fake
def _swiglu_fwd_fake(gate: Tensor, up: Tensor) -> Tensor:
    torch._check(gate.shape == up.shape, lambda: "swiglu: gate and up must have the same shape")
    return gate.new_empty(gate.shape)  # contiguous, like the real outputs


@torch.library.custom_op("novatune::swiglu_bwd", mutates_args=())
def swiglu_bwd(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    if use_triton(gate):
        return K.swiglu_bwd(dy, gate, up)
    dgate, dup = K.swiglu_bwd_ref(dy, gate, up)
    return dgate.to(gate.dtype).contiguous(), dup.to(up.dtype).contiguous()


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


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up, differentiable. gate and up: same shape (any rank). Mixed dtypes are promoted as
    eager PyTorch would (a copy; not expected in practice: both come from linears of one dtype)."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate and up must have the same shape, got {tuple(gate.shape)} and "
                         f"{tuple(up.shape)}")
    if gate.dtype != up.dtype:
        dt = torch.result_type(gate, up)
        gate, up = gate.to(dt), up.to(dt)
    return torch.ops.novatune.swiglu_fwd(gate, up)


def swiglu_mlp(x: Tensor, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module) -> Tensor:
    """down_proj(silu(gate_proj(x)) * up_proj(x)) - HF's LlamaMLP / Qwen3MLP forward with the fused activation.
    The projections are called (not their weights read), so LoRA / quantised wrappers keep working."""
    return down_proj(swiglu(gate_proj(x), up_proj(x)))


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
    def from_module(cls, mlp: nn.Module) -> "NovaSwiGLUMLP":
        missing = [n for n in ("gate_proj", "up_proj", "down_proj") if not hasattr(mlp, n)]
        if missing:
            raise TypeError(f"{type(mlp).__name__} has no {', '.join(missing)}: not a gated MLP")
        return cls(mlp.gate_proj, mlp.up_proj, mlp.down_proj)

    def forward(self, x: Tensor) -> Tensor:
        return swiglu_mlp(x, self.gate_proj, self.up_proj, self.down_proj)
