"""LoRA on the routed experts, inside the grouped GEMMs: no per-expert delta weight is ever formed.

    moe_experts_lora(x, ids, weights, gate_up, down, ..., gate_up_lora=(A, B, s), down_lora=(A, B, s))

For an expert weight W (E, ...) with per-expert factors A_e (r, in) and B_e (out, r), each projection of the expert
MLP (novatune.ops.moe) computes, on the rows sorted by expert (S rows, cumulative group ends),

    y = grouped(u, W) + s * grouped(grouped(u, A^T), B^T)

so the adapter costs a thin grouped GEMM (S x in x r; novatune.kernels.moe_lora.lowrank_project on the Triton
path) and an in-place low-rank add (novatune.kernels.moe_lora.lowrank_add_: y += s * (u A^T) B^T per row's
expert, no S x out temporary) instead of PEFT's W + s * B A (E x out x in, formed at
every forward and again for its backward). The frozen base gets no gradient; the adapters'
gradients are grouped outer products of (S, r) tensors:

    g = grouped(dy, B)               (S, r)     du += s * g A                (the LoRA path of the input's gradient,
                                                                              the same in-place low-rank add)
    dA_e = s * g_e^T u_e             (r, in)    dB_e = s * dy_e^T (u_e A_e^T)  (out, r)

For the down projection dy = w * dout (the routing weight of each row): the weight is folded into the (S, r)
factors and into the activation backward's w * a, never into an S x H copy, and the down adapter's path joins the
routing weights' gradient <a, dout W'> as the base weight's does. Saved for the backward besides the base op's:
the two (S, r) products u A^T (a few MB at S = 32k, r = 16).

The factors are the layout PEFT's ParamWrapper uses for every expert layout (A (r, in), B (out, r) per expert,
whatever the base weight's transposition); they are cast to the expert weights' dtype for the GEMMs, as PEFT casts
them before forming its delta, and their gradients come back in their own dtype (on the Triton path written so by
the kernel that computes them). The rank is padded with zeros: to a power of two on the Triton path (its kernels'
tile width; they mask the rest), to a multiple of 8 for torch's grouped GEMM on CUDA (16-byte strides on the (S, r)
operands); zeros add nothing and their gradients are dropped. Eager only (an autograd Function); under
torch.compile it raises.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from novatune.kernels.launch import next_pow2
from novatune.kernels.moe_lora import expert_major, lowrank_add_, lowrank_project
from novatune.kernels.moe_wgrad import grouped_outer
from novatune.ops import moe as M
from novatune.ops._backend import use_triton

Factors = tuple[Tensor, Tensor, float]  # (A (E, r, in), B (E, out, r), scaling)


def rank_multiple(t: Tensor) -> int:
    """The rank torch's path pads the factors to a multiple of: 8 on CUDA (16-byte strides of bf16 (S, r)
    operands)."""
    return 8 if t.is_cuda else 1


def _pad_rank(a: Tensor, b: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """A (E, rp, in) and B (E, out, rp) contiguous in `dtype`, rp = the padded rank (zeros): r rounded up to
    rank_multiple on torch's path, to a power of two on the Triton path (whose kernels mask the rank)."""
    # one copy each (cast and layout together; .to alone keeps B's strides: PEFT's B is a permuted view of its
    # (out, r * E) storage); .contiguous() does the layout when the dtype already matches (`to` returns the view)
    a = a.to(dtype, memory_format=torch.contiguous_format).contiguous()
    if use_triton(b):  # B read in its storage's own order (the expert fastest) by one kernel
        b = expert_major(b, dtype, next_pow2(a.shape[1]))
    else:
        b = b.to(dtype, memory_format=torch.contiguous_format).contiguous()
        pad = (-a.shape[1]) % rank_multiple(a)
        b = F.pad(b, (0, pad)) if pad else b
    pad = b.shape[2] - a.shape[1]
    return (F.pad(a, (0, 0, 0, pad)) if pad else a), b


def _thin(u: Tensor, m: Tensor, r: M.Routing, scale: float = 1.0) -> Tensor:
    """scale * u[rows of e] @ m[e] (S, rp): novatune.kernels.moe_lora.lowrank_project on the Triton path (one
    read of u at about the memory bandwidth), torch's grouped GEMM elsewhere."""
    if use_triton(u):
        return lowrank_project(u, m, r.ends, scale)
    out = M.grouped_mm(u, m, r.ends)
    return out if scale == 1.0 else out * scale


def _add(y: Tensor, u: Tensor, m: Tensor, r: M.Routing, scale: float = 1.0) -> None:
    """y += scale * u[row] @ m[expert of row], in place: novatune.kernels.moe_lora.lowrank_add_ on the Triton path,
    torch's grouped GEMM and an fp32 add elsewhere."""
    if use_triton(y):
        lowrank_add_(y, u, m, r.expert, scale)
    else:  # an (S, N) fp32 product, not the reference's per-row gather of m
        prod = M.grouped_mm(u, m, r.ends, out_dtype=torch.float32)
        y.copy_((y.float() + scale * prod.float()).to(y.dtype))


class _Side:
    """One adapted projection for one call: padded factors, its (S, rp) product u A^T, and after the backward
    the factors' gradients at the true rank in the factors' own dtypes."""

    def __init__(self, a: Tensor, b: Tensor, scaling: float, dtype: torch.dtype):
        self.rank, self.scaling = a.shape[1], float(scaling)
        self.grad_dtypes = (a.dtype, b.dtype)
        self.a, self.b = _pad_rank(a, b, dtype)
        self.ua: Tensor | None = None  # u A^T (S, rp), unscaled
        self.g: Tensor | None = None  # s * dy B (S, rp), from the input-gradient GEMM to the factor gradients
        self.da: Tensor | None = None
        self.db: Tensor | None = None

    def factor_(self, u: Tensor, r: M.Routing) -> Tensor:
        self.ua = _thin(u, self.a.transpose(-2, -1), r)
        return self.ua

    def add_(self, u: Tensor, y: Tensor, r: M.Routing) -> None:
        _add(y, self.factor_(u, r), self.b.transpose(-2, -1), r, self.scaling)

    def dinput_factor(self, dy: Tensor, r: M.Routing) -> Tensor:
        """g = s * dy B (S, rp): the input gradient's thin product, kept for the factor gradients."""
        self.g = _thin(dy, self.b, r, self.scaling)
        return self.g

    def grads(self, g_scaled: Tensor, u: Tensor, dy: Tensor, ua: Tensor, ua_scale: float, r: M.Routing) -> None:
        """dA = g^T u (g_scaled = s dy B) and dB = dy^T (ua_scale * u A^T) per group, at the true rank, in the
        factors' dtypes. On the Triton path one kernel each reads the wide operand once and writes the gradient in
        fp32 (or the factor's dtype) directly, the scale applied in fp32 (novatune.kernels.moe_wgrad.grouped_outer);
        torch's path rounds the scaled products to the GEMMs' dtype first and returns a result at the padded rank,
        cut and cast afterwards. dB is contiguous: autograd lays it out for PEFT's view (a write in PEFT's order
        scatters, and measured slower than that copy)."""
        k = self.rank
        if use_triton(u):
            e = self.a.shape[0]
            self.da = u.new_empty((e, k, u.shape[1]), dtype=self.grad_dtypes[0])
            self.db = u.new_empty((e, dy.shape[1], k), dtype=self.grad_dtypes[1])
            grouped_outer(u, g_scaled[:, :k], r.ends, self.da.transpose(-2, -1))
            grouped_outer(dy, ua[:, :k], r.ends, self.db, ua_scale)
            return
        self.da = M.grouped_outer(g_scaled, u, r.ends)[:, :k].to(self.grad_dtypes[0])
        self.db = M.grouped_outer(dy, ua * ua_scale, r.ends)[:, :, :k].to(self.grad_dtypes[1])


class ExpertsLoRA:
    """The adapters of one experts module for one call (either side may be None); the hooks novatune.ops.moe's
    forward and backward call at each grouped GEMM of an adapted weight."""

    def __init__(self, gate_up: Factors | None, down: Factors | None, dtype: torch.dtype):
        self.gate_up = None if gate_up is None else _Side(*gate_up, dtype)
        self.down = None if down is None else _Side(*down, dtype)

    # forward: y (S, out) of the base grouped GEMM gets s * (u A^T) B^T added in place
    def add_gate_up(self, xs: Tensor, h: Tensor, r: M.Routing) -> None:
        if self.gate_up is not None:
            self.gate_up.add_(xs, h, r)

    def add_down(self, a: Tensor, y: Tensor, r: M.Routing) -> None:
        if self.down is not None:
            self.down.add_(a, y, r)

    def down_factor_(self, a: Tensor, r: M.Routing) -> None:
        """Only the down adapter's u A^T, which its backward reads (an output nobody reads: output_unread)."""
        if self.down is not None:
            self.down.factor_(a, r)

    # backward, down side: dout_s is each row's token gradient without the routing weight w_row
    def down_dinput_(self, da_u: Tensor, dout_s: Tensor, r: M.Routing) -> None:
        """da_u (S, I) fp32 += s * (dout_s B) A: the adapted weight's part of dout_s @ W'."""
        side = self.down
        if side is not None:
            _add(da_u, side.dinput_factor(dout_s, r), side.a, r)

    def down_grads(self, aw: Tensor, dout_s: Tensor, w_row: Tensor, r: M.Routing) -> None:
        """aw = w * a from the activation backward; dy = w * dout_s enters through (s * w) * (a A^T)."""
        side = self.down
        if side is not None:
            assert side.ua is not None and side.g is not None  # set by add_down and down_dinput_
            ua_w = side.ua * (w_row[:, None] * side.scaling).to(side.ua.dtype)
            side.grads(side.g, aw, dout_s, ua_w, 1.0, r)
            side.g = side.ua = None

    # backward, gate/up side: dh is already weighted
    def gate_up_grads(self, xs: Tensor, dh: Tensor, r: M.Routing) -> None:
        side = self.gate_up
        if side is None:
            return
        assert side.ua is not None  # set by add_gate_up
        side.grads(side.dinput_factor(dh, r), xs, dh, side.ua, side.scaling, r)
        side.ua = None

    def gate_up_dinput_(self, dxs: Tensor, r: M.Routing) -> None:
        side = self.gate_up
        if side is None:
            return
        assert side.g is not None  # set by gate_up_grads
        _add(dxs, side.g, side.a, r)
        side.g = None

    def saved(self) -> list[Tensor | None]:
        """(A, B, u A^T) of each side, None for a side without an adapter: what the backward needs."""
        out: list[Tensor | None] = []
        for side in (self.gate_up, self.down):
            out += [None] * 3 if side is None else [side.a, side.b, side.ua]
        return out

    def restore(self, tensors) -> None:
        for i, side in enumerate((self.gate_up, self.down)):
            if side is not None:
                side.a, side.b, side.ua = tensors[3 * i:3 * i + 3]


class _ExpertsLoRAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weights, gate_up, down, gu_bias, dn_bias, ids, layout, scalings, output_unread, gu_a, gu_b,
                dn_a, dn_b):
        lora = ExpertsLoRA(None if gu_a is None else (gu_a, gu_b, scalings[0]),
                           None if dn_a is None else (dn_a, dn_b, scalings[1]), gate_up.dtype)
        out, h, r = M._experts_fwd(x, weights, gate_up, down, gu_bias, dn_bias, ids, layout, lora=lora,
                                   output_unread=output_unread)
        ctx.save_for_backward(x, weights, gate_up, down, gu_bias, dn_bias, h, r.order, r.pos, r.ends, r.expert,
                              *lora.saved())
        ctx.layout, ctx.lora = layout, lora
        lora.restore([None] * 6)  # the tensors live in ctx's saved tensors until the backward
        return out

    @staticmethod
    @once_differentiable  # h and u A^T are saved forward outputs: a second-order gradient would miss them
    def backward(ctx, dout):
        x, weights, gate_up, down, gu_bias, dn_bias, h, order, pos, ends, expert, *saved = ctx.saved_tensors
        lora = ctx.lora
        lora.restore(saved)
        grads = M._experts_bwd(dout, x, weights, gate_up, down, gu_bias, dn_bias, h,
                               M.Routing(order, pos, ends, expert), ctx.layout, ctx.needs_input_grad[:6], lora=lora)
        adapter_grads = []
        for side in (lora.gate_up, lora.down):
            adapter_grads += [None, None] if side is None else [side.da, side.db]
            if side is not None:
                side.da = side.db = None
        lora.restore([None] * 6)  # back to the saved tensors only (a second backward restores them again)
        return (*grads, None, None, None, None, *adapter_grads)


def _factors(name: str, lora: Factors | None, weight: Tensor, transposed: bool) -> Factors | None:
    """Checks one projection's (A (E, r, in), B (E, out, r), scaling) against its weight's shape."""
    if lora is None:
        return None
    a, b, scaling = lora
    e = weight.shape[0]
    w_in, w_out = (weight.shape[1], weight.shape[2]) if transposed else (weight.shape[2], weight.shape[1])
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != e or b.shape[0] != e or a.shape[1] != b.shape[2]:
        raise ValueError(f"moe_experts_lora: {name} factors A {tuple(a.shape)} / B {tuple(b.shape)} are not "
                         f"(E, r, in) / (E, out, r) with E = {e}")
    if a.shape[2] != w_in or b.shape[1] != w_out:
        raise ValueError(f"moe_experts_lora: {name} factors A {tuple(a.shape)} / B {tuple(b.shape)} do not match "
                         f"the weight {tuple(weight.shape)} (in {w_in}, out {w_out}, transposed={transposed})")
    return a, b, float(scaling)


def moe_experts_lora(x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor,
                     gate_up_bias: Tensor | None = None, down_bias: Tensor | None = None, *,
                     gate_up_lora: Factors | None = None, down_lora: Factors | None = None, transposed: bool = False,
                     interleaved: bool = False, activation: str = "silu", ids_from_router: bool = False,
                     output_unread: bool = False) -> Tensor:
    """novatune.ops.moe.moe_experts with each expert weight W_e replaced by W_e + s * B_e A_e, computed without
    forming it (module docstring). gate_up_lora / down_lora: (A (E, r, in), B (E, out, r), scaling) or None, in
    the projection's own in/out (gate/up: in = H, out = 2I in the weight's gate/up column order; down: in = I,
    out = H), whatever `transposed` says about the base weights. Differentiable in x, the routing weights, the
    factors, and the base weights and biases (frozen ones get no gradient). ids_from_router, output_unread: as
    moe_experts'."""
    if torch.compiler.is_compiling():
        raise NotImplementedError("moe_experts_lora runs eagerly only; keep the MoE block out of torch.compile "
                                  "(torch.compiler.disable) or let PEFT's forward run")
    if gate_up_lora is None and down_lora is None:  # checked there, once
        return M.moe_experts(x, ids, weights, gate_up, down, gate_up_bias, down_bias, transposed=transposed,
                             interleaved=interleaved, activation=activation, ids_from_router=ids_from_router,
                             output_unread=output_unread)
    M.check_experts_args(x, ids, weights, gate_up, down, transposed, activation, gate_up_bias, down_bias,
                         ids_from_router=ids_from_router)
    gu = _factors("gate_up", gate_up_lora, gate_up, transposed)
    dn = _factors("down", down_lora, down, transposed)
    layout = M.ExpertLayout(transposed=transposed, interleaved=interleaved, activation=activation)
    none = (None, None)
    return _ExpertsLoRAFunction.apply(x, weights, gate_up, down, gate_up_bias, down_bias, ids, layout,
                                      (gu[2] if gu else 1.0, dn[2] if dn else 1.0), output_unread,
                                      *(gu[:2] if gu else none), *(dn[:2] if dn else none))
