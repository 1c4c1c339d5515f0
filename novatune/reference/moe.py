"""Mixture-of-experts: the fp32 oracles of routing, permutation and the expert MLP, and Hugging Face's formulas.

Shapes: T tokens, hidden H, E experts, top-k K, expert intermediate I, S = T * K (token, expert) pairs.

    routing     logits (T, E) -> (weights (T, K), expert ids (T, K)) by one of two recipes:
                "softmax_topk": softmax over E in fp32, top-k, optionally renormalised to sum 1 (Qwen3-MoE's
                                norm_topk_prob, Mixtral always)
                "topk_softmax": top-k of the logits, softmax over the K chosen (GPT-OSS)
    experts     out[t] = sum_k w[t, k] * down_e(act(gate_up_e(x[t])))   with e = ids[t, k]
                gate_up_e(x) = x @ W_gu[e]^T (+ b_gu[e]) -> (2I,), laid out [gate; up] (concatenated) or
                (g0, u0, g1, u1, ...) (interleaved); act(gate, up) = silu(gate) * up; down_e likewise -> (H,).
                Weights are (E, out, in) as nn.Linear stores them, or (E, in, out) when `transposed`.

The oracles loop over experts in fp32 and import no kernel: a candidate never shares code with what checks it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def route_ref(logits: Tensor, top_k: int, scoring: str = "softmax_topk", renormalize: bool = False,
              softmax_fp32: bool = True, weights_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """Hugging Face's router arithmetic: (weights (T, K) in `weights_dtype` (default: the logits' dtype), ids)."""
    if scoring == "softmax_topk":
        probs = F.softmax(logits.float() if softmax_fp32 else logits, dim=-1)
        top, ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            top = top / top.sum(dim=-1, keepdim=True)
    elif scoring == "topk_softmax":
        top, ids = torch.topk(logits, top_k, dim=-1)
        top = F.softmax(top.float() if softmax_fp32 else top, dim=-1)
    else:
        raise ValueError(f"routing scoring {scoring!r}: choose 'softmax_topk' or 'topk_softmax'")
    return top.to(weights_dtype or logits.dtype), ids


def split_gate_up(h: Tensor, interleaved: bool) -> tuple[Tensor, Tensor]:
    """(gate, up) halves of a gate_up projection's output (..., 2I)."""
    if interleaved:
        return h[..., 0::2], h[..., 1::2]
    half = h.shape[-1] // 2
    return h[..., :half], h[..., half:]


def glu_ref(h: Tensor, interleaved: bool = False) -> Tensor:
    """silu(gate) * up in fp32 from the fused (..., 2I) buffer."""
    gate, up = split_gate_up(h.float(), interleaved)
    return F.silu(gate) * up


def _linear(x: Tensor, w: Tensor, b: Tensor | None, transposed: bool) -> Tensor:
    y = x @ w if transposed else x @ w.T
    return y if b is None else y + b


def experts_ref(x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor,
                gate_up_bias: Tensor | None = None, down_bias: Tensor | None = None, *, transposed: bool = False,
                interleaved: bool = False, activation=glu_ref) -> Tensor:
    """The expert MLP in fp32, one expert at a time (the oracle; result fp32). Experts that receive no token are
    skipped; a token choosing one expert twice gets both contributions."""
    x32 = x.float()
    out = torch.zeros_like(x32)
    f = lambda t: None if t is None else t.float()  # noqa: E731
    for e in range(gate_up.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h = _linear(x32[tok], gate_up[e].float(), None if gate_up_bias is None else f(gate_up_bias[e]), transposed)
        y = _linear(activation(h, interleaved), down[e].float(), None if down_bias is None else f(down_bias[e]),
                    transposed)
        out.index_add_(0, tok, y * weights[tok, slot].float()[:, None])
    return out


def permute_ref(x: Tensor, order: Tensor, top_k: int) -> Tensor:
    """Rows of x gathered in expert order: row r of the result is x[order[r] // K]."""
    return x[order // top_k]


def combine_ref(y: Tensor, pos: Tensor, weights: Tensor | None) -> Tensor:
    """out[t] = sum_k w[t, k] * y[pos[t, k]] in fp32 (w = 1 when weights is None)."""
    rows = y.float()[pos]  # (T, K, H)
    w = torch.ones(pos.shape, dtype=torch.float32, device=y.device) if weights is None else weights.float()
    return (rows * w[..., None]).sum(dim=1)


def hf_grouped_mm_experts(x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """Hugging Face's `grouped_mm` experts (concatenated, non-transposed, no bias) in the input dtype: sort by
    expert, grouped GEMMs, weighted copy, inverse permutation, sum over K (the stock formula)."""
    k = ids.shape[-1]
    flat = ids.reshape(-1)
    sorted_ids, perm = torch.sort(flat)
    xs = x[perm // k]
    counts = torch.bincount(sorted_ids, minlength=gate_up.shape[0])
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        h = xs[start:start + n] @ gate_up[e].T
        gate, up = split_gate_up(h, False)
        outs.append((F.silu(gate) * up) @ down[e].T)
        start += n
    y = torch.cat(outs) * weights.reshape(-1)[perm, None].to(x.dtype)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return y[inv].view(x.shape[0], k, -1).sum(dim=1).to(x.dtype)


def glu_bwd_ref(da: Tensor, h: Tensor, interleaved: bool = False) -> Tensor:
    """d(gate_up output) of silu(gate) * up in fp32, laid out like h."""
    gate, up = split_gate_up(h.float(), interleaved)
    sig = torch.sigmoid(gate)
    silu = gate * sig
    da = da.float()
    dgate, dup = da * up * (sig + silu * (1 - sig)), da * silu
    if interleaved:
        return torch.stack((dgate, dup), dim=-1).flatten(-2)
    return torch.cat((dgate, dup), dim=-1)


def glu_routed_bwd_ref(da: Tensor, h: Tensor, w_row: Tensor, interleaved: bool = False):
    """fp32 (dh, aw, dw_row) of the expert MLP's backward through the activation, the routing weight folded in:
    a = act(h); dw_row = <a, da>; aw = w * a; dh = act'(h) * (w * da). da is the gradient of y = a W^T WITHOUT the
    routing weight (dout[token] @ W); w_row (S,) the weight of each row."""
    a = glu_ref(h, interleaved)
    w = w_row.float()[:, None]
    return glu_bwd_ref(w * da.float(), h, interleaved), w * a, (a * da.float()).sum(-1)


def lora_weight_ref(weight: Tensor, lora_a: Tensor, lora_b: Tensor, scaling: float, transposed: bool = False) -> Tensor:
    """The adapted expert weight W + s * B_e A_e in fp32, laid out like W: A (E, r, in), B (E, out, r); W (E, out,
    in), or (E, in, out) when transposed. What PEFT's ParamWrapper forms at each forward (the oracle of the LoRA
    experts, whose op never forms it)."""
    delta = scaling * (lora_b.float() @ lora_a.float())  # (E, out, in)
    return weight.float() + (delta.transpose(-2, -1) if transposed else delta)


def grouped_outer_accumulate_ref(a: Tensor, b: Tensor, ends: Tensor, out: Tensor) -> Tensor:
    """fp32 reference of novatune.kernels.moe_wgrad: out[e] + a[group e]^T b[group e] for every expert, each group's
    product in fp32 (fp64 inputs stay fp64), added to out's value and rounded once to out's dtype. Returns a new
    tensor; out is not modified."""
    acc = out.double() if out.dtype == torch.float64 else out.float()
    res = acc.clone()
    start = 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            res[e] += a[start:end].to(acc.dtype).T @ b[start:end].to(acc.dtype)
        start = end
    return res.to(out.dtype)


def lowrank_add(y: torch.Tensor, u: torch.Tensor, m: torch.Tensor, expert: torch.Tensor,
                scale: float = 1.0) -> torch.Tensor:
    """y + scale * u[r] @ m[expert[r]] per row in fp32, rounded once to y's dtype (novatune.kernels.moe_lora's
    lowrank_add_, which writes it into y)."""
    prod = torch.einsum("sr,srn->sn", u.float(), m.float()[expert.long()])
    return (y.float() + scale * prod).to(y.dtype)


def expert_bias_add_ref(y: Tensor, expert: Tensor, bias: Tensor) -> Tensor:
    """fp32 y[r] + bias[expert[r]] (novatune.kernels.moe_bias.expert_bias_add_'s oracle; a new tensor)."""
    return y.float() + bias.float()[expert.long()]


def expert_column_sums_ref(dy: Tensor, expert: Tensor, num_experts: int, scale: Tensor | None = None) -> Tensor:
    """fp32 per-expert sums of scale[r] * dy[r] (E, N): the oracle of novatune.kernels.moe_bias.expert_column_sums
    (rows in any order here)."""
    rows = dy.float() if scale is None else dy.float() * scale.float()[:, None]
    sums = torch.zeros(num_experts, dy.shape[1], dtype=torch.float32, device=dy.device)
    return sums.index_add_(0, expert.long(), rows)


def expert_row_dot_ref(dy: Tensor, expert: Tensor, bias: Tensor) -> Tensor:
    """fp32 <dy[r], bias[expert[r]]> per row (S,): the oracle of novatune.kernels.moe_bias.expert_row_dot_."""
    return (dy.float() * bias.float()[expert.long()]).sum(-1)
