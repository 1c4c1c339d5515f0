"""Measurement: forward and backward together, warm-up, the median of many timings, inputs rotated past the L2.

On CUDA each candidate's fwd+bwd is captured once per input set into a CUDA graph and each replay is timed with a
pair of CUDA events: the figure is GPU time of the op (its kernels and the gaps between them), free of Python and
launch overhead, which the training step mostly hides behind its GEMMs (the final step check catches the case
where it does not). K input sets are rotated, with K chosen so that K sets exceed twice the L2 size: every replay
reads data the previous replays evicted, as in a real layer stack. A candidate that cannot be captured (a
host sync inside, say) is timed eagerly with events instead, and its Timing says so (`mode`, `note`).
`wall_us` (eager, events around each call, host overhead included) is measured too and reported.

Spread = interquartile range of the samples (robust to the odd preempted sample); select.py uses it as the noise
margin. On the CPU (tests, tiny configs) timings are perf_counter medians of eager calls.
"""
from __future__ import annotations

import inspect
import statistics
import time
from dataclasses import dataclass

import torch

from novatune.ops.contract import OpSpec
from novatune.tune.calls import make_dy


@dataclass
class Timing:
    median_us: float
    spread_us: float
    samples: int
    mode: str                     # cuda-graph | cuda-events | cpu-wall
    wall_us: float | None = None  # eager per-call time incl. host overhead (CUDA only)
    note: str = ""

    def to_dict(self) -> dict:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def iqr(xs: list[float]) -> float:
    if len(xs) < 4:
        return max(xs) - min(xs) if xs else 0.0
    q = statistics.quantiles(xs, n=4)
    return q[2] - q[0]


def l2_bytes(device) -> int:
    if torch.device(device).type != "cuda":
        return 0
    p = torch.cuda.get_device_properties(torch.device(device))
    return int(getattr(p, "L2_cache_size", 50 * 2**20))


def input_sets(spec: OpSpec, shape, dtype, device, seed: int = 0, max_sets: int = 8) -> list:
    """[(leaves dict, dy)]: enough fresh sets that together they exceed 2x the L2 (at least 2)."""
    gen = torch.Generator().manual_seed(seed)
    first = spec.make_inputs(shape, dtype, device, gen)
    per_set = sum(v.numel() * v.element_size() for v in first.values() if isinstance(v, torch.Tensor))
    per_set += per_set // max(len(spec.tensor_args), 1)  # dy
    k = min(max_sets, max(2, -(-2 * l2_bytes(device) // max(per_set, 1))))
    sets = []
    for i in range(k):
        inputs = first if i == 0 else spec.make_inputs(shape, dtype, device, gen)
        leaves = {n: (v.detach().requires_grad_(True) if n in spec.tensor_args else v) for n, v in inputs.items()}
        sets.append((leaves, make_dy(spec, shape, dtype, device, gen)))
    return sets


def peak_extra_bytes(spec: OpSpec, fn, sets: list) -> int | None:
    """Peak memory one fwd+bwd of fn allocates beyond what is live before it (torch.cuda.max_memory_allocated
    delta; the gradients it returns included). None off CUDA (the CPU allocator keeps no peak)."""
    leaves, dy = sets[0]
    device = next(v for v in leaves.values() if isinstance(v, torch.Tensor)).device
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    grads = _stepper(spec, fn, [(leaves, dy)])(0)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del grads
    return int(peak)


def _stepper(spec: OpSpec, fn, sets):
    def step(i: int):
        leaves, dy = sets[i % len(sets)]
        y = spec.call(fn, leaves)
        return torch.autograd.grad(y, [leaves[k] for k in spec.tensor_args], dy)
    return step


def _graph_kwargs() -> dict:
    # thread_local: a CUDA call made meanwhile by another thread (the background CUDA-extension build imports
    # and initialises on its own thread) does not invalidate this capture
    params = inspect.signature(torch.cuda.graph).parameters
    return {"capture_error_mode": "thread_local"} if "capture_error_mode" in params else {}


def _time_graphs(step, n_sets: int, iters: int, warmup: int) -> list[float]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # autograd needs its warm-up on a side stream before capture
        for i in range(max(warmup, n_sets)):
            step(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graphs, pool = [], None
    for i in range(n_sets):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool, **_graph_kwargs()):
            step(i)
        pool = g.pool()
        graphs.append(g)
    for i in range(warmup):
        graphs[i % n_sets].replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        graphs[i % n_sets].replay()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]


def _time_events(step, n_sets: int, iters: int, warmup: int) -> list[float]:
    for i in range(warmup):
        step(i)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        step(i)
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]


def _time_cpu(step, iters: int, warmup: int) -> list[float]:
    for i in range(warmup):
        step(i)
    out = []
    for i in range(iters):
        t0 = time.perf_counter()
        step(i)
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def time_fwd_bwd(spec: OpSpec, fn, sets: list, iters: int = 100, warmup: int = 10) -> Timing:
    """Time fn's forward + backward over the rotated input `sets` (from input_sets)."""
    step = _stepper(spec, fn, sets)
    leaves = sets[0][0]
    device = next(v for v in leaves.values() if isinstance(v, torch.Tensor)).device
    if device.type != "cuda":
        xs = _time_cpu(step, iters, warmup)
        return Timing(statistics.median(xs), iqr(xs), len(xs), "cpu-wall")
    wall = _time_events(step, len(sets), max(10, iters // 3), warmup)
    try:
        xs = _time_graphs(step, len(sets), iters, warmup)
        mode, note = "cuda-graph", ""
    except Exception as e:  # noqa: BLE001 - not capturable: time eagerly and say so
        torch.cuda.synchronize()
        xs, mode = _time_events(step, len(sets), iters, warmup), "cuda-events"
        note = f"CUDA graph capture failed ({type(e).__name__}: {str(e)[:160]}); eager event timing"
    return Timing(statistics.median(xs), iqr(xs), len(xs), mode, statistics.median(wall), note)


def kernel_us(spec: OpSpec, fn, sets: list, iters: int = 20) -> float | None:
    """Sum of CUDA kernel durations per fwd+bwd (torch.profiler; BENCHMARKS.md's 'kernel µs'), rotated inputs."""
    leaves = sets[0][0]
    if next(v for v in leaves.values() if isinstance(v, torch.Tensor)).device.type != "cuda":
        return None
    from novatune.measure.timing import kernel_us as _kernel_us

    step = _stepper(spec, fn, sets)
    counter = iter(range(10**9))
    return _kernel_us(lambda: step(next(counter)), iters=iters)
