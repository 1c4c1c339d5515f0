"""GPT-OSS's clamped SwiGLU on the interleaved gate/up projection output (HF's GptOssExperts._apply_gate):

    gate, up = gate_up[..., ::2], gate_up[..., 1::2]         (interleaved columns: g0 u0 g1 u1 ...)
    gate = min(gate, limit);  up = clamp(up, -limit, limit)
    y = (up + 1) * gate * sigmoid(alpha * gate)               (..., intermediate) from (..., 2 * intermediate)

`hf_clamped_swiglu` is that code in the input dtype (the stock formula); `clamped_swiglu_ref` the same on fp32
copies (the oracle, fp32 result). `clamped_swiglu_bwd_ref` is the closed-form backward, with torch.clamp's
gradient rule: the gradient passes where the input lies inside the closed interval and is exactly zero where the
clamp is active (NaN inputs included, as torch's comparison mask gives):

    s = sigmoid(alpha * g_c),  d gate = dy * (u_c + 1) * (s + alpha * g_c * s * (1 - s))   where gate <= limit
    d up = dy * g_c * s                                                                 where |up| <= limit
"""
from __future__ import annotations

import torch
from torch import Tensor

GPT_OSS_ALPHA, GPT_OSS_LIMIT = 1.702, 7.0


def hf_clamped_swiglu(gate_up: Tensor, alpha: float = GPT_OSS_ALPHA, limit: float = GPT_OSS_LIMIT) -> Tensor:
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1) * glu


def clamped_swiglu_ref(gate_up: Tensor, alpha: float = GPT_OSS_ALPHA, limit: float = GPT_OSS_LIMIT) -> Tensor:
    """fp32 oracle forward (returned in fp32)."""
    return hf_clamped_swiglu(gate_up.float(), alpha, limit)


def clamped_swiglu_bwd_ref(dy: Tensor, gate_up: Tensor, alpha: float = GPT_OSS_ALPHA,
                           limit: float = GPT_OSS_LIMIT) -> Tensor:
    """fp32 closed-form backward: d gate_up (..., 2 * intermediate), interleaved like gate_up, in fp32."""
    dy, gu = dy.float(), gate_up.float()
    gate, up = gu[..., ::2], gu[..., 1::2]
    g, u = gate.clamp(max=limit), up.clamp(-limit, limit)
    s = torch.sigmoid(alpha * g)
    dgate = torch.where(gate <= limit, dy * (u + 1) * (s + alpha * g * s * (1 - s)), 0.0)
    dup = torch.where((up >= -limit) & (up <= limit), dy * g * s, 0.0)
    return torch.stack((dgate, dup), dim=-1).flatten(-2)
