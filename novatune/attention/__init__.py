"""Packed-sequence attention: `PackedBatch` (document metadata, built once per batch on the host and reused by every
layer) and `varlen_attention` (document-causal attention over packed rows, several backends, one recorded choice).

    from novatune.attention import PackedBatch, varlen_attention, last_choice

    packed = PackedBatch.from_position_ids(position_ids_cpu, device="cuda")   # once per batch
    out = varlen_attention(q, k, v, packed)      # every layer: q (tokens, hq, d), k/v (tokens, hk, d)
    last_choice()                                # which backend ran and why

See README.md in this folder.
"""
from novatune.attention.backends import (
    AUTO_ORDER,
    BACKENDS,
    SINK_BACKENDS,
    SOFTCAP_BACKENDS,
    AttentionChoice,
    BackendUnavailable,
    last_choice,
    varlen_attention,
    why_unavailable,
)
from novatune.attention.packed import PackedBatch
from novatune.attention.sinks import sink_attention

__all__ = ["PackedBatch", "varlen_attention", "last_choice", "AttentionChoice", "BackendUnavailable", "AUTO_ORDER",
           "BACKENDS", "SINK_BACKENDS", "SOFTCAP_BACKENDS", "why_unavailable", "sink_attention"]
