"""The contract of packed-row attention (novatune.attention.backends.varlen_attention), a model-level op.

patch applies the chosen backend as each attention module's `_novatune_attn_backend` (its attention= option).
shape key (tokens, q heads, kv heads, head_dim, documents); call (q (T, hq, d), k, v (T, hk, d), packed) ->
(T, hq, d), documents of uneven lengths packed in one row, causal inside each. NaN rule: a NaN in v must give a
non-finite output at its token and stay inside its document (where exactly it spreads inside the document depends
on the kernel's tiling; a NaN in q is not used: CPU SDPA's online max drops it, as the stock path would).
Attention sinks (GPT-OSS) are a call of the same functional with `sinks=`; only attention.SINK_BACKENDS run them,
so a tuned backend is never applied to a module with sinks unless it is one of those (patch marks such modules).
"""
from __future__ import annotations

import functools

import torch

from novatune.attention.backends import varlen_attention, why_unavailable
from novatune.attention.packed import PackedBatch
from novatune.ops.contract import Candidate, OpSpec, doc_lengths
from novatune.reference.attention import attention_ref, hf_attention

# multi-document rows: plain "sdpa" cannot run
BACKENDS = ("reference", "sdpa_docs", "varlen", "flash", "fa4", "cudnn", "flex")
_FAMILY = {"reference": "eager", "sdpa_docs": "native", "varlen": "native", "flash": "native", "fa4": "native",
           "cudnn": "native", "flex": "compile"}


def _make_inputs(shape, dtype, device, gen) -> dict:
    t, hq, hk, d, docs = shape
    cu = [0]
    for n in doc_lengths(t, docs):
        cu.append(cu[-1] + n)
    q, k, v = (torch.randn(t, h, d, generator=gen) for h in (hq, hk, hk))
    return {"q": q.to(device=device, dtype=dtype), "k": k.to(device=device, dtype=dtype),
            "v": v.to(device=device, dtype=dtype), "packed": PackedBatch.from_cu_seqlens(cu, device=device)}


def _call_cases(dtype, device, gen) -> list:
    return [("packed row, GQA", _make_inputs((61, 4, 2, 16, 3), dtype, device, gen)),
            ("one document", _make_inputs((17, 2, 2, 8, 1), dtype, device, gen))]


def _noncontig(inputs) -> dict:
    out = dict(inputs)
    for name in ("q", "k", "v"):  # heads sliced out of a wider buffer: token stride (h + 1) * d
        x = inputs[name]
        buf = torch.zeros(x.shape[0], x.shape[1] + 1, x.shape[2], dtype=x.dtype, device=x.device)
        buf[:, 1:] = x
        out[name] = buf[:, 1:]
    return out


def _odd_shapes(shape, device_type: str) -> list:
    t, hq, hk, d, docs = shape
    out = [tuple(shape)]
    for s in [(37, hq, hk, d, 3), (1, hq, hk, d, 1)]:
        if s not in out:
            out.append(s)
    return out


def _nan_rule(inputs, ref_nan: dict, got_nan: dict) -> str | None:
    v, packed = inputs["v"], inputs["packed"]
    tok = (v.numel() // 2) // (v.shape[1] * v.shape[2])  # the validator poisons the flat middle element of v
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


def _backend_fn(backend: str):
    return lambda q, k, v, packed: varlen_attention(q, k, v, packed, backend=backend)


def _why_not(backend: str, shape, dtype, device: str) -> str | None:
    _t, hq, hk, d, _docs = shape
    try:
        q = torch.empty(2, hq, d, dtype=dtype, device=device)
        k = torch.empty(2, hk, d, dtype=dtype, device=device)
        return why_unavailable(backend, q, k, PackedBatch.from_cu_seqlens([0, 1, 2], device=device))
    except Exception as e:  # noqa: BLE001 - recorded as the skip reason
        return f"{type(e).__name__}: {e}"


def _candidates(shape, dtype, device: str) -> list:
    cuda = device == "cuda"
    out = [Candidate("attention", "hf_eager", "eager", make=lambda: hf_attention, selectable=False),
           # auto on CUDA picks FlashAttention (atomics in its backward): not bitwise reproducible
           Candidate("attention", "novatune_default", "default", {"backend": "auto"}, make=lambda: _backend_fn("auto"),
                     deterministic=not cuda)]
    for b in BACKENDS:
        out.append(Candidate("attention", f"backend_{b}", _FAMILY[b], {"backend": b},
                             make=functools.partial(_backend_fn, b),
                             deterministic=b == "reference" or not cuda,
                             unavailable=_why_not(b, shape, dtype, device)))
    return out


def _model_shape(config, tokens: int, docs: int) -> tuple:
    hq = int(config.num_attention_heads)
    hk = int(getattr(config, "num_key_value_heads", None) or hq)
    d = int(getattr(config, "head_dim", None) or config.hidden_size // hq)
    return (tokens, hq, hk, d, max(1, min(docs, tokens)))


SPEC = OpSpec(
    trace_kind="attention",
    name="attention", tensor_args=("q", "k", "v"), make_inputs=_make_inputs, reference=attention_ref,
    stock=hf_attention, floor_bytes=lambda shape, dtype: 0,  # compute-bound
    candidates=_candidates, call_cases=_call_cases, noncontiguous=_noncontig,
    layout="packed rows (T, h, d), documents in one row",
    shape_of=lambda q, k, v, packed, *_: (q.shape[0], q.shape[1], k.shape[1], q.shape[2], packed.num_docs),
    dtype_of=lambda q, *_: str(q.dtype)[6:],
    dy_shape=lambda shape: (shape[0], shape[1], shape[3]), odd_shapes=_odd_shapes, nan_rule=_nan_rule, nan_arg="v",
    setting=("_novatune_attn_backend", "backend"), model_shape=_model_shape, tolerance_scale=32.0,
    signature="attention(q (T, hq, d), k (T, hk, d), v (T, hk, d), packed: PackedBatch) -> (T, hq, d): causal "
              "attention inside each document of the packed row; differentiable in q, k, v",
)
