"""Per-layer memory policies, applied where Hugging Face checkpoints a decoder layer.

transformers' GradientCheckpointingLayer calls `layer._gradient_checkpointing_func(partial(forward, **kwargs), *args)`
when gradient checkpointing is on and the layer trains. `install` replaces that function per layer with a
`LayerPolicy`, which runs the layer as its policy says:

  keep        no checkpoint: the layer's saved tensors stay on the device until its backward (fastest, most memory)
  lean        `keep` without the cheap copies: the norms' outputs and Qwen3's rotated q/k, which their producers'
              saved tensors give again, are computed again in the backward instead of kept (lean_keep.py)
  recompute   the stock non-reentrant checkpoint: only the layer's inputs are kept, the whole layer is recomputed
  recompute_mlp
              the attention half kept as `lean` keeps it, the MLP (`layer.mlp`) under the stock checkpoint: the MLP's
              (tokens x intermediate) tensors, most of a layer's activations, are recomputed; the attention's
              projections, attention itself and its output projection run once
  selective   a checkpoint that keeps the matrix products' outputs (GEMMs, attention) and recomputes the elementwise
              ops (norms, activation, RoPE) from them: most of the recompute's time back for part of the memory
  offload     `recompute`, with the kept inputs moved to host memory until the backward (memory/offload.py)

Module hooks (FSDP2's all-gather, PEFT's) run outside this function, so every policy runs on the gathered layer.
The policy of a layer changes which tensors are kept, never the arithmetic: gradients equal the stock checkpoint's.
"""
from __future__ import annotations

import contextlib
import functools
import re

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from novatune.memory.lean_keep import kept_layer
from novatune.memory.offload import OffloadEngine
from novatune.patch.forwards import call_under_own_checkpoint

POLICIES = ("keep", "lean", "recompute", "recompute_mlp", "selective", "offload")
# the layer's forward (recompute_mlp: its attention half) runs once, so its backward reads weights no recompute has
# brought back before it (frozen-weight streaming refuses these layers)
KEPT = ("keep", "lean", "recompute_mlp")
# memory.policy (one word for every layer) -> the layer policy; auto and per-layer are resolved by the caller
UNIFORM = {"none": "keep", "checkpoint": "recompute", "offload": "offload", "selective": "selective",
           "recompute_mlp": "recompute_mlp"}

# ops whose outputs `selective` keeps: the matrix products (the time of a recompute) and attention
_SAVED_OP_NAMES = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "lora_linear_fwd", "matmul_4bit"}
_ATTENTION = re.compile(r"attention|attn")


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    name = getattr(op, "_opname", None) or str(op)  # OpOverload: "mm"; a higher-order op: its name
    if name in _SAVED_OP_NAMES or _ATTENTION.search(name):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts():
    return create_selective_checkpoint_contexts(_selective_policy)


@contextlib.contextmanager
def _mlp_checkpointed(layer: torch.nn.Module, checkpoint_fn):
    """While it is open, a call of `layer.mlp` runs its forward under `checkpoint_fn` (the layer's own checkpoint
    function: Hugging Face's non-reentrant checkpoint). The module's forward is swapped for the call's duration
    only, so whatever forward is bound then (stock, or novatune.patch's) is the one checkpointed, and the module's
    hooks stay outside the checkpoint, as for a layer."""
    mlp = layer.mlp
    own = mlp.__dict__.get("forward")
    forward = functools.partial(call_under_own_checkpoint, mlp, mlp.forward)
    mlp.__dict__["forward"] = functools.partial(checkpoint_fn, forward)
    try:
        yield
    finally:
        if own is None:
            mlp.__dict__.pop("forward", None)
        else:
            mlp.__dict__["forward"] = own


class LayerPolicy:
    """Stands in for one decoder layer's `_gradient_checkpointing_func` (module docstring)."""

    def __init__(self, policy: str, index: int, inner, engine: OffloadEngine | None,
                 layer: torch.nn.Module | None = None):
        if policy not in POLICIES:
            raise ValueError(f"unknown layer policy {policy!r}; choose one of {', '.join(POLICIES)}")
        if policy == "offload" and engine is None:
            raise ValueError("the offload policy needs an OffloadEngine")
        if policy == "recompute_mlp" and not isinstance(getattr(layer, "mlp", None), torch.nn.Module):
            raise ValueError(f"decoder layer {index} ({type(layer).__name__}) has no `mlp` module for recompute_mlp "
                             f"to checkpoint; use recompute for it")
        self.policy, self.index, self.inner, self.engine = policy, index, inner, engine
        # the layer whose MLP recompute_mlp checkpoints: a plain reference (a cycle with the layer, which holds this
        # object), so that a deep copy or a pickle of the layer carries a policy that points at the copy
        self.layer = layer if policy == "recompute_mlp" else None
        # patch/graphs.py captures the stock recompute only; a layer kept or offloaded runs outside its graphs
        self.graphs_compatible = policy == "recompute"

    def __call__(self, fn, *args, **kwargs):
        if self.policy == "recompute":
            return self.inner(fn, *args, **kwargs)
        if self.policy == "keep":
            return fn(*args, **kwargs)
        if self.policy == "lean":
            with kept_layer():
                return fn(*args, **kwargs)
        if self.policy == "recompute_mlp":
            with kept_layer(), _mlp_checkpointed(self.layer, self.inner):
                return fn(*args, **kwargs)
        if self.policy == "selective":
            return checkpoint(fn, *args, use_reentrant=False, context_fn=selective_contexts, **kwargs)
        with self.engine.layer(self.index):
            return self.inner(fn, *args, **kwargs)

    def __repr__(self) -> str:
        return f"LayerPolicy({self.policy!r}, layer {self.index})"


def stock_checkpoint():
    """The function transformers installs for non-reentrant checkpointing (the `recompute` policy's own)."""
    return functools.partial(checkpoint, use_reentrant=False)


def install(layers: list[torch.nn.Module], policies: list[str], engine: OffloadEngine | None = None) -> None:
    """Give each decoder layer its policy. Checkpointing must already be on (the layers carry
    `_gradient_checkpointing_func`); `keep` and `lean` layers then skip it."""
    if len(layers) != len(policies):
        raise ValueError(f"{len(policies)} layer policies for {len(layers)} decoder layers")
    for i, (layer, policy) in enumerate(zip(layers, policies)):
        inner = layer.__dict__.get("_gradient_checkpointing_func")
        if inner is None or not getattr(layer, "gradient_checkpointing", False):
            raise ValueError(f"decoder layer {i} ({type(layer).__name__}) is not gradient-checkpointed: call "
                             f"model.gradient_checkpointing_enable() before installing memory policies")
        if isinstance(inner, LayerPolicy):
            inner = inner.inner
        layer.__dict__["_gradient_checkpointing_func"] = LayerPolicy(policy, i, inner, engine, layer)


def uninstall(layers: list[torch.nn.Module]) -> None:
    for layer in layers:
        f = layer.__dict__.get("_gradient_checkpointing_func")
        if isinstance(f, LayerPolicy):
            layer.__dict__["_gradient_checkpointing_func"] = f.inner


def installed(layers: list[torch.nn.Module]) -> list[str]:
    """Each layer's policy as installed ('recompute' where HF's own checkpoint function is in place)."""
    out = []
    for layer in layers:
        f = layer.__dict__.get("_gradient_checkpointing_func")
        while f is not None and not isinstance(f, LayerPolicy) and hasattr(f, "inner"):
            f = f.inner  # patch/graphs.py wraps whatever it finds
        out.append(f.policy if isinstance(f, LayerPolicy) else "recompute" if f is not None else "keep")
    return out


def expand_layers(spec: list[str], num_layers: int) -> list[str]:
    """memory.layers -> one policy per layer. Items are a policy, or `policy*N` for N layers in a row:
    [offload*30, keep*6] for 36 layers. Raises ValueError naming the fix."""
    out: list[str] = []
    for item in spec:
        name, _, count = str(item).partition("*")
        name = name.strip()
        if name not in POLICIES:
            raise ValueError(f"{item!r}: unknown layer policy {name!r}; use one of {', '.join(POLICIES)}, "
                             f"optionally with *N for N layers")
        if count and not count.strip().isdigit():
            raise ValueError(f"{item!r}: the count after * must be a whole number, e.g. offload*30")
        out += [name] * (int(count) if count else 1)
    if len(out) != num_layers:
        raise ValueError(f"memory.layers names {len(out)} layers but the model has {num_layers}; give one policy per "
                         f"decoder layer, e.g. [offload*{max(num_layers - 4, 0)}, keep*{min(num_layers, 4)}]")
    return out
