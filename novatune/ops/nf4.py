"""NF4 dequantisation with device dispatch, bitsandbytes state import, and the dequantise-on-the-fly weight.

    novatune.ops.nf4_dequantize(t, dtype)     NF4Tensor -> dense tensor (CUDA: Triton; CPU: the fp32 reference,
                                               or the Triton kernel under TRITON_INTERPRET=1; bit-identical)
    from_bnb(weight)                           a bitsandbytes Params4bit (quant_type "nf4", with or without double
                                               quantisation) -> NF4Tensor sharing its storage (no copy)
    DequantWeight(t, dtype)                    what novatune.kernels.lora's GEMM step takes instead of a dense W:
                                               calling it dequantises into a fresh buffer that the caller drops
                                               right after its GEMM, so the caching allocator hands the same
                                               block to the next layer's dequantisation: one weight-sized
                                               (out x in, compute dtype) buffer alive at a time, never a
                                               dequantised copy of the model

Not differentiable (a frozen quantised weight has no gradient); the QLoRA autograd is novatune.ops.lora_linear.
bitsandbytes is never imported here: its state is read by attribute (quant_state.absmax / .code / .blocksize /
.offset / .state2 / .shape / .dtype / .quant_type, as in bitsandbytes/functional.py's QuantState).
"""
from __future__ import annotations

import torch
from torch import Tensor

from novatune.kernels import nf4 as K
from novatune.kernels.nf4 import NF4Tensor
from novatune.ops._backend import use_triton

__all__ = ["nf4_dequantize", "from_bnb", "DequantWeight", "NF4Tensor"]


def nf4_dequantize(t: NF4Tensor, dtype: torch.dtype | None = None, out: Tensor | None = None) -> Tensor:
    """Dense tensor of t.shape in `dtype` (default t.dtype): bitsandbytes' dequantize_4bit, bit for bit."""
    if use_triton(t.packed):
        return K.nf4_dequantize(t, dtype, out=out)
    ref = K.nf4_dequantize_ref(t, dtype or (out.dtype if out is not None else None))
    return ref if out is None else out.view(ref.shape).copy_(ref)


def from_bnb(weight) -> NF4Tensor:
    """NF4Tensor view of a bitsandbytes Params4bit (its .quant_state); raises for anything but NF4 in the
    standard packing (FP4, or the CPU inference repacking bnb applies to eval-mode CPU layers)."""
    qs = getattr(weight, "quant_state", None)
    if qs is None:
        raise ValueError("from_bnb: the weight has no quant_state (not quantised yet: bitsandbytes quantises a "
                         "Params4bit when it is moved to the device)")
    if qs.quant_type != "nf4":
        raise ValueError(f"from_bnb: quant_type {qs.quant_type!r} is not supported (NF4 only); quantise with "
                         f"bnb_4bit_quant_type='nf4'")
    if getattr(qs, "packing_format_for_cpu", False):
        raise ValueError("from_bnb: this weight was repacked by bitsandbytes for CPU inference "
                         "(packing_format_for_cpu); it no longer has the standard NF4 layout")
    data = weight.data if hasattr(weight, "data") else weight
    packed = data.reshape(-1).view(torch.uint8) if data.dtype != torch.uint8 else data.reshape(-1)
    t = NF4Tensor(packed=packed, absmax=qs.absmax, shape=torch.Size(qs.shape), dtype=qs.dtype,
                  code=qs.code.float(), blocksize=int(qs.blocksize))
    if getattr(qs, "nested", qs.state2 is not None):
        t.absmax2, t.code2, t.blocksize2 = qs.state2.absmax.float(), qs.state2.code.float(), int(qs.state2.blocksize)
        t.offset = torch.as_tensor(qs.offset, dtype=torch.float32, device=packed.device).reshape(1)
    K.check(t)
    return t


class DequantWeight:
    """A frozen (out, in) weight held as NF4, standing in for the dense W in novatune.kernels.lora's GEMMs:
    `.shape`/`.dtype` describe the dense weight (dtype: the GEMMs' compute dtype), `w()` materialises it."""

    def __init__(self, t: NF4Tensor, dtype: torch.dtype):
        if len(t.shape) != 2:
            raise ValueError(f"DequantWeight: a linear weight is 2-D (out, in), got shape {tuple(t.shape)}")
        self.t, self.dtype, self.shape = t, dtype, t.shape
        self.device = t.packed.device

    def __call__(self) -> Tensor:
        return nf4_dequantize(self.t, self.dtype)  # (out, in), dropped by the caller after one GEMM

    def __repr__(self) -> str:
        return f"DequantWeight(nf4 {tuple(self.shape)} -> {self.dtype})"
