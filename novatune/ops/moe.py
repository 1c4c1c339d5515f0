"""Mixture-of-experts: the expert MLP over grouped GEMMs, with a memory-lean backward, and the sort of the routing.

    moe_experts(x, ids, weights, gate_up, down, ...) -> (T, H)             out[t] = sum_k w[t,k] * expert(x[t])
The router's arithmetic (logits -> weights and ids) is novatune.ops.moe_routing.route.

How the expert MLP runs (T tokens, K choices, S = T * K rows, E experts; nothing reads a device value on the host,
so there is no host sync in the forward or the backward and every shape is known from T, K, H, I, E alone):

1. one stable sort of the (T*K,) expert ids (values and order in one call; one-byte keys up to 256 experts, so
   the radix sort runs one pass)
2. dispatch (one Triton launch): xs[r] = x[token of row r], and from the sorted ids the inverse permutation pos and
   the cumulative int32 group ends that grouped_mm takes (the same counts as a bincount, without its
   data-dependent output size)
3. h = grouped_mm(xs, gate_up) (+ bias per row), a = silu(gate) * up read from h in place (Triton)
4. y = grouped_mm(a, down) (+ bias), out = combine(y) (Triton: out[t] = sum_k w[t,k] * y[pos[t,k]], fp32
   accumulation; no weighted copy and no inverse-permuted copy of y)

The backward saves only x, the routing weights, h (S x 2I) and the routing's integers; it recomputes xs by the
gather and a from h, and never needs y: with dout_s = dout[token of each row] (a gather) and
da_u = dout_s @ W_down (the grouped GEMM the backward runs anyway), the routing weight's gradient is
dw = <y, dout> = <a, da_u> (+ <b_down, dout_s> with a bias), and the rest of the backward takes the weight inside
one row-wise Triton kernel (dh = act'(h) * w * da_u, aw = w * a for dW_down = aw^T dout_s; it reads w through the
sort order). da_u stays fp32 (the GEMM's accumulator; the dot product has cancellation). The input gradient's
unpermute also brings dw back to (token, choice) order in the same launch. Saved per layer: S x 2I + T x H
elements, where stock's grouped_mm path also keeps the gathered inputs and the expert outputs (2 x S x H more).
dX = dY @ W and dW = X^T dY per group are grouped GEMMs too, and the router trains as in stock.

Layouts are data: weights (E, out, in) as nn.Linear stores them or (E, in, out) (`transposed`, GPT-OSS); gate/up
concatenated [gate; up] or interleaved (g0, u0, g1, u1, ...); optional biases (E, out); `activation` names an
entry of ACTIVATIONS, so a family with another gated activation adds an entry instead of a new op: a pair
(fwd(h, interleaved) -> a (S, I), routed_bwd(da_u, h, w_pairs, order, interleaved) -> (dh (S, 2I), w * a (S, I),
<a, da_u> per row (S,) fp32), row r's weight w = w_pairs[order[r]]) on the fused gate_up output h (see
novatune.kernels.moe).

Host work is part of the design: the MoE step is host-bound on a GPU (the host queues kernels more slowly than
they run), so each layer's forward is a sort, one dispatch launch, two grouped GEMMs, the GLU and the combine,
and its backward two gathers, four grouped GEMMs, the GLU backward and one combine; bench/experiments/
exp_moe_host.py counts them.

Grouped GEMM: torch.nn.functional.grouped_mm (torch._grouped_mm on older releases) on CUDA. On the CPU torch's
kernel needs 16-byte aligned strides; other CPU shapes (odd hidden sizes in tests) run a per-group loop that reads
the group ends on the host - the CPU fallback only, never used on a GPU. Device rule as every op
(novatune.ops._backend): CUDA -> Triton kernels; CPU -> fp32 references for the data movement and activation
(Triton under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from novatune.kernels import clamped_swiglu as K_CLAMPED
from novatune.kernels import moe as K
from novatune.kernels import moe_bias as KB
from novatune.kernels.moe_wgrad import grouped_outer_accumulate
from novatune.ops import grad_norm
from novatune.ops._backend import use_triton
from novatune.ops.clamped_swiglu import ALPHA as CLAMP_ALPHA
from novatune.ops.clamped_swiglu import LIMIT as CLAMP_LIMIT
from novatune.ops.clamped_swiglu import clamped_swiglu_bwd, clamped_swiglu_fwd
from novatune.ops.contract import Candidate, OpSpec
from novatune.ops.grad_accumulation import accumulates_into_grad
from novatune.ops.moe_checks import check_expert_ids as _check_ids
from novatune.ops.moe_checks import check_experts_args as _check_args
from novatune.ops.moe_wgrad import weight_grad
from novatune.reference import moe as _ref

# torch >= 2.10 names it torch.nn.functional.grouped_mm; the private name is the same kernel
_NATIVE_GROUPED_MM = getattr(F, "grouped_mm", None) or torch._grouped_mm


# ----------------------------------------------------------------------------------------------- routing
@dataclass(frozen=True)
class Routing:
    """Where each (token, choice) pair sits once sorted by expert (all on the device, no host copy).

    order (S,): the (token, choice) pair of sorted row r (its token is order // K); pos (T, K): the sorted row of
    token t's k-th choice; ends (E,) int32: cumulative group ends (grouped_mm's offsets); expert (S,): the expert
    of each sorted row, in the sort's key dtype (sort_key_dtype: uint8 up to 256 experts)."""

    order: Tensor
    pos: Tensor
    ends: Tensor
    expert: Tensor

    @property
    def top_k(self) -> int:
        return self.pos.shape[1]

    def expert_index(self) -> Tensor:
        """expert as an index tensor (int64), for torch's indexing ops (a uint8 index would be read as a mask)."""
        return self.expert.long()


def sort_key_dtype(num_experts: int) -> torch.dtype:
    """The narrowest integer dtype that holds the expert ids: the radix sort runs one pass per key byte (uint8:
    one pass instead of the eight of int64 ids)."""
    if num_experts <= 256:
        return torch.uint8
    return torch.int16 if num_experts <= 1 << 15 else torch.int32


def _sort_ids(ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """(sorted expert ids in sort_key_dtype, order): one stable sort of the (T*K,) ids in [0, E) (ties keep token
    order: deterministic)."""
    return torch.sort(ids.reshape(-1).to(sort_key_dtype(num_experts)), stable=True)


def sort_by_expert(ids: Tensor, num_experts: int) -> Routing:
    """The routing of `ids` (T, K) with plain torch ops: the sort, a search for the group ends, a scatter for pos."""
    t, k = ids.shape
    expert, order = _sort_ids(ids, num_experts)
    ends = torch.searchsorted(expert, torch.arange(num_experts, device=ids.device, dtype=expert.dtype), right=True,
                              out_int32=True)
    pos = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=ids.device))
    return Routing(order=order, pos=pos.view(t, k), ends=ends, expert=expert)


def dispatch(x: Tensor, ids: Tensor, num_experts: int) -> tuple[Tensor, Routing]:
    """(xs (S, H) with xs[r] = x[token of row r], the routing): on the Triton path the sort and one launch that
    gathers the rows and writes pos and the group ends (novatune.kernels.moe.dispatch)."""
    if not use_triton(x):
        r = sort_by_expert(ids, num_experts)
        return x.index_select(0, r.order // r.top_k), r
    t, k = ids.shape
    expert, order = _sort_ids(ids, num_experts)
    xs, pos, ends = K.dispatch(x, order, expert, k, num_experts)
    return xs, Routing(order=order, pos=pos.view(t, k), ends=ends, expert=expert)


# ----------------------------------------------------------------------------------------------- grouped GEMM
def _aligned(*tensors: Tensor) -> bool:
    """torch's CPU grouped_mm needs every non-unit stride and the base address 16-byte aligned."""
    for t in tensors:
        size = t.element_size()
        strides = list(t.stride())
        if 1 in strides:  # one unit stride (the contiguous dim); a second one (a size-1 dim) must align too
            strides.remove(1)
        if t.data_ptr() % 16 or any((s * size) % 16 for s in strides):
            return False
    return True


_FP32_OUT_REFUSED: list[str] = []  # why this torch's CUDA grouped_mm refused out_dtype=float32 (reported once)


def grouped_mm(a: Tensor, b: Tensor, ends: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
    """Rows of a (S, K) in groups (cumulative int32 ends, (E,)) times b[e] (E, K, N) -> (S, N) in a's dtype, or
    in `out_dtype` (float32: the fp32 accumulator is kept instead of rounded to bf16)."""
    fp32_out = out_dtype is not None and out_dtype != a.dtype
    if a.is_cuda:
        if fp32_out and not _FP32_OUT_REFUSED:
            try:
                return _NATIVE_GROUPED_MM(a, b, offs=ends, out_dtype=out_dtype)
            except (RuntimeError, TypeError) as err:  # an older torch: say so once, keep the GEMM's own dtype
                _FP32_OUT_REFUSED.append(str(err).splitlines()[0])
                warnings.warn(f"novatune moe: torch's grouped_mm refused out_dtype={out_dtype} "
                              f"({_FP32_OUT_REFUSED[0]}); the routing weights' gradient uses the bf16 GEMM output "
                              "(stock's precision)", RuntimeWarning, stacklevel=2)
        return _NATIVE_GROUPED_MM(a, b, offs=ends)
    if not fp32_out and _aligned(a, b):
        return _NATIVE_GROUPED_MM(a, b, offs=ends)
    # CPU: torch's kernel needs 16-byte aligned strides and the output in the input dtype; otherwise a loop over
    # the groups (the group ends on the host cost nothing here)
    out = a.new_empty(a.shape[0], b.shape[2], dtype=out_dtype or a.dtype)
    start = 0
    for e, end in enumerate(ends.tolist()):
        torch.mm(a[start:end].to(out.dtype), b[e].to(out.dtype), out=out[start:end])
        start = end
    return out


@functools.cache
def _empty_groups_unwritten(device: torch.device) -> bool:
    """torch's grouped_mm leaves the weight gradient of an empty group unwritten on Blackwell (sm100: pytorch
    issue 172439); Hopper writes zeros. Where it does not, the result is masked (one pass over the gradient)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 10


def grouped_outer(a: Tensor, b: Tensor, ends: Tensor) -> Tensor:
    """Per group a_g^T b_g: a (S, M), b (S, N) -> (E, M, N); a group without rows gives zeros."""
    at = a.t()
    if a.is_cuda or _aligned(at, b):
        out = _NATIVE_GROUPED_MM(at, b, offs=ends)
        if _empty_groups_unwritten(a.device):
            counts = torch.diff(ends, prepend=ends.new_zeros(1))
            out = torch.where((counts > 0)[:, None, None], out, 0)  # never reads the host: no sync
        return out
    out = a.new_zeros(ends.shape[0], a.shape[1], b.shape[1])
    start = 0
    for e, end in enumerate(ends.tolist()):
        torch.mm(at[:, start:end], b[start:end], out=out[e])
        start = end
    return out


def _linear(x: Tensor, w: Tensor, bias: Tensor | None, r: Routing, transposed: bool) -> Tensor:
    y = grouped_mm(x, w if transposed else w.transpose(-2, -1), r.ends)
    return y if bias is None else _add_bias_(y, bias, r)


def _add_bias_(y: Tensor, bias: Tensor, r: Routing) -> Tensor:
    """y[row] += bias[expert of row], in place."""
    if use_triton(y) and bias.is_contiguous() and y.stride(1) == 1:
        return KB.expert_bias_add_(y, r.expert, bias)  # no gathered (S, N) copy of the bias
    return y.add_(bias[r.expert_index()])


def _linear_dinput(dy: Tensor, w: Tensor, r: Routing, transposed: bool, out_dtype=None) -> Tensor:
    return grouped_mm(dy, w.transpose(-2, -1) if transposed else w, r.ends, out_dtype)


def _linear_dweight(x: Tensor, dy: Tensor, r: Routing, transposed: bool) -> Tensor:
    return grouped_outer(x, dy, r.ends) if transposed else grouped_outer(dy, x, r.ends)


def _dweight(x: Tensor, dy: Tensor, r: Routing, transposed: bool, into: Tensor | None) -> Tensor | None:
    """The weight gradient of y = x W^T per group, returned; or, for a parameter in `into` (accumulates_into_grad
    accepted it), added into its .grad and None returned: inside the grouped GEMM on the Triton path
    (novatune.kernels.moe_wgrad: one pass, no fresh tensor), by column slices elsewhere (novatune.ops.moe_wgrad)."""
    if (into is not None and use_triton(dy) and dy.dtype in (torch.bfloat16, torch.float32)
            and into.grad is not None and into.grad.is_contiguous() and x.dtype == dy.dtype == into.grad.dtype):
        a, b = (x, dy) if transposed else (dy, x)
        squares = grad_norm.squares_wanted()  # the step's last backward: this is .grad's final value
        done = grouped_outer_accumulate(a, b, r.ends, into.grad, tma=True, squares=squares)  # TMA where it can
        # a kernel's write leaves the version counter as it was: bumped, so a record of .grad's squares made before
        # this addition no longer counts (novatune.ops.grad_norm)
        torch.autograd.graph.increment_version(into.grad)
        if squares:
            grad_norm.record_squares(into.grad, done[1])
        return None
    return weight_grad(functools.partial(_linear_dweight, x, r=r, transposed=transposed), dy, into,
                       2 if transposed else 1)  # the weights' output-feature dim: dY's columns


def _bias_grad(dy: Tensor, r: Routing, bias: Tensor, scale: Tensor | None = None) -> Tensor:
    """Per expert, the sum of its rows' gradients, each row times scale[r] when given (fp32 accumulation)."""
    if use_triton(dy):
        return KB.expert_column_sums(dy.contiguous(), r.expert, bias.shape[0], scale=scale).to(bias.dtype)
    rows = dy.float() if scale is None else dy.float() * scale[:, None]
    acc = torch.zeros(bias.shape, dtype=torch.float32, device=dy.device)
    return acc.index_add_(0, r.expert_index(), rows).to(bias.dtype)


# ----------------------------------------------------------------------------------------------- data movement
def permute(x: Tensor, r: Routing) -> Tensor:
    """xs[r] = x[token of row r]."""
    if use_triton(x):
        return K.gather_rows(x, r.order, div=r.top_k)
    return x.index_select(0, r.order // r.top_k)


def combine(y: Tensor, r: Routing, weights: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    if use_triton(y):
        return K.combine(y, r.pos, weights, out_dtype=out_dtype)
    return _ref.combine_ref(y, r.pos, weights).to(out_dtype)


def combine_and_pick(dys: Tensor, r: Routing, values: Tensor, out_dtype: torch.dtype,
                     values_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(sum over each token's rows of dys (T, H), values (S,) back in (token, choice) order (T, K)): the permute's
    backward and the routing weights' gradient in one launch on the Triton path."""
    if use_triton(dys):
        return K.combine_and_pick(dys, r.pos, values, values_dtype, out_dtype=out_dtype)
    return _ref.combine_ref(dys, r.pos, None).to(out_dtype), values[r.pos].to(values_dtype)


def _silu_glu_fwd(h: Tensor, interleaved: bool) -> Tensor:
    return K.glu_fwd(h, interleaved) if use_triton(h) else _ref.glu_ref(h, interleaved).to(h.dtype)


def _silu_glu_routed_bwd(da: Tensor, h: Tensor, w_pairs: Tensor, order: Tensor,
                         interleaved: bool) -> tuple[Tensor, Tensor, Tensor]:
    if use_triton(h):
        return K.glu_routed_bwd(da, h, w_pairs, interleaved, order=order)
    dh, aw, dw_row = _ref.glu_routed_bwd_ref(da, h, w_pairs[order], interleaved)
    return dh.to(h.dtype), aw.to(h.dtype), dw_row


def _needs_interleaved(interleaved: bool) -> None:
    if not interleaved:
        raise ValueError("the gpt_oss activation reads interleaved gate/up columns (g0, u0, g1, u1, ...)")


def _gpt_oss_glu_fwd(h: Tensor, interleaved: bool) -> Tensor:
    """GPT-OSS's clamped SwiGLU at its fixed alpha and limit (the spec refuses experts with other values)."""
    _needs_interleaved(interleaved)
    return clamped_swiglu_fwd(h, CLAMP_ALPHA, CLAMP_LIMIT)


def _gpt_oss_glu_routed_bwd(da: Tensor, h: Tensor, w_pairs: Tensor, order: Tensor,
                            interleaved: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The silu entry's contract from the clamped SwiGLU op: a recomputed from h, <a, da_u> in fp32, and the
    routing weight folded into the gradient before the activation's backward (dh = act'(h) * w * da_u)."""
    _needs_interleaved(interleaved)
    if use_triton(h):  # one launch: the silu entry's kernel with the clamped activation
        return K.glu_routed_bwd(da, h, w_pairs, True, order=order, clamp=(CLAMP_ALPHA, CLAMP_LIMIT))
    a = clamped_swiglu_fwd(h, CLAMP_ALPHA, CLAMP_LIMIT)
    w = w_pairs[order].float()[:, None]
    dot = (a.float() * da.float()).sum(-1)
    dh = clamped_swiglu_bwd((da.float() * w).to(h.dtype), h, CLAMP_ALPHA, CLAMP_LIMIT)
    return dh, (a.float() * w).to(h.dtype), dot


# name -> (fwd(h, interleaved) -> a, routed_bwd(da_u, h, w_pairs, order, interleaved) -> (dh, w * a, <a, da_u>)),
# row r's routing weight w being w_pairs[order[r]] (w_pairs: the (T*K,) weights in (token, choice) order)
ACTIVATIONS = {"silu": (_silu_glu_fwd, _silu_glu_routed_bwd), "gpt_oss": (_gpt_oss_glu_fwd, _gpt_oss_glu_routed_bwd)}


@dataclass(frozen=True)
class ExpertLayout:
    transposed: bool = False  # weights (E, in, out) instead of nn.Linear's (E, out, in)
    interleaved: bool = False  # gate/up alternate along the gate_up output instead of [gate; up]
    activation: str = "silu"


# ----------------------------------------------------------------------------------------------- forward, backward
def _experts_fwd(x: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor, gu_bias: Tensor | None,
                 dn_bias: Tensor | None, ids: Tensor, layout: ExpertLayout,
                 lora=None, output_unread: bool = False) -> tuple[Tensor, Tensor, Routing]:
    """(out (T, H) in x's dtype, h (S, 2I), routing): what the backward needs besides the inputs. `lora`: the
    adapters of the expert weights (novatune.ops.moe_lora.ExpertsLoRA), added inside the grouped GEMMs.
    `output_unread` (moe_experts'): out is left uninitialised, and the down projection and the combine skipped."""
    act_fwd, _ = ACTIVATIONS[layout.activation]
    # grouped_mm is not autocast-aware: run in the weights' dtype, as stock does
    xs, r = dispatch(x.to(gate_up.dtype), ids, gate_up.shape[0])
    # GPT-OSS's gate_up bias joins the clamped activation's pass (h += b written back, then act(h)) where nothing
    # else reads h in between (no adapter) and the kernel can take it
    fold = (gu_bias is not None and lora is None and layout.activation == "gpt_oss" and layout.interleaved
            and use_triton(xs) and gu_bias.is_contiguous())
    h = _linear(xs, gate_up, None if fold else gu_bias, r, layout.transposed)  # (S, 2I)
    if lora is not None:
        lora.add_gate_up(xs, h, r)
    del xs
    if fold and h.is_contiguous():
        a = K_CLAMPED.clamped_swiglu_fwd(h, CLAMP_ALPHA, CLAMP_LIMIT, bias=gu_bias, expert=r.expert)
    else:
        if fold and gu_bias is not None:  # rows padded by grouped_mm: the add on its own, then the activation
            _add_bias_(h, gu_bias, r)
        a = act_fwd(h, layout.interleaved)
    if output_unread:  # the backward reads h, the routing and the down adapter's u A^T: never y nor out
        if lora is not None:
            lora.down_factor_(a, r)
        return torch.empty_like(x), h, r
    y = _linear(a, down, dn_bias, r, layout.transposed)  # (S, H)
    if lora is not None:
        lora.add_down(a, y, r)
    return combine(y, r, weights, x.dtype), h, r


def _experts_bwd(dout: Tensor, x: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor, gu_bias: Tensor | None,
                 dn_bias: Tensor | None, h: Tensor, r: Routing, layout: ExpertLayout, needs: tuple[bool, ...],
                 lora=None, into: tuple[Tensor | None, Tensor | None] = (None, None)) -> tuple:
    """(dx, dweights, d_gate_up, d_down, d_gate_up_bias, d_down_bias); None where `needs` (x, weights, gate_up,
    down, gate_up_bias, down_bias) is False or the input is None, and for a weight in `into` (gate_up's, down's
    parameter or None), whose gradient is added into its .grad instead. Recomputes the permuted x and the activation.
    `lora` (the forward's ExpertsLoRA): its path joins dx and the routing weights' gradient, and the adapters'
    gradients are left on it."""
    _, act_bwd = ACTIVATIONS[layout.activation]
    dout_s = permute(dout.to(gate_up.dtype), r)  # (S, H): each row's token's gradient, not yet weighted
    w_pairs = weights.reshape(-1)  # row r's weight is w_pairs[order[r]]
    # the row weights as a tensor only where torch ops need them (a down bias, the down adapter)
    w_row = w_pairs[r.order].float() if dn_bias is not None or lora is not None else None
    # (S, I) = dout_s @ W_down, kept in fp32: the routing weight's gradient <a, da_u> is a dot product with
    # cancellation, which a bf16-rounded da_u would carry into it (rel. error ~2e-3 vs 2e-7 in fp32)
    da_u = _linear_dinput(dout_s, down, r, layout.transposed, out_dtype=torch.float32)
    if lora is not None:
        lora.down_dinput_(da_u, dout_s, r)
    dh, aw, dw_row = act_bwd(da_u, h, w_pairs, r.order, layout.interleaved)
    del da_u
    d_down = _dweight(aw, dout_s, r, layout.transposed, into[1]) if needs[3] else None
    if lora is not None:
        lora.down_grads(aw, dout_s, w_row, r)
    del aw
    d_dn_bias = None
    if dn_bias is not None:  # y = a W^T + b: b's part of <y, dout>, and b's gradient sum_rows w * dout_s
        assert w_row is not None  # computed above whenever there is a down bias
        if use_triton(dout_s) and dn_bias.is_contiguous():  # no gathered bias, no fp32 copy of dout_s
            # a fresh fp32 copy (one): the dot is added into it, and the activation's own output stays as it is
            dw_row = KB.expert_row_dot_(dw_row.to(torch.float32, memory_format=torch.contiguous_format, copy=True),
                                        dout_s, r.expert, dn_bias)
        else:
            dw_row = dw_row + (dout_s.float() * dn_bias[r.expert_index()].float()).sum(-1)
        d_dn_bias = _bias_grad(dout_s, r, dn_bias, w_row) if needs[5] else None
    del dout_s
    d_gate_up = None
    lora_gu = lora is not None and lora.gate_up is not None
    if needs[2] or lora_gu:
        xs = permute(x.to(gate_up.dtype), r)  # recomputed: a gather is cheaper than keeping S x H
        d_gate_up = _dweight(xs, dh, r, layout.transposed, into[0]) if needs[2] else None
        if lora_gu:
            lora.gate_up_grads(xs, dh, r)
        del xs
    d_gu_bias = _bias_grad(dh, r, gu_bias) if gu_bias is not None and needs[4] else None
    dx = dweights = None
    if needs[0]:
        dxs = _linear_dinput(dh, gate_up, r, layout.transposed)
        if lora_gu:
            lora.gate_up_dinput_(dxs, r)
        dx, dweights = combine_and_pick(dxs, r, dw_row, x.dtype, weights.dtype)
    if needs[1] and dweights is None:
        dweights = dw_row[r.pos].to(weights.dtype)  # (T, K): row pos[t, k] is pair (t, k)
    return dx, dweights if needs[1] else None, d_gate_up, d_down, d_gu_bias, d_dn_bias


# ----------------------------------------------------------------------------------------------- registered ops
# For torch.compile and FSDP2 tracing. Optional biases travel as empty tensors (a custom op returns no None).
def _opt(t: Tensor) -> Tensor | None:
    return None if t.numel() == 0 else t


@torch.library.custom_op("novatune::moe_experts_fwd", mutates_args=())
def moe_experts_fwd(x: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor, gate_up_bias: Tensor,
                    down_bias: Tensor, ids: Tensor, transposed: bool, interleaved: bool,
                    activation: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    layout = ExpertLayout(transposed, interleaved, activation)
    out, h, r = _experts_fwd(x, weights, gate_up, down, _opt(gate_up_bias), _opt(down_bias), ids, layout)
    return out, h, r.order, r.pos, r.ends, r.expert


@moe_experts_fwd.register_fake
def _moe_experts_fwd_fake(x, weights, gate_up, down, gate_up_bias, down_bias, ids, transposed, interleaved,
                          activation):
    t, k = ids.shape
    s = t * k
    two_i = gate_up.shape[2] if transposed else gate_up.shape[1]
    e = gate_up.shape[0]
    return (x.new_empty(x.shape), x.new_empty(s, two_i, dtype=gate_up.dtype), ids.new_empty(s, dtype=torch.int64),
            ids.new_empty(t, k, dtype=torch.int64), ids.new_empty(e, dtype=torch.int32),
            ids.new_empty(s, dtype=sort_key_dtype(e)))


@torch.library.custom_op("novatune::moe_experts_bwd", mutates_args=())
def moe_experts_bwd(dout: Tensor, x: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor, gate_up_bias: Tensor,
                    down_bias: Tensor, h: Tensor, order: Tensor, pos: Tensor, ends: Tensor, expert: Tensor,
                    transposed: bool, interleaved: bool,
                    activation: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    layout = ExpertLayout(transposed, interleaved, activation)
    grads = _experts_bwd(dout, x, weights, gate_up, down, _opt(gate_up_bias), _opt(down_bias), h,
                         Routing(order, pos, ends, expert), layout, (True,) * 6)
    dx, dweights, d_gate_up, d_down, d_gu_bias, d_dn_bias = grads
    return (dx, dweights, d_gate_up, d_down, gate_up_bias.new_empty(0) if d_gu_bias is None else d_gu_bias,
            down_bias.new_empty(0) if d_dn_bias is None else d_dn_bias)


@moe_experts_bwd.register_fake
def _moe_experts_bwd_fake(dout, x, weights, gate_up, down, gate_up_bias, down_bias, h, order, pos, ends, expert,
                          transposed, interleaved, activation):
    return tuple(t.new_empty(t.shape) for t in (x, weights, gate_up, down, gate_up_bias, down_bias))


def _setup_context(ctx, inputs, output) -> None:
    x, weights, gate_up, down, gu_bias, dn_bias, ids, transposed, interleaved, activation = inputs
    _, h, order, pos, ends, expert = output
    ctx.save_for_backward(x, weights, gate_up, down, gu_bias, dn_bias, h, order, pos, ends, expert)
    ctx.flags = (transposed, interleaved, activation)
    ctx.mark_non_differentiable(h, order, pos, ends, expert)


def _backward(ctx, dout, *unused):
    grads = torch.ops.novatune.moe_experts_bwd(dout, *ctx.saved_tensors, *ctx.flags)
    return (*grads, None, None, None, None)


moe_experts_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------- eager autograd
class _ExpertsFunction(torch.autograd.Function):
    """The eager path: the same implementations without the custom-op dispatch (optional biases as None)."""

    @staticmethod
    def forward(ctx, x, weights, gate_up, down, gate_up_bias, down_bias, ids, layout: ExpertLayout,
                wgrad_in_place: bool = False, output_unread: bool = False):
        out, h, r = _experts_fwd(x, weights, gate_up, down, gate_up_bias, down_bias, ids, layout,
                                 output_unread=output_unread)
        ctx.save_for_backward(x, weights, gate_up, down, gate_up_bias, down_bias, h, r.order, r.pos, r.ends,
                              r.expert)
        # the parameters themselves: under non-reentrant checkpointing the saved tensors unpack as detached copies
        ctx.layout, ctx.wgrad_params = layout, (gate_up, down) if wgrad_in_place else (None, None)
        return out

    @staticmethod
    def backward(ctx, dout):
        # decided before once_differentiable's no_grad: a create_graph backward must get its gradient returned
        into = tuple(w if need and accumulates_into_grad(w) else None
                     for w, need in zip(ctx.wgrad_params, ctx.needs_input_grad[2:4]))
        return _ExpertsFunction._grads(ctx, dout, into)

    @staticmethod
    @once_differentiable  # h is a saved forward output: a second-order gradient would miss its dependence
    def _grads(ctx, dout, into):
        x, weights, gate_up, down, gu_bias, dn_bias, h, order, pos, ends, expert = ctx.saved_tensors
        grads = _experts_bwd(dout, x, weights, gate_up, down, gu_bias, dn_bias, h, Routing(order, pos, ends, expert),
                             ctx.layout, ctx.needs_input_grad[:6], into=into)
        return (*grads, None, None, None, None)


def check_experts_args(x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor, transposed: bool,
                       activation: str, gate_up_bias: Tensor | None = None, down_bias: Tensor | None = None, *,
                       ids_from_router: bool = False) -> None:
    """The arguments checked (novatune.ops.moe_checks); the ids' range too unless `ids_from_router`."""
    _check_args(x, ids, weights, gate_up, down, transposed, activation, gate_up_bias, down_bias, ACTIVATIONS)
    if not ids_from_router:
        _check_ids(ids, gate_up.shape[0])


def moe_experts(x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor,
                gate_up_bias: Tensor | None = None, down_bias: Tensor | None = None, *, transposed: bool = False,
                interleaved: bool = False, activation: str = "silu", ids_from_router: bool = False,
                wgrad_in_place: bool = False, output_unread: bool = False) -> Tensor:
    """The routed expert MLP: out[t] = sum_k weights[t, k] * down_e(act(gate_up_e(x[t]))), e = ids[t, k].

    x (T, H); ids (T, K) integer expert ids in [0, E) (others raise: a ValueError on the CPU, a device-side
    assert on CUDA, without a host sync; `ids_from_router=True` skips that check for ids that are a top-k over E
    router logits, in range by construction: novatune's patched MoE blocks, which spare 4 launches per layer);
    weights (T, K) (any float dtype, differentiable);
    gate_up (E, 2I, H) and down (E, H, I), or (E, H, 2I) and (E, I, H) when `transposed`; biases (E, 2I), (E, H).
    Returns (T, H) in x's dtype; the GEMMs run in the weights' dtype. Differentiable in x, weights, the expert
    weights and biases. `wgrad_in_place`: expert weight gradients added into .grad where autograd would add
    them (inside the grouped GEMM on the Triton path, by column slices elsewhere: ops/moe_wgrad.py).
    `output_unread`: the caller differentiates through the output but never reads its values (a checkpointed
    layer's recompute, whose result only roots the backward: patch/graphs.py's captured backward), so the down
    projection and the combine are skipped and the output is uninitialised; the gradients are unchanged (the
    backward never reads the expert outputs). Ignored under torch.compile (the registered op computes it all)."""
    check_experts_args(x, ids, weights, gate_up, down, transposed, activation, gate_up_bias, down_bias,
                       ids_from_router=ids_from_router)
    if torch.compiler.is_compiling():  # traced: the registered op (optional biases as empty tensors)
        none = x.new_empty(0, dtype=gate_up.dtype)
        return torch.ops.novatune.moe_experts_fwd(x, weights, gate_up, down, none if gate_up_bias is None else
                                                  gate_up_bias, none if down_bias is None else down_bias, ids,
                                                  transposed, interleaved, activation)[0]
    layout = ExpertLayout(transposed=transposed, interleaved=interleaved, activation=activation)
    return _ExpertsFunction.apply(x, weights, gate_up, down, gate_up_bias, down_bias, ids, layout, wgrad_in_place,
                                  output_unread)


# ----------------------------------------------------------------------------------------------- the contract
def _make_inputs(shape, dtype, device, gen) -> dict:
    """shape (T, H, I, E, K): x, ids (the last expert receives no token), routing weights summing to 1 per token,
    gate_up (E, 2I, H) and down (E, H, I) scaled like trained weights (outputs ~ inputs in magnitude)."""
    t, h, i, e, k = shape
    choices = max(e - 1, k)
    ids = torch.stack([torch.randperm(choices, generator=gen)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=gen) + 0.1
    tensors = {"x": torch.randn(t, h, generator=gen), "weights": w / w.sum(-1, keepdim=True),
               "gate_up": torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5,
               "down": torch.randn(e, h, i, generator=gen) / i ** 0.5}
    out = {k2: v.to(device=device, dtype=dtype) for k2, v in tensors.items()}
    return {"x": out["x"], "ids": ids.to(device), "weights": out["weights"], "gate_up": out["gate_up"],
            "down": out["down"]}


def _call_cases(dtype, device, gen) -> list:
    """Qwen3-MoE's call (concatenated gate/up, nn.Linear layout, no bias) at toy sizes: experts without tokens, an
    odd hidden size and expert count, a single token, top-1."""
    return [("Qwen3-MoE layout, E 5 top-2", _make_inputs((13, 64, 32, 5, 2), dtype, device, gen)),
            ("odd hidden 37, E 7 top-3", _make_inputs((11, 37, 19, 7, 3), dtype, device, gen)),
            ("one token, top-1", _make_inputs((1, 16, 8, 3, 1), dtype, device, gen))]


def _floor(shape, dtype) -> int:
    """Bytes one fwd+bwd must move: the expert weights read in the forward and twice in the backward and their
    gradients written (4 x 3EHI), x / out / dout / dx (4TH), the saved gate_up output written and read (2 x 2SI)."""
    t, h, i, e, k = shape
    return (4 * 3 * e * h * i + 4 * t * h + 4 * t * k * i) * torch.tensor([], dtype=dtype).element_size()


def _candidates(shape, dtype, device: str) -> list:
    return [Candidate("moe_experts", "hf_eager", "eager", make=lambda: _ref.hf_grouped_mm_experts, selectable=False),
            Candidate("moe_experts", "novatune_default", "default", make=lambda: moe_experts)]


# No trace_kind: the layer's time is mostly the grouped GEMMs, which the profile counts under GEMM, not this op.
# tolerance_scale 4: the op rounds at other points than stock (the GLU and its backward round once, in fp32; the
# routing weights' gradient is <a, dout @ W_down> in fp32 instead of <y in bf16, dout>). Both are dot products
# with cancellation, so in bf16 single elements of a small gradient differ from stock's in either direction by
# several roundings of the row's scale; over 40 random Qwen3-MoE-layout cases the op's largest error on the
# routing weights' gradient is 0.65x stock's on average, but a single case can exceed the 4 x stock per-element
# bound the checker uses for elementwise ops.
SPEC = OpSpec(
    name="moe_experts", tensor_args=("x", "weights", "gate_up", "down"), make_inputs=_make_inputs,
    reference=_ref.experts_ref, stock=_ref.hf_grouped_mm_experts, floor_bytes=_floor, candidates=_candidates,
    call_cases=_call_cases, tolerance_scale=4.0,
    shape_of=lambda x, ids, weights, gate_up, down, *_: (x.shape[0], x.shape[1], down.shape[2],
                                                         gate_up.shape[0], ids.shape[1]),
    dtype_of=lambda x, *_: str(x.dtype)[6:],
    signature="moe_experts(x (T, H), ids (T, K) int, weights (T, K), gate_up (E, 2I, H), down (E, H, I)) -> "
              "(T, H): sum_k weights[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = ids[t, k]; "
              "differentiable in x, weights, gate_up and down")
