"""GPU timing used by bench/, `novatune bench` and the tune engine (docs/BENCHMARKS.md's two figures).

* kernel_us: the sum of GPU kernel durations per call from torch.profiler - the efficiency figure, free of
  host overhead, compared with the HBM floor (per_kernel_us: the same, per kernel name).
* wall_us: triton's do_bench median - includes host and launch overhead.
* copy_bandwidth_gbps / matmul_tflops: the two ceilings, measured in the same process as the figures;
  host_link_gbps: the pinned host-to-device copy rate (what activation offload moves per second).
"""
from __future__ import annotations

from collections.abc import Callable

import torch


def wall_us(fn: Callable[[], object], warmup_ms: int = 25, rep_ms: int = 100) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e3


def kernel_us(fn: Callable[[], object], iters: int = 30, warmup: int = 5) -> float:
    """Mean per-call sum of CUDA kernel durations (µs) recorded by torch.profiler."""
    return sum(per_kernel_us(fn, iters, warmup).values())


def per_kernel_us(fn: Callable[[], object], iters: int = 30, warmup: int = 5) -> dict[str, float]:
    """{CUDA kernel name: mean µs per call of fn} from torch.profiler (kernel_us is their sum)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name] = per.get(e.name, 0.0) + e.time_range.elapsed_us() / iters
    return per


def copy_bandwidth_gbps(nbytes: int = 2**30) -> float:
    """Device-to-device copy rate, counting bytes read plus bytes written (GB/s)."""
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    us = wall_us(lambda: y.copy_(x), warmup_ms=50, rep_ms=200)
    return 2 * nbytes / us / 1e3


def matmul_tflops(n: int = 8192) -> float:
    """bf16 n^3 matmul rate on random data (TFLOP/s): the MFU denominator."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    us = wall_us(lambda: a @ b, warmup_ms=50, rep_ms=200)
    return 2 * n**3 / us / 1e6


def host_link_gbps(nbytes: int = 2**28) -> float:
    """Pinned host-to-device copy rate (GB/s): what an activation offload can move per second each way."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    us = wall_us(lambda: dst.copy_(src, non_blocking=True), warmup_ms=20, rep_ms=100)
    return nbytes / us / 1e3
