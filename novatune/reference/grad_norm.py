"""fp64 reference of the gradients' total L2 norm as torch.nn.utils.get_total_norm(tensors, 2.0) defines it: each
tensor's norm, rounded to that tensor's dtype (torch's _foreach_norm returns it there), then the norm of those norms
(novatune.ops.grad_norm.total_norm)."""
from __future__ import annotations

import torch


def tensor_norms_ref(tensors: list[torch.Tensor]) -> torch.Tensor:
    """(len(tensors),) fp64: each tensor's L2 norm, exact up to fp64 rounding."""
    return torch.stack([t.detach().double().reshape(-1).square().sum().sqrt() for t in tensors])


def total_norm_ref(tensors: list[torch.Tensor]) -> torch.Tensor:
    """fp64 norm of the per-tensor norms, each rounded to its tensor's dtype first."""
    per = tensor_norms_ref(tensors)
    rounded = torch.stack([n.to(t.dtype).double() for n, t in zip(per, tensors)])
    return rounded.square().sum().sqrt()
