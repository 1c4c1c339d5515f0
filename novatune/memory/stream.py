"""Frozen-weight streaming: the frozen parameters of chosen decoder layers live in pinned host memory and visit the
GPU only while their layer runs (LoRA / QLoRA, whose base weights never change).

Layout. Two device slots, each big enough for one streamed layer's frozen parameters (one flat buffer per dtype).
The k-th streamed layer (in layer order) owns slot k % 2 for good: its frozen parameters' `.data` are views into
that slot, so their addresses never change (patch/graphs.py captures them once, and its CUDA graphs replay on
whatever the slot holds). Each streamed layer's values wait in one pinned host buffer per dtype; the device
storage they had is freed at install.

When. `acquire(index)` runs before every use of a streamed layer's weights: its forward (the layer's forward
pre-hook, which also covers evaluation without checkpointing), and in the backward its recompute (the wrapper of
the layer's checkpoint function; a checkpointed layer re-runs its forward inside the backward, and the backward's
own matmuls follow before the next layer's recompute can start, since that layer needs their input gradient);
patch/graphs.py calls it before each replay of a graphed layer. So the weights are read only between an `acquire`
and the next `acquire` of a layer of the same slot. Streaming therefore requires a recomputed layer: `keep` would
read the weights in its backward without a recompute before it, and is refused, as is a forward with gradients
and without checkpointing.

Below, "layer k" is the k-th streamed layer.

  acquire(k)   if slot k % 2 does not hold layer k, copy it now (fetched on demand; counted); the compute stream
               waits for that copy's event only. Then prefetch the layer expected next into the other slot: the
               next streamed layer in the forward (k + 1), the previous one in the backward (k - 1). The prefetch
               copy waits for an event recorded on the compute stream at this moment: everything the slot's
               previous owner (layer k - 1 in the forward, k + 1 in the backward) had to do is already issued.

In the forward the copy of layer k + 1 overlaps the layers between k and k + 1 (spread streamed layers apart: the
planner does); the last streamed layer's forward is followed by its own backward, and the backward leaves layers 0
and 1 in their slots for the next micro-batch's forward, so a micro-batch of K streamed layers copies 2K - 4 layers.

Nothing waits on a whole stream: every wait is on one event. On the CPU the same logic runs with plain tensors and
synchronous copies: the tests check that every use of a layer finds its own weights in its slot (a missed
`acquire` would compute with another layer's weights and change the loss).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes  # torch's own escape from dispatch modes

from novatune.memory.pinned import pinned_empty
from novatune.memory.policy import KEPT

SLOTS = 2


class StreamingRefused(ValueError):
    """A layer cannot be streamed: the message names the parameter and the fix."""


@dataclass
class _Entry:
    """One streamed layer: its frozen parameters and their places in the host and slot buffers."""
    index: int  # decoder layer index
    ordinal: int  # position among the streamed layers
    params: list = field(default_factory=list)  # (param, dtype, offset, numel, shape)
    host: dict = field(default_factory=dict)  # dtype -> pinned flat buffer

    @property
    def slot(self) -> int:
        return self.ordinal % SLOTS

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.host.values())


def frozen_parameters(layer: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """A layer's frozen parameters (each once, though modules may share it)."""
    seen, out = set(), []
    for name, p in layer.named_parameters():
        if id(p) not in seen and not p.requires_grad:
            seen.add(id(p))
            out.append((name, p))
    return out


def frozen_bytes(layer: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for _, p in frozen_parameters(layer))


def check_streamable(layer: nn.Module, index: int) -> None:
    """Refuse a layer with no frozen weight (full fine-tuning). Only frozen parameters stream (a host copy is never
    written back, so an optimizer step on a streamed weight would be lost): trainable ones stay on the device."""
    trained = [n for n, p in layer.named_parameters() if p.requires_grad and p.numel() * p.element_size() > 0]
    frozen = frozen_parameters(layer)
    if not frozen:
        raise StreamingRefused(f"decoder layer {index} has no frozen parameters to stream (full fine-tuning trains "
                               f"them: {', '.join(trained[:3])}...); frozen-weight streaming is for LoRA/QLoRA "
                               f"runs: set memory.stream_frozen_layers: 0 or method.type: lora")


class FrozenWeightStreamer:
    """Keeps streamed layers' frozen weights in host memory and brings each to its slot before use (module
    docstring). One per model; `install` picks the layers."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            self.h2d = torch.cuda.Stream(self.device)
        self.entries: dict[int, _Entry] = {}  # decoder layer index -> entry
        self.order: list[_Entry] = []
        self.slots: list[dict] = [{} for _ in range(SLOTS)]  # slot -> dtype -> flat device buffer
        self.holder: list[int | None] = [None] * SLOTS  # ordinal whose weights the slot holds (or is receiving)
        self.ready: list = [None] * SLOTS  # event of the copy into the slot
        self.stats: Counter = Counter()
        self.log: list[tuple[str, int]] = []  # ("acquire" | "copy", layer index), kept when `trace` is on
        self.trace = False
        self.hooks: list = []

    # ------------------------------------------------------------------------------------------ install
    def install(self, layers: list[nn.Module], indices: list[int]) -> None:
        """Move the frozen parameters of `layers[i]` for i in `indices` to pinned host memory; their `.data`
        become views into the layer's slot (module docstring)."""
        if self.order:
            raise RuntimeError("this streamer is already installed")
        for i in indices:
            check_streamable(layers[i], i)
        try:
            for ordinal, i in enumerate(sorted(indices)):
                self._move_to_host(_Entry(i, ordinal), layers[i])
        except BaseException:
            self.restore()  # the layers moved so far go back whole
            raise
        # the slots exist only once the device copies are gone: the peak of the install is the model's own
        for entry in self.order:
            slot = self.slots[entry.slot]
            for dtype, host in entry.host.items():
                if dtype not in slot or slot[dtype].numel() < host.numel():
                    slot[dtype] = torch.empty(host.numel(), dtype=dtype, device=self.device)
        for entry in self.order:
            slot = self.slots[entry.slot]
            for p, dtype, off, n, shape in entry.params:
                p.data = slot[dtype][off:off + n].view(shape)
        self.holder = [None] * SLOTS
        self.stats["streamed_layers"] = len(self.order)
        self.stats["host_bytes"] = sum(e.nbytes() for e in self.order)

    def _move_to_host(self, entry: _Entry, layer: nn.Module) -> None:
        """One layer's frozen parameters into its pinned host buffers; their device storage is released (an empty
        stand-in until the slots exist)."""
        sizes: Counter = Counter()
        for _, p in frozen_parameters(layer):
            if p.device != self.device and not (self.cuda and p.device.type == "cuda"):
                raise StreamingRefused(f"decoder layer {entry.index}: a frozen parameter is on {p.device}, not "
                                       f"{self.device}")
            entry.params.append((p, p.dtype, sizes[p.dtype], p.numel(), p.shape))
            sizes[p.dtype] += p.numel()
        for dtype, n in sizes.items():
            entry.host[dtype] = pinned_empty(n, dtype) if self.cuda else torch.empty(n, dtype=dtype)
        for p, dtype, off, n, _ in entry.params:
            entry.host[dtype][off:off + n].copy_(p.data.reshape(-1))  # synchronous: complete on return
        self.entries[entry.index] = entry
        self.order.append(entry)
        for p, dtype, *_ in entry.params:
            p.data = torch.empty(0, dtype=dtype, device=p.device)

    def slot_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for s in self.slots for b in s.values())

    def streamed(self) -> list[int]:
        return [e.index for e in self.order]

    # ------------------------------------------------------------------------------------------ use
    def acquire(self, index: int) -> None:
        """Before any use of decoder layer `index`'s weights (its forward, its recompute in the backward)."""
        entry = self.entries.get(index)
        if entry is None:
            return
        if self.trace:
            self.log.append(("acquire", index))
        self.stats["acquires"] += 1
        if self.holder[entry.slot] != entry.ordinal:
            self.stats["fetched_on_demand"] += 1
            self._copy(entry)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.ready[entry.slot])
        backward = torch._C._current_graph_task_id() != -1
        k = entry.ordinal + (-1 if backward else 1)
        if 0 <= k < len(self.order) and self.holder[self.order[k].slot] != k:
            self.stats["prefetched"] += 1
            self._copy(self.order[k])

    def _copy(self, entry: _Entry) -> None:
        """Copy a layer's host buffers into its slot, after everything issued on the compute stream so far (the
        slot's previous owner's reads)."""
        with _disable_current_modes():  # a selective checkpoint's dispatch mode must not record the copies
            self._copy_now(entry)

    def _copy_now(self, entry: _Entry) -> None:
        slot = self.slots[entry.slot]
        self.holder[entry.slot] = entry.ordinal
        self.stats["copies"] += 1
        self.stats["copied_bytes"] += entry.nbytes()
        if self.trace:
            self.log.append(("copy", entry.index))
        if not self.cuda:
            for dtype, host in entry.host.items():
                slot[dtype][:host.numel()].copy_(host)
            return
        self.h2d.wait_event(torch.cuda.current_stream(self.device).record_event())
        with torch.cuda.stream(self.h2d):
            for dtype, host in entry.host.items():
                slot[dtype][:host.numel()].copy_(host, non_blocking=True)
            self.ready[entry.slot] = self.h2d.record_event()

    def restore(self) -> None:
        """Put every streamed weight back in its own device storage (the export, a merge, or turning it off)."""
        for entry in self.order:
            for p, dtype, off, n, shape in entry.params:
                p.data = entry.host[dtype][off:off + n].view(shape).to(self.device, copy=True)
        self.entries.clear()
        self.order.clear()
        self.slots = [{} for _ in range(SLOTS)]
        self.holder = [None] * SLOTS


class _StreamedCheckpoint:
    """Stands in for a streamed layer's `_gradient_checkpointing_func`: the layer's forward, as the checkpoint runs
    it (at the forward and again as the recompute inside the backward), first acquires the layer's weights.
    patch/graphs.py wraps this object and, replaying its graphs instead, calls `before_replay` itself."""

    def __init__(self, streamer: FrozenWeightStreamer, index: int, inner):
        self.streamer, self.index, self.inner = streamer, index, inner
        self.graphs_compatible = getattr(inner, "graphs_compatible", True)
        if getattr(inner, "policy", "recompute") in KEPT:
            raise StreamingRefused(f"decoder layer {index} keeps its activations (memory policy {inner.policy}): its "
                                   f"backward would read its weights without a recompute before it; stream only "
                                   f"recomputed layers (recompute, selective, offload)")

    def __call__(self, fn, *args, **kwargs):
        streamer, index = self.streamer, self.index

        def acquired(*a, **kw):
            streamer.acquire(index)
            return fn(*a, **kw)
        return self.inner(acquired, *args, **kwargs)

    def before_replay(self) -> None:
        self.streamer.acquire(self.index)


class _StreamHook:
    """A streamed layer's forward pre-hook: its forward outside a checkpoint (evaluation, generation) acquires the
    weights too; a forward that will have a backward without a recompute is refused (it would read a slot that
    another layer may have filled by then). It runs outside the layer's checkpoint (transformers checkpoints
    `forward`, not `__call__`), so CUDA graphs of the layer leave it in place (`graph_safe`)."""

    graph_safe = True

    def __init__(self, streamer: FrozenWeightStreamer, index: int):
        self.streamer, self.index = streamer, index

    def __call__(self, module: nn.Module, args) -> None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return
        if torch.is_grad_enabled() and not (getattr(module, "gradient_checkpointing", False) and module.training):
            raise StreamingRefused(f"decoder layer {self.index} streams its frozen weights but runs with gradients "
                                   f"and without gradient checkpointing: its backward needs the recompute to "
                                   f"bring the weights back; keep checkpointing on (model.train() and "
                                   f"gradient_checkpointing_enable()) or run under torch.no_grad()")
        self.streamer.acquire(self.index)


def install_streaming(layers: list[nn.Module], indices: list[int], device) -> FrozenWeightStreamer:
    """Stream the frozen weights of `layers[i]` for i in `indices` (module docstring). The layers must be
    gradient-checkpointed (each has its `_gradient_checkpointing_func`); their memory policies are kept."""
    for i in indices:
        layer = layers[i]
        if not getattr(layer, "gradient_checkpointing", False) or "_gradient_checkpointing_func" not in layer.__dict__:
            raise StreamingRefused(f"decoder layer {i} is not gradient-checkpointed: frozen-weight streaming brings "
                                   f"the weights back for the recompute; call gradient_checkpointing_enable() first")
    streamer = FrozenWeightStreamer(device)
    wrapped = {i: _StreamedCheckpoint(streamer, i, layers[i].__dict__["_gradient_checkpointing_func"])
               for i in indices}  # checked (keep refused) before anything moves
    streamer.install(layers, indices)
    for i, func in wrapped.items():
        layers[i].__dict__["_gradient_checkpointing_func"] = func
        streamer.hooks.append(layers[i].register_forward_pre_hook(_StreamHook(streamer, i)))
    return streamer


def uninstall_streaming(layers: list[nn.Module], streamer: FrozenWeightStreamer) -> None:
    """Every weight back in its own device storage, the hooks and checkpoint wrappers removed."""
    for i in streamer.streamed():
        f = layers[i].__dict__.get("_gradient_checkpointing_func")
        if isinstance(f, _StreamedCheckpoint):
            layers[i].__dict__["_gradient_checkpointing_func"] = f.inner
    for h in streamer.hooks:
        h.remove()
    streamer.hooks.clear()
    streamer.restore()
