"""Attention sinks over packed rows: a learned logit s_h per query head joins every softmax denominator.

    out'[i, h] = sum_j exp(S_ij) v_j / (exp(s_h) + sum_j exp(S_ij))      (j: the keys query i sees in its document)

GPT-OSS's eager attention appends s_h as one more score column and drops that column after the softmax: the sink
carries no value, it only enlarges the denominator. With L_i = logsumexp_j S_ij (the log-sum-exp a
FlashAttention-style forward returns anyway) a sink is a per-(token, head) scale of the plain output:

    out' = out * c,      c = sigmoid(L - s_h)

Backward, with g = d out'. out' depends on q, k, v through out and through L:
    d out = c g,    dL = c (1 - c) rowsum(g * out),    d s_h = -sum_i c (1 - c) rowsum(g * out)
A FlashAttention backward given d_out and an LSE gradient dL forms dS = P (dP - (D - dL)) with
D = rowsum(d_out * out); here D - dL = c rowsum(g out) - c (1 - c) rowsum(g out) = rowsum(d_out * out'). So the
plain backward, called with d_out = c g, out = out' (not out) and the forward's own L, returns the exact gradients
of q, k and v, and d s_h = -sum_i (1 - c) rowsum(g * out') needs no division by c. tests/attention/test_sinks.py
checks all four gradients against autograd through the appended-column formula in fp32.

Two implementations of the plain (out, L) forward and its backward, selected by name:
  flash      aten._flash_attention_forward / _backward (FlashAttention-2 inside torch: CUDA, fp16/bf16), varlen
             over cu_seqlens, GQA native, HF's sliding window as window_size_left = window - 1 (flash.py)
  reference  the same math in fp32, one document at a time (CPU tests, and anywhere as the slow exact path)
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch.autograd.function import once_differentiable

from novatune.attention.flash import flash_bwd, flash_fwd
from novatune.attention.packed import PackedBatch
from novatune.kernels.sinks import sink_scale_bwd, sink_scale_fwd

__all__ = ["sink_attention", "SINK_IMPLS"]


# ------------------------------------------------------------------------------------------------ reference
def _doc_mask(n: int, window: int | None, device) -> torch.Tensor:
    """(n, n) bool: query i sees key j iff j <= i and i - j < window (HF's sliding window of `window` keys)."""
    i = torch.arange(n, device=device)
    delta = i.view(n, 1) - i.view(1, n)
    return (delta >= 0) & (delta < window) if window is not None else delta >= 0


def _doc_views(q, k, v, a: int, n: int, kv_head: torch.Tensor):
    """One document's q, k, v in fp32 as (hq, n, d), k and v repeated to the query heads."""
    qd = q[a:a + n].float().transpose(0, 1)
    kd = k[a:a + n].float().transpose(0, 1)[kv_head]
    vd = v[a:a + n].float().transpose(0, 1)[kv_head]
    return qd, kd, vd


def _reference_fwd(q, k, v, packed: PackedBatch, scale: float, window: int | None):
    """(out in q's dtype, L (tokens, hq) fp32): plain document-causal attention and its log-sum-exp."""
    hq, hk = q.shape[1], k.shape[1]
    kv_head = torch.arange(hq, device=q.device) // (hq // hk)
    outs, lses, a = [], [], 0
    for n in packed.host_lengths():
        qd, kd, vd = _doc_views(q, k, v, a, n, kv_head)
        s = (qd @ kd.transpose(1, 2)) * scale
        s = s.masked_fill(~_doc_mask(n, window, q.device), float("-inf"))
        lse = torch.logsumexp(s, dim=-1)                              # (hq, n)
        outs.append((torch.exp(s - lse.unsqueeze(-1)) @ vd).transpose(0, 1))
        lses.append(lse.transpose(0, 1))
        a += n
    return torch.cat(outs, 0).to(q.dtype), torch.cat(lses, 0)


def _reference_bwd(dout, q, k, v, out, lse, packed: PackedBatch, scale: float, window: int | None):
    """FlashAttention's backward in fp32, one document at a time: P from (q, k, L), D = rowsum(dout * out)."""
    hq, hk, d = q.shape[1], k.shape[1], q.shape[2]
    group = hq // hk
    kv_head = torch.arange(hq, device=q.device) // group
    # NaN-filled: a token the loop below missed shows as NaN in every test instead of stale memory
    dq, dk, dv = (torch.full(t.shape, float("nan"), dtype=torch.float32, device=t.device) for t in (q, k, v))
    a = 0
    for n in packed.host_lengths():
        qd, kd, vd = _doc_views(q, k, v, a, n, kv_head)
        do = dout[a:a + n].float().transpose(0, 1)                     # (hq, n, d)
        od = out[a:a + n].float().transpose(0, 1)
        s = (qd @ kd.transpose(1, 2)) * scale
        s = s.masked_fill(~_doc_mask(n, window, q.device), float("-inf"))
        p = torch.exp(s - lse[a:a + n].transpose(0, 1).unsqueeze(-1))  # (hq, n, n), 0 where masked
        ds = p * (do @ vd.transpose(1, 2) - (do * od).sum(-1, keepdim=True))
        dq[a:a + n] = ((ds @ kd) * scale).transpose(0, 1)
        # GQA: the query heads of one kv head add their key/value gradients
        dk[a:a + n] = ((ds.transpose(1, 2) @ qd) * scale).view(hk, group, n, d).sum(1).transpose(0, 1)
        dv[a:a + n] = (p.transpose(1, 2) @ do).view(hk, group, n, d).sum(1).transpose(0, 1)
        a += n
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _scale_fwd(out, lse, sinks):
    """out' = out * sigmoid(L - s_h), in fp32, rounded once to out's dtype."""
    c = torch.sigmoid(lse - sinks.float())                        # (tokens, hq) fp32
    return (out.float() * c.unsqueeze(-1)).to(out.dtype)


def _scale_bwd(g, out_sunk, lse, sinks):
    """(d out = c g in g's dtype, d s_h = -sum_i (1 - c) rowsum(g * out') in fp32)."""
    c = torch.sigmoid(lse - sinks.float()).unsqueeze(-1)         # (tokens, hq, 1)
    gf = g.float()
    dout = (gf * c).to(g.dtype).contiguous()
    return dout, -((1.0 - c.squeeze(-1)) * (gf * out_sunk.float()).sum(-1)).sum(0)


def _kernel_scale_fwd(out, lse, sinks):
    return sink_scale_fwd(out, lse, sinks) if out.is_cuda else _scale_fwd(out, lse, sinks)


def _kernel_scale_bwd(g, out_sunk, lse, sinks):
    return sink_scale_bwd(g, out_sunk, lse, sinks) if g.is_cuda else _scale_bwd(g, out_sunk, lse, sinks)


# fwd/bwd: the plain attention and its backward; scale_fwd/scale_bwd: the sink's scale around it (torch ops, or
# one Triton pass each way on CUDA: novatune/kernels/sinks.py; a CPU stand-in for the flash ops keeps torch's)
SINK_IMPLS = {"flash": SimpleNamespace(fwd=flash_fwd, bwd=flash_bwd, scale_fwd=_kernel_scale_fwd,
                                       scale_bwd=_kernel_scale_bwd),
              "reference": SimpleNamespace(fwd=_reference_fwd, bwd=_reference_bwd, scale_fwd=_scale_fwd,
                                           scale_bwd=_scale_bwd)}


# ------------------------------------------------------------------------------------------------ the sink
class _SinkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, packed, scale, window, impl):
        out, lse = impl.fwd(q, k, v, packed, scale, window)
        out_sunk = impl.scale_fwd(out, lse, sinks)
        ctx.save_for_backward(q, k, v, sinks, out_sunk, lse)
        ctx.meta = (packed, scale, window, impl)
        return out_sunk

    @staticmethod
    @once_differentiable  # out_sunk and lse are saved forward outputs: a second-order gradient would miss them
    def backward(ctx, g):
        q, k, v, sinks, out_sunk, lse = ctx.saved_tensors
        packed, scale, window, impl = ctx.meta
        dout, dsinks = impl.scale_bwd(g.to(q.dtype), out_sunk, lse, sinks)
        dq, dk, dv = impl.bwd(dout, q, k, v, out_sunk, lse, packed, scale, window)
        return dq, dk, dv, dsinks.to(sinks.dtype), None, None, None, None


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, packed: PackedBatch,
                   scale: float, window: int | None = None, impl: str = "reference") -> torch.Tensor:
    """Document-causal attention with one sink logit per query head. q (tokens, hq, d), k and v (tokens, hk, d),
    sinks (hq,); returns (tokens, hq, d) in q's dtype, differentiable in q, k, v and sinks. `impl`: "flash" or
    "reference" (see the module docstring)."""
    if sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must hold one logit per query head, shape ({q.shape[1]},); got "
                         f"{tuple(sinks.shape)}")
    if impl not in SINK_IMPLS:
        raise ValueError(f"unknown sink attention implementation {impl!r}; choose from {sorted(SINK_IMPLS)}")
    if impl == "flash":
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return _SinkAttention.apply(q, k, v, sinks, packed, float(scale), window, SINK_IMPLS[impl])
