"""Triton kernels of the gradients' L2 norms (the clipping norm), at the card's read bandwidth.

    norms(tensors, given=None) -> (len(tensors),) fp32       each tensor's L2 norm, by two kernels:
      _sum_squares_kernel     partials[b] = sum of x[block b]^2, fp32, one program per BLOCK elements
      _segment_norms_kernel   norms[t] = sqrt(sum of partials[starts[t]:starts[t+1]]), fp32

torch's `_foreach_norm` over bf16 gradients reads them at ~2.2 TB/s on an H200 (5.05 ms for the 5.6 B gradients of
the Qwen3-30B-A3B cut, bench/experiments/exp_optimizer_bandwidth.py, where a copy moves 4.2 TB/s); the first kernel
is a plain streaming read. Each program squares its elements in fp32 (a bf16 or fp16 value widened exactly) and
sums them in a fixed tree: no atomics, so the same gradients give the same bits on every run. The second kernel
adds one tensor's partials in a fixed order and takes a correctly rounded square root (tl.sqrt_rn), as torch's
kernels compute the per-tensor norm in fp32. Non-finite values propagate (inf^2 = inf, NaN stays NaN), and a sum
whose squares exceed fp32's range is inf, as torch's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from novatune.kernels.launch import cdiv, lean

BLOCK = 8192  # elements per program: 32 per thread at 8 warps (four 16-byte loads of bf16 each)
NUM_WARPS = 8
SEGMENT_BLOCK = 1024


@triton.jit
def _sum_squares_kernel(x_ptr, partial_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(partial_ptr + pid, tl.sum(x * x, axis=0))


@triton.jit
def _segment_norms_kernel(partial_ptr, starts_ptr, norm_ptr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    start = tl.load(starts_ptr + t)
    end = tl.load(starts_ptr + t + 1)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(start, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        acc += tl.load(partial_ptr + idx, mask=idx < end, other=0.0)
    tl.store(norm_ptr + t, tl.sqrt_rn(tl.sum(acc, axis=0)))


_SUM_SQUARES = lean(_sum_squares_kernel)
_SEGMENT_NORMS = lean(_segment_norms_kernel)
_POISON = False  # tests: the partials start as NaN, so a slot no program wrote would show in the norms


_BOUNDS: dict = {}  # (starts, device) -> the device copy: a step's gradients have the same sizes every step


def _bounds(starts: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The partials' segment bounds on the device, copied once per set of sizes (no host copy in later steps)."""
    key = (starts, device)
    if key not in _BOUNDS:
        if len(_BOUNDS) >= 64:
            _BOUNDS.clear()
        _BOUNDS[key] = torch.tensor(starts, dtype=torch.int64, device=device)
    return _BOUNDS[key]


def blocks_of(n: int) -> int:
    """Partial sums one tensor of n elements writes."""
    return cdiv(n, BLOCK)


def norms(tensors: list[torch.Tensor], given: list[torch.Tensor | None] | None = None) -> torch.Tensor:
    """(len(tensors),) fp32: each tensor's L2 norm. Tensors contiguous, of a float dtype, on one device. given[i],
    where not None, holds tensor i's sums of squares already (fp32 partials a kernel wrote with its final values):
    they are summed in place of reading the tensor."""
    device = tensors[0].device
    given = given or [None] * len(tensors)
    counts = [blocks_of(t.numel()) if g is None else g.numel() for t, g in zip(tensors, given)]
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    size = max(starts[-1], 1)
    partials = (torch.full((size,), float("nan"), dtype=torch.float32, device=device) if _POISON
                else torch.empty(size, dtype=torch.float32, device=device))
    for t, g, start, count in zip(tensors, given, starts, counts):
        if g is not None:
            partials[start:start + count].copy_(g)
        elif count:
            _SUM_SQUARES[(count,)](t, partials[start:], t.numel(), BLOCK=BLOCK, num_warps=NUM_WARPS)
    out = torch.empty(len(tensors), dtype=torch.float32, device=device)
    bounds = _bounds(tuple(starts), device)
    _SEGMENT_NORMS[(len(tensors),)](partials, bounds, out, BLOCK=SEGMENT_BLOCK, num_warps=4)
    return out
