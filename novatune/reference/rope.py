"""Rotary position embedding, HF's apply_rotary_pos_emb: q_embed = q * cos + rotate_half(q) * sin (same for k).

cos/sin are (b or 1, s, r) (or (s, r)), unsqueezed at `unsqueeze_dim` (1: q (b, h, s, d); 2: q (b, s, h, d)).
r = d, or r < d for partial rotary (Phi-3 / Phi-4-mini's apply_rotary_pos_emb): the first r features of each head
rotate (rotate_half over those r) and the last d - r pass through unchanged, in both directions.
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
    r = c.shape[-1]
    if r == x.shape[-1]:
        return x * c + rotate_half(x) * s
    x_rot, x_pass = x[..., :r], x[..., r:]
    return torch.cat((x_rot * c + rotate_half(x_rot) * s, x_pass), dim=-1)


def _rotate_back(g: Tensor, c: Tensor, s: Tensor) -> Tensor:
    r = c.shape[-1]
    g_rot = g[..., :r]
    back = g_rot * c - rotate_half(g_rot * s)
    return back if r == g.shape[-1] else torch.cat((back, g[..., r:]), dim=-1)


def hf_apply_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1) -> tuple[Tensor, Tensor]:
    """transformers' apply_rotary_pos_emb (Llama / Qwen3; Phi-3's with narrower tables) in the inputs' dtype."""
    c, s = _tables(cos, sin, unsqueeze_dim)
    return _rotate(q, c, s), _rotate(k, c, s)


def rope_ref(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1) -> tuple[Tensor, Tensor]:
    """The fp32 oracle (returns fp32). unsqueeze_dim may be negative, as HF allows."""
    return hf_apply_rope(q.float(), k.float(), cos.float(), sin.float(), unsqueeze_dim)


def rope_bwd_ref(dq_embed: Tensor, dk_embed: Tensor, cos: Tensor, sin: Tensor,
                 unsqueeze_dim: int = 1) -> tuple[Tensor, Tensor]:
    """Transpose of rope_ref in fp32: dx = dy * cos - rotate_half(dy * sin) on the rotated features, dx = dy on
    the pass-through ones."""
    c, s = _tables(cos.float(), sin.float(), unsqueeze_dim)
    return _rotate_back(dq_embed.float(), c, s), _rotate_back(dk_embed.float(), c, s)
