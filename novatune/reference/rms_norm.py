"""RMSNorm: y = weight * (x.float() * rsqrt(mean(x.float()^2, -1) + eps)).to(x.dtype).

`rms_norm_ref` is transformers' LlamaRMSNorm / Qwen3RMSNorm forward op for op (bit-identical to it on the CPU), so
it is both the stock formula (`hf_rms_norm`) and, on fp32 copies of the inputs, the fp32 oracle (`rms_norm_fp32`).
`rms_norm_bwd_ref` is the closed-form backward the kernels implement: dx is straight-through the rounding of the
normalised value to x's dtype (as autograd treats HF's `.to(input_dtype)`), dw uses the rounded value.

Gemma's RMSNorm (`offset_rms_norm_ref`, the stock formula of novatune.ops.offset_rms_norm) differs in two ways:
y = (x.float() * rstd * (offset + w.float())).to(x.dtype), i.e. an offset on the weight (Gemma: 1, the weight is
stored zero-centred) and the whole product in fp32 with one rounding at the end, in x's dtype.
"""
from __future__ import annotations

import torch
from torch import Tensor


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float = 1e-6, return_rstd: bool = False):
    """HF's op sequence in fp32 math; differentiable. Returns y, or (y, rstd) with rstd x.shape[:-1] fp32."""
    xf = x.to(torch.float32)
    rstd = _rstd(xf, eps)  # (..., 1)
    y = weight * (xf * rstd).to(x.dtype)
    return (y, rstd.squeeze(-1)) if return_rstd else y


def _rstd(xf: Tensor, eps: float) -> Tensor:
    """1 / sqrt(mean(x^2) + eps) over the last dim, keepdim, in fp32 (HF's op sequence)."""
    return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def offset_rms_norm_ref(x: Tensor, weight: Tensor, eps: float = 1e-6, offset: float = 1.0,
                        return_rstd: bool = False):
    """transformers' GemmaRMSNorm (Gemma, Gemma 2, Gemma 3) op for op, with `offset` in place of its 1.0:
    differentiable; y in x's dtype, or (y, rstd) with rstd x.shape[:-1] fp32."""
    xf = x.to(torch.float32)
    rstd = _rstd(xf, eps)
    y = ((xf * rstd) * (offset + weight.to(torch.float32))).to(x.dtype)
    return (y, rstd.squeeze(-1)) if return_rstd else y


def hf_gemma_rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float = 1.0) -> Tensor:
    """The stock Gemma formula as a function."""
    return offset_rms_norm_ref(x, weight, eps, offset)


def offset_rms_norm_fp32(x: Tensor, weight: Tensor, eps: float, offset: float = 1.0) -> Tensor:
    """The fp32 oracle of the Gemma norm: the same formula on fp32 copies."""
    return offset_rms_norm_ref(x.float(), weight.float(), eps, offset)


def offset_rms_norm_bwd_ref(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor,
                            offset: float = 1.0) -> tuple[Tensor, Tensor]:
    """The Gemma norm's backward in fp32: dx (x's dtype) with the effective weight offset + w, dw = sum dy * x_hat
    (x_hat unrounded: the forward multiplies it in fp32), in weight's dtype."""
    n = x.shape[-1]
    xhat = x.to(torch.float32) * rstd.unsqueeze(-1)
    dyf = dy.to(torch.float32)
    g = dyf * (offset + weight.to(torch.float32))
    c = (g * xhat).mean(-1, keepdim=True)
    dx = (g - xhat * c) * rstd.unsqueeze(-1)
    dw = (dyf * xhat).reshape(-1, n).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


def hf_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' RMSNorm forward as a function (the stock implementation)."""
    return rms_norm_ref(x, weight, eps)


def rms_norm_fp32(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The fp32 oracle: the same formula on fp32 copies (no rounding to the input dtype anywhere)."""
    return rms_norm_ref(x.float(), weight.float(), eps)


def rms_norm_bwd_ref(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """The kernels' backward formula in plain fp32 PyTorch: (dx in x's dtype, dw in weight's dtype)."""
    n = x.shape[-1]
    xhat = x.to(torch.float32) * rstd.unsqueeze(-1)  # (..., N)
    dyf = dy.to(torch.float32)
    g = dyf * weight.to(torch.float32)
    c = (g * xhat).mean(-1, keepdim=True)  # (..., 1)
    dx = (g - xhat * c) * rstd.unsqueeze(-1)
    dw = (dyf * xhat.to(x.dtype).to(torch.float32)).reshape(-1, n).sum(0)  # (N,)
    return dx.to(x.dtype), dw.to(weight.dtype)
