"""RoPE on q and k as registered ops: `novatune::rope_fwd` / `novatune::rope_bwd` + `apply_rope`.

    q_embed, k_embed = novatune.ops.apply_rope(q, k, cos, sin, unsqueeze_dim=1)

Same layout and result as HF's `apply_rotary_pos_emb` (up to rounding: novatune rounds once, from fp32, where HF
eager in bf16 rounds three times), including Phi-3's partial rotary: tables (b, s, r) narrower than head_dim d
rotate the first r features of each head and pass the other d - r through. q (b, hq, s, d) / k (b, hk, s, d)
with unsqueeze_dim=1, or (b, s, h, d) with unsqueeze_dim=2; strided views (last dim contiguous) are read in
place. Outputs are new tensors, dense, with the input's stride order (as torch.empty_like / HF's elementwise ops
give). Output dtype = input dtype.

Gradients flow to q and k only. cos/sin get none: HF computes them under torch.no_grad() from position_ids, so
nothing upstream can use one (a caller who needs d/dcos must use HF's formula).

Device choice via novatune.ops._backend.use_triton: CUDA (or CPU under TRITON_INTERPRET=1) -> one Triton launch
for q and k; otherwise the fp32 reference cast back to the input dtype.

Two paths to the same implementation (_run), as in novatune.ops.rms_norm:
* eager: a plain torch.autograd.Function that calls the launchers directly. The registered op's Python dispatch
  (custom-op autograd + redispatch of rope_fwd, then of rope_bwd) costs more host time than the kernels themselves
  at training shapes (H200: ~300 µs wall vs 45 µs of kernels per fwd+bwd), and RoPE runs 36 layers x (fwd,
  recompute, bwd) per micro-step.
* torch.compile (torch.compiler.is_compiling()): the registered ops `novatune::rope_fwd` / `novatune::rope_bwd`
  (fake impls + autograd registered, opcheck-tested), which is what tracing needs.
Both give identical numbers (tested).
"""
import functools

import torch

from novatune.kernels import rope as _k
from novatune.ops import dispatch
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
    triton_reason,
    variant_grid,
)
from novatune.reference import rope as _ref


def _new_like(x: torch.Tensor) -> torch.Tensor:
    """The output buffer for x: dense with x's stride order (torch.empty_like, like HF's elementwise ops), unless
    that would not leave head_dim contiguous (exotic inputs) - then plain contiguous. Used by the fake impls too,
    so real and fake strides agree."""
    out = torch.empty_like(x)
    return out if out.stride(-1) == 1 else torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _run(kernel, ref, x, y, cos, sin, unsqueeze_dim, on_triton: bool):
    """The one implementation behind both paths: kernel (Triton launcher) or ref (fp32 reference) on x and y."""
    x_out, y_out = _new_like(x), _new_like(y)
    if on_triton:
        return kernel(x, y, cos, sin, unsqueeze_dim, x_out, y_out)
    rx, ry = ref(x, y, cos, sin, unsqueeze_dim)   # CPU: fp32 reference, cast back to the input dtype
    return x_out.copy_(rx), y_out.copy_(ry)


def _check_args(q, k, cos, sin, unsqueeze_dim):
    _k.normalize_unsqueeze_dim(unsqueeze_dim)
    if not all(t.is_floating_point() for t in (q, k, cos, sin)):
        raise TypeError(f"apply_rope: q, k, cos and sin must be floating point, got {q.dtype}, {k.dtype}, "
                        f"{cos.dtype}, {sin.dtype} (integer inputs would be rotated and truncated)")
    if cos.shape != sin.shape:
        raise ValueError(f"apply_rope: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have one shape")
    try:  # one shape contract for the kernels and the references (which would broadcast a wrong table)
        _k.check_shapes(q.shape, k.shape, cos.shape, sin.shape, unsqueeze_dim)
    except ValueError as e:
        raise ValueError(f"apply_rope: {e}") from None


# ----------------------------------------------------------------------------------------------- registered ops
@torch.library.custom_op("novatune::rope_fwd", mutates_args=())
def rope_fwd(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             unsqueeze_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _run(_k.rope_fwd, _ref.rope_ref, q, k, cos, sin, unsqueeze_dim, use_triton(q))


@rope_fwd.register_fake
def _(q, k, cos, sin, unsqueeze_dim):
    return _new_like(q), _new_like(k)


@torch.library.custom_op("novatune::rope_bwd", mutates_args=())
def rope_bwd(dq_embed: torch.Tensor, dk_embed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             unsqueeze_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _run(_k.rope_bwd, _ref.rope_bwd_ref, dq_embed, dk_embed, cos, sin, unsqueeze_dim, use_triton(dq_embed))


@rope_bwd.register_fake
def _(dq_embed, dk_embed, cos, sin, unsqueeze_dim):
    return _new_like(dq_embed), _new_like(dk_embed)


def _setup_context(ctx, inputs, output):
    q, k, cos, sin, unsqueeze_dim = inputs
    ctx.save_for_backward(cos, sin)
    ctx.unsqueeze_dim = unsqueeze_dim
    ctx.q_meta = (q.shape, q.dtype)
    ctx.k_meta = (k.shape, k.dtype)


def _backward(ctx, dq_embed, dk_embed):
    cos, sin = ctx.saved_tensors
    # an unused output (e.g. only q_embed reaches the loss) may arrive as None: its input grad is zero
    if dq_embed is None:
        dq_embed = torch.zeros(ctx.q_meta[0], dtype=ctx.q_meta[1], device=cos.device)
    if dk_embed is None:
        dk_embed = torch.zeros(ctx.k_meta[0], dtype=ctx.k_meta[1], device=cos.device)
    dq, dk = rope_bwd(dq_embed, dk_embed, cos, sin, ctx.unsqueeze_dim)
    return dq, dk, None, None, None   # no grad for cos/sin (built under no_grad by HF) nor unsqueeze_dim


rope_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------- autograd glue
def make_function(fwd, bwd):
    """Functional apply_rope(q, k, cos, sin, unsqueeze_dim=1) from fwd(q, k, cos, sin, u) -> (q_embed, k_embed)
    and bwd(dq_embed, dk_embed, cos, sin, u) -> (dq, dk) (the tables get no gradient, as in HF where they are
    built under no_grad): the op's own eager path and every kernel candidate."""

    class _RopeFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, cos, sin, unsqueeze_dim):
            ctx.save_for_backward(cos, sin)
            ctx.unsqueeze_dim = unsqueeze_dim
            return fwd(q, k, cos, sin, unsqueeze_dim)

        @staticmethod
        def backward(ctx, dq_embed, dk_embed):
            # an output that did not reach the loss arrives as zeros (autograd.Function materialises grads)
            cos, sin = ctx.saved_tensors
            dq, dk = bwd(dq_embed, dk_embed, cos, sin, ctx.unsqueeze_dim)
            needs = ctx.needs_input_grad
            return (dq if needs[0] else None), (dk if needs[1] else None), None, None, None

    def apply_rope_fn(q, k, cos, sin, unsqueeze_dim=1):
        return _RopeFunction.apply(q, k, cos, sin, unsqueeze_dim)

    return apply_rope_fn


def _default_fwd(q, k, cos, sin, unsqueeze_dim):
    return _run(_k.rope_fwd, _ref.rope_ref, q, k, cos, sin, unsqueeze_dim, use_triton(q))


def _default_bwd(dq_embed, dk_embed, cos, sin, unsqueeze_dim):
    return _run(_k.rope_bwd, _ref.rope_bwd_ref, dq_embed, dk_embed, cos, sin, unsqueeze_dim, use_triton(dq_embed))


# the untuned eager path: the same implementation as the registered ops, without the custom-op dispatch
_eager = make_function(_default_fwd, _default_bwd)


# Argument shapes and dtypes _check_args accepted (eager calls only: under torch.compile shapes may be symbolic).
_CHECKED: set[tuple] = set()


# ----------------------------------------------------------------------------------------------- public API
def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for HF `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)`; one kernel for q and k.

    q (b, hq, s, d), k (b, hk, s, d) for unsqueeze_dim=1 (HF layout; GQA: hk may differ from hq), or
    (b, s, h, d) for unsqueeze_dim=2. cos/sin (b or 1, s, d) from the model's rotary embedding (per-token
    positions, so packed rows with restarting position_ids work). d even, <= 256; the tables' width r = d, or
    r < d (partial rotary: the last d - r features pass through). Returns new (q_embed, k_embed) in the input
    dtype.
    """
    if torch.compiler.is_compiling():
        _check_args(q, k, cos, sin, unsqueeze_dim)
        return rope_fwd(q, k, cos, sin, unsqueeze_dim)
    key = (q.shape, k.shape, cos.shape, sin.shape, unsqueeze_dim, q.dtype, k.dtype, cos.dtype, sin.dtype)
    if key not in _CHECKED:
        _check_args(q, k, cos, sin, unsqueeze_dim)
        if len(_CHECKED) >= 4096:   # bound only (every sequence length would be a new key)
            _CHECKED.clear()
        _CHECKED.add(key)
    # an implementation `novatune tune` selected for this shape
    # (dispatch.ACTIVE is None: nothing tuned, one global read).
    # Only the (b, s, h, d) layout is consulted: the tune entries are validated and timed there (the patched
    # model's layout), and a (b, h, s, d) call of the same size would run its kernel at other strides.
    if (hook := dispatch.ACTIVE) is not None and _k.normalize_unsqueeze_dim(unsqueeze_dim) == 2 and (
            out := hook("rope", q, k, cos, sin, unsqueeze_dim)) is not None:
        return out
    return _eager(q, k, cos, sin, unsqueeze_dim)


__all__ = ["apply_rope", "rope_fwd", "rope_bwd"]


# ----------------------------------------------------------------------------------------------- the contract
def _make_inputs(shape, dtype, device, gen, batch: int = 1, unsqueeze_dim: int = 2, magnitude: float = 1.0,
                 theta: float = 1e6, rotary_dim: int | None = None) -> dict:
    """shape key (tokens, hq, hk, d): q, k in (b, s, h, d) (unsqueeze_dim=2, the patched model's layout) or
    (b, h, s, d) (1, HF's), tables as HF's rotary embedding builds them on packed rows (positions restarting per
    document), so a candidate assuming positions 0..T-1 or ignoring the tables' values fails. rotary_dim < d:
    partial rotary tables (b, s, rotary_dim), as Phi-4-mini's."""
    t, hq, hk, d = shape
    s = t // batch
    cos, sin = rope_tables(batch, s, rotary_dim or d, dtype, device, theta)
    q = torch.randn(batch, s, hq, d, generator=gen) * magnitude
    k = torch.randn(batch, s, hk, d, generator=gen) * magnitude
    if unsqueeze_dim == 1:
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
    return {"q": q.to(device=device, dtype=dtype), "k": k.to(device=device, dtype=dtype), "cos": cos, "sin": sin,
            "unsqueeze_dim": unsqueeze_dim}


def noncontig_heads(inputs) -> dict:
    """q and k as views of one fused projection (b, s, 1 + hq + hk, d) with a leading dummy head: token stride
    (1 + hq + hk) * d, first element d elements off (what a fused qkv projection's views look like)."""
    q, k = inputs["q"], inputs["k"]
    b, t, hq, d = q.shape
    hk = k.shape[2]
    buf = torch.zeros(b, t, 1 + hq + hk, d, dtype=q.dtype, device=q.device)
    buf[:, :, 1:1 + hq] = q
    buf[:, :, 1 + hq:] = k
    return dict(inputs, q=buf[:, :, 1:1 + hq], k=buf[:, :, 1 + hq:])


def _call_cases(dtype, device, gen) -> list:
    mk = functools.partial(_make_inputs, dtype=dtype, device=device, gen=gen)
    return [("patched attention (b, s, h, d)", mk((2 * 37, 4, 2, 32), batch=2)),
            ("HF layout (b, h, s, d) unsqueeze_dim=1", mk((41, 3, 1, 16), unsqueeze_dim=1)),
            ("single token", mk((1, 2, 2, 8))), ("|x| ~ 1e4", mk((19, 2, 2, 64), magnitude=1e4)),
            ("rows > 65,535", mk((65_541, 1, 1, 4))),
            ("q/k views of a fused projection", noncontig_heads(mk((23, 4, 2, 16)))),
            ("partial rotary 3/4 (Phi-4-mini)", mk((29, 3, 1, 32), rotary_dim=24))]


def _floor(shape, dtype) -> int:
    t, hq, hk, d = shape
    # fwd reads q, k and writes both; bwd reads both grads and writes dq, dk; cos/sin read in each direction
    return (4 * t * (hq + hk) * d + 4 * t * d) * element_size(dtype)


def _poison(kernels, inputs, dy) -> dict:
    q, k, cos, sin, u = (inputs[n] for n in ("q", "k", "cos", "sin", "unsqueeze_dim"))
    qo, ko = kernels.fwd(q, k, cos, sin, u, q_out=fill_nan_like(q), k_out=fill_nan_like(k))
    dq, dk = kernels.bwd(dy[0], dy[1], cos, sin, u, dq=fill_nan_like(q), dk=fill_nan_like(k))
    return {"out_q": qo, "out_k": ko, "q": dq, "k": dk}


def _ref_in_dtype(q, k, cos, sin, unsqueeze_dim=1):
    qe, ke = _ref.rope_ref(q, k, cos, sin, unsqueeze_dim)   # fp32 math, one rounding (as the kernel)
    return qe.to(q.dtype), ke.to(k.dtype)


def _candidates(shape, dtype, device: str) -> list:
    out = [Candidate("rope", "hf_eager", "eager", make=lambda: _ref.hf_apply_rope, selectable=False),
           Candidate("rope", "novatune_default", "default", make=lambda: _eager),
           Candidate("rope", "torch_compile", "compile", make=lambda: compiled(_ref_in_dtype), deterministic=False)]
    # (heads split over programs per token, num_warps) around the launcher's default (split 1, 8 warps at
    # Qwen3-4B's 32 + 8 heads x 128; 4 warps when the (heads, half) tile is <= 2048 values)
    tvars = [dict(split=1, num_warps=4), dict(split=1, num_warps=16), dict(split=2, num_warps=4),
             dict(split=2, num_warps=8), dict(split=4, num_warps=4)]
    out += variant_grid("rope", "triton", tvars, lambda cfg: launchers(_k.rope_fwd, _k.rope_bwd, cfg, cfg),
                        make_function, triton_reason(device))
    return out


def qk_shape(q, k, *_):
    """(tokens, hq, hk, d) of q, k in (b, s, h, d)."""
    return (q.shape[0] * q.shape[1], q.shape[2], k.shape[2], q.shape[3])


def qk_dy_shapes(shape):
    t, hq, hk, d = shape
    return ((1, t, hq, d), (1, t, hk, d))


SPEC = OpSpec(
    trace_kind="RoPE",
    name="rope", tensor_args=("q", "k"), make_inputs=_make_inputs, reference=_ref.rope_ref,
    stock=_ref.hf_apply_rope, floor_bytes=_floor, candidates=_candidates, make_function=make_function,
    call_cases=_call_cases, poison_call=_poison, noncontiguous=noncontig_heads,
    layout="(b, s, h, d) unsqueeze_dim=2, positions restarting per document",
    shape_of=qk_shape, dtype_of=lambda q, k, cos, sin, *_: f"{str(q.dtype)[6:]}/{str(cos.dtype)[6:]}",
    dy_shape=qk_dy_shapes, odd_shapes=odd_token_shapes, outputs=("out_q", "out_k"),
    signature="apply_rope(q, k, cos, sin, unsqueeze_dim=1) -> (q_embed, k_embed): HF's apply_rotary_pos_emb; "
              "q (b, s, hq, d) / k (b, s, hk, d) with unsqueeze_dim=2 or (b, h, s, d) with 1, cos/sin (b, s, d); "
              "differentiable in q and k",
)
