"""GeGLU: y = gelu_tanh(gate) * up (Gemma's gated MLP activation, transformers' `gelu_pytorch_tanh`).

`hf_geglu` is HF's `act_fn(gate_proj(x)) * up_proj(x)` with ACT2FN["gelu_pytorch_tanh"] (torch's
gelu(approximate="tanh")) in the input dtype: the stock formula. `geglu_ref` is the same on fp32 copies (the
oracle). `geglu_bwd_ref` is the closed-form backward, with k = sqrt(2 / pi), z = k (g + 0.044715 g^3),
t = tanh(z): dgate = dy * up * (0.5 (1 + t) + 0.5 g (1 - t^2) k (1 + 3 * 0.044715 g^2)),
dup = dy * gelu_tanh(gate).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor


def hf_geglu(gate: Tensor, up: Tensor, inplace_backward: bool = False) -> Tensor:
    """The stock formula; inplace_backward (a memory option of novatune's op) does not change the values."""
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def geglu_ref(gate: Tensor, up: Tensor, inplace_backward: bool = False) -> Tensor:
    """fp32 oracle forward (returned in fp32)."""
    return hf_geglu(gate.float(), up.float())


def geglu_bwd_ref(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 closed-form backward (returned in fp32)."""
    dy, g, u = dy.float(), gate.float(), up.float()
    k = math.sqrt(2.0 / math.pi)
    t = torch.tanh(k * (g + 0.044715 * g ** 3))
    dact = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * g * g)
    return dy * u * dact, dy * 0.5 * g * (1.0 + t)
