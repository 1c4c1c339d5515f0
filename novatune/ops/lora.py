"""Fused LoRA linear as registered torch.library ops, plus the eager autograd.Function and the functional.

    y = x Wᵀ (+ b) + s · (x_l Aᵀ) Bᵀ      (novatune.ops.lora_linear; math, GEMM order: novatune/kernels/lora.py)

W (and b) are the frozen base layer's; A (r, in) and B (out, r) the adapter's; x_l = x, or the LoRA branch's own
input when the caller applies dropout to it (PEFT applies `lora_dropout` to the LoRA branch only). The backward
is written by hand: no dW unless W requires grad, xa = x_l Aᵀ (tokens x r) saved from the forward, and no
(tokens x out) tensor besides dy itself.

Registered ops (visible to torch.compile, FSDP2, opcheck):
    torch.ops.novatune.lora_linear_fwd(x, weight, bias?, lora_a, lora_b, scaling, x_lora?) -> (y, xa)
    torch.ops.novatune.lora_linear_bwd(dy, x, weight, bias?, lora_a, lora_b, xa, scaling, x_lora?,
        need_dx, need_dweight, need_dbias, need_da, need_db) -> (dx, dx_lora, dweight, dbias, da, db)
A gradient that is not computed comes back as an empty tensor (a custom op cannot return None); the registered
autograd turns it into None. Eager calls use `_LoRALinearFunction` instead: the custom-op dispatch costs ~100 µs of
host time per fwd+bwd, and a Qwen3-4B step runs 7 LoRA linears x 36 layers x (forward, recompute, backward).
Identical numbers on both paths (tested). Neither is twice differentiable (the backward reads xa saved from the
forward): a second-order gradient raises (the Function's backward is once_differentiable) instead of being wrong.

There is no device switch: the implementation is the same cuBLAS / CPU-BLAS GEMM sequence everywhere (nothing
to tune: the GEMMs are the vendor's), so the CPU path is the GPU path and the fp32 reference is only for tests.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from novatune.kernels import lora as K

__all__ = ["lora_linear", "lora_linear_fwd", "lora_linear_bwd", "lora_linear_group"]


def _flat(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.reshape(-1, t.shape[-1])


def _fwd_impl(x, weight, bias, lora_a, lora_b, scaling, x_lora):
    y, xa = K.lora_linear_fwd(_flat(x), weight, bias, lora_a, lora_b, scaling, _flat(x_lora))
    return y.view(*x.shape[:-1], weight.shape[0]), xa


def _bwd_impl(dy, x, weight, bias, lora_a, lora_b, xa, scaling, x_lora, need_dx, need_dweight, need_dbias,
              need_da, need_db, adapter_dtype=None):
    dx, dxl, dw, dbias, da, db = K.lora_linear_bwd(
        _flat(dy), _flat(x), weight, lora_a, lora_b, xa, scaling, _flat(x_lora), need_dx=need_dx, need_da=need_da,
        need_db=need_db, need_dweight=need_dweight, dbias_dtype=bias.dtype if need_dbias else None,
        adapter_dtype=adapter_dtype)
    return (None if dx is None else dx.view(x.shape), None if dxl is None else dxl.view(x_lora.shape), dw, dbias,
            da, db)


# ----------------------------------------------------------------------------------------------- registered ops
@torch.library.custom_op("novatune::lora_linear_fwd", mutates_args=())
def lora_linear_fwd(x: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor,
                    scaling: float, x_lora: Tensor | None) -> tuple[Tensor, Tensor]:
    """(y, xa): y (*x.shape[:-1], out) in x's dtype; xa = x_l Aᵀ (tokens, r), saved for the backward."""
    return _fwd_impl(x, weight, bias, lora_a, lora_b, scaling, x_lora)


@lora_linear_fwd.register_fake
def _lora_linear_fwd_fake(x, weight, bias, lora_a, lora_b, scaling, x_lora):
    torch._check(x.shape[-1] == weight.shape[1], lambda: "lora_linear: x and weight disagree on in_features")
    tokens = x.numel() // x.shape[-1]
    return x.new_empty((*x.shape[:-1], weight.shape[0])), x.new_empty((tokens, lora_a.shape[0]))


@torch.library.custom_op("novatune::lora_linear_bwd", mutates_args=())
def lora_linear_bwd(dy: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor,
                    xa: Tensor, scaling: float, x_lora: Tensor | None, need_dx: bool, need_dweight: bool,
                    need_dbias: bool, need_da: bool, need_db: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                              Tensor]:
    outs = _bwd_impl(dy, x, weight, bias, lora_a, lora_b, xa, scaling, x_lora, need_dx, need_dweight, need_dbias,
                     need_da, need_db)
    dx, dx_lora, dweight, dbias, da, db = (x.new_empty(0) if t is None else t for t in outs)
    return dx, dx_lora, dweight, dbias, da, db


@lora_linear_bwd.register_fake
def _lora_linear_bwd_fake(dy, x, weight, bias, lora_a, lora_b, xa, scaling, x_lora, need_dx, need_dweight,
                          need_dbias, need_da, need_db):
    def out(like, need):  # a fresh placeholder each: outputs must not alias one another (as the real impl's)
        return like.new_empty(like.shape) if need else x.new_empty(0)

    return (out(x, need_dx), out(x_lora, need_dx and x_lora is not None), out(weight, need_dweight),
            out(bias, need_dbias and bias is not None), out(lora_a, need_da), out(lora_b, need_db))


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, lora_a, lora_b, scaling, x_lora = inputs
    _y, xa = output
    ctx.save_for_backward(x, weight, bias, lora_a, lora_b, xa, x_lora)
    ctx.scaling = scaling


def _backward(ctx, dy: Tensor, _dxa: Tensor | None):
    # xa is an auxiliary output for the backward; a gradient flowing into it is not supported (ignored)
    x, weight, bias, lora_a, lora_b, xa, x_lora = ctx.saved_tensors
    nx, nw, nb, na, nbb, _, nxl = ctx.needs_input_grad
    dx, dxl, dw, dbias, da, db = torch.ops.novatune.lora_linear_bwd(
        dy, x, weight, bias, lora_a, lora_b, xa, ctx.scaling, x_lora, nx or nxl, nw, nb, na, nbb)
    # a gradient not asked for is an empty placeholder from the op: hand autograd None for it
    return (dx if nx else None), (dw if nw else None), (dbias if nb else None), (da if na else None), \
        (db if nbb else None), None, (dxl if nxl else None)


lora_linear_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------- eager fast path
class _LoRALinearFunction(torch.autograd.Function):
    """Same implementations as the registered ops, without the custom-op dispatch overhead (eager only)."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling, x_lora):
        # adapters cast to x's dtype once (no-ops when they have it) and kept for the backward: PEFT's fp32
        # adapters on a bf16 model are not cast again there (2 launches fewer; 2 x r x (in + out) bytes kept)
        a, b = lora_a.to(x.dtype), lora_b.to(x.dtype)
        if not isinstance(weight, Tensor) and getattr(weight, "keep_for_backward", False) and ctx.needs_input_grad[0]:
            weight = weight()  # QLoRA inside a checkpointed layer: this dense W also serves the backward's dx GEMM
        y, xa = _fwd_impl(x, weight, bias, a, b, scaling, x_lora)
        dense = isinstance(weight, Tensor)
        # QLoRA: the NF4 stand-in is kept on ctx (its packed storage is the module's own; nothing new is held)
        ctx.save_for_backward(x, weight if dense else None, bias, a, b, xa, x_lora)
        ctx.weight_obj = None if dense else weight
        ctx.scaling, ctx.adapter_dtype = scaling, lora_a.dtype
        return y

    @staticmethod
    @once_differentiable  # xa is a saved forward output: a gradient of this backward would miss its dependence
    def backward(ctx, dy: Tensor):
        x, weight, bias, a, b, xa, x_lora = ctx.saved_tensors
        weight = weight if ctx.weight_obj is None else ctx.weight_obj
        nx, nw, nb, na, nbb, _, nxl = ctx.needs_input_grad
        dx, dxl, dw, dbias, da, db = _bwd_impl(dy, x, weight, bias, a, b, xa, ctx.scaling, x_lora,
                                               nx or nxl, nw, nb, na, nbb, ctx.adapter_dtype)
        return (dx if nx else None), dw, dbias, da, db, None, (dxl if nxl else None)


# ----------------------------------------------------------------------------------------------- public API
def lora_linear(x: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor, scaling: float,
                x_lora: Tensor | None = None) -> Tensor:
    """x Wᵀ (+ b) + scaling · (x_l Aᵀ) Bᵀ with x_l = x_lora if given else x; differentiable in every tensor.

    x: (..., in) with W's dtype; weight (out, in); bias (out,) or None; lora_a (r, in); lora_b (out, r), any
    float dtype (cast to x's for the GEMMs; their gradients come back in their own dtype); x_lora: x's shape
    (e.g. dropout(x)), any float dtype. Returns (..., out) in x's dtype.

    weight may also be a dequantise-on-the-fly stand-in (QLoRA: novatune.ops.nf4.DequantWeight, frozen; math in
    novatune/kernels/lora.py): eager only for now, since the registered ops take tensors."""
    if not isinstance(weight, Tensor):
        if torch.compiler.is_compiling():
            raise NotImplementedError("lora_linear: a quantised base weight (QLoRA) runs eagerly only; call it "
                                      "outside torch.compile (mark the layer with torch.compiler.disable)")
        return _LoRALinearFunction.apply(x, weight, bias, lora_a, lora_b, float(scaling), x_lora)
    if torch.compiler.is_compiling():
        return torch.ops.novatune.lora_linear_fwd(x, weight, bias, lora_a, lora_b, float(scaling), x_lora)[0]
    return _LoRALinearFunction.apply(x, weight, bias, lora_a, lora_b, float(scaling), x_lora)


# ----------------------------------------------------------------------------------------------- grouped (eager)
class _LoRAGroupFunction(torch.autograd.Function):
    """Several LoRA linears on one input (novatune/kernels/lora.py, "grouped"); outputs are column blocks of one
    buffer. The stacked dense weights are kept for the backward only when the members' stand-ins say so (QLoRA
    inside a checkpointed layer, as _LoRALinearFunction), else densified again there."""

    @staticmethod
    def forward(ctx, x, weights, scaling, *adapters):
        n = len(weights)
        x2 = _flat(x)
        y, xa, w_cat, a_cat, b_casts = K.lora_group_fwd(x2, weights, adapters[:n], adapters[n:], scaling)
        # dense members are copied into W_cat: never held (the backward copies again); stand-ins as they say
        keep = ctx.needs_input_grad[0] and all(not isinstance(w, Tensor) and getattr(w, "keep_for_backward", False)
                                               for w in weights)
        ctx.save_for_backward(x2, xa, a_cat, w_cat if keep else None, *b_casts)
        ctx.weights, ctx.scaling, ctx.n, ctx.x_shape = (None if keep else weights), scaling, n, x.shape
        ctx.adapter_dtypes = [a.dtype for a in adapters]
        outs = [w.shape[0] for w in weights]
        return tuple(y.view(*x.shape[:-1], sum(outs)).split(outs, dim=-1))

    @staticmethod
    @once_differentiable  # as _LoRALinearFunction: xa is saved from the forward
    def backward(ctx, *dys):
        x2, xa, a_cat, w_cat, *b_casts = ctx.saved_tensors
        n = ctx.n
        # an output nobody used gets no gradient (None): it contributes nothing
        dys = [torch.zeros(x2.shape[0], b.shape[0], dtype=x2.dtype, device=x2.device) if dy is None
               else dy.reshape(-1, dy.shape[-1]) for dy, b in zip(dys, b_casts)]
        need_x, _, _, *need_ad = ctx.needs_input_grad
        dx, das, dbs = K.lora_group_bwd(dys, x2, ctx.weights, w_cat, a_cat, b_casts, xa, ctx.scaling,
                                        need_dx=need_x, need_da=any(need_ad[:n]), need_db=any(need_ad[n:]),
                                        adapter_dtype=ctx.adapter_dtypes[0])
        das = [None if d is None else d.to(t) for d, t in zip(das, ctx.adapter_dtypes[:n])]
        dbs = [None if d is None else d.to(t) for d, t in zip(dbs, ctx.adapter_dtypes[n:])]
        return (None if dx is None else dx.view(ctx.x_shape)), None, None, *das, *dbs


def lora_linear_group(x: Tensor, weights: list, lora_as: list[Tensor], lora_bs: list[Tensor],
                      scaling: float) -> tuple[Tensor, ...]:
    """lora_linear for several members sharing x and one scaling (an attention layer's q/k/v): one tuple of
    outputs, member i's (..., out_i) a column block of one buffer (last dim contiguous, rows strided). Eager only;
    no bias, no dropout (the patch groups only members on that fast path)."""
    if torch.compiler.is_compiling():
        raise NotImplementedError("lora_linear_group runs eagerly only")
    if not (len(weights) == len(lora_as) == len(lora_bs)) or not weights:
        raise ValueError(f"lora_linear_group: {len(weights)} weights, {len(lora_as)} A, {len(lora_bs)} B")
    if any(isinstance(w, Tensor) and w.requires_grad for w in weights):
        raise ValueError("lora_linear_group: the base weights are frozen here (no W gradient); a weight that "
                         "requires grad needs lora_linear per member")
    return _LoRAGroupFunction.apply(x, list(weights), float(scaling), *lora_as, *lora_bs)
