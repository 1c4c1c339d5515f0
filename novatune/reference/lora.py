"""LoRA linear: y = x W^T (+ b) + scaling * (x_lora A^T) B^T, the frozen base layer plus the low-rank update PEFT
adds (x_lora: the LoRA branch's input after dropout, default x).

`lora_linear_ref` is the fp32 oracle (plain PyTorch, differentiable: tests take its gradients by autograd on fp32
leaves).
"""
from __future__ import annotations

from torch import Tensor


def lora_linear_ref(x: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor, scaling: float,
                    x_lora: Tensor | None = None) -> Tensor:
    """fp32 reference, plain PyTorch and differentiable (tests take its gradients by autograd on fp32 leaves).

    Any leading dims on x; returns fp32 of shape (*x.shape[:-1], out). x_lora: the LoRA branch's input (dropout
    applied by the caller), default x."""
    x32 = x.float()
    xl32 = x32 if x_lora is None else x_lora.float()
    y = x32 @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y + scaling * ((xl32 @ lora_a.float().t()) @ lora_b.float().t())
