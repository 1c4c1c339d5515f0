"""AdamW with the moments in the parameter's dtype and the clipping scale folded into the update, dispatched by the
device rule of novatune.ops._backend.

    adamw_step(p, m, v, g, scale=None, lr=, beta1=, beta2=, eps=, weight_decay=, step=)   in place

An optimizer update, not a differentiable op: no custom-op registration or SPEC (nothing traces or tunes it).
CUDA: the Triton kernel (novatune.kernels.adamw); CPU: the fp32 reference, or the kernel under TRITON_INTERPRET=1.
The math: novatune/reference/adamw.py.
"""
from __future__ import annotations

from torch import Tensor

from novatune.kernels import adamw as K
from novatune.ops._backend import use_triton
from novatune.reference.adamw import adamw_step_ref

__all__ = ["adamw_step"]


def adamw_step(p: Tensor, m: Tensor, v: Tensor, g: Tensor, scale: Tensor | None = None, **hyper) -> None:
    if use_triton(p):
        K.adamw_step(p, m, v, g, scale, **hyper)
    else:
        adamw_step_ref(p, m, v, g, scale, **hyper)
