"""Profiler: a few training micro-steps under torch.profiler, with time attributed to op kinds and module types.

    prof = profile_steps(step, model, steps=2, trace="before.json")   # step() runs one micro-step
    prof.by_kind      {"GEMM": µs, "norm": µs, ...}      per profiled step
    prof.by_module    {"Qwen3MLP": µs, "Linear": µs, ...} (innermost module whose forward launched the work)
    prof.gaps_us      wall - busy per step (CUDA: launch gaps, the GPU idle while the host catches up)

What is counted: on CUDA, every GPU kernel / memcpy / memset once (torch.profiler's device events; not the
gpu_user_annotation spans kineto draws for record_function ranges, which shadow the kernels inside them), linked to
the CPU op that launched it; on the CPU, each aten op's self CPU time. So the kinds sum to busy (where kernels on
several streams overlap, a kernel is credited only with what earlier-started kernels do not already cover).
Kind: work launched inside torch.optim's Optimizer.step / zero_grad ranges (or by clip_grad_norm_'s foreach ops,
outside the model) is "optimizer", and nothing else is; other work is classified by the kernel (or op) name,
falling back to the launching op's name, then to the module's type. Module type: a record_function range
("nt_module::<Type>") is pushed around every module's forward by hooks installed only while profiling; backward work
is attributed to the module of its forward op through the autograd sequence number the profiler records on both;
a module range inside a backward node is a forward recomputed under gradient checkpointing ("<Type> [recompute]").
Busy = union of kernel intervals; gaps = wall - busy.
Traces: prof.export_chrome_trace (Chrome / Perfetto JSON).
"""
from __future__ import annotations

import re
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from novatune.memory.host_embedding import compute_device

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


def classify(name: str, skip: tuple = ()) -> str | None:
    for kind, rx in _COMPILED:
        if kind not in skip and rx.search(name):
            return kind
    return None


_NOT_OPT = ("optimizer",)  # outside an optimizer's context, an optimizer-looking name is not optimizer work
_OPT_RANGE = re.compile(r"Optimizer\.(step|zero_grad)#")  # torch.optim's record_function around step / zero_grad
_OPT_OP = re.compile(r"clip_grad|_foreach_|_fused_(adam|sgd)|multi_tensor", re.IGNORECASE)
_CPU = torch.autograd.DeviceType.CPU
_WORK_TYPES = {"kernel", "gpu_memcpy", "gpu_memset"}  # kineto activity types of real GPU work
_RUNTIME_TYPES = {"cuda_runtime", "cuda_driver", "privateuse1_runtime", "privateuse1_driver"}
_RUNTIME_NAME = re.compile(r"(cuda|cu|hip|nccl)[A-Z]")


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
        total = self.busy_us or sum(self.by_kind.values()) or 1.0  # the kinds sum to busy
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
            # always_call: close the range when forward raises too. Non-reentrant gradient checkpointing stops a
            # recomputed forward with an exception once the saved tensors it needs are back; without this, the
            # ranges of the modules it was in stay open, on the CPU side and in CUPTI's per-thread annotation
            # stack, and everything after them is nested under a stale module
            self.handles.append(m.register_forward_hook(post, always_call=True))
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


def _is_runtime(evt) -> bool:
    """A CPU-side CUDA runtime/driver call (cudaLaunchKernel, cuLaunchKernelEx, ...), not a torch op: its id is a
    CUPTI correlation id, a different number space from the torch op ids that kernels are linked to."""
    at = getattr(evt, "activity_type", None)
    return at in _RUNTIME_TYPES if at else bool(_RUNTIME_NAME.match(evt.name))


def _is_range(evt) -> bool:
    """A record_function range (nt_module::*, Optimizer.step#*, ...), whose GPU shadow must not count as work."""
    return bool(getattr(evt, "is_user_annotation", False)) or evt.name.startswith(MODULE_PREFIX) or "#" in evt.name


def _device_activities(events, cpu_ops):
    """(activity, launching op or None) for every GPU kernel / memcpy / memset, each once. Left out: the
    gpu_user_annotation spans kineto draws for record_function ranges (first to last kernel of a range, gaps
    included; they shadow the real kernels) and anything else that is not work the GPU did."""
    ranges = {e.name for e in cpu_ops if _is_range(e)}
    acts = []
    for e in events:
        if e.device_type == _CPU:
            continue
        at = getattr(e, "activity_type", None)
        if (at not in _WORK_TYPES) if at else (getattr(e, "is_user_annotation", False) or e.name in ranges):
            continue
        acts.append(e)
    by_id: dict[int, object] = {}
    for e in cpu_ops:  # kernels are linked to the innermost torch op; ranges and runtime calls are never launchers
        if not _is_runtime(e) and not _is_range(e):
            by_id.setdefault(e.id, e)
    if all(getattr(a, "linked_correlation_id", None) is not None for a in acts):
        return [(a, by_id.get(a.linked_correlation_id) if a.linked_correlation_id > 0 else None) for a in acts]
    # older torch: no link on the device event; match the (name, duration) pairs torch appended to each op
    queue: dict[tuple, list] = defaultdict(list)
    for e in by_id.values():
        for k in e.kernels:
            queue[(k.name, round(k.duration, 3))].append(e)
    out = []
    for a in acts:
        q = queue.get((a.name, round(a.time_range.end - a.time_range.start, 3)))
        out.append((a, q.pop(0) if q else None))
    return out


def _context(op, seq_module: dict) -> tuple[str | None, str, bool]:
    """(module, tag, optimizer?) of the op that launched some work, from its enclosing CPU events. Module: the
    innermost nt_module range, or for backward work the module of the forward op with the autograd sequence number
    of the enclosing backward node (tag " [bwd]"); a module range inside a backward node is a recomputed forward
    (gradient checkpointing, tag " [recompute]"). Optimizer: inside torch.optim's Optimizer.step / zero_grad range,
    or an optimizer-side op (clip_grad_norm_'s _foreach_norm / _foreach_mul_) outside the model's forward and
    backward."""
    chain = []
    e = op
    while e is not None:
        chain.append(e)
        e = e.cpu_parent
    mod, tag = None, ""
    for i, e in enumerate(chain):
        if e.name.startswith(MODULE_PREFIX):
            mod = e.name[len(MODULE_PREFIX):]
            tag = " [recompute]" if any(c.name.startswith(BWD_PREFIX) for c in chain[i + 1:]) else ""
            break
        if e.name.startswith(BWD_PREFIX) and e.sequence_nr >= 0:
            mod = seq_module.get((getattr(e, "fwd_thread", None), e.sequence_nr)) or seq_module.get(e.sequence_nr)
            tag = " [bwd]"
            break
    in_model = bool(tag) or mod is not None
    opt = any(_OPT_RANGE.match(c.name) for c in chain) or (
        not in_model and any(_OPT_OP.search(c.name) for c in chain))
    return mod, tag, opt


def analyze(events, steps: int, wall_us: float, device: str) -> Profile:
    """Attribute the profiler's events (prof.events()) to kinds and modules, per step. Each GPU activity (CPU: each
    aten op's self time) is counted once, so the kinds sum to the busy time; where kernels on several streams
    overlap, a kernel is credited only with the time no earlier-started kernel already covers."""
    cuda = device == "cuda"
    cpu_ops = [e for e in events if e.device_type == _CPU and not e.is_async]
    seq_module: dict = {}
    for e in cpu_ops:  # forward ops: (thread, autograd sequence number) -> the module that ran them
        if e.sequence_nr >= 0 and not e.name.startswith(BWD_PREFIX):
            mod = _module_of(e)
            if mod is not None:
                seq_module.setdefault((e.thread, e.sequence_nr), mod)
                seq_module.setdefault(e.sequence_nr, mod)
    if cuda:
        items, covered = [], float("-inf")
        for a, op in sorted(_device_activities(events, cpu_ops), key=lambda ao: ao[0].time_range.start):
            s, t = a.time_range.start, a.time_range.end
            items.append((a.name, op, max(0.0, t - max(s, covered))))
            covered = max(covered, t)
    else:
        items = [(e.name, e, e.self_cpu_time_total) for e in cpu_ops if e.name.startswith("aten::")]
    by_kind: dict[str, float] = defaultdict(float)
    by_module: dict[str, float] = defaultdict(float)
    ctx_cache: dict[int, tuple] = {}
    for name, op, dur in items:
        if op is None:  # launched outside any torch op: only its name says what it is
            mod, tag, opt = None, "", classify(name) == "optimizer"
        else:
            if id(op) not in ctx_cache:
                ctx_cache[id(op)] = _context(op, seq_module)
            mod, tag, opt = ctx_cache[id(op)]
        if opt:
            kind, label = "optimizer", "(optimizer)"
        else:
            # kernel name, else the launching op's name, else the module's type (HF eager RMSNorm is pow/mean/
            # rsqrt/mul kernels: they are norm work because Qwen3RMSNorm ran them); never "optimizer" here
            kind = (classify(name, _NOT_OPT) or (classify(op.name, _NOT_OPT) if op is not None else None)
                    or (classify(mod, _NOT_OPT) if mod else None) or "other")
            label = (mod or "(outside modules)") + tag
        by_kind[kind] += dur
        by_module[label] += dur
    busy = sum(d for _, _, d in items)
    n = max(steps, 1)
    return Profile(steps, wall_us / n, busy / n, {k: v / n for k, v in by_kind.items()},
                   {k: v / n for k, v in by_module.items()}, device)


def profile_steps(step, model: torch.nn.Module, steps: int = 2, trace: str | None = None,
                  warmup: int = 1) -> Profile:
    """Run `step()` `warmup` times unprofiled, then `steps` times under torch.profiler; write the trace if asked."""
    from torch.profiler import ProfilerActivity, profile

    device = compute_device(model).type  # not the first parameter's: a host-resident embedding table's
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
    # a kind may cover several ops (the profiler's RoPE kind: the plain RoPE kernel and the fused q/k-norm + RoPE)
    from novatune.ops.registry import OPS

    tunable: dict[str, str] = {}
    for spec in OPS.values():
        if spec.trace_kind:
            tunable[spec.trace_kind] = " / ".join(filter(None, [tunable.get(spec.trace_kind), spec.name]))
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
