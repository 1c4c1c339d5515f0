"""The experts' weight gradients added into `.grad` instead of returned whole to autograd: when it may, and how on the
torch path (a column slice at a time). On the Triton path (CUDA) the addition happens inside the grouped GEMM
instead (novatune.kernels.moe_wgrad: one pass, no fresh tensor at all); the rules below decide both.

    moe_experts(..., wgrad_in_place=True)          (patch(model) does it by default; moe_wgrad_in_place=False not)

Why: under gradient accumulation, every micro-batch after the first computes the expert weights' gradients
(E x 2I x H and E x H x I: 0.75 + 0.375 GiB per layer of Qwen3-30B-A3B in bf16) as fresh tensors, and autograd
then adds them into `.grad`. They are the largest transient of the backward: the memory replay of the MoE cut's
micro-step (LOG.md, session 14) has both alive at the step's peak. Computing the gradient in SLICES slices of its
output columns (the columns of dY in dW = dY^T X per expert) and adding each into its slice of `.grad` at once
keeps a quarter of it alive. Each element is the same dot product over the expert's rows, added once to the
accumulated gradient as autograd's AccumulateGrad adds it; on a GPU the GEMM of a column slice may run another
kernel than the whole one's, so a bf16 gradient may round differently (tests/ops/test_moe_wgrad.py).

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
from collections.abc import Callable

import torch
from torch import Tensor
from torch.autograd.graph import get_gradient_edge

SLICES = 4
ALIGN_BYTES = 16  # grouped_mm wants 16-byte aligned operand pointers: each slice starts at such an offset


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


def column_slices(width: int, element_size: int, slices: int = SLICES) -> list[tuple[int, int]]:
    """[lo, hi) column ranges covering `width` in about `slices` pieces, each starting at a 16-byte offset."""
    step = -(-width // slices)
    align = max(1, ALIGN_BYTES // element_size)
    step = -(-step // align) * align
    return [(lo, min(lo + step, width)) for lo in range(0, width, step)]


def weight_grad(dweight_of: Callable[[Tensor], Tensor], dy: Tensor, into: Tensor | None, out_dim: int) -> Tensor | None:
    """dweight_of(dy), the weight's gradient from the output gradient dy (rows x output features); or, with `into`
    (a parameter accumulates_into_grad accepted), that gradient added into `into.grad` slice by slice along its
    `out_dim` (dweight_of(dy[:, lo:hi]) is the gradient's output features lo:hi) and None returned."""
    if into is None:
        return dweight_of(dy)
    grad = into.grad
    assert grad is not None  # accumulates_into_grad checked it
    for lo, hi in column_slices(dy.shape[1], grad.element_size()):
        grad.narrow(out_dim, lo, hi - lo).add_(dweight_of(dy[:, lo:hi]))
    return None
