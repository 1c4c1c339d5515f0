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
    nf4_embedding(t, ids, dtype)               rows `ids` of a 2-D NF4 table, dequantised (Triton gather or the
                                               reference, bit-identical to nf4_dequantize(t)[ids])
    NF4Embedding.from_embedding(emb, dtype)    a frozen nn.Embedding stored as NF4 (double quantisation, the
                                               linears' layout); forward gathers and dequantises only the rows
                                               it is asked for: QLoRA's 152k x 4096 input embedding takes 0.30
                                               GiB instead of 1.16 GiB in bf16

Not differentiable (a frozen quantised weight has no gradient); the QLoRA autograd is novatune.ops.lora_linear.
bitsandbytes is never imported here: its state is read by attribute (quant_state.absmax / .code / .blocksize /
.offset / .state2 / .shape / .dtype / .quant_type, as in bitsandbytes/functional.py's QuantState).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from novatune.kernels import nf4 as K
from novatune.kernels.nf4 import NF4Tensor
from novatune.ops._backend import use_triton

__all__ = ["DequantWeight", "NF4Embedding", "NF4Tensor", "from_bnb", "nf4_dequantize", "nf4_embedding"]


def nf4_dequantize(t: NF4Tensor, dtype: torch.dtype | None = None, out: Tensor | None = None) -> Tensor:
    """Dense tensor of t.shape in `dtype` (default t.dtype): bitsandbytes' dequantize_4bit, bit for bit."""
    if use_triton(t.packed):
        return K.nf4_dequantize(t, dtype, out=out)
    ref = K.nf4_dequantize_ref(t, K.dequantize_dtype(t, dtype, out))
    return ref if out is None else out.view(ref.shape).copy_(ref)


def nf4_embedding(t: NF4Tensor, ids: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Rows `ids` of the 2-D NF4 table t, shape ids.shape + (H,), in `dtype` (default t.dtype)."""
    if use_triton(t.packed):
        return K.nf4_embedding(t, ids, dtype)
    return K.nf4_embedding_ref(t, ids, dtype)


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
        # True: the forward keeps the dequantised W for its backward instead of dequantising again there. Set
        # per call by the patch only inside a gradient-checkpointed layer (novatune/patch/lora.py): there the
        # first forward's saved tensors are not kept, and the recomputed forward's are freed by the backward
        # that follows it, so at most one layer's dense weights are ever held.
        self.keep_for_backward = False

    def __call__(self) -> Tensor:
        return nf4_dequantize(self.t, self.dtype)  # (out, in), dropped by the caller after one GEMM

    def into(self, out: Tensor) -> Tensor:
        """Dequantise into a preallocated contiguous (out, in) buffer (a row block of a grouped op's W_cat)."""
        return nf4_dequantize(self.t, self.dtype, out=out)

    def __repr__(self) -> str:
        return f"DequantWeight(nf4 {tuple(self.shape)} -> {self.dtype})"


# quantise the table this many elements at a time (a multiple of 128): ~20 bytes of temporaries per element, so
# 2^24 elements keep the set-up's extra memory near 0.3 GiB for any vocabulary
QUANT_CHUNK = 1 << 24
_STATE = ("packed", "absmax", "code", "absmax2", "code2", "offset")


class NF4Embedding(nn.Module):
    """A frozen embedding table held as NF4 (bitsandbytes' layout, blocksize 64, double quantisation: what
    novatune.train.qlora gives the linears). forward(ids) -> the dequantised rows in `compute_dtype`, shape
    ids.shape + (embedding_dim,); bit-identical to nf4_dequantize(table)[ids]. No parameters: nothing trains,
    and the output does not require grad (HF's enable_input_require_grads hook sets that on it, as on a frozen
    nn.Embedding's output). The NF4 state is registered as buffers so .to()/.cuda() move it and the state dict
    carries it; novatune.train.qlora's merged export writes the dequantised dense `weight` instead."""

    # the buffers of _STATE (all set: the table is double-quantised)
    packed: Tensor
    absmax: Tensor
    code: Tensor
    absmax2: Tensor
    code2: Tensor
    offset: Tensor

    def __init__(self, t: NF4Tensor, compute_dtype: torch.dtype, padding_idx: int | None = None):
        super().__init__()
        K.check(t)
        if len(t.shape) != 2 or not t.nested:
            raise ValueError(f"NF4Embedding: needs a 2-D double-quantised table, got shape {tuple(t.shape)}, "
                             f"nested={t.nested}")
        if compute_dtype not in K.OUT_DTYPES:
            raise TypeError(f"NF4Embedding: compute_dtype must be one of {K.OUT_DTYPES}, got {compute_dtype}")
        for name in _STATE:
            self.register_buffer(name, getattr(t, name).reshape(-1))
        self.num_embeddings, self.embedding_dim = int(t.shape[0]), int(t.shape[1])
        self.padding_idx = padding_idx  # kept for inspection; a frozen table has no padding gradient to mask
        self.compute_dtype, self.stored_dtype = compute_dtype, t.dtype
        self.blocksize, self.blocksize2 = t.blocksize, t.blocksize2

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, compute_dtype: torch.dtype | None = None) -> NF4Embedding:
        """Quantise emb.weight where it lies (chunked: QUANT_CHUNK). Plain nn.Embedding only: subclasses (Gemma's
        scaled embedding, ...) change the forward, which this module would silently drop."""
        if type(emb) is not nn.Embedding:
            raise TypeError(f"NF4Embedding.from_embedding: a plain nn.Embedding is needed, got {type(emb).__name__} "
                            f"(a subclass may scale or transform its output)")
        if emb.max_norm is not None:
            raise ValueError("NF4Embedding.from_embedding: max_norm renormalises rows in place; a frozen NF4 "
                             "table cannot do that")
        w = emb.weight.detach()
        t = K.nf4_quantize_ref(w, blocksize=64, double_quant=True, chunk=QUANT_CHUNK)
        return cls(t, compute_dtype or w.dtype, emb.padding_idx)

    def nf4(self) -> NF4Tensor:
        """The NF4Tensor view of the buffers (wherever .to() has put them)."""
        return NF4Tensor(packed=self.packed, absmax=self.absmax, shape=torch.Size((self.num_embeddings,
                         self.embedding_dim)), dtype=self.stored_dtype, code=self.code, blocksize=self.blocksize,
                         absmax2=self.absmax2, code2=self.code2, offset=self.offset, blocksize2=self.blocksize2)

    def _apply(self, fn, recurse=True):
        # model.to(dtype) / .half() would cast the fp32 scales and code tables like any float buffer: wrong values,
        # no error. Device moves apply; a float cast changes the output dtype (as it does an nn.Embedding's) and
        # leaves the NF4 state exact.
        probe = fn(self.code)
        if probe.dtype != self.code.dtype and probe.dtype in K.OUT_DTYPES:
            self.compute_dtype = probe.dtype
        for name in _STATE:
            self._buffers[name] = getattr(self, name).to(probe.device)
        return self

    def forward(self, input_ids: Tensor) -> Tensor:
        return nf4_embedding(self.nf4(), input_ids, self.compute_dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """The whole (num_embeddings, dim) table, dense (the export's `weight`)."""
        return nf4_dequantize(self.nf4(), dtype or self.compute_dtype)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, nf4 double-quant -> {self.compute_dtype}, "
                f"{sum(b.numel() * b.element_size() for b in self.buffers()) / 2**20:.1f} MiB")
