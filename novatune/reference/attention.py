"""Causal attention inside each document of a packed row, (tokens, heads, head_dim) layout, GQA by repeat; with
sinks (GPT-OSS), a learned per-head logit in every softmax denominator.

`hf_attention` is transformers' eager_attention_forward applied one document at a time (repeat_kv, scores in the
input dtype, fp32 softmax): the stock formula; on fp32 copies it is the fp32 oracle (`attention_ref`).
`packed` is anything with `.lengths` (the documents' token counts, in order).
"""
from __future__ import annotations

import math

import torch


def _documents(q, k, v, packed):
    """Per packed document: its length n and (hq, n, d) q, k, v with k and v repeated over the GQA groups
    (transformers' repeat_kv)."""
    rep, a = q.shape[1] // k.shape[1], 0
    for n in packed.lengths:
        yield (n, q[a:a + n].transpose(0, 1), k[a:a + n].transpose(0, 1).repeat_interleave(rep, 0),
               v[a:a + n].transpose(0, 1).repeat_interleave(rep, 0))
        a += n


def hf_attention(q, k, v, packed):
    scale = 1.0 / math.sqrt(q.shape[2])
    outs = []
    for n, qd, kd, vd in _documents(q, k, v, packed):
        s = (qd @ kd.transpose(1, 2)) * scale
        mask = torch.full((n, n), float("-inf"), device=q.device, dtype=s.dtype).triu(1)
        p = torch.softmax(s + mask, dim=-1, dtype=torch.float32).to(q.dtype)
        outs.append((p @ vd).transpose(0, 1))
    return torch.cat(outs, 0)


def attention_ref(q, k, v, packed, window=None):
    """The fp32 oracle; `window`: query i sees its document's keys i - window + 1 .. i (HF's sliding window)."""
    if window is None:
        return hf_attention(q.float(), k.float(), v.float(), packed)
    scale, outs = 1.0 / math.sqrt(q.shape[2]), []
    for n, qd, kd, vd in _documents(q.float(), k.float(), v.float(), packed):
        p = torch.softmax((qd @ kd.transpose(1, 2)) * scale + _window_mask(n, window, q.device), dim=-1)
        outs.append((p @ vd).transpose(0, 1))
    return torch.cat(outs, 0)


def _window_mask(n: int, window: int | None, device) -> torch.Tensor:
    """(n, n) additive mask: 0 where query i sees key j (j <= i, i - j < window), -inf elsewhere."""
    i = torch.arange(n, device=device)
    delta = i.view(n, 1) - i.view(1, n)
    seen = (delta >= 0) & (delta < window) if window is not None else delta >= 0
    return torch.zeros(n, n, device=device).masked_fill(~seen, float("-inf"))


def hf_attention_sinks(q, k, v, sinks, packed, window=None):
    """GPT-OSS's eager attention applied one document at a time: the per-head sink logit appended as one more
    score column, the row maximum subtracted, softmax in the scores' dtype, the sink column dropped."""
    hq, scale = q.shape[1], 1.0 / math.sqrt(q.shape[2])
    outs = []
    for n, qd, kd, vd in _documents(q, k, v, packed):
        s = (qd @ kd.transpose(1, 2)) * scale + _window_mask(n, window, q.device).to(q.dtype)
        combined = torch.cat([s, sinks.to(s.dtype).view(hq, 1, 1).expand(hq, n, 1)], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        p = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(v.dtype)
        outs.append((p @ vd).transpose(0, 1))
    return torch.cat(outs, 0)


def attention_sinks_ref(q, k, v, sinks, packed, window=None):
    """The fp32 oracle of attention with sinks (differentiable in all four inputs through autograd)."""
    return hf_attention_sinks(q.float(), k.float(), v.float(), sinks.float(), packed, window)
