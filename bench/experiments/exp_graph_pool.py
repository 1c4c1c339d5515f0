"""Experiment (issue 15): where a graphed LoRA/QLoRA run peaks, and what the CUDA graphs' pool holds, beside the
planner's graph-mode peak (novatune/memory/planner.py).

    python bench/experiments/exp_graph_pool.py [--results bench/results/experiments.jsonl] [--cases a,b]

Each case runs in its own process (a fresh allocator): the session is built as `novatune train` builds it, then
--warm optimizer steps (the eager batch and the graphs' capture), the peak statistics are reset, and --steps timed
steps run micro-batch by micro-batch with the peak read after each phase: the forward (the loss included), the
backward, the optimizer step. The row holds those peaks, max_memory_allocated / reserved over the timed steps, the
graphs' pool (memory_snapshot's segments outside the default pool: reserved, and allocated at rest), and the plan's
terms (static, kept, pool, the graphs' buffers, the loss's logits buffer). The question it settles: does a replayed
graph's pool show in max_memory_allocated (the planner's max(pool, loss) then models the measured peak), or only in
the reserved memory (then the measured peak is static + kept + buffers + the eager work, and the pool counts for the
cap alone)?
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

SEED = "examples/qwen3-4b-seed.yaml"
LORA16 = ["method.type=lora", "method.r=16", "method.alpha=32"]
CASES = {
    "qlora": ("examples/qlora.yaml", []),
    "qlora-eager": ("examples/qlora.yaml", ["model.patch_options.cuda_graphs=false"]),
    "seed-lora": (SEED, [*LORA16, "memory.stream_frozen_layers=0"]),
    "seed-lora-eager": (SEED, [*LORA16, "memory.stream_frozen_layers=0", "model.patch_options.cuda_graphs=false"]),
    "seed-lora-stream16": (SEED, [*LORA16, "memory.stream_frozen_layers=16"]),
}
GiB = 2**30


def _pool_bytes() -> tuple[int, int]:
    """(reserved, allocated) bytes in the private pools (the CUDA graphs'): segments outside the default pool."""
    import torch

    segments = [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)]
    return sum(s["total_size"] for s in segments), sum(s["allocated_size"] for s in segments)


def _peak_since(reset: bool = True) -> float:
    import torch

    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / GiB
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return peak


def run_case(name: str, warm: int, steps: int) -> dict:
    import torch

    from novatune.data.collate import model_inputs
    from novatune.train.config import load
    from novatune.train.session import build

    config, overrides = CASES[name]
    session = build(load(config, overrides))
    for mbs in session.batches(warm):
        session.step(mbs)
    plan = session.memory_plan.plan if session.memory_plan is not None else None
    phases = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    rest = []
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    overall = 0.0
    for mbs in session.batches(steps):
        n_items = max(1, sum(mb["num_target_tokens"] for mb in mbs))
        for mb in mbs:
            out = session.model(**model_inputs(mb, session.device, session.packed_kwargs),
                                num_items_in_batch=n_items, use_cache=False)
            phases["forward"] = max(phases["forward"], _peak_since())
            rest.append(torch.cuda.memory_allocated() / GiB)
            out.loss.backward()
            del out
            phases["backward"] = max(phases["backward"], _peak_since())
        torch.nn.utils.clip_grad_norm_(session.params, session.clip)
        session.apply_update()
        phases["optimizer"] = max(phases["optimizer"], _peak_since())
        overall = max(overall, *phases.values())
    pool_reserved, pool_allocated = _pool_bytes()
    runner = getattr(getattr(session, "patch_report", None), "graphs", None)
    row = {"experiment": "exp_graph_pool", "case": name, "config": config, "overrides": overrides,
           "peak_gib": round(overall, 3), "phase_peak_gib": {k: round(v, 3) for k, v in phases.items()},
           "after_forward_gib": round(max(rest), 3),
           "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / GiB, 3),
           "pool_reserved_gib": round(pool_reserved / GiB, 3), "pool_allocated_gib": round(pool_allocated / GiB, 3),
           "graph_stats": runner.stats() if runner is not None else None}
    if plan is not None:
        row["plan"] = {k: round(getattr(plan, k) / GiB, 3) for k in (
            "peak_bytes", "static_bytes", "activation_bytes", "transient_bytes", "graph_pool_bytes",
            "outside_transient_bytes")}
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--results", default="")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--case", default="", help="run this one case here and print its row (the worker)")
    p.add_argument("--timeout", type=float, default=300)
    args = p.parse_args(argv)
    if args.case:
        print("ROW " + json.dumps(run_case(args.case, args.warm, args.steps)))
        return
    from novatune.measure.results import write_row

    for name in args.cases.split(","):
        cmd = [sys.executable, __file__, "--case", name, "--warm", str(args.warm), "--steps", str(args.steps)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                                  cwd=Path(__file__).resolve().parents[2])
        except subprocess.TimeoutExpired:
            print(f"{name}: timed out after {args.timeout:.0f} s")
            continue
        rows = [json.loads(line[4:]) for line in done.stdout.splitlines() if line.startswith("ROW ")]
        if not rows:
            print(f"{name}: failed (exit {done.returncode}): {done.stderr[-1500:]}")
            continue
        row = rows[0]
        print(f"{name:20s} peak {row['peak_gib']} GiB {row['phase_peak_gib']} reserved {row['peak_reserved_gib']} "
              f"pool {row['pool_reserved_gib']} (allocated {row['pool_allocated_gib']}) plan {row.get('plan')}")
        if args.results:
            write_row(args.results, row)


if __name__ == "__main__":
    main()
