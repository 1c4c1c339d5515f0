"""The best peer stack (docs/BENCHMARKS.md): Liger-Kernel's fused ops + torch's varlen attention, wired into HF the way
the published anchor figures were measured, so `novatune bench` measures the same peer as the anchors.

* Liger: `apply_liger_kernel_to_<model_type>(rope, rms_norm, swiglu | geglu, fused_linear_cross_entropy)` (the
  keywords the family's function takes: Gemma's take geglu), called before the model is built (it swaps the
  modeling module's classes/forwards, process-wide: each bench stack runs in its own process for this reason).
* Attention: an `AttentionInterface` entry "peer_varlen" that finds document starts from position_ids on the
  device (one host sync per batch, cached across layers) and calls `torch.nn.attention.varlen.varlen_attn`, whose
  signature changed in every torch release (2.10 `is_causal`; 2.11 `window_size=(-1, 0)`; 2.12 `enable_gqa`).
  A layer's sliding window goes to `window_size` (per document, as the model computes it).
* A model whose attention varlen_attn cannot compute (`varlen_refusal`: logit soft-capping, Gemma 2; attention
  sinks, GPT-OSS; attention dropout) keeps Hugging Face's own attention, the one the stock stack runs, and the
  row's `applied` says so: Liger's kernels with HF's attention are what a Liger user trains such a model with.
  The varlen function itself raises PeerUnavailable on such a call (or on a window that binds, under a torch
  whose varlen_attn takes no window_size) instead of computing something else.
* Flex (the `hf-flex` stack): transformers' own flex_attention, which computes what varlen cannot (sinks through
  the log-sum-exp, soft-caps in its score_mod, windows in its block mask), with per-document block masks. Most
  families build their masks from position_ids and so detect packed rows themselves; some (GPT-OSS in transformers
  5.17-5.24) build them without, and their packed documents would attend to each other. `document_masks` builds
  the layer-type -> mask mapping from position_ids before the decoder runs, as the model's forward accepts it
  ready-made, so every family's flex row trains the per-document function.
"""
from __future__ import annotations

import functools
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
        if dropout:
            raise PeerUnavailable(f"{type(module).__name__} drops attention probabilities in training (p={dropout}); "
                                  "the peer's varlen_attn has no dropout")
        b, hq, s, d = query.shape  # (b, hq, s, d): HF's layout
        if kw.get("s_aux") is not None:
            raise PeerUnavailable("the peer's varlen attention has no attention sinks (s_aux): it would compute "
                                  "another function")
        cu, mx = meta(kw["position_ids"])
        # the layer's window as HF hands it to attention functions, else the attribute the layer keeps it in
        # (a release that stops passing the keyword must not turn local layers global)
        window = kw.get("sliding_window", getattr(module, "sliding_window", None))
        if window is not None and window >= mx:
            window = None  # no document reaches past the window: plain causal attention is the same function
        if window is not None and "window_size" not in sig:
            raise PeerUnavailable(f"torch {torch.__version__}'s varlen_attn takes no window_size and a document of "
                                  f"{mx} tokens exceeds the {window}-token sliding window: it would compute another "
                                  f"function")
        q = query.transpose(1, 2).reshape(b * s, hq, d)
        k = key.transpose(1, 2).reshape(b * s, key.shape[1], d)
        v = value.transpose(1, 2).reshape(b * s, value.shape[1], d)
        # FlashAttention's window: keys [i - left, i + right]; HF's sliding window of w keys is j > i - w
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


def varlen_refusal(config) -> str | None:
    """Why torch's varlen_attn cannot compute the attention of a model with this (transformers) config, or None."""
    cap = getattr(config, "attn_logit_softcapping", None)
    if cap is not None:
        return (f"{config.model_type} soft-caps its attention logits at {cap:g}; torch's varlen_attn has no "
                f"soft-cap")
    if getattr(config, "attention_dropout", 0.0):
        return (f"{config.model_type} drops attention probabilities (p={config.attention_dropout}); torch's "
                f"varlen_attn has no dropout")
    if config.model_type == "gpt_oss":
        return ("GPT-OSS adds learned per-head attention sinks to the softmax denominator; torch's varlen_attn has "
                "no sinks")
    return None


def use_peer_attention(model) -> str:
    """Switch a built model to the peer's varlen attention (HF's official dynamic switch) where varlen_attn computes
    the model's attention; otherwise keep the model's own HF attention. Returns what the row records."""
    why = varlen_refusal(model.config)
    if why is not None:
        return f"attention={model.config._attn_implementation} (Hugging Face's own: {why})"
    register_peer_varlen()
    model.set_attn_implementation(PEER_ATTENTION)
    if model.config._attn_implementation != PEER_ATTENTION:
        raise PeerUnavailable(f"{type(model).__name__} kept attention {model.config._attn_implementation!r}: it "
                              f"cannot switch its attention implementation dynamically")
    return f"attention={PEER_ATTENTION}"


# the mask builders of transformers.masking_utils, by the layer type a decoder layer declares
MASK_BUILDERS = {"full_attention": "create_causal_mask", "sliding_attention": "create_sliding_window_causal_mask"}


@functools.cache
def _parameters(fn) -> frozenset:
    return frozenset(inspect.signature(fn).parameters)  # once per builder, not at every forward


def _mask_for(builder, config, like, position_ids):
    """One layer type's mask through transformers' builder, whatever its keyword names in this release
    (inputs_embeds / input_embeds, cache / past_key_values, cache_position where it still exists)."""
    import torch

    params = _parameters(builder)
    kw = {"config": config, "attention_mask": None, "position_ids": position_ids,
          ("inputs_embeds" if "inputs_embeds" in params else "input_embeds"): like,
          ("cache" if "cache" in params else "past_key_values"): None}
    if "cache_position" in params:
        kw["cache_position"] = torch.arange(like.shape[1], device=like.device)
    return builder(**kw)


def document_masks(model):
    """Give the decoder (the base model under the causal LM) the mask of every layer type built from position_ids,
    so that packed documents never attend to each other whichever attention the config names. Acts only on a
    forward with position_ids and no attention_mask (a padded batch keeps the model's own masks). Returns the hook
    handle. A layer type without a builder here is refused: its mask would be guessed."""
    import torch
    from transformers import masking_utils

    config = model.config
    # a family without layer_types takes the sliding-window mask wherever its config sets a window (transformers'
    # own rule for Mistral, Mixtral, Phi-3, Qwen3-MoE), else the causal one
    default = "full_attention" if getattr(config, "sliding_window", None) is None else "sliding_attention"
    types = sorted(set(getattr(config, "layer_types", None) or [default]))
    unknown = [t for t in types if t not in MASK_BUILDERS]
    if unknown:
        raise PeerUnavailable(f"{config.model_type} has layers of type {unknown}: the peer builds masks for "
                              f"{sorted(MASK_BUILDERS)} only")
    builders = {t: getattr(masking_utils, MASK_BUILDERS[t]) for t in types}
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model

    def before_decoder(module, args, kwargs):
        pos = kwargs.get("position_ids")
        if pos is None or kwargs.get("attention_mask") is not None:
            return None
        embeds = kwargs.get("inputs_embeds")
        like = embeds if embeds is not None else torch.empty(pos.shape[0], pos.shape[1], 1, device=pos.device,
                                                             dtype=module.dtype)
        masks = {t: _mask_for(b, config, like, pos) for t, b in builders.items()}
        # one layer type: the mask itself (a ready 4D mask or BlockMask passes every family's mask code as it is);
        # several: the mapping that the families with mixed layers accept ready-made
        kwargs["attention_mask"] = masks if len(masks) > 1 else next(iter(masks.values()))
        return args, kwargs

    return decoder.register_forward_pre_hook(before_decoder, with_kwargs=True)


def use_flex_attention(model) -> str:
    """Switch a built model to transformers' flex_attention with per-document masks (`document_masks`); returns
    what the row records."""
    model.set_attn_implementation("flex_attention")
    if model.config._attn_implementation != "flex_attention":
        raise PeerUnavailable(f"{type(model).__name__} kept attention {model.config._attn_implementation!r}: it "
                              f"cannot switch to flex_attention")
    document_masks(model)
    return "attention=flex_attention (per-document block masks from position_ids)"
