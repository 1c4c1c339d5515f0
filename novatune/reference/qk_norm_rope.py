"""Qwen3's per-head q/k RMSNorm followed by RoPE, q and k in (b, s, h, d) and tables unsqueezed at dim 2.

`hf_qk_norm_rope` is the stock sequence (Qwen3RMSNorm on each head row, then apply_rotary_pos_emb) in the input
dtype; `qk_norm_rope_fp32` the fp32 oracle; `qk_norm_rope_ref` the kernel's own rounding sequence (HF's roundings
of the normalised value and of the weighted value, then one final rounding) and `qk_norm_rope_bwd_ref` the kernel's
closed-form backward, both in plain fp32 PyTorch.
"""
from __future__ import annotations

from torch import Tensor

from novatune.reference.rms_norm import hf_rms_norm, rms_norm_ref
from novatune.reference.rope import _tables, hf_apply_rope, rotate_half


def hf_qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin):
    """Qwen3Attention's q_norm / k_norm then apply_rotary_pos_emb (unsqueeze_dim=2), in the inputs' dtype."""
    return hf_apply_rope(hf_rms_norm(q, q_weight, eps), hf_rms_norm(k, k_weight, eps), cos, sin, 2)


def qk_norm_rope_fp32(q, k, q_weight, k_weight, eps, cos, sin):
    """The fp32 oracle: the stock sequence on fp32 copies."""
    return hf_qk_norm_rope(q.float(), k.float(), q_weight.float(), k_weight.float(), eps, cos.float(), sin.float())


def qk_norm_rope_ref(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, cos: Tensor,
                     sin: Tensor, return_rstd: bool = False):
    """fp32 math with the kernel's rounding sequence; differentiable. Returns (q_out, k_out) in
    promote(x, weight), or (q_out, k_out, rstd_q, rstd_k) with rstd (b, s, h) fp32."""
    c, s = _tables(cos.float(), sin.float(), 2)
    outs, rstds = [], []
    for x, w in ((q, q_weight), (k, k_weight)):
        # HF's norm (its roundings: the normalised value to x's dtype, the weighted one to promote(x, w)) ...
        n, rstd = rms_norm_ref(x, w, eps, return_rstd=True)
        qn = n.float()
        outs.append((qn * c + rotate_half(qn) * s).to(n.dtype))  # ... then the rotation, rounded once
        rstds.append(rstd)
    return (*outs, *rstds) if return_rstd else tuple(outs)


def qk_norm_rope_bwd_ref(dq_out, dk_out, q, k, q_weight, k_weight, rstd_q, rstd_k, cos, sin):
    """The kernel's backward formula in plain fp32 PyTorch: (dq, dk, dq_weight, dk_weight) in the inputs' dtypes."""
    c, s = _tables(cos.float(), sin.float(), 2)
    res = []
    for dy, x, w, rstd in ((dq_out, q, q_weight, rstd_q), (dk_out, k, k_weight, rstd_k)):
        g = dy.float()
        dn = g * c - rotate_half(g * s)  # = dy * cos + rotate_half^T(dy * sin)
        xhat = x.float() * rstd.unsqueeze(-1)
        gw = dn * w.float()
        m = (gw * xhat).mean(-1, keepdim=True)
        dx = (gw - xhat * m) * rstd.unsqueeze(-1)
        dw = (dn * xhat.to(x.dtype).float()).reshape(-1, x.shape[-1]).sum(0)
        res.append((dx.to(x.dtype), dw.to(w.dtype)))
    (dq, dwq), (dk, dwk) = res
    return dq, dk, dwq, dwk
