"""Cross-entropy of the lm_head: F.cross_entropy(hidden @ weight.T + bias, labels).

`linear_cross_entropy_ref` computes the logits in fp32 (the oracle); `hf_linear_ce` is HF's lm_head + loss, the
logits in the input dtype and then `.float()` (the stock formula).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_cross_entropy_ref(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             ignore_index: int = -100, reduction: str = "mean", normalizer=None,
                             bias: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """fp32 oracle (differentiable). softcap: the loss of softcap * tanh(logits / softcap) (Gemma 2)."""
    H = hidden.shape[-1]
    logits = hidden.float().reshape(-1, H) @ weight.float().t()  # (T, V) fp32
    if bias is not None:
        logits = logits + bias.float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    y = labels.reshape(-1).to(logits.device)
    if normalizer is not None:
        return F.cross_entropy(logits, y, ignore_index=ignore_index, reduction="sum") / normalizer
    return F.cross_entropy(logits, y, ignore_index=ignore_index, reduction=reduction)


def hf_linear_ce(hidden, weight, labels, ignore_index: int = -100, reduction: str = "mean",
                 softcap: float | None = None):
    """HF's lm_head + ForCausalLMLoss with labels already shifted: logits in the input dtype, then .float().
    softcap: Gemma 2's final soft-capping as HF computes it, in the logits' dtype before the .float()."""
    logits = hidden @ weight.T
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=ignore_index,
                           reduction=reduction)


def token_stats_ref(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100):
    """The per-token statistics of `logits` (T, V) as TRL computes them from the full logits, in fp32:
    (nll = -log p(label), lse, entropy = -sum p log p, argmax (first index, int64)); 0, 0, 0, -1 on ignored
    tokens. Pass the logits the caller's loss sees (fp32 ones for the oracle, input-dtype ones for the stock)."""
    z = logits.float()
    y = labels.reshape(-1)
    keep = y != ignore_index
    logp = torch.log_softmax(z, dim=-1)
    nll = -logp.gather(1, y.clamp(min=0).unsqueeze(1)).squeeze(1)
    lse = torch.logsumexp(z, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    zero = torch.zeros_like(lse)
    return (torch.where(keep, nll, zero), torch.where(keep, lse, zero), torch.where(keep, entropy, zero),
            torch.where(keep, z.argmax(-1), torch.full_like(y, -1)))
