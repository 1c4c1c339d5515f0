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
its output: its forward is not a plain gather) and max_norm (renormalises the rows it reads). Token ids must lie
in [0, vocab): the data pipeline checks them before training (an id past the table would read past the buffer).
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from novatune.kernels.moe import gather_rows
from novatune.memory.pinned import pinned_empty


class HostEmbeddingRefused(ValueError):
    """The input embedding cannot live on the host: the message says why and what to set instead."""


def why_not(model: nn.Module, need_cuda: bool = True) -> str | None:
    """Why the model's input embedding cannot move to host memory, or None when it can."""
    emb = model.get_input_embeddings()
    if type(emb) is not nn.Embedding:
        return (f"the input embedding is {type(emb).__name__}, not a plain nn.Embedding (its forward does more "
                f"than gather rows)")
    if emb.weight.requires_grad:
        return "the input embedding trains (full fine-tuning, or LoRA with it in modules_to_save)"
    out = model.get_output_embeddings()
    if out is not None and getattr(out, "weight", None) is not None \
            and out.weight.untyped_storage().data_ptr() == emb.weight.untyped_storage().data_ptr():
        return "the input embedding is tied to lm_head, which the loss reads on the device"
    if emb.max_norm is not None:
        return "the input embedding has max_norm (it renormalises the rows it reads)"
    if need_cuda and emb.weight.device.type != "cuda":
        return f"the input embedding is on {emb.weight.device.type}, not a CUDA device"
    return None


def _gather_forward(emb: nn.Embedding, device: torch.device, host: torch.Tensor):
    def forward(input_ids: torch.Tensor) -> torch.Tensor:
        table = emb.weight
        out = torch.empty((input_ids.numel(), table.shape[1]), dtype=table.dtype, device=input_ids.device)
        return gather_rows(table, input_ids.reshape(-1), out).view(*input_ids.shape, table.shape[1])
    forward.host_embedding_device = device  # what `restore` moves the table back to
    forward.host_buffer = host  # the registered tensor itself: its registration ends when it is collected
    return forward


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
    emb.forward = _gather_forward(emb, weight.device, host)
    emb.weight = nn.Parameter(host, requires_grad=False)
    return weight.numel() * weight.element_size()


def is_on_host(model: nn.Module) -> bool:
    return hasattr(model.get_input_embeddings().__dict__.get("forward"), "host_embedding_device")


def restore(model: nn.Module) -> None:
    """The table back in device memory and the module's own forward (nothing when it is not on the host)."""
    emb = model.get_input_embeddings()
    forward = emb.__dict__.get("forward")
    if not hasattr(forward, "host_embedding_device"):
        return
    emb.weight = nn.Parameter(emb.weight.detach().to(forward.host_embedding_device), requires_grad=False)
    del emb.forward
