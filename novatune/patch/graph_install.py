"""Where novatune's CUDA graphs of the decoder layers (novatune/patch/graphs.py) attach to a model, and where what
wraps the model tells them to stay off: the patch's entry point and the runner's refusal switch.
"""
from __future__ import annotations

import torch
from torch import nn

from novatune.patch.graphs import LayerGraphRunner


def keep_layers_eager(model: nn.Module, reason: str) -> int:
    """The decoder layers of a patched `model` never replayed from CUDA graphs, for `reason` (what wraps the model
    knows, the layers' own check cannot see: FSDP2 over one rank hooks only the root, and re-allocates the layers'
    gathered parameters each step). Returns how many graph runners were told."""
    told = 0
    for module in model.modules():
        runner = getattr(getattr(module, "_novatune_state", None), "graphs", None)
        if isinstance(runner, LayerGraphRunner):
            runner.refused = reason
            told += 1
    return told


def install(model: nn.Module, stack: nn.Module, state, report, requested) -> None:
    """Attach a LayerGraphRunner to the decoder stack (novatune.patch's cuda_graphs option): "auto" captures the
    forward and the recompute+backward of LoRA/QLoRA layers; True both for any layers; "forward" the forward only."""
    layers = list(getattr(stack, "layers", []) or [])
    why = None
    if not torch.cuda.is_available():
        why = "CUDA is not available"
    elif not layers or not all(hasattr(layer, "gradient_checkpointing") for layer in layers):
        why = "the decoder layers are not HF GradientCheckpointingLayers"
    elif not state.all_attention_patched:
        why = "not every attention layer is novatune's (the graphs need the packed varlen path)"
    elif requested == "auto" and not report.replaced("lora"):
        why = "no fused LoRA layers (full fine-tuning: the forward-only graphs measured slower, cuda_graphs='forward')"
    if why is not None:
        if requested in (True, "forward"):
            raise ValueError(f"cuda_graphs={requested!r} cannot apply: {why}")
        report.add("", "cuda_graphs", "note", f"CUDA graphs not used: {why}")  # auto: nothing was asked for
        return
    forward_only = requested == "forward"
    runner = LayerGraphRunner(layers, state, full_training=requested != "auto", forward_only=forward_only)
    state.graphs = runner
    what = ("its no-grad forward from a CUDA graph, its recompute+backward eagerly" if forward_only else
            "its forward and its recompute+backward from CUDA graphs")
    report.add("", "cuda_graphs", "replaced",
               f"each gradient-checkpointed decoder layer ({len(layers)}) replays {what} (captured after one "
               "eager batch; one set per (documents, longest document) power-of-two bucket)")

    def undo():
        runner.uninstall()
        state.graphs = None

    report._undo.append(undo)
