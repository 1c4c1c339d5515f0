"""The best peer stack (docs/BENCHMARKS.md): Liger-Kernel's fused ops + torch's varlen attention, wired into HF the way
the published anchor figures were measured, so `novatune bench` measures the same peer as the anchors.

* Liger: `apply_liger_kernel_to_<model_type>(rope, rms_norm, swiglu | geglu, fused_linear_cross_entropy)` (the
  keywords the family's function takes: Gemma's take geglu), called before the model is built (it swaps the
  modeling module's classes/forwards, process-wide: each bench stack runs in its own process for this reason).
* Attention: an `AttentionInterface` entry "peer_varlen" that finds document starts from position_ids on the
  device (one host sync per batch, cached across layers) and calls `torch.nn.attention.varlen.varlen_attn`, whose
  signature changed in every torch release (2.10 `is_causal`; 2.11 `window_size=(-1, 0)`; 2.12 `enable_gqa`).
  A layer's sliding window goes to `window_size` (per document, as the model computes it); attention logit
  soft-capping (Gemma 2) has no varlen_attn argument, so such a call raises PeerUnavailable instead of computing
  something else.
"""
from __future__ import annotations

import inspect

PEER_ATTENTION = "peer_varlen"


class PeerUnavailable(RuntimeError):
    """The peer stack cannot run here (Liger not installed, or torch without varlen_attn); the message says why."""


def liger_version() -> str | None:
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("liger-kernel")
    except PackageNotFoundError:
        return "unknown"


def apply_liger(model_type: str) -> str:
    """Liger's kernels for one HF family (before the model is built); returns the function name applied."""
    try:
        import liger_kernel.transformers as lk
    except ImportError as e:
        raise PeerUnavailable(f"liger_kernel is not importable ({e}); pip install liger-kernel") from None
    name = f"apply_liger_kernel_to_{model_type}"
    fn = getattr(lk, name, None)
    if fn is None:
        raise PeerUnavailable(f"liger_kernel has no {name} (model_type {model_type!r} is not supported by Liger)")
    wanted = dict(rope=True, rms_norm=True, swiglu=True, geglu=True, cross_entropy=False,
                  fused_linear_cross_entropy=True)
    params = inspect.signature(fn).parameters
    fn(**{k: v for k, v in wanted.items() if k in params})
    return name


class PackedMeta:
    """(cu_seqlens, max_seqlen) of a packed batch from its position_ids, computed once per batch (one host sync for
    the max) and reused by every layer, which all receive the same position_ids tensor (the recompute under
    checkpointing too: it replays the saved kwargs).

    Keyed on the tensor's identity, holding a reference to it. An address key (data_ptr, shape), used here until
    ba63b8f, went stale: the next micro-batch's position_ids is allocated where the freed previous one was, so
    the peer attended over another row's documents with no error (and none of the host syncs it should pay)."""

    def __init__(self):
        self.pos = self.cu = self.mx = None
        self.misses = 0

    def __call__(self, position_ids):
        import torch

        if self.pos is not position_ids:
            pos = position_ids.view(-1)
            starts = torch.nonzero(pos == 0).view(-1).to(torch.int32)
            cu = torch.cat([starts, torch.tensor([pos.numel()], device=pos.device, dtype=torch.int32)])
            self.pos, self.cu, self.mx = position_ids, cu, int((cu[1:] - cu[:-1]).max())
            self.misses += 1
        return self.cu, self.mx


def register_peer_varlen() -> str:
    """Register the peer's varlen attention with transformers' AttentionInterface; returns its name."""
    import torch
    from transformers import AttentionInterface

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as e:
        raise PeerUnavailable(f"torch {torch.__version__} has no torch.nn.attention.varlen ({e})") from None
    sig = inspect.signature(varlen_attn).parameters
    meta = PackedMeta()

    def varlen_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        if kw.get("softcap") is not None:
            raise PeerUnavailable(f"{type(module).__name__} soft-caps its attention logits ({kw['softcap']}); torch's "
                                  "varlen_attn cannot, so the peer's attention would compute something else")
        b, hq, s, d = query.shape  # (b, hq, s, d): HF's layout
        if kw.get("s_aux") is not None:
            raise PeerUnavailable("the peer's varlen attention has no attention sinks (s_aux): it would compute "
                                  "another function")
        cu, mx = meta(kw["position_ids"])
        window = kw.get("sliding_window")
        if window is not None and mx > window:
            raise PeerUnavailable(f"the peer's varlen attention has no sliding window ({window} tokens) and a "
                                  f"document of {mx} tokens exceeds it: it would compute another function")
        q = query.transpose(1, 2).reshape(b * s, hq, d)
        k = key.transpose(1, 2).reshape(b * s, key.shape[1], d)
        v = value.transpose(1, 2).reshape(b * s, value.shape[1], d)
        window = kw.get("sliding_window")
        if window is not None and "window_size" not in sig:
            raise PeerUnavailable(f"torch {torch.__version__}'s varlen_attn takes no window_size (sliding window)")
        extra = ({"window_size": (int(window) - 1, 0)} if window is not None else
                 {"is_causal": True} if "is_causal" in sig else {"window_size": (-1, 0)})
        if "enable_gqa" in sig:
            extra["enable_gqa"] = True
        elif key.shape[1] != hq:
            k = k.repeat_interleave(hq // key.shape[1], dim=1)
            v = v.repeat_interleave(hq // key.shape[1], dim=1)
        out = varlen_attn(q, k, v, cu, cu, mx, mx, scale=scaling, **extra)
        return out.view(b, s, hq, d), None

    AttentionInterface.register(PEER_ATTENTION, varlen_forward)
    return PEER_ATTENTION


def use_peer_attention(model) -> None:
    """Switch a built model to the registered peer attention (HF's official dynamic switch)."""
    model.set_attn_implementation(PEER_ATTENTION)
    if model.config._attn_implementation != PEER_ATTENTION:
        raise PeerUnavailable(f"{type(model).__name__} kept attention {model.config._attn_implementation!r}: it "
                              f"cannot switch its attention implementation dynamically")
