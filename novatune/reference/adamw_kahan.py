"""AdamW with a compensated (Kahan) weight update: the fp32 oracle of novatune.kernels.adamw_kahan.

A bf16 weight cannot take an update smaller than half its spacing (2^-9 of its magnitude): `w + u` rounds back to
`w`, and plain bf16 AdamW at small learning rates leaves most weights unchanged. Kahan summation keeps what the
rounding dropped in a compensation buffer `c` (the weight's dtype) and adds it to the next update, so `w + c`
follows the exact sum of the updates and `w` is that sum rounded to its dtype (what an fp32 master copy cast to
bf16 would give), at 2 bytes per parameter instead of a 4-byte master copy.

One step, all arithmetic in fp32 (m, v are fp32 state; w, c, g in their storage dtypes):
    m = b1 m + (1 - b1) g                      v = b2 v + (1 - b2) g^2
    u = -lr (m / bc1) / (sqrt(v) / sqrt(bc2) + eps) - lr wd w        (bc_i = 1 - b_i^step: torch.optim.AdamW's)
    y = u + c;   w' = dtype(w + y);   c' = dtype(y - (w' - w))        (w' - w is exact: Sterbenz)
Without a compensation buffer (fp32 weights) w' = w + u.
"""
from __future__ import annotations

import math

from torch import Tensor


def adamw_kahan_step_ref(w: Tensor, c: Tensor | None, m: Tensor, v: Tensor, g: Tensor, *, lr: float, beta1: float,
                         beta2: float, eps: float, weight_decay: float, step: int) -> None:
    """One in-place step on (w, c, m, v) from the gradient g (module docstring)."""
    bc1, bc2_sqrt = 1.0 - beta1 ** step, math.sqrt(1.0 - beta2 ** step)
    w32, g32 = w.float(), g.float()
    m.mul_(beta1).add_(g32, alpha=1.0 - beta1)
    v.mul_(beta2).addcmul_(g32, g32, value=1.0 - beta2)
    u = -lr * (m / bc1) / (v.sqrt() / bc2_sqrt + eps) - lr * weight_decay * w32
    if c is None:
        w.copy_(w32 + u)
        return
    y = u + c.float()
    new = (w32 + y).to(w.dtype)
    c.copy_(y - (new.float() - w32))
    w.copy_(new)
