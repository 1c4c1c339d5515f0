"""SwiGLU: y = silu(gate) * up (the activation of a gated MLP, with the projections done).

`hf_swiglu` is HF's `act_fn(gate_proj(x)) * up_proj(x)` in the input dtype (the stock formula); `swiglu_ref` is the
same formula on fp32 copies (the oracle, results in fp32). `swiglu_bwd_ref` is the closed-form backward:
dgate = dy * up * sig * (1 + gate * (1 - sig)), dup = dy * silu(gate), sig = sigmoid(gate).
"""
from __future__ import annotations

import torch
from torch import Tensor


def hf_swiglu(gate: Tensor, up: Tensor, inplace_backward: bool = False) -> Tensor:
    """The stock formula; inplace_backward (a memory option of novatune's op) does not change the values."""
    return torch.nn.functional.silu(gate) * up


def swiglu_ref(gate: Tensor, up: Tensor, inplace_backward: bool = False) -> Tensor:
    """fp32 oracle forward (returned in fp32)."""
    return hf_swiglu(gate.float(), up.float())


def swiglu_bwd_ref(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 closed-form backward (returned in fp32)."""
    dy, g, u = dy.float(), gate.float(), up.float()
    sig = torch.sigmoid(g)
    dgate = dy * u * sig * (1.0 + g * (1.0 - sig))
    dup = dy * g * sig
    return dgate, dup
