"""A kept layer without its cheap copies: norm outputs and Qwen3's rotated q/k computed again in the backward.

The `keep` policy runs a decoder layer without a checkpoint, so every tensor its ops save stays until the backward.
Some of those are outputs of elementwise ops whose inputs are saved anyway (novatune/ops/recipes.py): each RMSNorm's
output, saved by the projections or the experts that read it, and Qwen3's normalised, rotated q and k, saved by
attention. `kept_layer()` runs the layer's forward with

  * the ops offering those outputs (recipes.offering), and
  * saved-tensor hooks: a saved tensor that is an offered output (or a view of one) is stored as its recipe, which
    holds only tensors its producer keeps anyway; the backward computes the outputs again (once for all their
    consumers, with the kernel that made them: the same values bit for bit) and frees them with their last
    consumer. Every other saved tensor is stored as it is.

Per token that is 2 x hidden + (q + kv with Qwen3's q/k norms) elements a kept layer no longer holds, for one
norm kernel (and one q/k-norm + RoPE kernel) more per layer in the backward.

Saved-tensor hooks switch off autograd's own check that a saved tensor was not modified in place before the
backward; the hooks here check it themselves (a saved tensor's version at the forward against its version when
the backward reads it) and raise autograd's error.
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from novatune.ops import recipes


class _Recomputed:
    """What autograd stores instead of an offered output: its recipe and the view of it the consumer saved."""

    __slots__ = ("recipe", "index", "size", "stride", "offset")

    def __init__(self, recipe: recipes.Recipe, index: int, t: Tensor):
        self.recipe, self.index = recipe, index
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


class _Checked:
    """A saved tensor stored as it is, with its version at the forward (the check the hooks switch off)."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: Tensor):
        # detached: the same data and version counter, without a reference back to the graph (an op's saved output
        # would otherwise hold its own node, and a graph never run backward would never be freed)
        self.tensor, self.version = t.detach(), t._version


def _pack(t: Tensor):
    found = recipes.find(t)
    if found is None:
        return _Checked(t)
    return _Recomputed(*found, t)


def _unpack(saved) -> Tensor:
    if isinstance(saved, _Checked):
        if saved.tensor._version != saved.version:
            raise RuntimeError(f"one of the variables needed for gradient computation has been modified by an inplace "
                               f"operation: a {tuple(saved.tensor.shape)} {saved.tensor.dtype} tensor saved by a kept "
                               f"layer is at version {saved.tensor._version}; expected version {saved.version}")
        return saved.tensor
    out = saved.recipe.outputs()[saved.index]
    return out.as_strided(saved.size, saved.stride, saved.offset)


@contextlib.contextmanager
def kept_layer():
    """Around a kept layer's forward (module docstring)."""
    with recipes.offering(), torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        yield
