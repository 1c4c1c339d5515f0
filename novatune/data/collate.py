"""Rows of documents -> model inputs, with every document boundary computed here on the host.

For a micro-batch of B rows padded to the longest row T (or to `pad_to`, when given: one shape for every batch):

  input_ids     (B, T) int64   tokens; padding = pad id
  position_ids  (B, T) int64   restart at 0 for each document (and for the padding tail, its own segment)
  labels        (B, T) int64   token ids where trained, -100 elsewhere: on each document's first token (no loss
                               across documents), on masked prompt/user tokens, on padding
  cu_seqlens    (S+1,) int32   cumulative segment lengths over the flattened B*T tokens (CPU tensor)
  max_seqlen    int            longest segment
  num_target_tokens  int       labels that carry a loss after HF's shift (labels[:, 1:] != -100)
  num_tokens    int            real (non-padding) tokens
  attn_keys     float          sum over documents of L^2/2: average attended keys = attn_keys / num_tokens

Computing cu_seqlens/max_seqlen here means the model never syncs with the GPU to find document boundaries.
"""
from __future__ import annotations

import torch

from novatune.data.formats import Doc

IGNORE = -100


def collate(rows: list[list[Doc]], pad_id: int = 0, pad_to: int | None = None) -> dict:
    T = max(max(sum(len(d[0]) for d in row) for row in rows), pad_to or 0)
    ids, pos, lab, seg = [], [], [], []
    n_tokens = 0
    attn_keys = 0.0
    for row in rows:
        r_ids: list[int] = []
        r_pos: list[int] = []
        r_lab: list[int] = []
        for d_ids, d_mask in row:
            n = len(d_ids)
            r_ids += d_ids
            r_pos += range(n)
            r_lab += [IGNORE] + [t if m else IGNORE for t, m in zip(d_ids[1:], d_mask[1:])]
            seg.append(n)
            n_tokens += n
            attn_keys += n * n / 2
        pad = T - len(r_ids)
        if pad:
            r_ids += [pad_id] * pad
            r_pos += range(pad)
            r_lab += [IGNORE] * pad
            seg.append(pad)
        ids.append(r_ids)
        pos.append(r_pos)
        lab.append(r_lab)
    labels = torch.tensor(lab, dtype=torch.long)
    cu = torch.zeros(len(seg) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(seg, dtype=torch.int32), 0)
    return {
        "input_ids": torch.tensor(ids, dtype=torch.long),
        "position_ids": torch.tensor(pos, dtype=torch.long),
        "labels": labels,
        "cu_seqlens": cu,
        "max_seqlen": max(seg),
        "num_target_tokens": int((labels[:, 1:] != IGNORE).sum()),
        "num_tokens": n_tokens,
        "attn_keys": attn_keys,
    }


def model_inputs(batch: dict, device: torch.device | str, packed_kwargs: str | None = "host") -> dict:
    """The kwargs for the HF forward (labels included; the trainer adds num_items_in_batch and use_cache=False).

    packed_kwargs adds HF's FlashAttentionKwargs names `cu_seq_lens_q/k` + `max_length_q/k`: "host" keeps the
    cu_seqlens tensor on the CPU (novatune's patched attention builds its PackedBatch from it without a device
    sync), "device" copies it without blocking (stock flash_attention_2 reads it on the GPU), None leaves them out
    (stock sdpa/eager find the documents from position_ids)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        # Pinned sources: a copy from pageable memory makes CUDA synchronise the stream first, which would idle
        # the GPU once per micro-batch while the host queues the next forward.
        out = {k: (batch[k] if batch[k].is_pinned() else batch[k].pin_memory()).to(dev, non_blocking=True)
               for k in ("input_ids", "position_ids", "labels")}
    else:
        out = {k: batch[k].to(dev) for k in ("input_ids", "position_ids", "labels")}
    if packed_kwargs:
        cu = batch["cu_seqlens"] if packed_kwargs == "host" else batch["cu_seqlens"].to(dev, non_blocking=True)
        out["cu_seq_lens_q"] = out["cu_seq_lens_k"] = cu
        out["max_length_q"] = out["max_length_k"] = batch["max_seqlen"]
    return out
