"""AdamW with a compensated (Kahan) bf16 weight update, dispatched by the device rule of novatune.ops._backend.

    adamw_kahan_step(w, c, m, v, g, lr=, beta1=, beta2=, eps=, weight_decay=, step=)   in place

An optimizer update, not a differentiable op: no custom-op registration or SPEC (nothing traces or tunes it).
CUDA: the Triton kernel (novatune.kernels.adamw_kahan); CPU: the fp32 reference, or the kernel under
TRITON_INTERPRET=1. The math: novatune/reference/adamw_kahan.py.
"""
from __future__ import annotations

from torch import Tensor

from novatune.kernels import adamw_kahan as K
from novatune.ops._backend import use_triton
from novatune.reference.adamw_kahan import adamw_kahan_step_ref

__all__ = ["adamw_kahan_step"]


def adamw_kahan_step(w: Tensor, c: Tensor | None, m: Tensor, v: Tensor, g: Tensor, **hyper) -> None:
    if use_triton(w):
        K.adamw_kahan_step(w, c, m, v, g, **hyper)
    else:
        adamw_kahan_step_ref(w, c, m, v, g, **hyper)
