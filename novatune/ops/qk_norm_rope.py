"""Qwen3's q/k per-head RMSNorm + RoPE as one op: registered custom ops, an eager fast path and the functional.

    q_out, k_out = novatune.ops.qk_norm_rope.qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin)

equals HF's
    q_out = apply_rotary_pos_emb(Qwen3RMSNorm(q), Qwen3RMSNorm(k), cos, sin, unsqueeze_dim=2)   # (b, s, h, d)
with q (b, s, hq, d), k (b, s, hk, d) (last dim contiguous; other strides free, e.g. views of a fused projection),
weights (d,), cos/sin (b, s, d), (1, s, d) or (s, d) from the model's rotary embedding (per-token positions, so
packed rows with restarting position_ids need nothing special). Outputs: new contiguous (b, s, h, d) tensors in
promote(x.dtype, weight.dtype) (cos/sin's dtype does not enter, as in novatune.ops.apply_rope). Rounding: n and
w * n exactly as HF's Qwen3RMSNorm, the rotation in fp32 rounded once (HF rounds three times); see
novatune/kernels/qk_norm_rope.py for the exact sequence and the bound against HF.

Gradients flow to q, k, q_weight, k_weight (weight grads accumulated in fp32); cos/sin get none (HF builds them under
torch.no_grad()).

Registered ops (torch.compile, FSDP2, opcheck):
    torch.ops.novatune.qk_norm_rope_fwd(q, k, q_weight, k_weight, eps, cos, sin) -> (q_out, k_out, rstd_q, rstd_k)
    torch.ops.novatune.qk_norm_rope_bwd(dq_out, dk_out, q, k, q_weight, k_weight, rstd_q, rstd_k, cos, sin)
        -> (dq, dk, dq_weight, dk_weight)
rstd_* are (b, s, h) fp32, saved for the backward together with q, k, the weights and cos/sin (no extra copies).
Eager calls take an autograd.Function around the same implementations (identical numbers, tested): custom-op
dispatch with registered autograd costs ~100+ µs of host time per fwd+bwd, which would show in wall time at 36
layers. Under torch.compile (torch.compiler.is_compiling()) the registered op is used.

Device rule (novatune.ops._backend.use_triton): CUDA -> Triton kernels; CPU -> the fp32 reference (same rounding
sequence as the kernels); CPU under TRITON_INTERPRET=1 -> the kernels.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from novatune.kernels import qk_norm_rope as _k
from novatune.ops import dispatch, recipes
from novatune.ops._backend import use_triton
from novatune.ops.contract import (
    Candidate,
    OpSpec,
    compiled,
    element_size,
    fill_nan_like,
    launchers,
    odd_token_shapes,
    rope_tables,
    row_scales,
    triton_reason,
    variant_grid,
)
from novatune.ops.rope import noncontig_heads, qk_dy_shapes, qk_shape
from novatune.reference import qk_norm_rope as _ref

__all__ = ["qk_norm_rope", "qk_norm_rope_fwd", "qk_norm_rope_bwd"]


def _check(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"qk_norm_rope: q and k must be (b, s, h, d), got {tuple(q.shape)} and {tuple(k.shape)}")
    if not all(t.is_floating_point() for t in (q, k, q_weight, k_weight, cos, sin)):
        raise TypeError(f"qk_norm_rope: q, k, the weights and cos/sin must be floating point, got {q.dtype}, "
                        f"{k.dtype}, {q_weight.dtype}, {k_weight.dtype}, {cos.dtype}, {sin.dtype}")
    d = q.shape[-1]
    if k.shape[-1] != d or q_weight.shape != (d,) or k_weight.shape != (d,):
        raise ValueError(f"qk_norm_rope: head_dim of q {tuple(q.shape)}, k {tuple(k.shape)} and the weights "
                         f"{tuple(q_weight.shape)}/{tuple(k_weight.shape)} must agree")
    if cos.shape != sin.shape or cos.shape[-1] != d:
        raise ValueError(f"qk_norm_rope: cos/sin {tuple(cos.shape)}/{tuple(sin.shape)} must be (b, s, {d}) "
                         f"(partial rotary is not supported)")
    if d % 2 or d > _k.MAX_HEAD_DIM:
        raise ValueError(f"qk_norm_rope: head_dim must be even and <= {_k.MAX_HEAD_DIM}, got {d}")
    (b, s), table = q.shape[:2], (1, *cos.shape) if cos.dim() == 2 else tuple(cos.shape)
    if k.shape[:2] != (b, s) or len(table) != 3 or table[1] != s or table[0] not in (1, b):
        raise ValueError(f"qk_norm_rope: q {tuple(q.shape)} and k {tuple(k.shape)} must share (b, s), and cos/sin "
                         f"{tuple(cos.shape)} must be ({b}, {s}, {d}) or broadcastable (1, {s}, {d})")


def _fwd_impl(q, k, q_weight, k_weight, eps, cos, sin):
    if use_triton(q):
        return _k.qk_norm_rope_fwd(q, k, q_weight, k_weight, eps, cos, sin)
    # contiguous: the fake impl promises contiguous outputs whatever the inputs' layout
    return tuple(t.contiguous() for t in _ref.qk_norm_rope_ref(q, k, q_weight, k_weight, eps, cos, sin,
                                                               return_rstd=True))


def _bwd_impl(dq_out, dk_out, q, k, q_weight, k_weight, rstd_q, rstd_k, cos, sin):
    if use_triton(q):
        return _k.qk_norm_rope_bwd(dq_out, dk_out, q, k, q_weight, k_weight, rstd_q, rstd_k, cos, sin)
    return tuple(t.contiguous() for t in _ref.qk_norm_rope_bwd_ref(dq_out, dk_out, q, k, q_weight, k_weight, rstd_q,
                                                                   rstd_k, cos, sin))


# ----------------------------------------------------------------------------------------------- registered ops
@torch.library.custom_op("novatune::qk_norm_rope_fwd", mutates_args=())
def qk_norm_rope_fwd(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, cos: Tensor,
                     sin: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(q_out, k_out, rstd_q, rstd_k): outputs contiguous (b, s, h, d) in promote(x, weight); rstd (b, s, h) fp32."""
    return _fwd_impl(q, k, q_weight, k_weight, eps, cos, sin)


@qk_norm_rope_fwd.register_fake
def _qk_norm_rope_fwd_fake(q, k, q_weight, k_weight, eps, cos, sin):
    return (q.new_empty(q.shape, dtype=torch.promote_types(q.dtype, q_weight.dtype)),
            k.new_empty(k.shape, dtype=torch.promote_types(k.dtype, k_weight.dtype)),
            q.new_empty(q.shape[:-1], dtype=torch.float32), k.new_empty(k.shape[:-1], dtype=torch.float32))


@torch.library.custom_op("novatune::qk_norm_rope_bwd", mutates_args=())
def qk_norm_rope_bwd(dq_out: Tensor, dk_out: Tensor, q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor,
                     rstd_q: Tensor, rstd_k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dq_weight, dk_weight): dq/dk contiguous in q's/k's dtype, weight grads in the weights' dtypes."""
    return _bwd_impl(dq_out, dk_out, q, k, q_weight, k_weight, rstd_q, rstd_k, cos, sin)


@qk_norm_rope_bwd.register_fake
def _qk_norm_rope_bwd_fake(dq_out, dk_out, q, k, q_weight, k_weight, rstd_q, rstd_k, cos, sin):
    return q.new_empty(q.shape), k.new_empty(k.shape), q_weight.new_empty(q_weight.shape), \
        k_weight.new_empty(k_weight.shape)


def _setup_context(ctx, inputs, output):
    q, k, q_weight, k_weight, _eps, cos, sin = inputs
    _qo, _ko, rstd_q, rstd_k = output
    ctx.save_for_backward(q, k, q_weight, k_weight, rstd_q, rstd_k, cos, sin)


def _grads_or_zeros(dq_out, dk_out, q, k, q_weight, k_weight):
    # an unused output (e.g. only q_out reaches the loss) may arrive as None: its grad is zero
    if dq_out is None:
        dq_out = torch.zeros(q.shape, dtype=torch.promote_types(q.dtype, q_weight.dtype), device=q.device)
    if dk_out is None:
        dk_out = torch.zeros(k.shape, dtype=torch.promote_types(k.dtype, k_weight.dtype), device=k.device)
    return dq_out, dk_out


def _backward(ctx, dq_out, dk_out, _drstd_q, _drstd_k):
    # rstd_* are auxiliary outputs for the backward; a gradient flowing into them is not supported (ignored)
    q, k, q_weight, k_weight, rstd_q, rstd_k, cos, sin = ctx.saved_tensors
    dq_out, dk_out = _grads_or_zeros(dq_out, dk_out, q, k, q_weight, k_weight)
    dq, dk, dwq, dwk = torch.ops.novatune.qk_norm_rope_bwd(dq_out, dk_out, q, k, q_weight, k_weight, rstd_q,
                                                           rstd_k, cos, sin)
    return dq, dk, dwq, dwk, None, None, None  # no grad for eps, cos, sin


qk_norm_rope_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------- autograd glue
def make_function(fwd, bwd):
    """Functional qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin) from fwd(...) -> (q_out, k_out, rstd_q,
    rstd_k) and bwd(dq_out, dk_out, q, k, q_weight, k_weight, rstd_q, rstd_k, cos, sin) -> (dq, dk, dwq, dwk):
    the op's own eager path and every kernel candidate."""

    class _QKNormRopeFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, q_weight, k_weight, eps, cos, sin):
            q_out, k_out, rstd_q, rstd_k = fwd(q, k, q_weight, k_weight, eps, cos, sin)
            ctx.save_for_backward(q, k, q_weight, k_weight, rstd_q, rstd_k, cos, sin)
            if recipes.active():  # a kept layer: attention may keep this recipe instead of q_out, k_out
                ins = tuple(t.detach() for t in (q, k, q_weight, k_weight, cos, sin))
                recipes.offer((q_out, k_out), lambda: fwd(*ins[:4], eps, *ins[4:])[:2], ins)
            return q_out, k_out

        @staticmethod
        @once_differentiable  # rstd_q/rstd_k are saved forward outputs: a second-order gradient would miss them
        def backward(ctx, dq_out, dk_out):
            q, k, q_weight, k_weight, rstd_q, rstd_k, cos, sin = ctx.saved_tensors
            dq_out, dk_out = _grads_or_zeros(dq_out, dk_out, q, k, q_weight, k_weight)
            dq, dk, dwq, dwk = bwd(dq_out, dk_out, q, k, q_weight, k_weight, rstd_q, rstd_k, cos, sin)
            need = ctx.needs_input_grad
            return (dq if need[0] else None, dk if need[1] else None, dwq if need[2] else None,
                    dwk if need[3] else None, None, None, None)

    def qk_norm_rope_fn(q, k, q_weight, k_weight, eps, cos, sin):
        return _QKNormRopeFunction.apply(q, k, q_weight, k_weight, eps, cos, sin)

    return qk_norm_rope_fn


# the untuned eager path: the same implementations as the registered ops, without the custom-op dispatch
_eager = make_function(_fwd_impl, _bwd_impl)


# ----------------------------------------------------------------------------------------------- public API
def qk_norm_rope(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, cos: Tensor,
                 sin: Tensor) -> tuple[Tensor, Tensor]:
    """HF Qwen3's q_norm/k_norm followed by apply_rotary_pos_emb(unsqueeze_dim=2), in one op for q and k.

    q (b, s, hq, d), k (b, s, hk, d) (GQA: hk may differ), last dim contiguous; q_weight, k_weight (d,); eps the
    norms' variance_epsilon (one value for both: Qwen3 uses config.rms_norm_eps for q_norm and k_norm); cos/sin
    (b, s, d), (1, s, d) or (s, d); d even, <= 256. Returns new contiguous (q_out, k_out), (b, s, h, d), dtype
    promote(x, weight). Differentiable in q, k and both weights.
    """
    _check(q, k, q_weight, k_weight, cos, sin)
    if torch.compiler.is_compiling():
        return tuple(torch.ops.novatune.qk_norm_rope_fwd(q, k, q_weight, k_weight, eps, cos, sin)[:2])
    # an implementation `novatune tune` selected for this shape
    # (dispatch.ACTIVE is None: nothing tuned, one global read)
    if (hook := dispatch.ACTIVE) is not None and (
            out := hook("qk_norm_rope", q, k, q_weight, k_weight, eps, cos, sin)) is not None:
        return out
    return _eager(q, k, q_weight, k_weight, eps, cos, sin)


# ----------------------------------------------------------------------------------------------- the contract
def _make_inputs(shape, dtype, device, gen, batch: int = 1, eps: float = 1e-6, magnitude: float = 1.0) -> dict:
    """shape key (tokens, hq, hk, d): q, k (b, s, h, d) with per-(token, head) row scales 1e-3..10 (mean(x^2)
    down to ~eps: a wrong eps shows), weights far from 1, HF tables on packed rows (positions restarting)."""
    t, hq, hk, d = shape
    s = t // batch
    cos, sin = rope_tables(batch, s, d, dtype, device)
    wq, wk = (1.0 + 0.5 * torch.randn(d, generator=gen) for _ in range(2))

    def heads(h):
        x = torch.randn(batch, s, h, d, generator=gen) * magnitude
        return (x * row_scales(batch * s * h, gen).view(batch, s, h, 1)).to(device=device, dtype=dtype)
    return {"q": heads(hq), "k": heads(hk), "q_weight": wq.to(device=device, dtype=dtype),
            "k_weight": wk.to(device=device, dtype=dtype), "eps": eps, "cos": cos, "sin": sin}


def _call_cases(dtype, device, gen) -> list:
    mk = functools.partial(_make_inputs, dtype=dtype, device=device, gen=gen)
    return [("Qwen3 attention (b, s, h, d) eps 1e-6", mk((2 * 29, 4, 2, 32), batch=2)),
            ("eps 1e-5", mk((31, 3, 1, 16), eps=1e-5)), ("single token", mk((1, 2, 2, 8))),
            ("|x| ~ 1e4", mk((19, 2, 2, 64), magnitude=1e4)), ("rows > 65,535", mk((65_541, 1, 1, 4))),
            ("q/k views of a fused projection", noncontig_heads(mk((23, 4, 2, 16))))]


def _floor(shape, dtype) -> int:
    t, hq, hk, d = shape
    # fwd reads q, k, writes outputs (+ fp32 rstd per row); bwd reads the grads, q, k, writes dq, dk
    return (5 * t * (hq + hk) * d + 4 * t * d) * element_size(dtype) + 2 * t * (hq + hk) * 4


def _poison(kernels, inputs, dy) -> dict:
    q, k, wq, wk, eps, cos, sin = (inputs[n] for n in ("q", "k", "q_weight", "k_weight", "eps", "cos", "sin"))
    odt = torch.promote_types(q.dtype, wq.dtype)
    rq = torch.full(q.shape[:3], float("nan"), dtype=torch.float32, device=q.device)
    rk = torch.full(k.shape[:3], float("nan"), dtype=torch.float32, device=k.device)
    qo, ko, rq, rk = kernels.fwd(q, k, wq, wk, eps, cos, sin, q_out=fill_nan_like(q.to(odt)),
                                 k_out=fill_nan_like(k.to(odt)), rstd_q=rq, rstd_k=rk)
    dq, dk, dwq, dwk = kernels.bwd(dy[0], dy[1], q, k, wq, wk, rq, rk, cos, sin, dq=fill_nan_like(q),
                                   dk=fill_nan_like(k), dq_weight=fill_nan_like(wq), dk_weight=fill_nan_like(wk))
    return {"out_q": qo, "out_k": ko, "q": dq, "k": dk, "q_weight": dwq, "k_weight": dwk}


def _ref_in_dtype(q, k, q_weight, k_weight, eps, cos, sin):
    return _ref.qk_norm_rope_ref(q, k, q_weight, k_weight, eps, cos, sin)  # outputs in promote(x, weight)


def _candidates(shape, dtype, device: str) -> list:
    out = [Candidate("qk_norm_rope", "hf_eager", "eager", make=lambda: _ref.hf_qk_norm_rope, selectable=False),
           Candidate("qk_norm_rope", "novatune_default", "default", make=lambda: _eager),
           Candidate("qk_norm_rope", "torch_compile", "compile", make=lambda: compiled(_ref_in_dtype),
                     deterministic=False)]
    # Around kernels/qk_norm_rope_config.py's H200 defaults at Qwen3-4B's shape (forward 2 tokens x all heads per
    # program on 4 warps; backward 32 head rows per item, 4 warps, 3 pipeliner stages): one token or four per
    # forward program, more warps, 16 / 64 rows or register prefetch (stages 0) in the backward. An empty dict
    # keeps that direction's default heuristic (per shape).
    tvars = [(dict(block_t=1, num_warps=4), {}), (dict(block_t=4, num_warps=8), {}),
             (dict(block_t=1, num_warps=8), {}), ({}, dict(rows=16, num_warps=4, stages=3)),
             ({}, dict(rows=64, num_warps=8, stages=3)), ({}, dict(rows=32, num_warps=4, stages=0)),
             ({}, dict(rows=32, num_warps=8, stages=3))]
    out += variant_grid("qk_norm_rope", "triton", tvars,
                        lambda v: launchers(_k.qk_norm_rope_fwd, _k.qk_norm_rope_bwd, v[0], v[1]), make_function,
                        triton_reason(device))
    return out


SPEC = OpSpec(
    trace_kind="RoPE",
    name="qk_norm_rope", tensor_args=("q", "k", "q_weight", "k_weight"), make_inputs=_make_inputs,
    reference=_ref.qk_norm_rope_fp32, stock=_ref.hf_qk_norm_rope, floor_bytes=_floor, candidates=_candidates,
    make_function=make_function, call_cases=_call_cases, poison_call=_poison, noncontiguous=noncontig_heads,
    layout="(b, s, h, d), positions restarting per document", shape_of=qk_shape,
    dtype_of=lambda q, k, q_weight, *_: f"{str(q.dtype)[6:]}/{str(q_weight.dtype)[6:]}",
    dy_shape=qk_dy_shapes, odd_shapes=odd_token_shapes, outputs=("out_q", "out_k"),
    signature="qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin) -> (q_out, k_out): Qwen3's q_norm/k_norm "
              "(RMSNorm per head row) then HF RoPE with unsqueeze_dim=2; q (b, s, hq, d), k (b, s, hk, d), weights "
              "(d,), cos/sin (b, s, d); differentiable in q, k and both weights",
)
