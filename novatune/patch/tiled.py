"""The MLP tiled along the sequence, for long rows: the (tokens x intermediate) activations never exist whole.

An MLP acts on each token on its own, so MLP(x) is the concatenation of MLP(chunk) over row chunks of x. Each chunk
runs under torch.utils.checkpoint (non-reentrant): its forward keeps nothing but its (chunk x hidden) output, and
the backward recomputes that one chunk's gate / up / activation before back-propagating through it, so at any time
one chunk's intermediate activations are alive instead of the whole row's. Parameter gradients flow through
autograd as usual (one AccumulateGrad per parameter, hooks and gradient accumulation unchanged); checkpoint keeps
the RNG state, so an adapter's dropout draws the same mask in the recompute. Nesting inside a gradient-checkpointed
decoder layer is supported by non-reentrant checkpointing.

The value is the same function of the same numbers: each output row is computed from its own input row by the same
GEMMs. What can differ is summation order where rows are reduced: the weight gradients are sums over chunks of
per-chunk GEMMs (last-bit differences, like any change of GEMM shape).

Cost: one extra MLP forward per chunk in the backward (with layer checkpointing the MLP then runs its forward three
times), so tiling is for rows whose intermediate would not fit: `mode="auto"` tiles a batch whose
(tokens x intermediate) activation in the compute dtype exceeds AUTO_MIN_BYTES, in chunks of about CHUNK_BYTES.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

# auto tiles from 1 GiB per (tokens x intermediate) tensor: Qwen3-4B (intermediate 9728, bf16) from 55k tokens per
# micro-batch, Qwen3-8B (12288) from 44k; the MLP backward holds several such tensors at once
AUTO_MIN_BYTES = 1 << 30
# chunks of about 256 MiB per (chunk x intermediate) tensor: ~13.8k rows at Qwen3-4B, large enough that the
# chunk GEMMs run at the full matmul rate
CHUNK_BYTES = 256 << 20
MIN_CHUNK_ROWS = 1024
MODES = ("auto", True, False)


@dataclass(frozen=True)
class MLPTiling:
    """When and how a model's MLPs are tiled. mode True: every batch of more than one chunk; "auto": batches whose
    intermediate activation exceeds AUTO_MIN_BYTES; False: never."""

    mode: bool | str
    intermediate_size: int

    def chunk_rows(self, x: Tensor) -> int:
        return self.chunk_rows_for(x.element_size())

    def applies(self, x: Tensor) -> bool:
        return self.applies_to(x.numel() // x.shape[-1], x.element_size())

    def chunk_rows_for(self, element_size: int) -> int:
        per_row = self.intermediate_size * element_size
        rows = max(MIN_CHUNK_ROWS, CHUNK_BYTES // per_row, 1)
        return rows if rows < 256 else rows - rows % 256  # whole GEMM tiles

    def applies_to(self, rows: int, element_size: int) -> bool:
        """Whether a batch of `rows` tokens is tiled (the memory planner asks before any tensor exists)."""
        if self.mode is False or rows <= self.chunk_rows_for(element_size):
            return False
        return self.mode is True or rows * self.intermediate_size * element_size > AUTO_MIN_BYTES


def check_mode(mode) -> None:
    if mode not in MODES or (mode == 1 and mode is not True) or (mode == 0 and mode is not False):
        raise ValueError(f"tiled_mlp={mode!r}: choose 'auto', True or False")


def tiled_rows(fn: Callable[[Tensor], Tensor], x: Tensor, chunk_rows: int) -> Tensor:
    """fn(x) computed on row chunks of `chunk_rows` (x flattened to (rows, hidden)); fn must act on each row on its
    own. Under grad each chunk is checkpointed (module docstring); without grad the chunks just run in turn."""
    lead, hidden = x.shape[:-1], x.shape[-1]
    chunks = x.reshape(-1, hidden).split(chunk_rows)  # one SplitBackward: dx is one concatenation, not per-chunk pads
    if torch.is_grad_enabled():
        outs = [checkpoint(fn, c, use_reentrant=False, preserve_rng_state=True) for c in chunks]
    else:
        outs = [fn(c) for c in chunks]
    out = torch.cat(outs)
    return out.view(*lead, out.shape[-1])
