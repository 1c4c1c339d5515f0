"""RoPE on q and k as registered ops: `novatune::rope_fwd` / `novatune::rope_bwd` + `apply_rope`.

    q_embed, k_embed = novatune.ops.apply_rope(q, k, cos, sin, unsqueeze_dim=1)

Same layout and result as HF's `apply_rotary_pos_emb` (up to rounding: novatune rounds once, from fp32, where HF
eager in bf16 rounds three times). q (b, hq, s, d) / k (b, hk, s, d) with unsqueeze_dim=1, or (b, s, h, d) with
unsqueeze_dim=2; strided views (last dim contiguous) are read in place. Outputs are new tensors, dense, with the
input's stride order (as torch.empty_like / HF's elementwise ops give). Output dtype = input dtype.

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

import torch

from novatune.kernels import rope as _k
from novatune.ops import _backend
from novatune.ops._backend import use_triton


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
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"apply_rope: q and k must be 4-d, got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[-1] != cos.shape[-1] or k.shape[-1] != cos.shape[-1] or cos.shape != sin.shape:
        raise ValueError(f"apply_rope: head_dim of q {tuple(q.shape)}, k {tuple(k.shape)} and cos/sin "
                         f"{tuple(cos.shape)}/{tuple(sin.shape)} must agree (partial rotary is not supported)")


# ----------------------------------------------------------------------------------------------- registered ops
@torch.library.custom_op("novatune::rope_fwd", mutates_args=())
def rope_fwd(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             unsqueeze_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _run(_k.rope_fwd, _k.rope_ref, q, k, cos, sin, unsqueeze_dim, use_triton(q))


@rope_fwd.register_fake
def _(q, k, cos, sin, unsqueeze_dim):
    return _new_like(q), _new_like(k)


@torch.library.custom_op("novatune::rope_bwd", mutates_args=())
def rope_bwd(dq_embed: torch.Tensor, dk_embed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             unsqueeze_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _run(_k.rope_bwd, _k.rope_bwd_ref, dq_embed, dk_embed, cos, sin, unsqueeze_dim, use_triton(dq_embed))


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


# ----------------------------------------------------------------------------------------------- eager fast path
class _RopeFunction(torch.autograd.Function):
    """Same implementation as the registered ops, without the custom-op dispatch overhead (eager only)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, unsqueeze_dim):
        on_triton = use_triton(q)   # decided once: the backward runs on the same device
        ctx.save_for_backward(cos, sin)
        ctx.unsqueeze_dim, ctx.on_triton = unsqueeze_dim, on_triton
        return _run(_k.rope_fwd, _k.rope_ref, q, k, cos, sin, unsqueeze_dim, on_triton)

    @staticmethod
    def backward(ctx, dq_embed, dk_embed):
        # an output that did not reach the loss arrives as zeros (autograd.Function materialises grads)
        cos, sin = ctx.saved_tensors
        dq, dk = _run(_k.rope_bwd, _k.rope_bwd_ref, dq_embed, dk_embed, cos, sin, ctx.unsqueeze_dim, ctx.on_triton)
        needs = ctx.needs_input_grad
        return (dq if needs[0] else None), (dk if needs[1] else None), None, None, None


# Argument shapes _check_args accepted (eager calls only: under torch.compile shapes may be symbolic).
_CHECKED: set[tuple] = set()


# ----------------------------------------------------------------------------------------------- public API
def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for HF `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)`; one kernel for q and k.

    q (b, hq, s, d), k (b, hk, s, d) for unsqueeze_dim=1 (HF layout; GQA: hk may differ from hq), or
    (b, s, h, d) for unsqueeze_dim=2. cos/sin (b or 1, s, d) from the model's rotary embedding (per-token
    positions, so packed rows with restarting position_ids work). d even, <= 256, equal to the tables' d
    (partial rotary is not supported). Returns new (q_embed, k_embed) in the input dtype.
    """
    if torch.compiler.is_compiling():
        _check_args(q, k, cos, sin, unsqueeze_dim)
        return rope_fwd(q, k, cos, sin, unsqueeze_dim)
    key = (q.shape, k.shape, cos.shape, sin.shape, unsqueeze_dim)
    if key not in _CHECKED:
        _check_args(q, k, cos, sin, unsqueeze_dim)
        if len(_CHECKED) >= 4096:   # bound only (every sequence length would be a new key)
            _CHECKED.clear()
        _CHECKED.add(key)
    # an implementation `novatune tune` selected for this shape (OVERRIDE is None: nothing tuned, one global read).
    # Only the (b, s, h, d) layout is consulted: the tune entries are validated and timed there (the patched
    # model's layout), and a (b, h, s, d) call of the same size would run its kernel at other strides.
    if (hook := _backend.OVERRIDE) is not None and _k.normalize_unsqueeze_dim(unsqueeze_dim) == 2 and (
            out := hook("rope", q, k, cos, sin, unsqueeze_dim)) is not None:
        return out
    return _RopeFunction.apply(q, k, cos, sin, unsqueeze_dim)


__all__ = ["apply_rope", "rope_fwd", "rope_bwd"]
