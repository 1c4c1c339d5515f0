"""LoRA linear: the GEMM sequences of the fused forward/backward (the fp32 oracle is novatune.reference.lora).

    y = x Wᵀ (+ b) + s · (x_l Aᵀ) Bᵀ          W (out, in) frozen, A (r, in), B (out, r), s = alpha / r
                                               x_l = x, or dropout(x) for the LoRA branch only (PEFT's order)

No Triton here on purpose: every product is a cuBLAS (or CPU BLAS) GEMM. What the fused version saves over PEFT's
eager module is passes over (tokens x out) and (tokens x in) memory and launches, not FLOPs. The scaling s never
costs a kernel: it is the GEMMs' alpha (addmm(..., alpha=s), applied in fp32 in the epilogue).

forward (the big GEMM + 2 with K or N = r):
    xa = x_l Aᵀ                             (tokens, r)   kept for the backward (tiny)
    y  = s · xa Bᵀ (+ b)                    (tokens, out) K = r GEMM, bias in its epilogue
    y += x Wᵀ                               the big GEMM accumulates into y (beta = 1): its read of y hides under
                                            a compute-bound GEMM, where PEFT's `base + lora * s` is three more
                                            memory-bound passes (fp32 ones when the adapters are fp32)
backward (dy: (tokens, out); nothing else of that size is ever allocated):
    g  = dy B                               (tokens, r)
    dB = s · dyᵀ xa                         (out, r)
    dA = s · gᵀ x_l                         (r, in)
    dx = s · g A ; dx += dy W               K = r GEMM first, then the big GEMM accumulates into it (as forward);
                                            with dropout, dx_l = s · g A is returned separately (autograd routes
                                            it through the dropout) and dx = dy W
    no dW (W is frozen) unless asked for: dW = dyᵀ x;  db = Σ_tokens dy when the bias trains

Precision: the GEMMs run in x's dtype (bf16 in training) with fp32 accumulation inside BLAS; A and B are cast to
that dtype (r x in and out x r: a few hundred KiB; the op layer casts once per forward and keeps the casts for the
backward), so adapters PEFT keeps in fp32 cost no fp32 GEMM and no fp32 (tokens x out) temporary. dA and dB come
out of bf16 GEMMs (fp32 accumulate, one rounding) and are returned in the adapters' own dtype. The forward rounds
xa once and the LoRA term once more before the final sum: a few bf16 ulps relative to the output
(tests/kernels/test_lora.py states the tolerances).

The base weight W is either a dense tensor or a dequantise-on-the-fly stand-in (QLoRA: novatune.ops.nf4.DequantWeight,
any object with `.shape`, `.dtype`, `.device` and `__call__() -> dense W`): each big GEMM materialises it just
before and drops it right after (`_dense`), so the forward holds one dequantised weight for the length of one GEMM
and the backward dequantises again instead of keeping it (dx = dy·dequant(W) + s·(dy B)A; never a W gradient).
Callers that may hold the dense weight (novatune.ops.lora inside a checkpointed layer) pass it as a tensor to both
instead. Every operand must be on x's device (ValueError otherwise: a GEMM into x's buffer does not check them).

Launchers take 2-D operands (callers flatten leading dims) and optional preallocated `out=` / `dx=` buffers so
tests can poison them and check every element is written (a beta = 0 GEMM never reads its output's old values).
No torch.autograd, no transformers (ARCHITECTURE.md).
"""
from __future__ import annotations

import torch
from torch import Tensor

ORDERS = ("lora_first", "base_first")


def _check(x: Tensor, weight: Tensor, lora_a: Tensor, lora_b: Tensor, x_lora: Tensor | None,
           bias: Tensor | None = None) -> None:
    n_in, n_out, r = weight.shape[1], weight.shape[0], lora_a.shape[0]
    for name, t in (("weight", weight), ("lora_a", lora_a), ("lora_b", lora_b), ("x_lora", x_lora), ("bias", bias)):
        # a GEMM writing into x's device never checks its operands' (a meta W makes addmm_ skip the product)
        if t is not None and t.device != x.device:
            raise ValueError(f"lora_linear: {name} is on {t.device} but x on {x.device}: move the layer and its "
                             "input to one device (a meta weight has not been materialised: load it first)")
    if x.dim() != 2 or x.shape[1] != n_in:
        raise ValueError(f"lora_linear: x must be (tokens, {n_in}), got {tuple(x.shape)}")
    if tuple(lora_a.shape) != (r, n_in) or tuple(lora_b.shape) != (n_out, r):
        raise ValueError(f"lora_linear: A {tuple(lora_a.shape)} / B {tuple(lora_b.shape)} do not fit W "
                         f"{tuple(weight.shape)} (need A (r, {n_in}), B ({n_out}, r))")
    if weight.dtype != x.dtype:
        raise TypeError(f"lora_linear: x is {x.dtype} but the base weight is {weight.dtype} (the GEMMs run in "
                        f"x's dtype; cast x as the base layer would need)")
    if x_lora is not None and x_lora.shape != x.shape:
        raise ValueError(f"lora_linear: x_lora {tuple(x_lora.shape)} must have x's shape {tuple(x.shape)}")
    if bias is not None and tuple(bias.shape) != (n_out,):
        raise ValueError(f"lora_linear: bias must be ({n_out},), got {tuple(bias.shape)}")


def _dense(weight) -> Tensor:
    """The dense (out, in) base weight: the tensor itself, or a fresh dequantisation (a temporary the caller's
    GEMM consumes; freed when the expression ends, so the caching allocator reuses its block for the next one)."""
    return weight if isinstance(weight, Tensor) else weight()


def _scaled_mm(m1: Tensor, m2: Tensor, scaling: float, out: Tensor | None = None) -> Tensor:
    """scaling · m1 m2 in one GEMM: addmm with beta = 0 (its input is ignored, never read) and alpha = scaling."""
    if out is None:
        out = m1.new_empty(m1.shape[0], m2.shape[1])
    return out.addmm_(m1, m2, beta=0, alpha=scaling)


def lora_linear_fwd(x: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor, scaling: float,
                    x_lora: Tensor | None = None, out: Tensor | None = None,
                    order: str = "lora_first") -> tuple[Tensor, Tensor]:
    """(y, xa): y (tokens, out) in x's dtype; xa = x_l Aᵀ (tokens, r) in x's dtype, for the backward.

    order: "lora_first" (default: the K = r GEMM writes y, the big GEMM accumulates into it) or "base_first"
    (big GEMM writes y, the K = r GEMM accumulates: one more memory-bound read of y; kept for bench_lora.py)."""
    _check(x, weight, lora_a, lora_b, x_lora, bias)
    cd = x.dtype
    a, b = lora_a.to(cd), lora_b.to(cd)  # no-ops when the caller passes them in x's dtype (the op layer does)
    xa = torch.mm(x if x_lora is None else x_lora.to(cd), a.t())  # (tokens, r)
    if order == "lora_first":
        if bias is None:
            y = _scaled_mm(xa, b.t(), scaling, out)
        else:
            y = torch.addmm(bias.to(cd), xa, b.t(), alpha=scaling, out=out)
        y.addmm_(x, _dense(weight).t())  # (tokens, out): the big GEMM with beta = 1
    elif order == "base_first":
        if bias is None:
            y = torch.mm(x, _dense(weight).t(), out=out)
        else:
            y = torch.addmm(bias.to(cd), x, _dense(weight).t(), out=out)
        y.addmm_(xa, b.t(), alpha=scaling)
    else:
        raise ValueError(f"lora_linear_fwd: order={order!r}, choose one of {ORDERS}")
    return y, xa


def lora_linear_bwd(dy: Tensor, x: Tensor, weight: Tensor, lora_a: Tensor, lora_b: Tensor, xa: Tensor,
                    scaling: float, x_lora: Tensor | None = None, *, need_dx: bool = True, need_da: bool = True,
                    need_db: bool = True, need_dweight: bool = False, dbias_dtype: torch.dtype | None = None,
                    adapter_dtype: torch.dtype | None = None, dx: Tensor | None = None):
    """(dx, dx_lora, dweight, dbias, da, db); entries not asked for (or with no x_lora: dx_lora) are None.
    need_dx covers both input gradients (x's and, with dropout, x_lora's: both come from the same activation).

    dx, dx_lora: x's / x_lora's dtype; dweight: W's; dbias (only when dbias_dtype is given, in that dtype): summed
    in fp32; da, db: adapter_dtype (default: lora_a's dtype; the op layer passes pre-cast adapters and the
    parameters' dtype here). With x_lora (dropout), dx = dy W only and dx_lora = s (dy B) A: the caller's autograd
    adds the two through the dropout. Without it, dx = s (dy B) A + dy W in one buffer."""
    _check(x, weight, lora_a, lora_b, x_lora)
    if need_dweight and not isinstance(weight, Tensor):
        raise ValueError("lora_linear_bwd: a quantised (dequantise-on-the-fly) base weight is frozen: no dW")
    cd = x.dtype
    adt = lora_a.dtype if adapter_dtype is None else adapter_dtype
    dy = dy.to(cd)
    a, b = lora_a.to(cd), lora_b.to(cd)
    xl = x if x_lora is None else x_lora.to(cd)
    g = torch.mm(dy, b) if (need_da or need_dx) else None  # (tokens, r): reads dy once; None when not needed
    db = _scaled_mm(dy.t(), xa, scaling).to(adt) if need_db else None  # (out, r): reads dy again
    da = _scaled_mm(g.t(), xl, scaling).to(adt) if g is not None and need_da else None  # (r, in)
    dx_out = dx_lora = None
    if g is not None and need_dx:
        if x_lora is not None:
            # the LoRA branch's input gradient, routed through the dropout by the caller's autograd
            dx_lora = _scaled_mm(g, a, scaling).to(x_lora.dtype)  # (tokens, in)
            dx_out = torch.mm(dy, _dense(weight), out=dx)
        else:
            dx_out = _scaled_mm(g, a, scaling, dx)  # K = r GEMM writes dx ...
            dx_out.addmm_(dy, _dense(weight))  # ... the big GEMM accumulates into it
    dweight = torch.mm(dy.t(), x).to(weight.dtype) if need_dweight else None
    dbias = dy.sum(0, dtype=torch.float32).to(dbias_dtype) if dbias_dtype is not None else None
    return dx_out, dx_lora, dweight, dbias, da, db


# ----------------------------------------------------------------------------------------------- grouped
# Several LoRA linears reading the same input (an attention layer's q/k/v): member i has W_i (out_i, in), A_i
# (r_i, in), B_i (out_i, r_i), one common scaling s. One launch sequence for the group instead of one per member:
#     xa = x A_catᵀ                     (tokens, R)   one GEMM for every member's x A_iᵀ (A_cat = A_i stacked)
#     W_cat = W_i stacked               (O, in)       dequantised straight into its rows (QLoRA), no copy after
#     Y[:, cols_i] = s · xa_i B_iᵀ      member by member, into one (tokens, O) buffer
#     Y += x W_catᵀ                     one big GEMM for all members
# and the outputs are Y's column blocks. Backward, with dy_i for each member:
#     G[:, r_i] = dy_i B_i ;  dB_i = s · dy_iᵀ xa_i ;  dA_cat = s · Gᵀ x (one GEMM) ;
#     dx = s · G A_cat (one GEMM, K = R) + Σ_i dy_i W_i   (accumulated in one fp32-accumulated buffer)
# Per member the products are the single-linear ones above; dx sums the members inside GEMMs instead of in bf16
# afterwards (autograd adding three separate dx), which only removes roundings.


def _dense_into(weight, out: Tensor) -> Tensor:
    """The dense weight written into `out` (a row block of W_cat): a copy, or a dequantisation straight into it
    (a stand-in with `.into(out)`, e.g. novatune.ops.nf4.DequantWeight)."""
    return out.copy_(weight) if isinstance(weight, Tensor) else weight.into(out)


def lora_group_fwd(x: Tensor, weights: list, lora_as: list[Tensor], lora_bs: list[Tensor], scaling: float):
    """(Y, xa, W_cat, A_cat, B_casts) for members sharing x (tokens, in): Y (tokens, Σ out_i) with member i in its
    column block (in order), xa (tokens, Σ r_i), W_cat (Σ out_i, in) the stacked dense weights, A_cat and B_casts
    the adapters in x's dtype (what the backward needs). Every product in x's dtype, fp32 accumulation."""
    for w, a, b in zip(weights, lora_as, lora_bs):
        _check(x, w, a, b, None)
    cd, (tokens, n_in) = x.dtype, x.shape
    a_cat = torch.cat(list(lora_as)).to(cd)  # (R, in): one cast for all members
    b_casts = [b.to(cd) for b in lora_bs]
    outs = [w.shape[0] for w in weights]
    w_cat = x.new_empty(sum(outs), n_in)
    y = x.new_empty(tokens, sum(outs))
    xa = torch.mm(x, a_cat.t())  # (tokens, R)
    o = r = 0
    for w, b, n in zip(weights, b_casts, outs):
        _dense_into(w, w_cat[o:o + n])
        k = b.shape[1]
        y[:, o:o + n].addmm_(xa[:, r:r + k], b.t(), beta=0, alpha=scaling)  # writes the block, reads nothing
        o, r = o + n, r + k
    y.addmm_(x, w_cat.t())
    return y, xa, w_cat, a_cat, b_casts


def lora_group_bwd(dys: list[Tensor], x: Tensor, weights: list, w_cat: Tensor | None, a_cat: Tensor,
                   b_casts: list[Tensor], xa: Tensor, scaling: float, *, need_dx: bool = True, need_da: bool = True,
                   need_db: bool = True, adapter_dtype: torch.dtype | None = None):
    """(dx, [dA_i], [dB_i]) for lora_group_fwd's members; w_cat None: the weights are densified again (QLoRA
    outside a checkpointed layer). Entries not asked for are None. dA_i / dB_i in adapter_dtype (default
    A_cat's), dx in x's dtype."""
    cd, adt = x.dtype, adapter_dtype or a_cat.dtype
    ranks = [b.shape[1] for b in b_casts]
    outs = [b.shape[0] for b in b_casts]
    dys = [dy.to(cd) for dy in dys]
    g = x.new_empty(x.shape[0], sum(ranks)) if (need_da or need_dx) else None
    dbs: list[Tensor | None] = [None] * len(dys)
    r = 0
    for i, (dy, b, k) in enumerate(zip(dys, b_casts, ranks)):
        if g is not None:
            g[:, r:r + k].addmm_(dy, b, beta=0)  # (tokens, r_i)
        if need_db:
            dbs[i] = _scaled_mm(dy.t(), xa[:, r:r + k], scaling).to(adt)  # (out_i, r_i)
        r += k
    das: list[Tensor | None] = [None] * len(dys)
    if g is not None and need_da:
        das = list(_scaled_mm(g.t(), x, scaling).to(adt).split(ranks))
    dx = None
    if g is not None and need_dx:
        if w_cat is None:
            w_cat = x.new_empty(sum(outs), x.shape[1])
            o = 0
            for w, n in zip(weights, outs):
                _dense_into(w, w_cat[o:o + n])
                o += n
        dx = _scaled_mm(g, a_cat, scaling)  # the members' LoRA terms summed inside one GEMM (K = R)
        o = 0
        for dy, n in zip(dys, outs):
            dx.addmm_(dy, w_cat[o:o + n])
            o += n
    return dx, das, dbs
