"""Planted faults for `novatune validate` tests: each breaks novatune's patched model the way a real bug would.

They monkeypatch the names novatune.patch.forwards (and patch.loss) calls at run time, so they apply to every model
patched while the monkeypatch is active (and to none after the test)."""
from __future__ import annotations

import torch

from novatune.attention.packed import PackedBatch
from novatune.patch import forwards
from novatune.patch import loss as loss_forward


def wrong_eps(monkeypatch, eps: float = 1e-5) -> None:
    """Every fused RMSNorm uses `eps` instead of the model's (Qwen3: 1e-6) - e.g. Llama's default hard-coded."""
    real = forwards.rms_norm
    monkeypatch.setattr(forwards, "rms_norm", lambda x, weight, _eps: real(x, weight, eps))


def cross_documents(monkeypatch) -> None:
    """Packed attention ignores the document boundaries: plain causal attention over each whole row."""
    real = forwards.varlen_attention

    def attention(q, k, v, packed, **kw):
        rows = torch.arange(0, (packed.batch + 1) * packed.seq_len, packed.seq_len, dtype=torch.int32)
        whole = PackedBatch.from_cu_seqlens(rows, packed.seq_len, batch=packed.batch, device=packed.device)
        return real(q, k, v, whole, **kw)

    monkeypatch.setattr(forwards, "varlen_attention", attention)


def per_microbatch_loss(monkeypatch) -> None:
    """The fused loss divides by the micro-batch's own target-token count instead of num_items_in_batch."""
    real = loss_forward.linear_cross_entropy

    def loss(hidden, weight, labels, reduction="mean", normalizer=None, **kw):
        return real(hidden, weight, labels, reduction="mean", normalizer=None, **kw)

    monkeypatch.setattr(loss_forward, "linear_cross_entropy", loss)


FAULTS = {"wrong_eps": wrong_eps, "cross_documents": cross_documents, "per_microbatch_loss": per_microbatch_loss}
