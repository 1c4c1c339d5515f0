"""Causal attention inside each document of a packed row, (tokens, heads, head_dim) layout, GQA by repeat.

`hf_attention` is transformers' eager_attention_forward applied one document at a time (repeat_kv, scores in the
input dtype, fp32 softmax): the stock formula; on fp32 copies it is the fp32 oracle (`attention_ref`).
`packed` is anything with `.lengths` (the documents' token counts, in order).
"""
from __future__ import annotations

import math

import torch


def hf_attention(q, k, v, packed):
    hq, hk, d = q.shape[1], k.shape[1], q.shape[2]
    scale = 1.0 / math.sqrt(d)
    outs, a = [], 0
    for n in packed.lengths:
        qd = q[a:a + n].transpose(0, 1)                                    # (hq, n, d)
        kd = k[a:a + n].transpose(0, 1).repeat_interleave(hq // hk, 0)     # repeat_kv
        vd = v[a:a + n].transpose(0, 1).repeat_interleave(hq // hk, 0)
        s = (qd @ kd.transpose(1, 2)) * scale
        mask = torch.full((n, n), float("-inf"), device=q.device, dtype=s.dtype).triu(1)
        p = torch.softmax(s + mask, dim=-1, dtype=torch.float32).to(q.dtype)
        outs.append((p @ vd).transpose(0, 1))
        a += n
    return torch.cat(outs, 0)


def attention_ref(q, k, v, packed):
    return hf_attention(q.float(), k.float(), v.float(), packed)
