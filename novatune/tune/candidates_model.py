"""Candidates of the model-level choices (see opspecs_model.py): linear cross-entropy modes, attention backends.

Each candidate that patch can apply carries the setting in `params` ({"mode": ...} / {"backend": ...}); the
baselines (HF eager, torch.compile of the HF formula) are validated and timed for the report but are not
selectable: patch has no switch that would run them.

linear_cross_entropy  hf_eager (F.cross_entropy on logits computed in the input dtype, as HF), torch_compile of
                      it, novatune_default (mode "auto": what patch runs untuned), mode_tokens / mode_vocab /
                      mode_inplace (novatune.ops.linear_cross_entropy with that plan)
attention             hf_eager (HF's eager_attention_forward per document: repeat_kv, scores in the input dtype,
                      fp32 softmax), novatune_default (backend "auto"), backend_<name> for varlen, flex,
                      sdpa_docs, reference (each skipped with the reason where it cannot run)
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from novatune.tune.candidates import Candidate, _compiled

CE_MODES = ("tokens", "vocab", "inplace")
ATTN_BACKENDS = ("reference", "sdpa_docs", "varlen", "flex")  # multi-document rows: plain "sdpa" cannot run
_ATTN_FAMILY = {"reference": "eager", "sdpa_docs": "native", "varlen": "native", "flex": "compile"}


# ----------------------------------------------------------------------------------------------- linear CE
def hf_linear_ce(hidden, weight, labels):
    """HF's lm_head + ForCausalLMLoss (labels already shifted): logits in the input dtype, then .float()."""
    return F.cross_entropy((hidden @ weight.T).float(), labels, ignore_index=-100)


def _ce_mode_fn(mode: str):
    from novatune.ops.linear_cross_entropy import linear_cross_entropy

    return lambda hidden, weight, labels: linear_cross_entropy(hidden, weight, labels, mode=mode)


def linear_ce_candidates(shape, dtype: torch.dtype, device: str, families=None) -> list[Candidate]:
    t, h, _v = shape
    op = "linear_cross_entropy"
    out = [
        Candidate(op, "hf_eager", "eager", make=lambda: hf_linear_ce, selectable=False),
        Candidate(op, "novatune_default", "default", {"mode": "auto"}, make=lambda: _ce_mode_fn("auto")),
    ]
    for m in CE_MODES:
        params = {"mode": m}
        if m == "inplace" and t < h:
            params["note"] = "tokens < hidden: runs as 'tokens'"
        out.append(Candidate(op, f"mode_{m}", "triton", params, make=lambda m=m: _ce_mode_fn(m)))
    out.append(Candidate(op, "torch_compile", "compile", make=lambda: _compiled(hf_linear_ce), deterministic=False,
                         selectable=False))
    return [c for c in out if families is None or c.family in families]


# ----------------------------------------------------------------------------------------------- attention
def hf_attention(q, k, v, packed):
    """transformers' eager_attention_forward, one causal document at a time, in (tokens, heads, d) layout."""
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


def _attn_fn(backend: str):
    from novatune.attention.backends import varlen_attention

    return lambda q, k, v, packed: varlen_attention(q, k, v, packed, backend=backend)


def _attn_reason(backend: str, shape, dtype, device: str) -> str | None:
    from novatune.attention.backends import why_unavailable
    from novatune.attention.packed import PackedBatch

    _t, hq, hk, d, _docs = shape
    try:
        q = torch.empty(2, hq, d, dtype=dtype, device=device)
        k = torch.empty(2, hk, d, dtype=dtype, device=device)
        return why_unavailable(backend, q, k, PackedBatch.from_cu_seqlens([0, 1, 2], device=device))
    except Exception as e:  # noqa: BLE001 - recorded as the skip reason
        return f"{type(e).__name__}: {e}"


def attention_candidates(shape, dtype: torch.dtype, device: str, families=None) -> list[Candidate]:
    op = "attention"
    cuda = device == "cuda"
    out = [
        Candidate(op, "hf_eager", "eager", make=lambda: hf_attention, selectable=False),
        # auto on CUDA picks FlashAttention (atomics in its backward): not bitwise reproducible
        Candidate(op, "novatune_default", "default", {"backend": "auto"}, make=lambda: _attn_fn("auto"),
                  deterministic=not cuda),
    ]
    for b in ATTN_BACKENDS:
        out.append(Candidate(op, f"backend_{b}", _ATTN_FAMILY[b], {"backend": b}, make=lambda b=b: _attn_fn(b),
                             deterministic=b == "reference" or not cuda,
                             unavailable=_attn_reason(b, shape, dtype, device)))
    return [c for c in out if families is None or c.family in families]
