"""A Trainer's packed batches with their document offsets read on the host, before the batch moves to the GPU.

Packed attention needs each batch's document offsets on the host (FlashAttention's varlen launch takes the longest
document as a host integer). A Trainer moves every tensor of the batch to the GPU before the forward, so offsets
derived from the model call's `position_ids` (or `cu_seq_lens_q`) cost a device-to-host copy per micro-batch: the
host waits there for the previous micro-batch's backward to finish, and the forward then runs at the host's
queueing pace.

`novatune.patch(trainer)` wraps the trainer's data collator: a packed batch whose packing keys are CPU tensors
(TRL's `cu_seq_lens_q` / `position_ids`) gets `HostOffsets` (offsets as Python ints, with the batch's shape) under
HOST_OFFSETS_KWARG.
The Trainer's `_prepare_inputs` leaves a plain object where it is, the model call passes it down as a keyword, and
the decoder's pre-hook (patch/forwards.py) builds the batch's PackedBatch from it without touching the device.
The offsets come from the same CPU tensors the model then receives, read by the same function, so they are the ones
the device copy would give.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from novatune.attention.packed import PackedBatch
from novatune.patch.report import PatchReport

HOST_OFFSETS_KWARG = "novatune_host_offsets"


@dataclass(frozen=True)
class HostOffsets:
    """Document offsets (cumulative, over the flattened batch x seq_len tokens) of one collated batch."""

    cu_seqlens: tuple[int, ...]
    batch: int
    seq_len: int

    def packed(self, batch: int, seq_len: int, device: torch.device) -> PackedBatch:
        """The PackedBatch on `device` for a model call of (batch, seq_len) tokens; a batch of another shape means
        the offsets are not this call's (a caller changed the batch after collation): say so instead of guessing."""
        if (batch, seq_len) != (self.batch, self.seq_len):
            raise ValueError(f"{HOST_OFFSETS_KWARG}: offsets of a ({self.batch}, {self.seq_len}) batch given to a "
                             f"({batch}, {seq_len}) model call; pass the collated batch unchanged, or drop the key")
        return PackedBatch(torch.tensor(self.cu_seqlens, dtype=torch.int32), batch, seq_len, device)


class HostOffsetsCollator:
    """A data collator whose padding-free packed batches also carry their HostOffsets."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, *args, **kwargs):
        batch = self.inner(*args, **kwargs)
        if isinstance(batch, Mapping):
            offsets = host_offsets_of(batch)
            if offsets is not None:
                batch[HOST_OFFSETS_KWARG] = offsets
        return batch

    def __getattr__(self, name):  # the wrapped collator's attributes (TRL reads e.g. its pad token)
        if name == "inner":  # not set yet (unpickling in a data-loader worker): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


def host_offsets_of(batch: Mapping) -> HostOffsets | None:
    """HostOffsets of a collated batch whose packing keys (`cu_seq_lens_q` or `position_ids`, and the padding mask)
    are CPU tensors, read exactly as the model call would read them (PackedBatch.from_kwargs); None when they are
    not on the CPU or say nothing of packing (the model call then reads its offsets as before)."""
    ids = batch.get("input_ids")
    keys = {k: batch[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q") if k in batch}
    pos, mask = batch.get("position_ids"), batch.get("attention_mask")
    tensors = [t for t in (ids, pos, mask, *keys.values()) if isinstance(t, torch.Tensor)]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or any(t.device.type != "cpu" for t in tensors):
        return None
    packed = PackedBatch.from_kwargs(position_ids=pos, attention_mask=mask, batch=ids.shape[0], device="cpu", **keys)
    if packed is None:
        return None
    return HostOffsets(tuple(packed.cu_seqlens_cpu.tolist()), packed.batch, packed.seq_len)


def read_offsets_on_host(trainer, report: PatchReport) -> None:
    """Wrap `trainer.data_collator` (once); report.revert() puts the trainer's own back."""
    inner = getattr(trainer, "data_collator", None)
    if inner is None or isinstance(inner, HostOffsetsCollator):
        return
    trainer.data_collator = HostOffsetsCollator(inner)
    report.add("trainer.data_collator", "host_offsets", "replaced",
               "packed batches carry their document offsets from the collator's CPU position_ids (no device->host "
               "copy per micro-batch)")

    note = main_process_collation_note(trainer)
    if note:
        report.add("trainer.args.dataloader_num_workers", "note", "note", note)

    def undo():
        if isinstance(trainer.data_collator, HostOffsetsCollator):
            trainer.data_collator = trainer.data_collator.inner

    report._undo.append(undo)


def main_process_collation_note(trainer) -> str | None:
    """A Trainer with `dataloader_num_workers=0` collates each optimizer step's micro-batches in the main process,
    right after the step's host sync (its logging reads the loss): the GPU waits meanwhile. Measured on an H200 host
    with TRL's padding-free collator, 4 packed 4096-token rows per step: 9-15 ms per step in the main process,
    1.2-1.8 ms with 2 workers (bench/experiments/exp_trl_gap.py). novatune leaves the trainer's settings as they
    are and says so."""
    args = getattr(trainer, "args", None)
    if args is None or getattr(args, "dataloader_num_workers", None) != 0:
        return None
    return ("the trainer collates its batches in the main process (dataloader_num_workers=0) while the GPU waits "
            "at each optimizer step; dataloader_num_workers=2 collates them ahead in worker processes")
