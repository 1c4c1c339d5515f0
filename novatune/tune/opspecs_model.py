"""Op specs of the model-level choices: linear cross-entropy (a mode) and packed attention (a backend).

Unlike rms_norm / swiglu, these are not swapped per call through the ops' dispatch hook: `novatune.patch` applies
the choice as a setting on the patched model (`applied_by="patch"`: the causal LM's `_novatune_ce_mode`, each
attention module's `_novatune_attn_backend`, i.e. what patch(cross_entropy_mode=..., attention=...) sets).

linear_cross_entropy  shape (tokens, hidden, vocab); call (hidden (T, H), weight (V, H), labels (T,)) -> 0-dim
                      mean loss; gradients of hidden and weight. Labels hold ignore_index rows (never the row the
                      NaN check poisons). memory_rule: a mode whose peak memory exceeds the default's is not picked
                      (unless --allow-more-memory).
attention             shape (tokens, q heads, kv heads, head_dim, documents); call (q (T, hq, d), k, v (T, hk, d),
                      packed) -> (T, hq, d), documents of uneven lengths packed in one row, causal inside each.
                      NaN rule: a NaN in v must give a non-finite output at its token (p[t, t] > 0) and stay inside
                      its document (where exactly it spreads inside the document depends on the kernel's tiling;
                      a NaN in q is not used: CPU SDPA's online max drops it, as the stock path would).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from novatune.tune.opspecs import OpSpec

IGNORE = -100


def _no_poison(kernels, inputs, dy) -> dict:  # no candidate of these ops exposes raw out= launchers
    raise NotImplementedError("no kernel candidates for this op")


# ----------------------------------------------------------------------------------------------- linear CE
def _ce_inputs(shape, dtype, device, gen) -> dict:
    t, h, v = shape
    hidden = torch.randn(t, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) * (2.0 / math.sqrt(h))  # logits ~ N(0, 4): peaked and flat rows
    labels = torch.randint(0, v, (t,), generator=gen)
    nan_row = (t * h // 2) // h  # the row validate's NaN check poisons (flat middle of hidden): never ignored
    ignored = (torch.arange(t) % 7 == 3) & (torch.arange(t) != nan_row)
    labels[ignored] = IGNORE
    return {"hidden": hidden.to(device=device, dtype=dtype), "weight": weight.to(device=device, dtype=dtype),
            "labels": labels.to(device)}


def _ce_reference(hidden, weight, labels):
    return F.cross_entropy(hidden.float() @ weight.float().T, labels, ignore_index=IGNORE)


def _ce_noncontig(inputs) -> dict:
    h = inputs["hidden"]
    pad = torch.zeros(h.shape[0], h.shape[1] + 8, dtype=h.dtype, device=h.device)
    pad[:, 4:4 + h.shape[1]] = h
    return dict(inputs, hidden=pad[:, 4:4 + h.shape[1]])


def ce_odd_shapes(shape, device_type: str) -> list:
    """The real shape, 37 tokens, and (when the real one has tokens >= hidden) hidden + 37 tokens, so "inplace"
    (which needs tokens >= hidden) runs its own path at an odd count too."""
    t, h, v = shape
    extra = [(37, h, v)] + ([(h + 37, h, v)] if t >= h else [])
    out = [tuple(shape)]
    for s in extra:
        if s not in out:
            out.append(s)
    return out


LINEAR_CE = OpSpec(
    name="linear_cross_entropy", tensor_args=("hidden", "weight"), make_inputs=_ce_inputs, reference=_ce_reference,
    floor_bytes=lambda shape, dtype: 0,  # GEMM-bound: no HBM floor
    shape_of=lambda hidden, weight, labels, *_: (hidden.numel() // hidden.shape[-1], hidden.shape[-1],
                                                 weight.shape[0]),
    dtype_of=lambda hidden, *_: str(hidden.dtype)[6:],
    poison_call=_no_poison, noncontiguous=_ce_noncontig, layout="hidden (T, H), weight (V, H) contiguous",
    dy_shape=lambda shape: (), odd_shapes=ce_odd_shapes, applied_by="patch", memory_rule=True,
)


# ----------------------------------------------------------------------------------------------- attention
def doc_lengths(tokens: int, docs: int) -> list[int]:
    """`docs` documents of uneven lengths (growing ~linearly) summing to `tokens`; equal split if that fails."""
    docs = max(1, min(docs, tokens))
    tri = docs * (docs + 1) // 2
    cu = [round(tokens * (k * (k + 1) // 2) / tri) for k in range(docs + 1)]
    lens = [b - a for a, b in zip(cu, cu[1:])]
    if min(lens) < 1:
        lens = [tokens // docs + (1 if i < tokens % docs else 0) for i in range(docs)]
    return lens


def _attn_inputs(shape, dtype, device, gen) -> dict:
    from novatune.attention.packed import PackedBatch

    t, hq, hk, d, docs = shape
    lens = doc_lengths(t, docs)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    q = torch.randn(t, hq, d, generator=gen)
    k = torch.randn(t, hk, d, generator=gen)
    v = torch.randn(t, hk, d, generator=gen)
    packed = PackedBatch.from_cu_seqlens(cu, device=device)
    return {"q": q.to(device=device, dtype=dtype), "k": k.to(device=device, dtype=dtype),
            "v": v.to(device=device, dtype=dtype), "packed": packed}


def _attn_reference(q, k, v, packed):
    from novatune.attention.backends import _reference

    return _reference(q.float(), k.float(), v.float(), packed, 1.0 / math.sqrt(q.shape[-1]))


def _attn_noncontig(inputs) -> dict:
    out = dict(inputs)
    for name in ("q", "k", "v"):  # heads sliced out of a wider buffer: token stride (h + 1) * d
        x = inputs[name]
        buf = torch.zeros(x.shape[0], x.shape[1] + 1, x.shape[2], dtype=x.dtype, device=x.device)
        buf[:, 1:] = x
        out[name] = buf[:, 1:]
    return out


def attn_odd_shapes(shape, device_type: str) -> list:
    t, hq, hk, d, docs = shape
    out = [tuple(shape)]
    for s in [(37, hq, hk, d, 3), (1, hq, hk, d, 1)]:
        if s not in out:
            out.append(s)
    return out


def _attn_nan_rule(inputs, ref_nan: dict, got_nan: dict) -> str | None:
    v, packed = inputs["v"], inputs["packed"]
    tok = (v.numel() // 2) // (v.shape[1] * v.shape[2])  # validate poisons the flat middle element of v
    cu = packed.cu_seqlens_cpu.tolist()
    doc = next(i for i in range(len(cu) - 1) if cu[i] <= tok < cu[i + 1])
    a, b = cu[doc], cu[doc + 1]
    for name, g in got_nan.items():
        bad = (~torch.isfinite(g)).reshape(g.shape[0], -1).any(-1).cpu()
        outside = bad.clone()
        outside[a:b] = False
        if bool(outside.any()):
            return (f"{name}: NaN in token {tok} (document [{a}, {b})) leaked into {int(outside.sum())} tokens "
                    f"of other documents")
    if bool(torch.isfinite(got_nan["out"][tok]).all()):
        return f"out: NaN in v at token {tok} gave a finite output there (swallowed NaN)"
    return None


ATTENTION = OpSpec(
    name="attention", tensor_args=("q", "k", "v"), make_inputs=_attn_inputs, reference=_attn_reference,
    floor_bytes=lambda shape, dtype: 0,  # compute-bound
    shape_of=lambda q, k, v, packed, *_: (q.shape[0], q.shape[1], k.shape[1], q.shape[2], packed.num_docs),
    dtype_of=lambda q, *_: str(q.dtype)[6:],
    poison_call=_no_poison, noncontiguous=_attn_noncontig, layout="packed rows (T, h, d), documents in one row",
    dy_shape=lambda shape: (shape[0], shape[1], shape[3]), odd_shapes=attn_odd_shapes, nan_rule=_attn_nan_rule,
    nan_arg="v",
    applied_by="patch",
)
