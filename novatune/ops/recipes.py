"""Outputs an op can compute again from tensors it keeps anyway: what a kept layer need not keep.

A decoder layer that keeps its activations (no checkpoint) holds every tensor its ops save for the backward. Some
of them are outputs of cheap elementwise ops whose inputs their producer saves anyway: RMSNorm's output (its
producer keeps its input and the per-row statistics) is saved again by the projections that read it; Qwen3's
normalised and rotated q and k (qk_norm_rope keeps the projections' q and k) are saved again by attention. The
consumer's copy is the only reason they stay, 2 x hidden + q + kv elements per token (Qwen3-30B-A3B: 68 MiB per
layer at 4,096 tokens).

While `offering()` is active (memory/lean_keep.py turns it on around a kept layer's forward), such an op calls
`offer(outputs, recompute)`: `recompute()` returns the same outputs again, bit for bit (the same kernel on the same
inputs), from the tensors the op saves itself. The memory layer's saved-tensor hook asks `find(t)` for every tensor
a consumer saves; where t is an offered output (or a view of one) it keeps the offer instead of the tensor, and
the backward computes the outputs again, once for all of their consumers.

An offer lives while its output does (a weak reference): an output that has died cannot be matched by a later
tensor that reuses its memory. The inputs a recompute reads are the producer's saved tensors; their version
counters are recorded at the offer, and a recompute after an in-place change of one raises, as autograd does for
a saved tensor. So is a change of the output itself: the version an output had at its offer is the only one
matched, so a consumer that saves it after an in-place change keeps the tensor itself.
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable

import torch
from torch import Tensor

_offering = 0  # nesting depth of offering(): ops offer only inside it (one int read otherwise)
_offers: dict[int, list[Offer]] = {}  # data_ptr of an offered output's storage -> the offers made for it


class Recipe:
    """The outputs of one op call, computed again on demand (once; cached while an offer holds the recipe)."""

    __slots__ = ("recompute", "inputs", "versions", "cached", "__weakref__")

    def __init__(self, recompute: Callable[[], tuple[Tensor, ...]], inputs: tuple[Tensor, ...]):
        self.recompute, self.inputs = recompute, inputs
        self.versions = tuple(t._version for t in inputs)
        self.cached: tuple[Tensor, ...] | None = None

    def outputs(self) -> tuple[Tensor, ...]:
        if self.cached is None:
            if tuple(t._version for t in self.inputs) != self.versions:
                raise RuntimeError("an input of a recomputed activation (a norm's or RoPE's output that a lean "
                                   "layer computes again in its backward) was modified in place after the forward; "
                                   "give that layer the keep policy (memory.layers), or memory.policy: none")
            with torch.no_grad():
                self.cached = tuple(self.recompute())
        return self.cached


class Offer:
    """Output `index` of a recipe, matched to saved tensors while the output itself is alive."""

    __slots__ = ("output", "recipe", "index", "version")

    def __init__(self, output: Tensor, recipe: Recipe, index: int):
        self.output, self.recipe, self.index = weakref.ref(output), recipe, index
        self.version = output._version  # a later in-place change makes the output differ from what recompute gives


@contextlib.contextmanager
def offering():
    global _offering
    _offering += 1
    try:
        yield
    finally:
        _offering -= 1
        if not _offering:
            _offers.clear()  # an offer outlives its forward only through what a consumer packed


def active() -> bool:
    return _offering > 0


def offer(outputs: tuple[Tensor, ...], recompute: Callable[[], tuple[Tensor, ...]],
          inputs: tuple[Tensor, ...]) -> None:
    """Say that `recompute()` gives `outputs` again from `inputs` (tensors the caller saves for its own backward).
    Does nothing outside offering(). Outputs must be contiguous tensors that own their storage from its start."""
    if not _offering:
        return
    recipe = Recipe(recompute, inputs)
    for i, out in enumerate(outputs):
        if out.storage_offset() != 0 or not out.is_contiguous():
            continue
        _offers.setdefault(out.untyped_storage().data_ptr(), []).append(Offer(out, recipe, i))


def find(t: Tensor) -> tuple[Recipe, int] | None:
    """The recipe and output index that give `t` (an offered output, or a view into one) again, or None."""
    if not _offers or t.layout != torch.strided:
        return None
    offers = _offers.get(t.untyped_storage().data_ptr())
    if not offers:
        return None
    ptr = t.untyped_storage().data_ptr()
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))  # the view's last element
    for offer in offers:
        out = offer.output()  # alive: the storage is still its own, not memory a later tensor reuses
        if (out is not None and out.dtype == t.dtype and t._version == offer.version and last < out.numel()
                and out.untyped_storage().data_ptr() == ptr):  # not moved (set_, resize_) since the offer
            return offer.recipe, offer.index
    return None
