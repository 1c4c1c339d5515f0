"""Where a whole optimizer step's GPU time goes, without the host-side op recording that inflates host time:
torch.profiler with CUDA activity only over one step of `novatune train` (every micro-batch and the optimizer
update, from one step end to the next), then the kernel timeline split into phases by kernel name (forward,
backward, optimizer) with the GPU idle inside each, the same step's unprofiled wall time beside it (the step
before, CUDA events), and the largest gaps with the kernels on either side.

Why: a one-micro-step profile with CPU ops recorded (`novatune bench --profile`) showed the MoE forward waiting on
the host (15 of 15.7 ms idle), but the profiler's per-op recording slows the host by an unknown factor and a lone
micro-step starts from an empty launch queue. This says how much idle a real step has, and where.

    python bench/experiments/exp_moe_step_timeline.py CONFIG OUT_DIR [--step N] [--set key=value ...]
"""
from __future__ import annotations

import argparse
import json
import os
import re

import torch
from torch.profiler import ProfilerActivity, profile

from novatune.train.config import load
from novatune.train.loop import train

# kernel-name patterns of each phase, the first match wins; anything else counts as "other"
PHASES = (
    ("optimizer", re.compile(r"multi_tensor|fused_adam|_fused_adamw|adamw|norm_kernel.*clip|foreach", re.I)),
    ("backward", re.compile(r"bwd|backward|_cols_grad|_glu_routed_bwd|dot_do_o|convert_dq|sum_and_scatter", re.I)),
    ("forward", re.compile(r"fwd|_gather_rows|_combine|gatherTopK|sbtopk|softmax|_dispatch|radixSort|sort", re.I)),
)


def phase_of(name: str) -> str:
    for phase, rx in PHASES:
        if rx.search(name):
            return phase
    return "other"


def timeline(trace_path: str) -> dict:
    """Busy and idle time per phase: each gap is charged to the phase of the kernel that ends it (the GPU waited
    for that kernel's launch); the phase of an unnamed kernel (GEMMs, elementwise) is its last named neighbour's."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    gpu = ("kernel", "gpu_memset", "gpu_memcpy")
    kernels = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in gpu), key=lambda e: e["ts"])
    busy: dict[str, float] = {}
    idle: dict[str, float] = {}
    gaps = []
    phase, end, prev_name = "forward", None, ""
    for e in kernels:
        named = phase_of(e["name"])
        if named != "other":
            phase = named
        busy[phase] = busy.get(phase, 0.0) + e["dur"]
        if end is not None and e["ts"] > end:
            idle[phase] = idle.get(phase, 0.0) + e["ts"] - end
            gaps.append((e["ts"] - end, phase, prev_name[:70], e["name"][:70]))
        end = max(end or 0.0, e["ts"] + e["dur"])
        prev_name = e["name"]
    span = (end - kernels[0]["ts"]) if kernels else 0.0
    by_kernel: dict[str, float] = {}
    idle_before: dict[str, float] = {}
    for e in kernels:
        by_kernel[e["name"][:70]] = by_kernel.get(e["name"][:70], 0.0) + e["dur"]
    for g, _p, _a, b in gaps:
        idle_before[b] = idle_before.get(b, 0.0) + g
    gaps.sort(reverse=True)
    top = lambda d, n: {k: round(v / 1e3, 2) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:n]}  # noqa: E731
    return {"span_ms": round(span / 1e3, 2), "kernels": len(kernels),
            "busy_ms": {k: round(v / 1e3, 2) for k, v in busy.items()},
            "idle_ms": {k: round(v / 1e3, 2) for k, v in idle.items()},
            "busy_by_kernel_ms": top(by_kernel, 25), "idle_before_kernel_ms": top(idle_before, 15),
            "largest_gaps": [{"us": round(g, 1), "phase": p, "after": a, "before": b} for g, p, a, b in gaps[:25]]}


class _Window:
    """Times step `step - 1` with CUDA events (unprofiled) and profiles step `step` (CUDA activity only)."""

    def __init__(self, step: int, out_dir: str):
        self.step, self.out_dir, self.result = step, out_dir, {}
        self.events: dict[int, torch.cuda.Event] = {}
        self.prof = None

    def at_step_end(self, step: int, _mbs=None) -> None:
        if step in (self.step - 2, self.step - 1, self.step):
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.events[step] = ev
        if step == self.step - 1:
            torch.cuda.synchronize()
            self.prof = profile(activities=[ProfilerActivity.CUDA])
            self.prof.__enter__()
            ev = torch.cuda.Event(enable_timing=True)  # after the sync: the profiled step's own start
            ev.record()
            self.events[-1] = ev
        elif step == self.step and self.prof is not None:
            torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            path = os.path.join(self.out_dir, "step_timeline.json")
            self.prof.export_chrome_trace(path)
            self.result = {"unprofiled_step_ms": round(self.events[self.step - 2].elapsed_time(
                               self.events[self.step - 1]), 1),
                           "profiled_step_ms": round(self.events[-1].elapsed_time(self.events[self.step]), 1),
                           **timeline(path)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("out_dir")
    p.add_argument("--step", type=int, default=4, help="the profiled step (>= 3: the step before it is timed)")
    p.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE")
    p.add_argument("--results", default=None, help="append the row to this JSONL file")
    a = p.parse_args()
    if a.step < 3:
        raise SystemExit("--step must be >= 3: step N-1 is timed unprofiled, the profiler opens at its end")
    os.makedirs(a.out_dir, exist_ok=True)
    sets = [f"train.max_steps={a.step + 1}", f"checkpoint.output_dir={a.out_dir}/run", "checkpoint.save_every=0",
            "checkpoint.export=false", *a.sets]
    window = _Window(a.step, a.out_dir)
    train(load(a.config, sets), step_hook=window.at_step_end)
    row = {"exp": "moe_step_timeline", "config": a.config, "sets": a.sets, "step": a.step,
           "git_sha": os.environ.get("NOVATUNE_GIT_SHA"), "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", **window.result}
    print(json.dumps(row))
    if a.results:
        with open(a.results, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
