"""The peak GPU memory a run holds, CUDA graphs' pools included.

torch.cuda.max_memory_allocated() counts a CUDA graph's temporaries only while the graph is captured: when the
capture ends they are freed into the graph's private pool, where the replays keep using them, and the allocator's
allocated-bytes statistic no longer counts them. The memory stays reserved for the pool all the same, beside
whatever the eager code allocates. So a run's peak is its allocated peak plus the bytes its graphs' private pools
hold unallocated (read from the allocator's snapshot: segments whose pool id is not the default pool's).
A capture inside the measured window counts its temporaries twice (allocated while capturing, then idle in the
pool): the figure errs high, never low.
"""
from __future__ import annotations

import torch

DEFAULT_POOL = (0, 0)


def graph_pool_idle_bytes(device=None) -> int:
    """Bytes reserved by CUDA-graph private pools and not allocated in them (0 without CUDA)."""
    if not torch.cuda.is_available():
        return 0
    index = torch.cuda.current_device() if device is None else torch.device(device).index
    total = 0
    for seg in torch.cuda.memory_snapshot():
        if index is not None and seg.get("device", index) != index:
            continue
        if tuple(seg.get("segment_pool_id", DEFAULT_POOL)) != DEFAULT_POOL:
            total += int(seg["total_size"]) - int(seg["allocated_size"])
    return total


def peak_bytes(device=None) -> int:
    """max_memory_allocated since the last reset, plus the graphs' pools (module docstring)."""
    return torch.cuda.max_memory_allocated(device) + graph_pool_idle_bytes(device)
