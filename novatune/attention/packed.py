"""PackedBatch: document boundaries of a batch of packed rows, computed once per batch on the host.

A packed batch is `batch` rows of `seq_len` tokens; each row is the concatenation of whole documents, and attention
must stay inside a document (causal within it, never across). Flattening the rows gives `tokens = batch * seq_len`
positions; documents are contiguous ranges of them, so everything the attention kernels need follows from

    cu_seqlens = [0, end_0, end_1, ..., tokens]      (int32, (num_docs + 1,), on the target device)

Invariants (checked by the constructors):
  * cu_seqlens[0] == 0, cu_seqlens[-1] == tokens, strictly increasing (no empty documents);
  * every row start r * seq_len is a document start (a document never spans two rows);
  * `max_seqlen` is a Python int, `lengths` a Python list: the kernels need them on the host, and reading them back
    from the GPU in every layer would be a device sync per layer (Unsloth/NVIDIA measured +43% forward from caching
    exactly this metadata).

Cost model: built ONCE per batch and reused by every layer. The host work happens here (one D2H copy of
position_ids or cu_seqlens if they live on the GPU - pass CPU tensors to avoid even that), followed by one
non-blocking H2D copy from pinned memory. Per-layer calls only read attributes. The extras that only one backend
needs (document id per token for FlexAttention, the BlockMask itself) are built lazily on first use and cached here,
so they too are built once per batch.

Padding is not packing: rows with an attention_mask containing zeros are rejected when they hold several documents
(see `from_kwargs`); left to the caller's stock attention otherwise.
"""
from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["PackedBatch"]

# FlexAttention's default sparse block (tokens per BlockMask tile).
FLEX_BLOCK = 128

_NOT_ON_HOST = ("this PackedBatch is a CUDA-graph static buffer (PackedBatch.graph_static): its document offsets are "
                "on the device only, so only the varlen backend can run on it")


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One H2D copy that does not block the host: pinned source + non_blocking. Dropping the pinned source early is
    safe: torch's caching host allocator records the copy's stream event and reuses the block only after it."""
    if device.type == "cpu":
        return host
    return host.to(device, non_blocking=True)


def _pin(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda" and torch.cuda.is_available():
        return host.pin_memory()
    return host


class PackedBatch:
    """Document metadata for a packed (batch, seq_len) batch. Build with a classmethod constructor, once per batch.

    Attributes (all fixed at construction):
      cu_seqlens      int32 (num_docs + 1,) on `device`: document offsets into the flattened batch*seq tokens
      cu_seqlens_cpu  the same offsets on the host (pinned when the device is CUDA)
      lengths         list[int], document lengths (host; the CPU backends loop over it without a device sync)
      max_seqlen      int, longest document
      num_docs, batch, seq_len, total_tokens (= batch * seq_len)
      one_doc_per_row True when every row is exactly one document (plain causal attention per row applies)
      device          where cu_seqlens (and the lazily built extras) live
    """

    def __init__(self, cu_seqlens_cpu: torch.Tensor, batch: int, seq_len: int, device: torch.device | str | None):
        cu = cu_seqlens_cpu.to(device="cpu", dtype=torch.int32).reshape(-1)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        tokens = batch * seq_len
        if cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != tokens:
            raise ValueError(f"cu_seqlens must start at 0 and end at batch*seq_len={tokens}; got {cu.tolist()[:8]}...")
        lengths = cu[1:] - cu[:-1]
        if bool((lengths <= 0).any()):
            raise ValueError("cu_seqlens must be strictly increasing (empty documents are not allowed)")
        if batch > 1:
            # A row start that is not a document start would let a document span two rows.
            row_starts = torch.arange(0, tokens, seq_len, dtype=torch.int32)
            if not bool(torch.isin(row_starts, cu).all()):
                raise ValueError("every row must start a new document (a cu_seqlens entry at each r * seq_len)")
        self.batch, self.seq_len, self.total_tokens = int(batch), int(seq_len), tokens
        # None on a graph_static batch only: its offsets live in a device buffer refilled before each replay
        host_lengths: list[int] = lengths.tolist()
        self.lengths: list[int] | None = host_lengths
        self.num_docs = len(host_lengths)
        self.max_seqlen = max(host_lengths)
        # Row starts are document starts, so "one document per row" is just a count.
        self.one_doc_per_row = self.num_docs == self.batch
        self.cu_seqlens_cpu: torch.Tensor | None = _pin(cu, self.device)
        self.cu_seqlens = _to_device(self.cu_seqlens_cpu, self.device)
        self._doc_ids: dict[int, torch.Tensor] = {}  # padded length -> device int32 doc id per token
        self._block_masks: dict[tuple[int, int | None], Any] = {}  # (block size, window) -> BlockMask
        self._padded: dict[int, torch.Tensor] = {}  # slots -> device int32 offsets padded with empty documents

    # ----------------------------------------------------------------------------------------------- constructors
    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor | Sequence, device: torch.device | str | None = None
                          ) -> PackedBatch:
        """From per-document position ids, shape (batch, seq_len) or (seq_len,) (= one row), tensor or nested list.

        A document starts at the start of each row and wherever the position is 0 OR does not increase by exactly 1
        over the previous token. So a row whose positions do not restart at 0 ([5, 6, 7, 0, 1]) is split at 0 and
        its first piece ([5, 6, 7], e.g. the tail of a document cut by the packer) is a document of its own - the
        robust reading, since attention can never reach the part of the document that lives in another row.

        Computed on the host: a CUDA position_ids is copied to the CPU once (the only device sync, once per batch;
        pass the collator's CPU tensor to avoid it). `device` defaults to position_ids' device (CPU for a list).
        """
        dev: torch.device | str | None
        if isinstance(position_ids, torch.Tensor):
            dev = position_ids.device if device is None else device
            pos = position_ids.detach().to("cpu")
        else:
            dev = device
            pos = torch.as_tensor(position_ids)
        if pos.dim() == 1:
            pos = pos.unsqueeze(0)
        if pos.dim() != 2 or pos.numel() == 0:
            raise ValueError(f"position_ids must have shape (batch, seq_len) or (seq_len,); got {tuple(pos.shape)} "
                             "(3-D multimodal rope position ids are not supported)")
        pos = pos.to(torch.int64)
        b, s = pos.shape
        starts = torch.nonzero(_document_starts(pos).reshape(-1)).reshape(-1)
        cu = torch.cat([starts, torch.tensor([b * s])]).to(torch.int32)
        return cls(cu, b, s, dev)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor | Sequence[int], max_seqlen: int | None = None,
                        batch: int = 1, device: torch.device | str | None = None) -> PackedBatch:
        """From cumulative document offsets, as carried by TRL / `DataCollatorWithFlattening` batches
        (`cu_seq_lens_q`, `max_length_q`; their rows are flattened into one, so batch defaults to 1).

        The offsets are read on the host (one D2H copy when they live on the GPU, once per batch). `max_seqlen`, when
        given, is checked against the offsets: a too-small value would make FlashAttention skip tokens silently.
        """
        dev: torch.device | str | None
        if isinstance(cu_seqlens, torch.Tensor):
            dev = cu_seqlens.device if device is None else device
            cu = cu_seqlens.detach().to("cpu")
        else:
            dev = device
            cu = torch.as_tensor(cu_seqlens)
        cu = cu.reshape(-1).to(torch.int64)
        if cu.numel() < 2:
            raise ValueError("cu_seqlens needs at least 2 entries")
        tokens = int(cu[-1])
        if batch < 1 or tokens % batch:
            raise ValueError(f"total tokens {tokens} is not divisible by batch={batch}")
        pb = cls(cu, batch, tokens // batch, dev)
        if max_seqlen is not None and int(max_seqlen) < pb.max_seqlen:
            raise ValueError(f"max_seqlen={int(max_seqlen)} is smaller than the longest document ({pb.max_seqlen})")
        return pb

    @classmethod
    def graph_static(cls, cu_seqlens: torch.Tensor, max_seqlen: int, batch: int, seq_len: int) -> PackedBatch:
        """A PackedBatch over a FIXED device buffer, for CUDA-graph capture (novatune/patch/graphs.py).

        `cu_seqlens` (int32, (slots + 1,), on the GPU) is refilled before each replay with one batch's offsets,
        its unused tail repeating the total (empty documents, which FlashAttention's varlen kernels skip);
        `max_seqlen` is an upper bound of every batch replayed through it. The host lists (`lengths`) are
        unknown here, so only the varlen backend can run on it (the graph code checks that it did)."""
        pb = cls.__new__(cls)
        pb.device = cu_seqlens.device
        pb.batch, pb.seq_len, pb.total_tokens = int(batch), int(seq_len), int(batch) * int(seq_len)
        pb.lengths, pb.num_docs, pb.max_seqlen = None, cu_seqlens.numel() - 1, int(max_seqlen)
        pb.one_doc_per_row = False  # several (possibly empty) slots per row: never plain per-row causal SDPA
        pb.cu_seqlens_cpu, pb.cu_seqlens = None, cu_seqlens
        pb._doc_ids, pb._block_masks, pb._padded = {}, {}, {}
        return pb

    @classmethod
    def from_kwargs(cls, position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                    batch: int = 1, device: torch.device | str | None = None, **hf_kwargs) -> PackedBatch | None:
        """From the keyword arguments of a Hugging Face model call; returns None when nothing says the rows are packed.

        Uses `cu_seq_lens_q` (+ `max_length_q`) when present (TRL's flattening collator computed them already; with
        `batch` rows of equal length - TRL flattens into one row, the default), else `position_ids`;
        `device` is where the model runs (a host-side cu_seq_lens_q then costs no device sync at all); with
        neither, returns None (nothing says the rows are packed: use stock attention).

        `attention_mask` is the 2-D (batch, seq_len) padding mask of the model call. A mask with zeros together with
        packed rows (several documents in a row, or cu_seq_lens) raises ValueError: padding inside packed rows is
        not supported. A mask with zeros and one document per row is plain padding: returns None (stock attention
        handles it); so is a padded batch whose padding has position ids of its own (TRL's collator with
        return_position_ids pads them with 0), when each row's unmasked tokens count up by one. Checking the mask
        reads one bool back from the device (once per batch); on that padded path the mask and position_ids are
        read to the host too (a batch that pads goes to stock attention anyway).
        """
        cu = hf_kwargs.get("cu_seq_lens_q")
        if cu is not None:
            cu_k = hf_kwargs.get("cu_seq_lens_k")
            if cu_k is not None and cu_k is not cu and not torch.equal(torch.as_tensor(cu_k).cpu(),
                                                                      torch.as_tensor(cu).cpu()):
                raise ValueError("cu_seq_lens_k differs from cu_seq_lens_q: only self-attention over packed rows is "
                                 "supported")
            packed = cls.from_cu_seqlens(cu, hf_kwargs.get("max_length_q"), batch=batch, device=device)
        elif position_ids is not None:
            packed = cls.from_position_ids(position_ids, device=device)
        else:
            return None
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
                raise TypeError("attention_mask must be the 2-D (batch, seq_len) padding mask of the model call; "
                                f"got {type(attention_mask).__name__} "
                                f"{tuple(getattr(attention_mask, 'shape', ()))}")
            if bool((attention_mask == 0).any()):
                if cu is None and (packed.one_doc_per_row or _one_doc_per_row_where_unmasked(position_ids,
                                                                                            attention_mask)):
                    return None
                raise ValueError("attention_mask has padding (zeros) in packed rows: padding inside packed rows is "
                                 "not supported - pack without padding (position_ids / cu_seq_lens only) or drop "
                                 "the packing")
        return packed

    # ----------------------------------------------------------------------------------------------- host layout
    def host_lengths(self) -> list[int]:
        """The document lengths as a host list; ValueError on a graph_static batch, which has none."""
        if self.lengths is None:
            raise ValueError(_NOT_ON_HOST)
        return self.lengths

    def host_offsets(self) -> torch.Tensor:
        """cu_seqlens on the host; ValueError on a graph_static batch, which has them on the device only."""
        if self.cu_seqlens_cpu is None:
            raise ValueError(_NOT_ON_HOST)
        return self.cu_seqlens_cpu

    # ----------------------------------------------------------------------------------------------- lazy extras
    def doc_ids(self, pad_to: int | None = None) -> torch.Tensor:
        """int32 document index of each flattened token, on `device`, built once and cached.

        With `pad_to` the tensor is padded to that length with the id `num_docs` (a document of its own), so a
        FlexAttention mask_mod may index the padded tail of the last block without going out of bounds."""
        n = max(pad_to or 0, self.total_tokens)
        if n not in self._doc_ids:
            ids = torch.repeat_interleave(torch.arange(self.num_docs, dtype=torch.int32),
                                          torch.tensor(self.host_lengths(), dtype=torch.int64))
            if n > self.total_tokens:
                ids = torch.cat([ids, torch.full((n - self.total_tokens,), self.num_docs, dtype=torch.int32)])
            self._doc_ids[n] = _to_device(_pin(ids, self.device), self.device)
        return self._doc_ids[n]

    def block_mask(self, block_size: int = FLEX_BLOCK, window: int | None = None):
        """FlexAttention BlockMask, document-causal over the flattened tokens (B = H = 1), built once and cached.

        Built directly from the document layout rather than by `create_block_mask`, which would evaluate the mask on
        all tokens^2 pairs (a 256 MiB bool tensor and seconds of work at 16k tokens). Because documents are
        contiguous and ordered, a tile (query block i, key block j <= i) is
          * non-empty iff j == i or the last document of block j is the first document of block i;
          * full (mask_mod can be skipped) iff j < i, block i is complete, and blocks j..i hold one single document.
        The mask_mod is still attached for the partial tiles. Tested equal to create_block_mask's result.

        With a sliding `window` (query i sees keys i - window + 1 .. i of its document) the mask comes from
        create_block_mask on that mask_mod (tokens^2 evaluation, once per batch: windowed models only).
        """
        key = (block_size, window)
        if key not in self._block_masks:
            self._block_masks[key] = (_doc_causal_block_mask(self, block_size) if window is None
                                      else _doc_local_block_mask(self, block_size, window))
        return self._block_masks[key]

    def padded_offsets(self, slots: int) -> torch.Tensor:
        """cu_seqlens as `slots` documents, on `device`, built once per slot count and cached: the real offsets
        followed by repeats of the total (empty documents), the layout graph_static uses. Kernels whose compiled
        plan is keyed on the document count (cuDNN's) then see one count for many batches."""
        if slots < self.num_docs:
            raise ValueError(f"{slots} slots cannot hold {self.num_docs} documents")
        if slots not in self._padded:
            cu = self.host_offsets()
            tail = torch.full((slots - self.num_docs,), self.total_tokens, dtype=torch.int32)
            self._padded[slots] = _to_device(_pin(torch.cat([cu.to(torch.int32), tail]), self.device), self.device)
        return self._padded[slots]

    def __repr__(self) -> str:
        return (f"PackedBatch(batch={self.batch}, seq_len={self.seq_len}, num_docs={self.num_docs}, "
                f"max_seqlen={self.max_seqlen}, one_doc_per_row={self.one_doc_per_row}, device={self.device})")


def _doc_causal_block_mask(pb: PackedBatch, block: int):
    from torch.nn.attention.flex_attention import BlockMask

    T = pb.total_tokens
    nb = -(-T // block)
    # first / last document id of every block, from the host offsets (no device work, no sync)
    cu = pb.host_offsets().to(torch.int64)
    first_tok = torch.arange(nb, dtype=torch.int64) * block
    last_tok = torch.clamp(first_tok + block, max=T) - 1
    lo = torch.searchsorted(cu, first_tok, right=True) - 1  # (nb,)
    hi = torch.searchsorted(cu, last_tok, right=True) - 1
    qi = torch.arange(nb).view(nb, 1)
    kj = torch.arange(nb).view(1, nb)
    below = kj < qi
    any_ = (kj == qi) | (below & (hi.view(1, nb) == lo.view(nb, 1)))
    complete = (first_tok + block <= T).view(nb, 1)
    full = below & complete & (lo.view(1, nb) == hi.view(nb, 1))
    partial = any_ & ~full

    dev = pb.device

    def ordered(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # the layout BlockMask expects, on the model's device: per query block, the count and the ascending indices
        # of the set kv blocks
        num = m.sum(-1, dtype=torch.int32).view(1, 1, nb)
        idx = torch.argsort(m.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32).view(1, 1, nb, nb)
        return _to_device(_pin(num, dev), dev), _to_device(_pin(idx, dev), dev)

    kv_num, kv_idx = ordered(partial)
    full_num, full_idx = ordered(full)
    doc = pb.doc_ids(pad_to=nb * block)

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    extra: dict[str, Any] = {}
    if "seq_lengths" in inspect.signature(BlockMask.from_kv_blocks).parameters:
        extra["seq_lengths"] = (T, T)  # else the lengths are read as nb * block: wrong when T % block != 0
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod, **extra)


def _doc_local_block_mask(pb: PackedBatch, block: int, window: int):
    from torch.nn.attention.flex_attention import create_block_mask

    T = pb.total_tokens
    doc = pb.doc_ids(pad_to=-(-T // block) * block)

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    return create_block_mask(mask_mod, 1, 1, T, T, device=pb.device, BLOCK_SIZE=block)


def _document_starts(pos: torch.Tensor) -> torch.Tensor:
    """(b, s) bool: where a document starts in rows of position ids (each row's first token, a 0, or a position that
    does not follow the one before)."""
    start = torch.ones(pos.shape, dtype=torch.bool)
    start[:, 1:] = (pos[:, 1:] == 0) | (pos[:, 1:] != pos[:, :-1] + 1)
    return start


def _one_doc_per_row_where_unmasked(position_ids, attention_mask: torch.Tensor) -> bool:
    """Whether each row's unmasked tokens are one document (no document starts between two unmasked tokens): a
    padded batch whose padding has position ids of its own, not packed rows. Read on the host, on the padded path
    only."""
    if position_ids is None:
        return False
    pos = torch.as_tensor(position_ids).detach().cpu().to(torch.int64).expand(attention_mask.shape)
    keep = attention_mask.detach().cpu() != 0
    return not bool((_document_starts(pos)[:, 1:] & keep[:, 1:] & keep[:, :-1]).any())
