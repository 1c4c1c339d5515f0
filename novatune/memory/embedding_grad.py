"""A trained input embedding's gradient kept as rows between the micro-steps of an optimizer step.

Under gradient accumulation every parameter's `.grad` lives from the first micro-step's backward to the optimizer
step, so the later micro-steps' forwards run with all gradients in memory. The input embedding's is the size of
its table (vocab x hidden x 2 bytes: 0.58 GiB for Qwen3-30B-A3B's 151,936 x 2,048, 1.08 GiB for GPT-OSS's
201,088 x 2,880), yet a micro-batch of T tokens touches at most T of its rows. With `memory.embedding_grad: rows`
the table's backward keeps, per micro-step, only the rows it touched (T x hidden), and builds the dense gradient
once, in the step's last backward, when the activations are already freed:

  micro-step  backward: the per-token gradients summed per distinct id, by torch's own embedding backward run over
  (not last)            the ids renumbered 0..T-1 in sorted order (the same kernel over the same positions in the
                        same order as stock's, so the same sums and roundings); kept with the ids; no gradient
                        reaches autograd
  last        backward: zeros(vocab, hidden), each kept micro-step's rows added in micro-step order, then this
                        micro-step's; returned to autograd, which stores it as `.grad`

Stock accumulates the same way (`.grad` = g1, then g1 + g2 rounded, ...): every row a micro-step touches is one
add of that micro-step's rounded sum, and a row it does not touch adds nothing; here the untouched rows add
nothing and the touched ones get the same add, so `.grad` is bit for bit stock's. Nothing waits for the host:
the number of distinct ids is never read, the renumbering pads to T slots (spare slot s holds id s mod vocab and
a zero row: adding +0.0 changes nothing but the sign of a -0.0, and spreading the spare slots over rows keeps
their atomic adds from all landing on one row).

Which micro-step is the last is the trainer's to say (`micro_step(model, last)` around each forward; the flag is
read at the forward, so a backward runs as its forward was told). Outside that context every backward is a last
one: the module's gradient reaches autograd whole, as stock's does.

Refused with the reason (`why_not`): a frozen table (no gradient), a table tied to lm_head (the head's gradient is
dense anyway: nothing to save), a subclass of nn.Embedding or a module whose forward is already replaced, max_norm,
scale_grad_by_freq and sparse gradients (their backward is not the plain row sum), and hooks on the weight (they
would run once per step instead of once per micro-step). The trainer also refuses DDP and FSDP2, whose hooks
expect a gradient from every backward (train/config_checks.py). Under torch.compile the lookup stays eager
(torch.compiler.disable): its backward keeps state between calls.
"""
from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from novatune.memory.host_embedding import tied_to_head


class EmbeddingGradRefused(ValueError):
    """The input embedding's gradient cannot be kept as rows: the message says why and what to set instead."""


class RowGrads:
    """One table's state: the kept micro-steps' (ids, rows) and whether the next forward's backward defers."""

    def __init__(self, num_embeddings: int, padding_idx: int | None):
        self.num_embeddings, self.padding_idx = num_embeddings, padding_idx
        self.pending: list[tuple[Tensor, Tensor]] = []
        self.defer = False

    def pending_bytes(self) -> int:
        return sum(i.numel() * i.element_size() + r.numel() * r.element_size() for i, r in self.pending)


def why_not(model: nn.Module) -> str | None:
    """Why the model's input embedding cannot keep its gradient as rows, or None when it can."""
    if tied_to_head(model):
        return "the input embedding is tied to lm_head, whose gradient fills the whole table anyway"
    emb = model.get_input_embeddings()
    if type(emb) is not nn.Embedding:
        return f"{type(emb).__name__} is not a plain nn.Embedding (its forward may scale or transform the rows)"
    if "forward" in emb.__dict__:
        return "the input embedding's forward is already replaced on the module"
    if not emb.weight.requires_grad:
        return "the input embedding is frozen (it has no gradient)"
    if emb.max_norm is not None:
        return "the input embedding has max_norm (it renormalises the rows it reads)"
    for attr, what in (("scale_grad_by_freq", "scales its gradient by each id's count"),
                       ("sparse", "already returns a sparse gradient")):
        if getattr(emb, attr):
            return f"the input embedding has {attr} (it {what})"
    w = emb.weight
    if getattr(w, "_backward_hooks", None) or getattr(w, "_post_accumulate_grad_hooks", None):
        return "the input embedding's weight has gradient hooks (they would run once per step, not per micro-step)"
    return None


def distinct_rows(ids: Tensor, grad: Tensor, num_embeddings: int, padding_idx: int | None) -> tuple[Tensor, Tensor]:
    """(slot ids (T,), rows (T, hidden)): the gradient of an embedding lookup of `ids` with output gradient `grad`,
    one row per distinct id, as torch's embedding backward sums them; spare slot s holds id s mod vocab and a zero
    row. No host sync (the number of distinct ids is never read)."""
    flat = ids.reshape(-1)
    n = flat.numel()
    rows_in = grad.reshape(n, -1)
    if padding_idx is not None:  # the padding row gets no gradient (stock skips its tokens)
        rows_in = rows_in.masked_fill((flat == padding_idx).unsqueeze(1), 0)
    sorted_ids, order = torch.sort(flat, stable=True)
    starts = torch.ones(n, dtype=torch.bool, device=flat.device)
    starts[1:] = sorted_ids[1:] != sorted_ids[:-1]
    slot_sorted = torch.cumsum(starts, 0) - 1  # slot of each sorted position: ids renumbered 0.. in sorted order
    slot = torch.empty_like(slot_sorted).scatter_(0, order, slot_sorted)
    # spare slots (past the distinct ids) keep id s mod vocab with a zero row: spread over rows, not all on one
    spare = torch.arange(n, device=flat.device) % num_embeddings
    slot_ids = spare.to(flat.dtype).scatter_(0, slot_sorted, sorted_ids)
    # torch's own backward over the renumbered ids: slot s's row is the sum stock computes for id slot_ids[s]
    rows = torch.ops.aten.embedding_dense_backward(rows_in, slot, n, -1, False)
    return slot_ids, rows


def dense_grad(state: RowGrads, hidden: int, like: Tensor) -> Tensor:
    """The table's gradient: each kept micro-step's rows added in order into zeros; the kept rows are dropped."""
    grad = torch.zeros((state.num_embeddings, hidden), dtype=like.dtype, device=like.device)
    for slot_ids, rows in state.pending:
        grad.index_add_(0, slot_ids, rows)
    state.pending.clear()
    return grad


class _RowGradEmbedding(torch.autograd.Function):
    """nn.Embedding's lookup whose weight gradient follows RowGrads (module docstring)."""

    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor, state: RowGrads):
        ctx.save_for_backward(ids)
        ctx.state, ctx.defer = state, state.defer
        return F.embedding(ids, weight, state.padding_idx)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        if not ctx.needs_input_grad[1]:
            return None, None, None
        (ids,) = ctx.saved_tensors
        state = ctx.state
        state.pending.append(distinct_rows(ids, grad_out, state.num_embeddings, state.padding_idx))
        if ctx.defer:
            return None, None, None
        return None, dense_grad(state, grad_out.shape[-1], grad_out), None


@torch.compiler.disable  # eager under torch.compile: the backward keeps rows between calls
def _row_grad_forward(self: nn.Embedding, input_ids: Tensor) -> Tensor:
    return _RowGradEmbedding.apply(input_ids, self.weight, self._novatune_row_grads)


def install(model: nn.Module) -> int:
    """Keep the model's input-embedding gradient as rows between micro-steps. Returns the bytes the later
    micro-steps' forwards no longer hold (the table's gradient). Raises EmbeddingGradRefused naming the fix."""
    why = why_not(model)
    if why is not None:
        raise EmbeddingGradRefused(f"memory.embedding_grad: rows: {why}; set memory.embedding_grad: dense")
    emb = model.get_input_embeddings()
    emb._novatune_row_grads = RowGrads(emb.num_embeddings, emb.padding_idx)
    emb.forward = types.MethodType(_row_grad_forward, emb)
    return emb.weight.numel() * emb.weight.element_size()


def state_of(model: nn.Module) -> RowGrads | None:
    get = getattr(model, "get_input_embeddings", None)
    return getattr(get(), "_novatune_row_grads", None) if get is not None else None


def uninstall(model: nn.Module) -> None:
    """The module's own forward back; rows still kept are dropped (with the step they belonged to)."""
    emb = model.get_input_embeddings()
    if hasattr(emb, "_novatune_row_grads"):
        del emb.forward, emb._novatune_row_grads


@contextlib.contextmanager
def micro_step(model: nn.Module, last: bool):
    """Around one micro-step's forward: a step's micro-steps but the last keep their rows (module docstring)."""
    state = state_of(model)
    if state is None:
        yield
        return
    state.defer = not last
    try:
        yield
    finally:
        state.defer = False


def discard(model: nn.Module) -> None:
    """Drop the rows of an abandoned step (a step whose last backward never ran): what zero_grad is to `.grad`."""
    state = state_of(model)
    if state is not None:
        state.pending.clear()
