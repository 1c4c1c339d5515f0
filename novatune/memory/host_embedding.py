"""Frozen input embeddings in host memory: the token-embedding table of a LoRA/QLoRA run (frozen, untied) lives in
page-locked host memory mapped into the GPU's address space, and the GPU gathers each micro-batch's rows straight
from it (novatune.kernels.moe.gather_rows, one row of `hidden` values per token read over the host link). The
table never occupies device memory: vocab x hidden x 2 bytes (Qwen3's 151,936 x 2,048 bf16: 0.58 GiB; x 4,096:
1.16 GiB), at the cost of reading tokens x hidden x 2 bytes over the link per forward (16 MiB for 4,096 tokens of
2,048; ~0.5 ms at 30 GB/s). No host sync: the token ids stay on the device and the kernel reads host memory
through its device address.

The module stays where it is (its hooks, e.g. PEFT's enable_input_require_grads, keep running); its weight
becomes a frozen parameter on the host (state dicts and exports read it as before) and its forward the gather.
`restore` puts the weight back on the device (before an export or a merge, as the weight streamer does).

Refused with the reason: a trainable table (its gradient would need the device), a table tied to lm_head (the
loss reads it on the device every micro-batch), a subclass of nn.Embedding (Gemma's scaled embedding multiplies
its output: its forward is not a plain gather) and max_norm (renormalises the rows it reads). The gather does not
check the ids: an id past the table would read past the buffer, where nn.Embedding stops with a device assert. The
run builder places the table only after checking that the model's vocab_size, which the data pipeline checks every
token id against, and the padding id fit the table (train/session.py).

While the table is on the host, HF's `model.device` (its first parameter's) says cpu: code that needs the device
the model computes on asks `compute_device(model)`.
"""
from __future__ import annotations

import functools
import types

import torch
from torch import nn

from novatune.kernels.moe import gather_rows
from novatune.memory.pinned import pinned_empty


class HostEmbeddingRefused(ValueError):
    """The input embedding cannot live on the host: the message says why and what to set instead."""


def tied_to_head(model: nn.Module) -> bool:
    """Whether the input embedding shares its table with lm_head (declared in the config, or one tensor)."""
    emb = model.get_input_embeddings()
    head_weight = getattr(model.get_output_embeddings(), "weight", None)
    shared = head_weight is not None and (head_weight is emb.weight or (
        not emb.weight.is_meta and head_weight.untyped_storage().data_ptr() == emb.weight.untyped_storage().data_ptr()))
    return bool(getattr(model.config, "tie_word_embeddings", False)) or shared


def lookup_refusal(model: nn.Module) -> str | None:
    """Why the input embedding cannot be replaced by a plain row lookup kept apart from lm_head (here: on the host;
    train/qlora.py: in NF4), or None: a table tied to lm_head, or a subclass of nn.Embedding (Gemma's scaled one
    multiplies its rows: its forward is more than a gather)."""
    if tied_to_head(model):
        return "tied to lm_head, which reads the same table"
    emb = model.get_input_embeddings()
    if type(emb) is not nn.Embedding:
        return f"{type(emb).__name__} is not a plain nn.Embedding (its forward may scale or transform the rows)"
    return None


def why_not(model: nn.Module, need_cuda: bool = True) -> str | None:
    """Why the model's input embedding cannot move to host memory, or None when it can."""
    emb = model.get_input_embeddings()
    why = lookup_refusal(model)
    if why is not None:
        return f"the input embedding: {why}"
    if emb.weight.requires_grad:
        return "the input embedding trains (full fine-tuning, or LoRA with it in modules_to_save)"
    if emb.max_norm is not None:
        return "the input embedding has max_norm (it renormalises the rows it reads)"
    if need_cuda and emb.weight.device.type != "cuda":
        return f"the input embedding is on {emb.weight.device.type}, not a CUDA device"
    return None


def _gather_forward(self: nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
    """The module's forward while its table is on the host: the GPU gathers the rows (module docstring)."""
    table = self.weight
    out = torch.empty((input_ids.numel(), table.shape[1]), dtype=table.dtype, device=input_ids.device)
    return gather_rows(table, input_ids.reshape(-1), out).view(*input_ids.shape, table.shape[1])


def place_on_host(model: nn.Module, pin=None) -> int:
    """Move the model's input embedding table to mapped page-locked host memory and make its forward gather from
    there. Returns the device bytes freed. `pin(shape, dtype)`: the host buffer (tests on the CPU pass plain host
    tensors; then the table need not start on a CUDA device)."""
    why = why_not(model, need_cuda=pin is None)
    if why is not None:
        raise HostEmbeddingRefused(f"memory.embeddings_on_host: {why}; set memory.embeddings_on_host: false")
    emb = model.get_input_embeddings()
    weight = emb.weight
    host = (pin or functools.partial(pinned_empty, mapped=True))(weight.shape, weight.dtype)
    host.copy_(weight.detach())
    # the registered tensor itself stays on the module (its registration ends when it is collected), with the
    # device `restore` moves the table back to; a bound method, so a deep copy of the module gathers its own table
    emb._novatune_host_table = (host, weight.device)
    emb.forward = types.MethodType(_gather_forward, emb)
    emb.weight = nn.Parameter(host, requires_grad=False)
    return weight.numel() * weight.element_size()


def is_on_host(model: nn.Module) -> bool:
    return hasattr(model.get_input_embeddings(), "_novatune_host_table")


def restore(model: nn.Module) -> None:
    """The table back in device memory and the module's own forward (nothing when it is not on the host)."""
    emb = model.get_input_embeddings()
    if not hasattr(emb, "_novatune_host_table"):
        return
    _, device = emb._novatune_host_table
    emb.weight = nn.Parameter(emb.weight.detach().to(device), requires_grad=False)
    del emb.forward, emb._novatune_host_table


def compute_device(model: nn.Module) -> torch.device:
    """Where the model computes: the device of its parameters outside host memory (a host-resident embedding
    table is the first parameter of most causal LMs, so `next(model.parameters()).device` and HF's `model.device`
    say cpu), or the CPU when every parameter is there."""
    return next((p.device for p in model.parameters() if p.device.type != "cpu"), torch.device("cpu"))
