"""A dense projection whose weight gradient is added into `.grad` inside the GEMM: `novatune.ops.linear`.

    y = linear(x, weight, bias)                         # F.linear's value and gradients
    y = project(module, x, wgrad_in_place=True)         # module(x), through `linear` where that is the same call

Why: under gradient accumulation every micro-batch after the first computes each weight's gradient as a fresh
tensor (dW = dY^T X), and autograd then adds it into `.grad`: the GEMM writes dW, the add reads dW and `.grad` and
writes `.grad`. Here the backward calls the GEMM with `.grad` as its accumulator (addmm_, beta 1): the GEMM reads
`.grad` once and writes it once, and no fresh dW exists. At Qwen3-4B that is 16 GB less traffic per accumulated
micro-batch and ~400 fewer launches per step. The sum is the same dot product added once to the accumulated
gradient; in bf16 it is rounded once (inside the GEMM, in fp32) instead of twice (dW, then the sum), so a bf16
gradient may differ from autograd's by a rounding, on the accurate side.

When: only where autograd would have added that gradient into `.grad` itself (novatune.ops.moe_wgrad's rules:
one process, a plain nn.Parameter with a `.grad` of its own shape and dtype, no tensor hooks, the engine running
its AccumulateGrad, no create_graph, not compiled). Anywhere else, and on the first micro-batch (no `.grad` yet),
the gradient is returned to autograd as F.linear's backward returns it.

`project(module, x)` takes this path only for a module that is exactly torch.nn.Linear with no forward or backward
hooks on it or global ones: LoRA and quantised wrappers, FSDP2-managed or hooked modules are called as modules.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as _module

from novatune.ops.grad_accumulation import accumulates_into_grad


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.weight = weight  # the parameter itself, for the .grad test in the backward (a saved tensor unpacks as
        ctx.has_bias = bias is not None  # a tensor, not necessarily as the Parameter object)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy: Tensor):
        # plain ops: with create_graph the backward is itself differentiable (and accumulates_into_grad says no)
        x, weight = ctx.saved_tensors
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None
        dw = db = None
        dy2 = dy.reshape(-1, dy.shape[-1])
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            if accumulates_into_grad(ctx.weight):
                ctx.weight.grad.addmm_(dy2.t(), x2)  # the GEMM accumulates into .grad: no fresh dW
            else:
                dw = dy2.t().mm(x2)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear(x, weight, bias), differentiable; the weight's gradient goes into its existing `.grad` inside the
    GEMM where autograd would add it there itself (module docstring). Traced (torch.compile) or under autocast:
    F.linear."""
    # traced, or under autocast (its casts happen inside F.linear; this Function's backward would meet the autocast
    # dtype of dy and the weight's own): F.linear itself
    if torch.compiler.is_compiling() or torch.is_autocast_enabled(x.device.type):
        return F.linear(x, weight, bias)
    return _LinearFunction.apply(x, weight, bias)


def forward_hooked(module: nn.Module) -> bool:
    """Whether a forward hook (the module's or a global one) sees this module's call: it may keep the output."""
    return bool(module._forward_hooks or module._forward_pre_hooks or _module._global_forward_hooks
                or _module._global_forward_pre_hooks)


def output_hooked(module: nn.Module) -> bool:
    """Whether a forward hook (the module's or a global one) receives this module's output: it may keep it."""
    return bool(module._forward_hooks or _module._global_forward_hooks)


def _backward_hooked(module: nn.Module) -> bool:
    """Whether a module backward hook (full or pre, the module's or a global one) expects this module's call: the
    hooks see, and may change, the gradients of its input and output, which only the module's own call offers."""
    return bool(module._backward_hooks or module._backward_pre_hooks or _module._global_backward_hooks
                or _module._global_backward_pre_hooks)


def _plain_linear(module: nn.Module) -> bool:
    return type(module) is nn.Linear and not forward_hooked(module) and not _backward_hooked(module)


def project(module: nn.Module, x: Tensor, wgrad_in_place: bool = True) -> Tensor:
    """module(x); for a plain nn.Linear with wgrad_in_place, the same through `linear`."""
    if wgrad_in_place and isinstance(module, nn.Linear) and _plain_linear(module) and module.weight.requires_grad:
        return linear(x, module.weight, module.bias)
    return module(x)
