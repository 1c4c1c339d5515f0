"""Attention over packed rows: several backends, one dispatcher (`varlen_attention`, exported as novatune.ops).

Math (every backend): for each document [a, b) of the flattened tokens and each query head h,
    out[i, h] = sum_{a <= j <= i} softmax_j(scale * q[i, h] . k[j, h // G]) v[j, h // G],   G = hq // hk
i.e. causal inside the document, nothing across documents (cu_seqlens / the BlockMask guarantee it), and GQA maps
query head h to kv head h // G (the same as HF's repeat_kv / repeat_interleave).

Logit soft-capping (Gemma 2, `softcap`): every score becomes softcap * tanh(score / softcap) after the scale and
before the mask and softmax, as HF's eager attention computes it. Only SOFTCAP_BACKENDS apply it (flex through a
score_mod, reference in its fp32 math); the others refuse a call with it (never drop it).

Layout: q (tokens, hq, d), k and v (tokens, hk, d), tokens = batch * seq_len flattened from (batch, seq, heads, d);
strided views are fine as long as the last dim is contiguous. Output (tokens, hq, d) in q's dtype (possibly a
strided view; reshape it). All backends are differentiable through torch autograd.

Backends:
  varlen     torch.nn.attention.varlen.varlen_attn (FlashAttention-2 inside torch; CUDA, fp16/bf16, d % 8 == 0,
             d <= 256)
  flash      the same FlashAttention-2 kernels as varlen through aten's ops from a plain autograd.Function (flash.py):
             no torch.library wrapper per call (host time); first in AUTO_ORDER on CUDA (measured below)
  cudnn      cuDNN's fused attention with ragged offsets through torch's aten ops (cudnn.py; CUDA sm80+, cuDNN 9,
             fp16/bf16, d % 8 == 0, d <= 128, no sliding window); not in AUTO_ORDER: the tune engine chooses it
  fa4        FlashAttention-4's CuTe-DSL kernels (fa4.py; the flash-attn-4 package; CUDA sm90/sm100/sm110, fp16/bf16,
             d a multiple of 32 in [64, 256], window; trains where measured or after its gradient self-check)
  flex       compiled FlexAttention with a document-causal BlockMask cached in the PackedBatch (CUDA)
  sdpa       F.scaled_dot_product_attention(is_causal=True) per row; only when every row is one document (on sm90
             it dispatches to cuDNN, the fastest measured: docs/BENCHMARKS.md)
  sdpa_docs  one causal SDPA call per document (CPU path; a slow but correct last resort on CUDA)
  reference  exact fp32 math per document (tests, numerics baseline)

Choice: `backend="auto"` takes the first usable name in AUTO_ORDER[device type] (the tune engine may replace these
lists), falls back to the next one if a backend raises, and records what ran and why (`last_choice()`). An explicitly
requested backend that cannot run raises BackendUnavailable naming what to do.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from novatune.attention.cudnn import cudnn_attention, cudnn_detail, cudnn_why_not
from novatune.attention.fa4 import fa4_attention, fa4_detail, fa4_why_not
from novatune.attention.flash import flash2_inputs_why_not, flash_attention, flash_why_not
from novatune.attention.packed import PackedBatch
from novatune.attention.sinks import sink_attention

__all__ = ["varlen_attention", "last_choice", "AttentionChoice", "BackendUnavailable", "AUTO_ORDER", "BACKENDS",
           "SINK_BACKENDS", "SOFTCAP_BACKENDS", "why_unavailable"]

BACKENDS = ("varlen", "flash", "fa4", "cudnn", "flex", "sdpa", "sdpa_docs", "reference")
# Backends that can add attention sinks (novatune/attention/sinks.py): they expose the softmax's log-sum-exp and
# a backward that takes the sunk output. The others refuse a call with sinks (never drop them).
SINK_BACKENDS = ("varlen", "flash", "reference")
_SINK_IMPL = {"varlen": "flash", "flash": "flash", "reference": "reference"}
# Backends that can soft-cap the scores (cap * tanh(s / cap)): flex as a score_mod, reference in its own math.
# torch's varlen_attn (FlashAttention-2 inside torch) and SDPA expose no soft-cap argument.
SOFTCAP_BACKENDS = ("flex", "reference")

# Preference order of the automatic choice, per device type. Module-level on purpose: `novatune tune` replaces these
# lists with measured orders. "sdpa" only applies when every row is one document, so it can safely come first.
# "flash" (the same FlashAttention-2 kernels as varlen, bit-equal to it, without torch's custom-op wrapper: less
# host time per call in a host-bound step) before varlen: the seed workload on one H200, the two side by side in
# one call, flash 16,293 vs varlen 15,995 tok/s (session19-3) and 16,048 vs 14,566 (session19-4).
# varlen before flex: in the headline training step (H200, torch 2.11) varlen gave 15,893 tok/s vs flex 14,767
# (bench/results/e2e.jsonl); flex's backward is slower there and its BlockMask costs host time per batch.
# "fa4" (FlashAttention-4, where the flash-attn-4 package is installed; skipped with the reason where it is not)
# before flash: on the seed's rows (4 x 4096 tokens, GQA 32/8, d 128, one H200) forward + backward 1.426 ms against
# flash's 2.458 and varlen's 2.480 (bench/results/attention.jsonl, session28-1), and the seed's training step at
# 17,583 against 16,709 tok/s in one call (session28-1).
# "cudnn" stays out until a training step measures it ahead of flash; `novatune tune` times it beside the others.
AUTO_ORDER: dict[str, list[str]] = {
    "cuda": ["sdpa", "fa4", "flash", "varlen", "flex", "sdpa_docs"],
    "cpu": ["sdpa", "sdpa_docs"],
}


class BackendUnavailable(RuntimeError):
    """An explicitly requested backend cannot run here (the message says why and what to do)."""


@dataclass
class AttentionChoice:
    """What `varlen_attention` ran: for the patch report and the tune engine."""
    backend: str                      # the backend that produced the output
    requested: str                    # "auto" or the explicit name
    reason: str                       # why this one
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (backend, why not) tried before it
    detail: str = ""                  # backend specifics, e.g. how varlen handled GQA


_LAST: AttentionChoice | None = None
_BROKEN: dict[str, str] = {}  # backends that raised during an automatic choice: not retried in this process


def last_choice() -> AttentionChoice | None:
    """The choice made by the most recent `varlen_attention` call (None before the first call)."""
    return _LAST


@contextlib.contextmanager
def isolated_choices():
    """Backends that raise inside this block are not remembered as broken for later automatic choices, and the
    last choice is restored after it: a failed CUDA-graph warm-up or capture (novatune/patch/graphs.py) says
    nothing about the backend's eager use. Yields a list that receives the choices made inside the block."""
    global _LAST
    broken, last, seen = dict(_BROKEN), _LAST, []
    _WATCHERS.append(seen)
    try:
        yield seen
    finally:
        _WATCHERS.remove(seen)
        _BROKEN.clear()
        _BROKEN.update(broken)
        _LAST = last


_WATCHERS: list[list] = []


# ------------------------------------------------------------------------------------------------ varlen (FA2)
# varlen_attn's keyword arguments changed in every release (docs/BENCHMARKS.md): 2.10 `is_causal=True`; 2.11
# `window_size=(-1, 0)`, which must be a TUPLE (2.11+ computes `is_causal = window_size == (-1, 0)`); 2.12 adds
# `enable_gqa` and raises on hk != hq without it. Read the signature once, at import.
try:
    from torch.nn.attention.varlen import varlen_attn

    _varlen_attn: Callable[..., Any] | None = varlen_attn
    _VARLEN_PARAMS = frozenset(inspect.signature(varlen_attn).parameters)
    _VARLEN_IMPORT_ERROR = ""
except Exception as e:  # noqa: BLE001 - older torch or a broken build: the backend is simply unavailable
    _varlen_attn, _VARLEN_PARAMS = None, frozenset()
    _VARLEN_IMPORT_ERROR = (f"torch {torch.__version__} has no usable torch.nn.attention.varlen "
                            f"({type(e).__name__}: {e})")

# GQA in varlen_attn: with `enable_gqa` (2.12+) we pass it. Without it (2.10/2.11) the Python wrapper does not check
# head counts and hands K/V straight to aten._flash_attention_forward / _backward, i.e. FlashAttention-2's
# mha_varlen_fwd/bwd, which accept hk dividing hq natively (query head h reads kv head h // (hq/hk); the backward
# sums dK/dV over each group). So K/V are NOT repeated on 2.11 ("native"). Should a build reject it, the first
# failure switches to repeat_interleave ("repeat"), recorded in AttentionChoice.detail.
_VARLEN_GQA = "flag" if "enable_gqa" in _VARLEN_PARAMS else "native"


def _varlen(q, k, v, packed: PackedBatch, scale: float, window: int | None = None) -> torch.Tensor:
    global _VARLEN_GQA
    if _varlen_attn is None:
        raise BackendUnavailable(_VARLEN_IMPORT_ERROR)
    kw: dict[str, Any] = {}
    if window is not None:
        kw["window_size"] = (window - 1, 0)  # FlashAttention keys [i - left, i + right]: HF's window of `window` keys
    elif "is_causal" in _VARLEN_PARAMS:
        kw["is_causal"] = True
    else:
        kw["window_size"] = (-1, 0)  # tuple, not list: see above
    if "scale" in _VARLEN_PARAMS:
        kw["scale"] = scale
    elif scale != 1.0 / math.sqrt(q.shape[-1]):
        q = q * (scale * math.sqrt(q.shape[-1]))  # no `scale` argument: fold it into q
    gqa = k.shape[1] != q.shape[1]
    if gqa and _VARLEN_GQA == "flag":
        kw["enable_gqa"] = True
    cu, mx = packed.cu_seqlens, packed.max_seqlen
    # the same cu tensor for q and k: newer torch requires `cu_seq_q is cu_seq_k` for causal cuDNN varlen
    if gqa and _VARLEN_GQA == "native":
        try:
            return _varlen_attn(q, k, v, cu, cu, mx, mx, **kw)
        except (RuntimeError, ValueError):
            _VARLEN_GQA = "repeat"  # this build rejects hk != hq: repeat K/V from now on (an unrelated error
            # re-raises from the call below)
    if gqa and _VARLEN_GQA == "repeat":
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return _varlen_attn(q, k, v, cu, cu, mx, mx, **kw)


def _varlen_why_not(q, k, packed, window=None) -> str | None:
    if _varlen_attn is None:
        return _VARLEN_IMPORT_ERROR + "; upgrade torch to >= 2.10 or use backend='flex'"
    if window is not None and "window_size" not in _VARLEN_PARAMS:
        return f"torch {torch.__version__}'s varlen_attn takes no window_size (sliding window); use backend='flex'"
    if not ("is_causal" in _VARLEN_PARAMS or "window_size" in _VARLEN_PARAMS):
        return f"unknown varlen_attn signature in torch {torch.__version__}: {sorted(_VARLEN_PARAMS)}"
    if q.device.type != "cuda":
        return "varlen_attn is CUDA-only (FlashAttention-2 inside torch); move the tensors to a GPU or use " \
               "backend='sdpa_docs' / 'reference' on the CPU"
    return flash2_inputs_why_not(q, "varlen_attn")


# ------------------------------------------------------------------------------------------------ flex
_FLEX_COMPILED = None


def _flex_fn(compiled: bool = True):
    """flex_attention, compiled once per process (eager flex materialises tokens^2 scores: tests only).

    Default dynamic-shape handling on purpose: fixed-length packed rows compile once; a flattening collator whose
    token count changes each batch gets one dynamic recompile instead of one per length."""
    global _FLEX_COMPILED
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    if _FLEX_COMPILED is None:
        _FLEX_COMPILED = torch.compile(flex_attention)
    return _FLEX_COMPILED


@functools.cache
def _softcap_score_mod(cap: float):
    """flex score_mod: the scaled score s -> cap * tanh(s / cap) (Gemma 2's attention logit soft-capping). One
    function object per cap: the compiled flex guards on the score_mod, so a new closure per call would recompile."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / cap) * cap

    return score_mod


def _flex(q, k, v, packed: PackedBatch, scale: float, window: int | None = None,
          compiled: bool = True, softcap: float | None = None) -> torch.Tensor:
    # (tokens, h, d) -> (1, h, tokens, d): strided views, no copies; flex needs only the last dim contiguous.
    qh, kh, vh = (t.unsqueeze(0).transpose(1, 2) for t in (q, k, v))
    mod = None if softcap is None else _softcap_score_mod(float(softcap))
    out = _flex_fn(compiled)(qh, kh, vh, score_mod=mod, block_mask=packed.block_mask(window=window), scale=scale,
                             enable_gqa=k.shape[1] != q.shape[1])
    return out[0].transpose(0, 1)  # (tokens, hq, d) view


def _flex_why_not(q, k, packed) -> str | None:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"torch {torch.__version__} has no FlexAttention ({e}); upgrade torch or use backend='varlen'"
    if q.device.type != "cuda":
        return "the flex backend runs compiled Triton kernels on CUDA only; use backend='sdpa_docs' / 'reference' " \
               "on the CPU"
    return None


# ------------------------------------------------------------------------------------------------ sdpa
def _sdpa(q, k, v, packed: PackedBatch, scale: float, window: int | None = None) -> torch.Tensor:
    if not packed.one_doc_per_row or window is not None:
        raise BackendUnavailable("sdpa needs one document per row and no sliding window (use 'flex'/'varlen')")
    b, s = packed.batch, packed.seq_len
    # (tokens, h, d) -> (b, h, s, d) strided views: no transposed copies
    qh, kh, vh = (t.unflatten(0, (b, s)).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                         enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2).reshape(b * s, q.shape[1], q.shape[2])


def _sdpa_docs(q, k, v, packed: PackedBatch, scale: float, window: int | None = None) -> torch.Tensor:
    outs = []
    a = 0
    gqa = k.shape[1] != q.shape[1]
    for n in packed.host_lengths():  # host list: no device sync
        qd, kd, vd = (t[a:a + n].unsqueeze(0).transpose(1, 2) for t in (q, k, v))  # (1, h, n, d)
        if window is not None and n > window:
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=_local_causal(n, window, q.device),
                                               scale=scale, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=gqa)
        outs.append(o[0].transpose(0, 1))
        a += n
    return torch.cat(outs, 0)


def _local_causal(n: int, window: int | None, device) -> torch.Tensor:
    """(n, n) bool: query i sees key j iff j <= i and i - j < window (HF's sliding window: `window` keys)."""
    i = torch.arange(n, device=device)
    delta = i.view(n, 1) - i.view(1, n)
    return (delta >= 0) & (delta < window) if window is not None else delta >= 0


def _reference(q, k, v, packed: PackedBatch, scale: float, window: int | None = None,
               softcap: float | None = None) -> torch.Tensor:
    """Exact math in fp32, one document at a time (memory: one (hq, L, L) score matrix at a time)."""
    hq, hk = q.shape[1], k.shape[1]
    kv_head = torch.arange(hq, device=q.device) // (hq // hk)  # query head h reads kv head h // G
    outs = []
    a = 0
    for n in packed.host_lengths():
        qd = q[a:a + n].float().transpose(0, 1)                      # (hq, n, d)
        kd = k[a:a + n].float().transpose(0, 1)[kv_head]             # (hq, n, d)
        vd = v[a:a + n].float().transpose(0, 1)[kv_head]
        s = (qd @ kd.transpose(1, 2)) * scale                        # (hq, n, n)
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        causal = _local_causal(n, window, q.device)
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
        outs.append((p @ vd).transpose(0, 1))                        # (n, hq, d)
        a += n
    return torch.cat(outs, 0).to(q.dtype)


_IMPLS: dict[str, Callable[..., torch.Tensor]] = {"varlen": _varlen, "flash": flash_attention, "fa4": fa4_attention,
                                                   "cudnn": cudnn_attention, "flex": _flex, "sdpa": _sdpa,
                                                   "sdpa_docs": _sdpa_docs, "reference": _reference}


def why_unavailable(name: str, q: torch.Tensor, k: torch.Tensor, packed: PackedBatch,
                    window: int | None = None, sinks: bool = False, softcap: bool = False) -> str | None:
    """None if backend `name` can run on these inputs, else the reason (used by the choice and the tune engine).
    `sinks`: the call adds attention sinks (only SINK_BACKENDS can); `softcap`: it soft-caps the scores (only
    SOFTCAP_BACKENDS can)."""
    if name not in _IMPLS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {BACKENDS} or 'auto'")
    return _why_not(name, q, k, packed, _effective_window(window, packed), sinks, softcap)


def _why_not(name: str, q: torch.Tensor, k: torch.Tensor, packed: PackedBatch, window: int | None,
             sinks: bool = False, softcap: bool = False) -> str | None:
    """why_unavailable for a known backend and a window already made effective (_effective_window): the
    attention call normalises the window once and asks each backend in turn."""
    if softcap and sinks:
        return "no backend combines attention sinks with logit soft-capping"
    if softcap and name not in SOFTCAP_BACKENDS:
        return (f"the {name} backend cannot soft-cap attention logits (it takes no score modification); use one of "
                f"{SOFTCAP_BACKENDS}")
    if sinks:
        return _sinks_why_not(name, q, k, window)
    if name == "varlen":
        return _varlen_why_not(q, k, packed, window)
    if name == "flash":
        return flash_why_not(q, k, window)
    if name == "flex":
        return _flex_why_not(q, k, packed)
    if name == "cudnn":
        return cudnn_why_not(q, k, packed, window)
    if name == "fa4":
        return fa4_why_not(q, k, packed, window)
    if name == "sdpa" and not packed.one_doc_per_row:
        return "rows hold several documents (sdpa runs plain causal attention per row)"
    if name == "sdpa" and window is not None:
        return f"a document is longer than the sliding window ({window}); sdpa runs plain causal attention"
    return None


def _sinks_why_not(name: str, q, k, window: int | None) -> str | None:
    if name not in SINK_BACKENDS:
        return (f"the {name} backend cannot add attention sinks (it exposes no softmax log-sum-exp); use one of "
                f"{SINK_BACKENDS}")
    return flash_why_not(q, k, window) if _SINK_IMPL[name] == "flash" else None


def _effective_window(window: int | None, packed: PackedBatch) -> int | None:
    """The sliding window, or None where it cannot matter (no document is longer than it)."""
    if window is None:
        return None
    if int(window) < 1:
        raise ValueError(f"sliding window must be >= 1 key, got {window}")
    return None if packed.max_seqlen <= window else int(window)


def _check(q, k, v, packed: PackedBatch, sinks=None):
    if not isinstance(packed, PackedBatch):
        raise TypeError(f"packed must be a PackedBatch, got {type(packed).__name__}")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be (tokens, heads, head_dim); got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"k and v must be (tokens, hk, d) matching q {tuple(q.shape)}; got {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
    # Input errors are raised here, before any backend runs: under "auto" a backend that raises is marked broken
    # for the process, which must mean the backend failed, never that the call was malformed.
    if not q.is_floating_point() or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype} (cast k and v "
                        "to q's dtype, as the attention layer's projections would give)")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.shape[0] != packed.total_tokens:
        raise ValueError(f"q has {q.shape[0]} tokens but the PackedBatch describes {packed.total_tokens} "
                         f"({packed.batch} x {packed.seq_len})")
    if packed.device.type != q.device.type:
        raise ValueError(f"PackedBatch lives on {packed.device} but q on {q.device}: build it with device=q.device")
    if sinks is not None and (sinks.shape != (q.shape[1],) or sinks.device != q.device
                              or not sinks.is_floating_point()):
        raise ValueError(f"sinks must be one logit per query head, floating point, shape ({q.shape[1]},) on "
                         f"{q.device}; got {tuple(sinks.shape)} {sinks.dtype} on {sinks.device}")


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: PackedBatch,
                     scale: float | None = None, backend: str = "auto", window: int | None = None,
                     sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """Document-causal attention over packed rows. q (tokens, hq, d); k, v (tokens, hk, d); returns (tokens, hq, d).

    `window`: sliding-window attention as Hugging Face defines it (query i sees the `window` keys i - window + 1 ..
    i of its own document); None = full causal attention inside each document.
    `sinks`: (hq,) learned logits, one per query head, added to every softmax denominator (GPT-OSS); differentiable.
    Only SINK_BACKENDS can apply them: "auto" skips the others (recorded), an explicit one raises.
    `softcap`: scores become softcap * tanh(score / softcap) after the scale (Gemma 2); only SOFTCAP_BACKENDS.

    `packed` is built once per batch (PackedBatch.from_position_ids / from_cu_seqlens / from_kwargs) and passed to
    every layer. `scale` defaults to 1/sqrt(d). `backend`: "auto" or one of BACKENDS; see the module docstring.
    The choice is recorded: `last_choice()`. q, k, v share one floating dtype and device (under autocast they are
    cast to its dtype first, as SDPA does); malformed inputs raise here, before any backend runs, so they never
    make "auto" skip a backend for the rest of the process.
    """
    global _LAST
    if torch.is_autocast_enabled(q.device.type):  # what SDPA does under autocast: q, k, v in the autocast dtype
        dt = torch.get_autocast_dtype(q.device.type)
        q, k, v = (t.to(dt) if t.is_floating_point() else t for t in (q, k, v))
    _check(q, k, v, packed, sinks)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    window = _effective_window(window, packed)
    if softcap is not None and not float(softcap) > 0:
        raise ValueError(f"softcap must be a positive number of logits (or None), got {softcap}")

    def run(name: str) -> torch.Tensor:
        if sinks is not None:
            return sink_attention(q, k, v, sinks, packed, scale, window, impl=_SINK_IMPL[name])
        if softcap is not None:
            return _IMPLS[name](q, k, v, packed, scale, window, softcap=float(softcap))
        return _IMPLS[name](q, k, v, packed, scale, window)

    with_sinks, with_cap = sinks is not None, softcap is not None
    if backend != "auto":
        if backend not in _IMPLS:
            raise ValueError(f"unknown attention backend {backend!r}; choose from {BACKENDS} or 'auto'")
        why = _why_not(backend, q, k, packed, window, with_sinks, with_cap)
        if why is not None:
            raise BackendUnavailable(f"attention backend {backend!r} is unavailable: {why}")
        out = run(backend)
        _LAST = AttentionChoice(backend, backend, "requested explicitly", detail=_detail(backend, with_sinks, with_cap))
        _record(_LAST)
        return out
    skipped: list[tuple[str, str]] = []
    order = AUTO_ORDER.get(q.device.type, []) + ["reference"]  # reference: always runs, the last resort
    for name in order:
        # a failing sink (or soft-capped) path says nothing of the plain one
        broken_key = name + (" with sinks" if with_sinks else "") + (" with softcap" if with_cap else "")
        why = _BROKEN.get(broken_key) or _why_not(name, q, k, packed, window, with_sinks, with_cap)
        if why is not None:
            skipped.append((name, why))
            continue
        try:
            out = run(name)
        except torch.OutOfMemoryError:
            raise  # a slower backend would not fit either; don't hide it
        except Exception as e:  # noqa: BLE001 - automatic choice: fall back, remember, and say so
            _BROKEN[broken_key] = f"raised {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            skipped.append((name, _BROKEN[broken_key]))
            continue
        failed = [n for n, w in skipped if w.startswith("raised ")]
        reason = f"first usable in AUTO_ORDER[{q.device.type!r}]" + (
            f"; FELL BACK: {', '.join(failed)} raised (see skipped)" if failed else "")
        _LAST = AttentionChoice(name, "auto", reason, skipped, _detail(name, with_sinks, with_cap))
        _record(_LAST)
        return out
    raise RuntimeError(f"no attention backend could run: {skipped}")  # unreachable: reference always runs


def _record(choice: AttentionChoice) -> None:
    for seen in _WATCHERS:
        seen.append(choice)


def _detail(name: str, with_sinks: bool = False, with_cap: bool = False) -> str:
    if with_cap:
        return f"{name} with logit soft-capping (cap * tanh(score / cap))"
    if with_sinks:
        return f"attention sinks: {_SINK_IMPL[name]} attention + log-sum-exp, out * sigmoid(L - sink)"
    if name == "varlen":
        sig = "is_causal" if "is_causal" in _VARLEN_PARAMS else "window_size=(-1, 0)"
        return f"torch {torch.__version__}: causal via {sig}; GQA {_VARLEN_GQA}"
    if name == "flash":
        return f"torch {torch.__version__}: aten FlashAttention-2 ops from an autograd.Function, GQA native"
    if name == "flex":
        return "compiled flex_attention, document-causal BlockMask cached per batch, enable_gqa"
    if name == "cudnn":
        return cudnn_detail()
    if name == "fa4":
        return fa4_detail()
    return ""
