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

When: only where autograd would have put that gradient into `.grad` itself, by the same addition
(novatune.ops.grad_accumulation.accumulates_into_grad has the rules); anywhere else the gradient is returned whole,
as without the option.
"""
from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

SLICES = 4
ALIGN_BYTES = 16  # grouped_mm wants 16-byte aligned operand pointers: each slice starts at such an offset


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
