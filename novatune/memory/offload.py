"""Activation offload: a checkpointed layer's saved inputs wait in host memory between its forward and backward.

With non-reentrant checkpointing (torch.utils.checkpoint, use_reentrant=False) the only tensors a layer keeps for
its backward are its inputs: the checkpoint saves them as saved tensors of the outer graph, and everything the
layer computes inside is recomputed. `OffloadEngine.layer(i)` wraps one layer's checkpoint call in
`torch.autograd.graph.saved_tensors_hooks`, so those input saves pass through `_pack` / `_unpack`:

  forward   _pack: the tensor is copied into a pooled page-locked host buffer (memory/pinned.py) on a side stream
            (d2h) that first waits for an event recorded on the compute stream; the device tensor is released to the
            allocator once that copy has run (`record_stream`), so its memory serves the next layers.
  backward  _unpack of layer i (called when its recompute starts): its input was prefetched into one of two device
            slots while layer i+1 ran its backward; the compute stream waits on that copy's event only. It then
            asks for the previous offloaded layer's input to be copied into the other slot (h2d stream), after
            an event that marks layer i+1's backward (the slot's last reader) as issued.

Nothing waits on a whole stream: every wait is on one event. The shared per-batch tensors of a layer call
(cos/sin position embeddings, position ids) travel as keyword arguments of the checkpointed function, not as its
saved inputs, so they are never offloaded (nor copied once per layer).

A host buffer returns to the pool when autograd drops the saved tensor (after the backward, or with the graph);
a later copy into it waits for the event of its last read. On the CPU the same logic runs with host = device
(plain tensors, no streams or events): the tests drive the pool, the slots and the prefetch order there.
"""
from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import Tensor

from novatune.memory.pinned import pinned_empty

# Tensors smaller than this stay where they are: a copy's fixed cost (a few µs) outweighs the memory saved.
MIN_OFFLOAD_BYTES = 1 << 20


@dataclass
class _Group:
    """The offloaded tensors of one layer call, in save order."""
    slot: int
    saved: list = field(default_factory=list)
    on_device: bool = False  # its tensors sit in their slot (prefetched or fetched) and the slot is still theirs
    prefetch_issued: bool = False  # its backward started and asked for the previous group


class _Saved:
    """What autograd stores instead of an offloaded tensor."""
    __slots__ = ("engine", "generation", "position", "key", "host", "offloaded", "read", "fetched", "view",
                 "__weakref__")

    def __init__(self, engine, generation: int, position: int, key: tuple, host: Tensor, offloaded):
        self.engine, self.generation, self.position, self.key = engine, generation, position, key
        self.host, self.offloaded = host, offloaded  # offloaded: the d2h copy's event (None on the CPU)
        self.read = None  # event of the last h2d copy that read `host`
        self.fetched = None  # event of the h2d copy into the slot
        self.view: Tensor | None = None  # the slot tensor this saved tensor is unpacked as

    def __del__(self):
        if self.engine is not None:
            self.engine._release_host(self.key, self.host, self.read or self.offloaded)


def indexed(device: torch.device | str) -> torch.device:
    """`cuda` as the tensors report it (`cuda:0`, the current device): the engine compares each saved tensor's
    device with its own, and an index-less `cuda` equals no tensor's device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class OffloadEngine:
    """Moves offloaded layers' checkpoint inputs to host memory and back (module docstring). One per model."""

    def __init__(self, device: torch.device | str, min_bytes: int = MIN_OFFLOAD_BYTES):
        self.device = indexed(device)
        self.min_bytes = min_bytes
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            self.d2h = torch.cuda.Stream(self.device)
            self.h2d = torch.cuda.Stream(self.device)
        self.free_host: dict[tuple, list[tuple[Tensor, object]]] = {}
        self.slots: dict[tuple, Tensor] = {}  # (slot, key) -> device buffer
        self.slot_owner: dict[int, _Group] = {}
        self.groups: dict[tuple[int, int], _Group] = {}  # (generation, position) -> group
        self.generation, self.position, self.last_layer = 0, -1, None
        self.current: _Group | None = None
        self.current_id: tuple[int, int] | None = None
        self.stats: Counter = Counter()

    # ------------------------------------------------------------------------------------------------ forward
    @contextlib.contextmanager
    def layer(self, index: int):
        """The context of one offloaded layer's checkpoint call: its saved inputs go through the engine. A layer
        index at or below the previous one starts a new forward (a new micro-batch)."""
        if self.last_layer is None or index <= self.last_layer:
            self.generation += 1
            self.position = -1
            self._forget_finished()
        self.last_layer = index
        self.position += 1
        gid = (self.generation, self.position)
        self.current_id, self.current = gid, _Group(slot=self.position % 2)
        self.groups[gid] = self.current
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self.current = self.current_id = None

    def _forget_finished(self) -> None:
        """Drop the bookkeeping of forwards whose tensors autograd no longer holds."""
        for gid in [g for g, grp in self.groups.items() if all(s() is None for s in grp.saved)]:
            del self.groups[gid]

    def _pack(self, t: Tensor):
        nbytes = t.numel() * t.element_size()
        if (self.current is None or t.device != self.device or nbytes < self.min_bytes or not t.is_contiguous()
                or (self.cuda and torch.cuda.is_current_stream_capturing())):
            self.stats["kept_tensors"] += 1
            return t
        key = (tuple(t.shape), t.dtype)
        host, last_read = self._host_buffer(key)
        if self.cuda:
            produced = torch.cuda.current_stream(self.device).record_event()
            self.d2h.wait_event(produced)
            if last_read is not None:
                self.d2h.wait_event(last_read)
            with torch.cuda.stream(self.d2h):
                host.copy_(t, non_blocking=True)
                offloaded = self.d2h.record_event()
            t.record_stream(self.d2h)  # the allocator reuses t's memory only after the copy ran
        else:
            host.copy_(t)
            offloaded = None
        gen, pos = self.current_id
        saved = _Saved(self, gen, pos, key, host, offloaded)
        self.current.saved.append(weakref.ref(saved))
        self.stats["offloaded_tensors"] += 1
        self.stats["offloaded_bytes"] += nbytes
        return saved

    def _host_buffer(self, key: tuple) -> tuple[Tensor, object]:
        pool = self.free_host.get(key)
        if pool:
            return pool.pop()
        shape, dtype = key
        self.stats["host_buffers"] += 1
        return (pinned_empty(shape, dtype) if self.cuda else torch.empty(shape, dtype=dtype)), None

    def _release_host(self, key: tuple, host: Tensor, last_use) -> None:
        self.free_host.setdefault(key, []).append((host, last_use))

    # ----------------------------------------------------------------------------------------------- backward
    def _unpack(self, saved):
        if isinstance(saved, Tensor):
            return saved
        group = self.groups[(saved.generation, saved.position)]
        if not group.on_device or saved.view is None:
            self.stats["fetched_on_demand"] += 1
            self._fetch(group)
        if not group.prefetch_issued:
            group.prefetch_issued = True
            prev = self.groups.get((saved.generation, saved.position - 1))
            if prev is not None and not prev.on_device:
                self.stats["prefetched_groups"] += 1
                self._fetch(prev)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(saved.fetched)
        self.stats["unpacked_tensors"] += 1
        return saved.view

    def _fetch(self, group: _Group) -> None:
        """Copy a group's tensors from their host buffers into the group's device slot, after the slot's previous
        owner's readers (everything issued on the compute stream so far) and the group's own d2h copies."""
        owner = self.slot_owner.get(group.slot)
        if owner is not None and owner is not group:
            owner.on_device = False  # its tensors are overwritten: a second backward through it fetches again
        self.slot_owner[group.slot] = group
        if self.cuda:
            slot_free = torch.cuda.current_stream(self.device).record_event()
            self.h2d.wait_event(slot_free)
        for j, ref in enumerate(group.saved):
            saved = ref()
            if saved is None:
                continue
            buf = self._slot_buffer(group.slot, j, saved.key)
            if self.cuda:
                self.h2d.wait_event(saved.offloaded)
                with torch.cuda.stream(self.h2d):
                    buf.copy_(saved.host, non_blocking=True)
                    saved.fetched = saved.read = self.h2d.record_event()
            else:
                buf.copy_(saved.host)
            saved.view = buf.detach()
        group.on_device = True

    def _slot_buffer(self, slot: int, j: int, key: tuple) -> Tensor:
        buf = self.slots.get((slot, j, key))
        if buf is None:
            shape, dtype = key
            buf = self.slots[(slot, j, key)] = torch.empty(shape, dtype=dtype, device=self.device)
            self.stats["device_slots"] += 1
        return buf

    def device_slot_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.slots.values())
