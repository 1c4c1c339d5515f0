"""Profiler: a few training micro-steps under torch.profiler, with time attributed to op kinds and module types.

    prof = profile_steps(step, model, steps=2, trace="before.json")   # step() runs one micro-step
    prof.by_kind      {"GEMM": µs, "norm": µs, ...}      per profiled step
    prof.by_module    {"Qwen3MLP": µs, "Linear": µs, ...} (innermost module whose forward launched the work)
    prof.gaps_us      wall - busy per step (CUDA: launch gaps, the GPU idle while the host catches up)

What is counted: on CUDA, every GPU kernel's duration (torch.profiler's device events, attached by the profiler to
the CPU op that launched them); on the CPU, each aten op's self CPU time. Op kind comes from the kernel (or op)
name, falling back to the launching op's name, then to the module's type. Module type: a record_function range ("nt_module::<Type>") is
pushed around every module's forward by hooks installed only while profiling; backward work is attributed to the
module of its forward op through the autograd sequence number the profiler records on both (so recomputed forwards
under gradient checkpointing are attributed too). Busy = union of kernel intervals; gaps = wall - busy.
Traces: prof.export_chrome_trace (Chrome / Perfetto JSON).
"""
from __future__ import annotations

import re
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

MODULE_PREFIX = "nt_module::"
BWD_PREFIX = "autograd::engine::evaluate_function: "

# first match wins: specific before generic (a fused q/k-norm + RoPE kernel is RoPE work, a fused linear CE
# is loss)
KINDS = [
    ("attention", r"flash|fmha|flex|attention|attn|sdpa|cudnn.*(mha|sdp)|varlen"),
    ("loss", r"cross_entropy|(^|_)ce_|_cols_(stats|grad|finish)|nll_loss|log_softmax|logsumexp|linear_ce"),
    ("RoPE", r"(^|_)rope|rotary"),
    # before norm: clip_grad_norm_'s kernels (LpNorm, _foreach_norm) are optimizer-side work, not RMSNorm
    ("optimizer", r"adam|foreach|multi_tensor|fused_sgd|clip_grad|optimizer"),
    ("norm", r"rms|norm(?!al)"),
    ("GEMM", r"gemm|matmul|\bmm\b|aten::mm|aten::addmm|aten::bmm|aten::linear|cublas|cutlass|sm\d+_xmma|nvjet|wgmma"),
    ("activation", r"silu|swiglu|gelu|sigmoid|act_and_mul|relu"),
    ("copies", r"copy|memcpy|memset|cat\b|aten::cat|contiguous|to_copy|fill|index|gather|scatter|embedding"),
]
_COMPILED = [(k, re.compile(p, re.IGNORECASE)) for k, p in KINDS]


def classify(name: str) -> str | None:
    for kind, rx in _COMPILED:
        if rx.search(name):
            return kind
    return None


@dataclass
class Profile:
    steps: int
    wall_us: float                       # per step
    busy_us: float                       # per step (CUDA: union of kernel intervals; CPU: sum of aten self time)
    by_kind: dict = field(default_factory=dict)
    by_module: dict = field(default_factory=dict)
    device: str = "cpu"
    trace: str | None = None

    @property
    def gaps_us(self) -> float:
        return max(0.0, self.wall_us - self.busy_us)

    def to_dict(self) -> dict:
        return {"steps": self.steps, "device": self.device, "wall_us": round(self.wall_us, 1),
                "busy_us": round(self.busy_us, 1), "gaps_us": round(self.gaps_us, 1), "trace": self.trace,
                "by_kind": {k: round(v, 1) for k, v in sorted(self.by_kind.items(), key=lambda kv: -kv[1])},
                "by_module": {k: round(v, 1) for k, v in sorted(self.by_module.items(), key=lambda kv: -kv[1])}}

    def table(self) -> str:
        lines = [f"profile ({self.device}, {self.steps} step(s)): wall {self.wall_us / 1e3:.1f} ms/step, busy "
                 f"{self.busy_us / 1e3:.1f} ms, gaps {self.gaps_us / 1e3:.1f} ms "
                 f"({100 * self.gaps_us / max(self.wall_us, 1e-9):.0f}%)"]
        total = sum(self.by_kind.values()) or 1.0
        for k, v in sorted(self.by_kind.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {k:12s} {v / 1e3:9.2f} ms  {100 * v / total:5.1f}%")
        return "\n".join(lines)


class module_ranges:
    """Context manager: a record_function range around every module forward of `model` (innermost wins)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.handles = []

    def __enter__(self):
        from torch.autograd.profiler import record_function

        def pre(mod, args):
            stack = mod.__dict__.setdefault("_nt_prof_ranges", [])
            rf = record_function(MODULE_PREFIX + type(mod).__name__)
            rf.__enter__()
            stack.append(rf)

        def post(mod, args, out):
            stack = mod.__dict__.get("_nt_prof_ranges")
            if stack:
                stack.pop().__exit__(None, None, None)

        for m in self.model.modules():
            self.handles.append(m.register_forward_pre_hook(pre))
            self.handles.append(m.register_forward_hook(post))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        for m in self.model.modules():
            m.__dict__.pop("_nt_prof_ranges", None)


def _module_of(evt) -> str | None:
    e = evt
    while e is not None:
        if e.name.startswith(MODULE_PREFIX):
            return e.name[len(MODULE_PREFIX):]
        e = e.cpu_parent
    return None


def _backward_seq(evt) -> int | None:
    e = evt
    while e is not None:
        if e.name.startswith(BWD_PREFIX):
            return e.sequence_nr if e.sequence_nr >= 0 else None
        e = e.cpu_parent
    return None


def _interval_union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def analyze(events, steps: int, wall_us: float, device: str) -> Profile:
    """Attribute the profiler's events (prof.events()) to kinds and modules, per step."""
    cuda = device == "cuda"
    seq_module: dict[int, str] = {}
    for e in events:  # forward ops: their autograd sequence number -> the module that ran them
        if e.device_type == torch.autograd.DeviceType.CPU and e.sequence_nr >= 0 and not e.name.startswith(BWD_PREFIX):
            mod = _module_of(e)
            if mod is not None:
                seq_module.setdefault(e.sequence_nr, mod)
    by_kind: dict[str, float] = defaultdict(float)
    by_module: dict[str, float] = defaultdict(float)
    busy, intervals = 0.0, []
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU:
            if cuda:
                intervals.append((e.time_range.start, e.time_range.end))
            continue
        if cuda:
            items = [(k.name, k.duration) for k in e.kernels]
        elif e.name.startswith("aten::"):
            items = [(e.name, e.self_cpu_time_total)]  # self time: nested aten ops are not counted twice
        else:
            items = []
        if not items:
            continue
        seq = _backward_seq(e)
        mod = seq_module.get(seq) if seq is not None else _module_of(e)
        for name, dur in items:
            # kernel name, else the launching op's name, else the module's type (HF eager RMSNorm is pow/mean/
            # rsqrt/mul kernels: they are norm work because Qwen3RMSNorm ran them)
            kind = classify(name) or classify(e.name) or (classify(mod) if mod else None) or "other"
            by_kind[kind] += dur
            label = mod or "(outside modules)"
            by_module[label + (" [bwd]" if seq is not None else "")] += dur
            busy += dur if not cuda else 0.0
    if cuda:
        busy = _interval_union(intervals)
    n = max(steps, 1)
    return Profile(steps, wall_us / n, busy / n, {k: v / n for k, v in by_kind.items()},
                   {k: v / n for k, v in by_module.items()}, device)


def profile_steps(step, model: torch.nn.Module, steps: int = 2, trace: str | None = None,
                  warmup: int = 1) -> Profile:
    """Run `step()` `warmup` times unprofiled, then `steps` times under torch.profiler; write the trace if asked."""
    from torch.profiler import ProfilerActivity, profile

    device = next(model.parameters()).device.type
    for _ in range(warmup):
        step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    if device == "cuda":
        torch.cuda.synchronize()
    with module_ranges(model), profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e6
    result = analyze(prof.events(), steps, wall, device)
    if trace:
        prof.export_chrome_trace(str(trace))
        result.trace = str(trace)
    return result


def rank_targets(prof: Profile, op_floor_us: dict[str, float]) -> list[dict]:
    """Targets ranked by possible gain per step: for a kind the registry can tune, its time minus the HBM floor of
    its calls (`op_floor_us`: kind -> floor µs per step, from the shapes seen); launch gaps as their own target;
    other kinds listed with gain 0 and why."""
    tunable = {"norm": "rms_norm", "activation": "swiglu"}
    out = []
    for kind, t in prof.by_kind.items():
        if kind in tunable:
            floor = op_floor_us.get(kind)
            gain = t - floor if floor is not None else t
            out.append({"target": kind, "op": tunable[kind], "time_us": t, "floor_us": floor,
                        "possible_gain_us": max(0.0, gain), "how": "candidate registry"})
        else:
            out.append({"target": kind, "op": None, "time_us": t, "floor_us": None, "possible_gain_us": 0.0,
                        "how": "no candidates registered for this kind"})
    if prof.device == "cuda":
        out.append({"target": "launch gaps", "op": None, "time_us": prof.gaps_us, "floor_us": 0.0,
                    "possible_gain_us": prof.gaps_us, "how": "fewer launches / CUDA graphs (not tuned here)"})
    return sorted(out, key=lambda r: (-r["possible_gain_us"], -r["time_us"]))
