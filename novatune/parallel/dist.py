"""The process group of a run, from the environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*).

`setup(strategy, device_type)` returns a `Dist`: rank, world size, and the helpers the trainer needs. Without
torchrun a ddp/fsdp2 run is one process: it gets a one-member group on an in-memory store, so the same wrapped
model and sharded checkpoints run (what `novatune bench` measures for the fsdp2 stack). Strategy none makes no
group at all.

Control decisions that every rank must take together (stop on a signal, a non-finite check) go through a
separate gloo group on the CPU: on CUDA that costs no device synchronisation, and every rank sees the same answer,
so no rank waits in a collective the others skipped.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    strategy: str = "none"
    control: object = None  # the CPU (gloo) group for host-side agreement; None without a process group

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.strategy != "none" and dist.is_available() and dist.is_initialized()

    def barrier(self) -> None:
        if self.active:
            dist.barrier(group=self.control)

    def any_true(self, flag: bool) -> bool:
        """True on every rank when any rank passes True (a host-side OR over the control group)."""
        if not self.active:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        return bool(t.item())

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a tensor over the ranks, in place, on its device (no host synchronisation on CUDA)."""
        if self.active and self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def gather(self, value) -> list:
        """Every rank's `value` (a small picklable object), in rank order, on every rank."""
        if not self.active or self.world == 1:
            return [value]
        out = [None] * self.world
        dist.all_gather_object(out, value, group=self.control)
        return out

    def from_main(self, compute):
        """compute() run on rank 0 only, its (small, picklable) result on every rank: work every rank would
        repeat with the same answer (hashing a shared checkpoint folder) is done once."""
        return self.broadcast(compute() if self.main else None)

    def broadcast(self, value):
        """Rank 0's `value` on every rank (a small picklable object)."""
        if not self.active or self.world == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def setup(strategy: str, device_type: str) -> Dist:
    """Join (or make) the process group for `strategy`; on CUDA, bind this process to its LOCAL_RANK's GPU."""
    if strategy == "none":
        if launched_by_torchrun() and int(os.environ["WORLD_SIZE"]) > 1:
            raise RuntimeError("parallel.strategy is none but torchrun started WORLD_SIZE="
                               f"{os.environ['WORLD_SIZE']} processes: every process would train the whole run on "
                               "its own; set --set parallel.strategy=fsdp2 (or ddp), or run one process")
        return Dist()
    backend = "nccl" if device_type == "cuda" else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        if launched_by_torchrun():
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    control = dist.new_group(backend="gloo") if backend != "gloo" else None
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, strategy, control)


def teardown(d: Dist) -> None:
    """Leave the process group once every rank is done (no rank still waits in a collective)."""
    if d.active:
        dist.barrier(group=d.control)
        dist.destroy_process_group()
