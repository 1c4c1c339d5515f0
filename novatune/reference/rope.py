"""Rotary position embedding, HF's apply_rotary_pos_emb: q_embed = q * cos + rotate_half(q) * sin (same for k).

cos/sin are (b or 1, s, d) (or (s, d)), unsqueezed at `unsqueeze_dim` (1: q (b, h, s, d); 2: q (b, s, h, d)).
`hf_apply_rope` is the stock formula in the input dtype; `rope_ref` the fp32 oracle; `rope_bwd_ref` its transpose,
a rotation by -theta: dx = dy * cos - rotate_half(dy * sin).
"""
from __future__ import annotations

import torch
from torch import Tensor


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _tables(cos: Tensor, sin: Tensor, unsqueeze_dim: int) -> tuple[Tensor, Tensor]:
    if cos.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    return cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)


def _rotate(x: Tensor, c: Tensor, s: Tensor) -> Tensor:
    return x * c + rotate_half(x) * s


def hf_apply_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1) -> tuple[Tensor, Tensor]:
    """transformers' apply_rotary_pos_emb (Llama / Qwen3) as a function, in the inputs' dtype."""
    c, s = _tables(cos, sin, unsqueeze_dim)
    return _rotate(q, c, s), _rotate(k, c, s)


def rope_ref(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1) -> tuple[Tensor, Tensor]:
    """The fp32 oracle (returns fp32). unsqueeze_dim may be negative, as HF allows."""
    return hf_apply_rope(q.float(), k.float(), cos.float(), sin.float(), unsqueeze_dim)


def rope_bwd_ref(dq_embed: Tensor, dk_embed: Tensor, cos: Tensor, sin: Tensor,
                 unsqueeze_dim: int = 1) -> tuple[Tensor, Tensor]:
    """Transpose of rope_ref in fp32: dx = dy * cos - rotate_half(dy * sin)."""
    c, s = _tables(cos.float(), sin.float(), unsqueeze_dim)
    gq, gk = dq_embed.float(), dk_embed.float()
    return gq * c - rotate_half(gq * s), gk * c - rotate_half(gk * s)
