"""Op-time breakdown from a Chrome/Perfetto trace written by torch.profiler (`prof.export_chrome_trace(path)`).

GPU time is the sum of the durations of the GPU events (`cat` kernel, gpu_memcpy, gpu_memset), so concurrent
streams add up (it is CUDA time, not wall time; `span_ms` is the wall span from the first GPU event to the last).

Each kernel is put in one category: GEMM, attention, norms, activation, RoPE, loss, optimizer, copies, other. Its
name alone is often enough (`flash_fwd`, `nvjet`, `cutlass ... gemm`, `multi_tensor_apply`), but stock HF computes
RMSNorm or RoPE as chains of generic elementwise kernels (pow, mean, rsqrt, mul, cat: several ATen operators
per norm). Those are attributed through what launched them: the kernel's `correlation` id leads to the CUDA
runtime call, whose enclosing CPU ops and Python frames on the same thread (with_stack=True traces carry
`nn.Module: Qwen3RMSNorm_0` and `apply_rotary_pos_emb` frames) name the module; a backward op
(`autograd::engine::evaluate_function: MulBackward0`) inherits the context of the forward op with the same
`Sequence number`. Traces recorded without with_stack attribute fewer elementwise kernels (they count as "other");
the breakdown says how many kernels were attributed through their launch context.

A CPU-only trace (no GPU events) is summarised from its top-level CPU ops instead, and says so.
(novatune/tune/profile.py may categorise profiles too; this module is self-contained on purpose.)
"""
from __future__ import annotations

import gzip
import json
from collections import defaultdict
from pathlib import Path

CATEGORIES = ("GEMM", "attention", "norms", "activation", "RoPE", "loss", "optimizer", "copies", "other")

# kernel-name rules that hold whatever launched the kernel (checked first)
_STRONG = [
    ("attention", ("flash", "fmha", "sdpa", "attention", "attn", "flex", "triton_tem_fused", "varlen")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "cublas", "xmma", "matmul", "wgmma", "splitk",
              # CPU-only traces classify aten ops, not kernels
              "aten::linear", "aten::mm", "aten::addmm", "aten::bmm", "mmbackward")),
]
# launch-context rules: module / python function / aten op names around the launch (lower-cased)
# Without Python frames (with_stack=False) a few aten ops still name their module in HF models: pow/rsqrt only
# occur in RMSNorm, neg in RoPE's rotate_half; mul/mean/cat/add are shared and stay "other".
_CONTEXT = [
    ("optimizer", ("optimizer.step", "adam", "_foreach", "clip_grad")),
    ("loss", ("cross_entropy", "nll_loss", "nllloss", "log_softmax", "logsoftmax", "loss_function",
              "forcausallmloss", "linear_cross")),
    ("RoPE", ("rotary", "apply_rotary", "rope", "aten::neg", "negbackward")),
    ("norms", ("rmsnorm", "rms_norm", "layernorm", "layer_norm", "aten::rsqrt", "rsqrtbackward", "aten::pow",
               "powbackward")),
    ("activation", ("silu", "gelu", "swiglu", "act_fn")),
]
# kernel-name rules for whatever the context did not settle
_WEAK = [
    ("loss", ("cross_entropy", "log_softmax", "nll_loss", "_lce", "logsumexp")),
    ("optimizer", ("adam", "multi_tensor_apply", "foreach")),
    ("RoPE", ("rope", "rotary")),
    ("norms", ("rms", "norm")),
    ("activation", ("silu", "swiglu", "gelu", "act_and_mul")),
    ("copies", ("copy", "memcpy", "memset", "fill", "catarray", "cast", "transpose")),
]
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
CPU_CATS = ("cpu_op", "python_function", "user_annotation")


def _match(text: str, rules) -> str | None:
    for cat, words in rules:
        if any(w in text for w in words):
            return cat
    return None


def classify(kernel: str, context: str = "", gpu_cat: str = "kernel") -> tuple[str, bool]:
    """(category, attributed through the launch context)."""
    k = kernel.lower()
    if gpu_cat in ("gpu_memcpy", "gpu_memset"):
        return "copies", False
    strong = _match(k, _STRONG)
    if strong:
        return strong, False
    ctx = _match(context.lower(), _CONTEXT) if context else None
    if ctx:
        return ctx, True
    return _match(k, _WEAK) or "other", False


def load_trace(path: str | Path) -> dict:
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt") as f:
        data = json.load(f)
    if isinstance(data, list):  # the bare-array form of the Chrome trace format
        data = {"traceEvents": data}
    if "traceEvents" not in data:
        raise ValueError(f"{p}: not a Chrome trace (no traceEvents)")
    return data


def _contexts(events: list[dict], cpu_mode: bool = False) -> dict:
    """GPU mode: correlation id -> names of the CPU ops / Python frames enclosing its runtime launch (outermost
    first). CPU mode: id(top-level cpu_op) -> the Python frames enclosing it. A backward op's context is extended by
    its forward op's (same `Sequence number`)."""
    by_thread = defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or "ts" not in e:
            continue
        cat = e.get("cat", "")
        if cat in CPU_CATS or (cat in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})):
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    fwd_ctx: dict[int, list[str]] = {}
    pending = []  # (key, enclosing names, backward seq numbers): resolved once every forward op has been seen
    for evs in by_thread.values():
        evs.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0))))
        stack: list[dict] = []
        for e in evs:
            ts = float(e["ts"])
            while stack and float(stack[-1]["ts"]) + float(stack[-1].get("dur", 0)) <= ts:
                stack.pop()
            args = e.get("args", {})
            names = [s["name"] for s in stack]
            seqs = [s["args"]["Sequence number"] for s in stack + [e] if "Sequence number" in s.get("args", {})
                    and "evaluate_function" in s["name"]]
            if e.get("cat") in ("cuda_runtime", "cuda_driver"):
                if not cpu_mode:
                    pending.append((args["correlation"], names, seqs))
                continue
            if cpu_mode and e.get("cat") == "cpu_op" and not any(s.get("cat") == "cpu_op" for s in stack):
                pending.append((id(e), names, seqs))
            seq = args.get("Sequence number")
            if seq is not None and "evaluate_function" not in e["name"] and "Backward" not in e["name"]:
                fwd_ctx.setdefault(seq, names + [e["name"]])
            stack.append(e)
    return {key: [n for s in seqs for n in fwd_ctx.get(s, [])] + names for key, names, seqs in pending}


def breakdown(path: str | Path, top: int = 12) -> dict:
    """{kind, total_ms, span_ms, categories_ms, kernels, attributed, top: [(name, ms, category)]} for one trace."""
    data = load_trace(path)
    events = [e for e in data["traceEvents"] if isinstance(e, dict)]
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS]
    if not gpu:
        return _cpu_breakdown(events, top)
    ctx = _contexts(events)
    cats = {c: 0.0 for c in CATEGORIES}
    per_kernel: dict[tuple, float] = {}  # (kernel, category): the same kernel may serve several categories
    attributed = 0
    for e in gpu:
        corr = e.get("args", {}).get("correlation")
        names = ctx.get(corr, [])
        cat, via_ctx = classify(e["name"], " | ".join(names), e.get("cat", "kernel"))
        attributed += via_ctx
        us = float(e.get("dur", 0))
        cats[cat] += us
        per_kernel[(e["name"], cat)] = per_kernel.get((e["name"], cat), 0.0) + us
    t0 = min(float(e["ts"]) for e in gpu)
    t1 = max(float(e["ts"]) + float(e.get("dur", 0)) for e in gpu)
    total = sum(cats.values())
    tops = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]
    return {"kind": "gpu", "total_ms": total / 1e3, "span_ms": (t1 - t0) / 1e3,
            "categories_ms": {c: v / 1e3 for c, v in cats.items() if v > 0},
            "kernels": len(gpu), "attributed": attributed,
            "top": [(name, us / 1e3, cat) for (name, cat), us in tops]}


def _cpu_breakdown(events: list[dict], top: int) -> dict:
    """No GPU events: top-level cpu_op durations (nested ops are inside their parent's time), classified by the op
    name and the Python frames around it."""
    ctx = _contexts(events, cpu_mode=True)
    tops_ = [e for e in events if id(e) in ctx]
    if not tops_:
        raise ValueError("trace has neither GPU events nor CPU ops")
    cats = {c: 0.0 for c in CATEGORIES}
    per_op: dict[tuple, float] = {}
    attributed = 0
    for e in tops_:
        dur = float(e.get("dur", 0))
        cat, via_ctx = classify(e["name"], " | ".join(ctx[id(e)] + [e["name"]]))
        attributed += via_ctx
        cats[cat] += dur
        per_op[(e["name"], cat)] = per_op.get((e["name"], cat), 0.0) + dur
    lo = min(float(e["ts"]) for e in tops_)
    hi = max(float(e["ts"]) + float(e.get("dur", 0)) for e in tops_)
    tops = sorted(per_op.items(), key=lambda kv: -kv[1])[:top]
    return {"kind": "cpu", "total_ms": sum(cats.values()) / 1e3, "span_ms": (hi - lo) / 1e3,
            "categories_ms": {c: v / 1e3 for c, v in cats.items() if v > 0}, "kernels": len(tops_),
            "attributed": attributed, "top": [(name, us / 1e3, cat) for (name, cat), us in tops]}


def is_trace_file(path: Path) -> bool:
    """A Chrome trace by name (*.json.gz, *trace*.json, traces/*.json) or by its first bytes."""
    name = path.name
    if name.endswith(".json.gz"):
        return True
    if not name.endswith(".json"):
        return False
    if "trace" in name or path.parent.name == "traces":
        return True
    with open(path, "rb") as f:
        head = f.read(4096)
    return b'"traceEvents"' in head or b'"schemaVersion"' in head
