"""When a backward may add a weight's gradient into its existing `.grad` itself instead of returning it to
autograd: the rules the in-place weight gradients share (the experts' grouped GEMM, novatune.ops.moe_wgrad; the
dense projections, novatune.ops.linear; the fused loss's lm_head, novatune.ops.linear_cross_entropy; the CUDA
graphs' recompute, novatune.patch.graph_recompute).

    accumulates_into_grad(param)   inside a backward: may this backward add param's gradient into param.grad?
    grad_takes_adds(param)         the part of those rules that does not depend on the running backward

When: only where autograd would have put that gradient into `.grad` itself, by the same addition:
  - the backward runs without grad mode (no create_graph; read before once_differentiable turns grad mode off),
    outside torch.compile and outside compiled autograd;
  - the weight is a plain dense nn.Parameter (not a tensor subclass such as FSDP2's DTensor), and its `.grad`
    already exists as a plain dense tensor of its shape, dtype and device (on the first micro-batch autograd keeps
    the returned gradient as `.grad`, with nothing to add);
  - the weight has no tensor hooks (register_hook, register_post_accumulate_grad_hook), and no process group is
    initialised (DDP's and FSDP's hooks on the gradient accumulator are invisible from Python);
  - the autograd engine runs the weight's AccumulateGrad in this backward: not torch.autograd.grad, not
    backward(inputs=...) without it.
Anywhere else the gradient is returned whole, as without the option. A hook registered on the AccumulateGrad node
itself from Python (rare; torch offers no way to list those) would not see the gradient: leave the option off then.
"""
from __future__ import annotations

import sys

import torch
from torch import Tensor
from torch.autograd.graph import get_gradient_edge


def accumulates_into_grad(param: Tensor | None) -> bool:
    """Whether this backward may add `param`'s gradient into `param.grad` itself (the module docstring's rules)."""
    if param is None or torch.is_grad_enabled() or not grad_takes_adds(param):
        return False
    try:
        return bool(torch._C._will_engine_execute_node(get_gradient_edge(param).node))
    except RuntimeError:  # torch.autograd.grad(): the engine captures leaf gradients instead of accumulating them
        return False


def grad_takes_adds(param: Tensor | None) -> bool:
    """The rules of `accumulates_into_grad` that do not depend on the running backward: a plain strided Parameter
    whose `.grad` exists with its shape, dtype and device, no hooks on it, one process, nothing compiled. A forward
    that adds into `.grad` (novatune.ops.linear_cross_entropy under the trainer's promise) checks these; that its
    backward will run AccumulateGrad is the promise's part."""
    if param is None or torch.compiler.is_compiling() or _compiled_autograd():
        return False
    if type(param) is not torch.nn.Parameter or param.layout != torch.strided or not param.requires_grad:
        return False
    grad = param.grad
    if grad is None or type(grad) is not torch.Tensor or grad.layout != torch.strided:
        return False
    if grad.shape != param.shape or grad.dtype != param.dtype or grad.device != param.device:
        return False
    if param._backward_hooks or getattr(param, "_post_accumulate_grad_hooks", None):
        return False
    return not (torch.distributed.is_available() and torch.distributed.is_initialized())


def _compiled_autograd() -> bool:
    # never imported, never on (importing torch._dynamo here would cost a second on the first backward)
    compiled_autograd = sys.modules.get("torch._dynamo.compiled_autograd")
    return compiled_autograd is not None and bool(getattr(compiled_autograd, "compiled_autograd_enabled", False)
                                                  or getattr(compiled_autograd, "in_compiled_autograd_region", False))
