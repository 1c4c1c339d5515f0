"""Op specs of RoPE (`novatune.ops.apply_rope`) and Qwen3's fused q/k-norm + RoPE (`novatune.ops.qk_norm_rope`).

Both are applied through the ops' dispatch hook (like rms_norm / swiglu): the patched attention forward calls
them per layer with the real shapes, so `select.recording` sees those shapes and `select.install` swaps the
implementation per (op, shape, dtype) with no model setting.

rope          shape (tokens, q heads, kv heads, head_dim); call (q (1, T, hq, d), k (1, T, hk, d), cos, sin (1, T, d),
              unsqueeze_dim=2) -> (q_embed, k_embed): the patched model's (b, s, h, d) layout (apply_rope only
              consults the hook for it). Gradients of q and k (cos/sin are built under no_grad by HF).
qk_norm_rope  same shape key; call (q, k, q_weight (d,), k_weight (d,), eps, cos, sin) -> (q_out, k_out).
              Gradients of q, k and both weights.

Inputs: packed rows whose positions restart at each document (documents of uneven lengths), tables as HF's rotary
embedding builds them (inv_freq with Qwen3's rope_theta 1e6, cos/sin cast to the input dtype), so a candidate that
assumed positions 0..T-1 or ignored the tables' per-token values fails. For the norm: per-(token, head) row scales
from 1e-3 to 10 (mean(x^2) down to ~eps: a wrong eps shows) and weights far from 1 (a skipped weight shows).
"""
from __future__ import annotations

import torch

from novatune.tune.opspecs import OpSpec, _fill_like
from novatune.tune.opspecs_model import doc_lengths

ROPE_THETA = 1e6  # Qwen3's rope_theta (Llama 3 uses 5e5): only the spread of angles matters for validation


def _tables(tokens: int, d: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """HF rotary tables (1, T, d) for a packed row: positions restart per document (at least 3 documents when
    there are 3 tokens, else one per ~1024 tokens, as patch(tune=True) assumes)."""
    docs = min(tokens, max(3, tokens // 1024))
    pos = torch.cat([torch.arange(n, dtype=torch.float32) for n in doc_lengths(tokens, docs)])
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def _heads(tokens: int, h: int, d: int, gen, scaled: bool) -> torch.Tensor:
    x = torch.randn(1, tokens, h, d, generator=gen)
    if scaled:  # per-(token, head) row scales 1e-3 .. 10, shuffled
        n = tokens * h
        scale = torch.logspace(-3, 1, n, dtype=torch.float32)[torch.randperm(n, generator=gen)]
        x = x * scale.view(1, tokens, h, 1)
    return x


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _noncontig(inputs) -> dict:
    """q and k as views of one fused projection (1, T, 1 + hq + hk, d) with a leading dummy head: token stride
    (1 + hq + hk) * d, first element d elements off (what a fused qkv projection's views look like)."""
    q, k = inputs["q"], inputs["k"]
    _b, t, hq, d = q.shape
    hk = k.shape[2]
    buf = torch.zeros(1, t, 1 + hq + hk, d, dtype=q.dtype, device=q.device)
    buf[:, :, 1:1 + hq] = q
    buf[:, :, 1 + hq:] = k
    return dict(inputs, q=buf[:, :, 1:1 + hq], k=buf[:, :, 1 + hq:])


def odd_shapes(shape, device_type: str) -> list:
    """The real shape, 37 tokens (3 documents) and 1 token at the same heads; 4097 tokens too on a GPU when the
    real count is larger (a tail block in every tiling)."""
    t, hq, hk, d = shape
    extra = [(37, hq, hk, d), (1, hq, hk, d)] + ([(4097, hq, hk, d)] if device_type == "cuda" and t > 4097 else [])
    out = [tuple(shape)]
    for s in extra:
        if s not in out:
            out.append(s)
    return out


def _elt(dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def _qk_shape(q, k, *_):
    return (q.shape[0] * q.shape[1], q.shape[2], k.shape[2], q.shape[3])


def _dy_shapes(shape):
    t, hq, hk, d = shape
    return ((1, t, hq, d), (1, t, hk, d))


# ----------------------------------------------------------------------------------------------- rope
def _rope_inputs(shape, dtype, device, gen) -> dict:
    t, hq, hk, d = shape
    cos, sin = _tables(t, d, dtype, device)
    return {"q": _heads(t, hq, d, gen, False).to(device=device, dtype=dtype),
            "k": _heads(t, hk, d, gen, False).to(device=device, dtype=dtype),
            "cos": cos, "sin": sin, "unsqueeze_dim": 2}


def rope_reference(q, k, cos, sin, unsqueeze_dim):
    """HF's apply_rotary_pos_emb in fp32, written out here (not the kernel module's copy) so the validator does not
    share code with the kernels it checks."""
    c, s = cos.float().unsqueeze(unsqueeze_dim), sin.float().unsqueeze(unsqueeze_dim)
    qf, kf = q.float(), k.float()
    return qf * c + _rotate_half(qf) * s, kf * c + _rotate_half(kf) * s


def _rope_floor(shape, dtype) -> int:
    t, hq, hk, d = shape
    # fwd reads q, k and writes both; bwd reads both grads and writes dq, dk; cos/sin read in each direction
    return (4 * t * (hq + hk) * d + 4 * t * d) * _elt(dtype)


def _rope_poison(kernels, inputs, dy) -> dict:
    q, k, cos, sin, u = (inputs[n] for n in ("q", "k", "cos", "sin", "unsqueeze_dim"))
    qo, ko = kernels.fwd(q, k, cos, sin, u, q_out=_fill_like(q), k_out=_fill_like(k))
    dq, dk = kernels.bwd(dy[0], dy[1], cos, sin, u, dq=_fill_like(q), dk=_fill_like(k))
    return {"out_q": qo, "out_k": ko, "q": dq, "k": dk}


ROPE = OpSpec(
    name="rope", tensor_args=("q", "k"), make_inputs=_rope_inputs, reference=rope_reference,
    floor_bytes=_rope_floor, shape_of=_qk_shape,
    dtype_of=lambda q, k, cos, sin, *_: f"{str(q.dtype)[6:]}/{str(cos.dtype)[6:]}",
    poison_call=_rope_poison, noncontiguous=_noncontig,
    layout="(b, s, h, d) unsqueeze_dim=2, positions restarting per document",
    dy_shape=_dy_shapes, odd_shapes=odd_shapes, outputs=("out_q", "out_k"),
)


# ----------------------------------------------------------------------------------------------- qk_norm_rope
def _qk_inputs(shape, dtype, device, gen) -> dict:
    t, hq, hk, d = shape
    cos, sin = _tables(t, d, dtype, device)
    wq, wk = (1.0 + 0.5 * torch.randn(d, generator=gen) for _ in range(2))
    return {"q": _heads(t, hq, d, gen, True).to(device=device, dtype=dtype),
            "k": _heads(t, hk, d, gen, True).to(device=device, dtype=dtype),
            "q_weight": wq.to(device=device, dtype=dtype), "k_weight": wk.to(device=device, dtype=dtype),
            "eps": 1e-6, "cos": cos, "sin": sin}


def qk_norm_rope_reference(q, k, q_weight, k_weight, eps, cos, sin):
    """Qwen3RMSNorm of each head row, then HF's RoPE (unsqueeze_dim=2), all in fp32."""
    def norm(x, w):
        xf = x.float()
        return w.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))
    return rope_reference(norm(q, q_weight), norm(k, k_weight), cos, sin, 2)


def _qk_floor(shape, dtype) -> int:
    t, hq, hk, d = shape
    # fwd reads q, k, writes outputs (+ fp32 rstd per row); bwd reads the grads, q, k, writes dq, dk
    return (5 * t * (hq + hk) * d + 4 * t * d) * _elt(dtype) + 2 * t * (hq + hk) * 4


def _qk_poison(kernels, inputs, dy) -> dict:
    q, k, wq, wk, eps, cos, sin = (inputs[n] for n in ("q", "k", "q_weight", "k_weight", "eps", "cos", "sin"))
    odt = torch.promote_types(q.dtype, wq.dtype)
    rq = torch.full(q.shape[:3], float("nan"), dtype=torch.float32, device=q.device)
    rk = torch.full(k.shape[:3], float("nan"), dtype=torch.float32, device=k.device)
    qo, ko, rq, rk = kernels.fwd(q, k, wq, wk, eps, cos, sin, q_out=_fill_like(q.to(odt)),
                                 k_out=_fill_like(k.to(odt)), rstd_q=rq, rstd_k=rk)
    dq, dk, dwq, dwk = kernels.bwd(dy[0], dy[1], q, k, wq, wk, rq, rk, cos, sin, dq=_fill_like(q),
                                   dk=_fill_like(k), dq_weight=_fill_like(wq), dk_weight=_fill_like(wk))
    return {"out_q": qo, "out_k": ko, "q": dq, "k": dk, "q_weight": dwq, "k_weight": dwk}


QK_NORM_ROPE = OpSpec(
    name="qk_norm_rope", tensor_args=("q", "k", "q_weight", "k_weight"), make_inputs=_qk_inputs,
    reference=qk_norm_rope_reference, floor_bytes=_qk_floor, shape_of=_qk_shape,
    dtype_of=lambda q, k, q_weight, *_: f"{str(q.dtype)[6:]}/{str(q_weight.dtype)[6:]}",
    poison_call=_qk_poison, noncontiguous=_noncontig,
    layout="(b, s, h, d), positions restarting per document",
    dy_shape=_dy_shapes, odd_shapes=odd_shapes, outputs=("out_q", "out_k"),
)
