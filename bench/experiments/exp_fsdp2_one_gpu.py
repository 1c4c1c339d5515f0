"""Where FSDP2 (and DDP) lose time beside the plain path: over one GPU (issue 16's 3% line) and, under torchrun,
over several (issue 17's scaling).

    python bench/experiments/exp_fsdp2_one_gpu.py VARIANT OUT_DIR [--set KEY=VALUE ...]
    torchrun --nproc-per-node 2 bench/experiments/exp_fsdp2_one_gpu.py VARIANT OUT_DIR [KEY=VALUE ...]

VARIANT: plain, ddp (tags: _static: static_graph, _bucket200: 200 MB buckets, _nobcast: no buffer broadcast),
or fsdp2 with any of the tags _noreshard, _bf16reduce (reduce_dtype bf16: no fp32 gradient
accumulation), _nomp (no mixed-precision policy), _stepsync (parallel.gradient_sync step), e.g.
fsdp2_bf16reduce_noreshard. Builds the seed workload's Session, runs 2 warm-up and 3 timed steps, times the
phases of one step (how long the host takes to queue forward_backward and apply_update, and until the GPU has run
them), then one whole optimizer step under torch.profiler; writes OUT_DIR/VARIANT.txt (rank r > 0:
VARIANT.rank<r>.txt): tok/s, peak, phases, the CUDA time per kernel category and the top kernels."""
from __future__ import annotations

import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

variant, out_dir = sys.argv[1], Path(sys.argv[2])
overrides = [a for a in sys.argv[3:] if "=" in a]

from novatune.train.config import load_with_base  # noqa: E402
from novatune.train.session import build  # noqa: E402

if "bf16reduce" in variant or "nomp" in variant:
    import torch.distributed.fsdp as fsdp

    real = fsdp.MixedPrecisionPolicy

    def policy(**kw):
        if "nomp" in variant:
            return real()
        return real(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    fsdp.MixedPrecisionPolicy = policy

if variant.startswith("ddp") and "_" in variant:  # DDP's own knobs: _static, _bucket200, _nobcast
    import torch.nn.parallel as tnp

    real_ddp = tnp.DistributedDataParallel

    def ddp(module, **kw):
        kw.update({"static_graph": True} if "static" in variant else {})
        kw.update({"bucket_cap_mb": 200} if "bucket200" in variant else {})
        kw.update({"broadcast_buffers": False} if "nobcast" in variant else {})
        return real_ddp(module, **kw)
    tnp.DistributedDataParallel = ddp

sets = [f"parallel.strategy={'none' if variant == 'plain' else variant.split('_')[0]}"]
if "noreshard" in variant:
    sets.append("parallel.reshard_after_forward=false")
if "stepsync" in variant:
    sets.append("parallel.gradient_sync=step")
cfg, base = load_with_base("examples/qwen3-4b-seed.yaml", sets + overrides)
session = build(cfg, base)
plan = session.batches(6)
for k in range(2):
    float(session.step(plan[k]).loss)
torch.cuda.synchronize()
torch.cuda.reset_peak_memory_stats()
t0 = time.perf_counter()
for k in range(2, 5):
    out = session.step(plan[k])
torch.cuda.synchronize()
wall = time.perf_counter() - t0
tokens = sum(mb["num_tokens"] for mbs in plan[2:5] for mb in mbs) * session.dist.world
who = f"rank {session.dist.rank} of {session.dist.world}"
lines = [f"{variant} ({who}): {tokens / wall:,.0f} tok/s, step {1e3 * wall / 3:.0f} ms, peak "
         f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, loss {float(out.loss):.4f}"]

# phases: how long the host takes to queue each (cpu) and until the GPU has run it (gpu, after a sync)
for k in (5, 2):
    mbs = plan[k]
    session.dist.barrier()
    torch.cuda.synchronize()
    t = time.perf_counter()
    session.forward_backward(mbs)
    q_fb = time.perf_counter() - t
    torch.cuda.synchronize()
    d_fb = time.perf_counter() - t
    t = time.perf_counter()
    session.apply_update()
    q_up = time.perf_counter() - t
    torch.cuda.synchronize()
    d_up = time.perf_counter() - t
    lines.append(f"phases: forward_backward queued {1e3 * q_fb:.0f} ms / done {1e3 * d_fb:.0f} ms; "
                 f"apply_update queued {1e3 * q_up:.0f} ms / done {1e3 * d_up:.0f} ms")

with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                        torch.profiler.ProfilerActivity.CUDA]) as prof:
    t1 = time.perf_counter()
    session.step(plan[5])
    torch.cuda.synchronize()
    prof_wall = time.perf_counter() - t1
cats: dict[str, float] = defaultdict(float)
kernels: dict[str, list] = defaultdict(lambda: [0.0, 0])
total = 0.0
for ev in prof.events():
    if ev.device_type != torch.autograd.DeviceType.CUDA:
        continue
    us = ev.device_time
    total += us
    name = ev.name
    low = name.lower()
    cat = ("nccl" if "nccl" in low else "gemm" if ("gemm" in low or "sm90" in low or "cutlass" in low or "nvjet" in low)
           else "flash" if "flash" in low else "copy" if ("copy" in low or "memcpy" in low or "cat" in low
                                                             or "split" in low) else
           "adam" if "adam" in low else "triton" if "triton" in low else "elementwise/other")
    cats[cat] += us
    kernels[name][0] += us
    kernels[name][1] += 1
lines.append(f"profiled step: wall {1e3 * prof_wall:.0f} ms, CUDA kernel time {total / 1e3:.0f} ms")
for cat, us in sorted(cats.items(), key=lambda kv: -kv[1]):
    lines.append(f"  {cat:20s} {us / 1e3:9.1f} ms")
lines.append("top kernels (ms, calls):")
for name, (us, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:28]:
    lines.append(f"  {us / 1e3:8.1f} {n:6d}  {name[:130]}")
labelled = [e for e in prof.key_averages() if any(t in e.key for t in ("FSDP", "Optimizer", "clip", "norm"))]
lines.append("labelled regions (CPU total ms, calls):")
for e in sorted(labelled, key=lambda e: -e.cpu_time_total)[:20]:
    lines.append(f"  {e.cpu_time_total / 1e3:8.1f} {e.count:6d}  {e.key[:100]}")
cpu = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
lines.append("top CPU ops (self ms, calls):")
for e in cpu:
    lines.append(f"  {e.self_cpu_time_total / 1e3:8.1f} {e.count:6d}  {e.key[:100]}")
out_dir.mkdir(parents=True, exist_ok=True)
name = variant if session.dist.main else f"{variant}.rank{session.dist.rank}"
(out_dir / f"{name}.txt").write_text("\n".join(lines) + "\n")
print("\n".join(lines[:14] if session.dist.main else lines[:2]), flush=True)
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
