"""What a family spec must declare before its forwards may replace a module: every attribute that changes the math.

`refusals(config, spec)` reads each MATH_ATTRIBUTE (patch/spec.py) from the config: a non-neutral value the spec
does not list in `honours` refuses every module of that attribute's kind, with the reason. `attention_refusal`
checks what lives on an attention module instead of the config (its own window, sinks, soft-capping, q/k norms,
non-causal).
The forwards then implement exactly the declared quirks: `layer_window` is the one sliding window they apply.
"""
from __future__ import annotations

import torch.nn as nn

from novatune.attention.backends import SINK_BACKENDS, SOFTCAP_BACKENDS
from novatune.patch.spec import MATH_ATTRIBUTES, FamilySpec, config_value, is_neutral

_QK_NORM_NAMES = ("q_norm", "k_norm", "q_layernorm", "k_layernorm")


def refusals(config, spec: FamilySpec) -> dict[str, str]:
    """module kind -> why this config's math is not what the spec's forwards compute (absent: no objection)."""
    out: dict[str, list[str]] = {}
    for attr in MATH_ATTRIBUTES:
        value = config_value(config, attr.name)
        if attr.name not in spec.honours and not is_neutral(attr, value):
            out.setdefault(attr.kind, []).append(f"{attr.name}={value!r} ({attr.what})")
    if spec.norm_offset and spec.norm_rounding != "output":
        # offset_rms_norm rounds once after the weight (Gemma's order); an offset with Llama's rounding is not it
        out.setdefault("rms_norm", []).append(f"norm offset {spec.norm_offset} with norm_rounding "
                                              f"{spec.norm_rounding!r} (only 'output' is implemented with an offset)")
    return {kind: f"config sets {', '.join(why)}, which the {spec.name} spec does not implement"
            for kind, why in out.items()}


def attention_refusal(module: nn.Module, spec: FamilySpec, backend: str | bool = "auto") -> str | None:
    """Why this attention module computes something the packed attention forward does not, or None.
    `backend`: the attention backend the patch binds (one that cannot add sinks refuses a module with sinks)."""
    cls = type(module).__name__
    if not hasattr(module, "head_dim") or not hasattr(module, "scaling"):
        return f"{cls} lacks head_dim/scaling attributes"
    if getattr(module, "is_causal", True) is False:
        return f"{cls} is not causal"
    sinks_name = spec.attention.sinks
    if getattr(module, "sinks", None) is not None and sinks_name != "sinks":
        return f"{cls} has attention sinks, which the {spec.name} spec does not implement"
    if sinks_name is not None and getattr(module, sinks_name, None) is not None and backend not in (
            "auto", *SINK_BACKENDS):
        return (f"{cls} has attention sinks, which attention backend {backend!r} cannot add; use attention='auto' "
                f"or one of {SINK_BACKENDS}")
    if spec.attention.q_norm is None and any(getattr(module, n, None) is not None for n in _QK_NORM_NAMES):
        return f"{cls} has q/k norms, which the {spec.name} spec does not declare"
    cap = getattr(module, spec.attention.softcap or "attn_logit_softcapping", None)
    # a spec that honours attn_logit_softcapping without naming the attribute: the stock forward ignores it (Gemma 3)
    if cap is not None and spec.attention.softcap is None and "attn_logit_softcapping" not in spec.honours:
        return f"{cls} soft-caps its attention logits ({cap}), which the {spec.name} spec does not declare"
    if cap is not None and spec.attention.softcap is not None and backend not in ("auto", *SOFTCAP_BACKENDS):
        return (f"{cls} soft-caps its attention logits, which attention backend {backend!r} cannot; use "
                f"attention='auto' or one of {SOFTCAP_BACKENDS}")
    own = getattr(module, "sliding_window", None)
    if own is not None and spec.attention.window_attr != "sliding_window":
        return f"{cls} has sliding_window={own}, which the {spec.name} spec does not declare"
    return None


def layer_window(module: nn.Module, config, spec: FamilySpec) -> int | None:
    """The sliding window (in keys, HF's definition) this attention layer applies, as the spec declares it."""
    names = spec.attention
    if names.window_attr is not None:
        window = getattr(module, names.window_attr, None)
    elif names.window_config is not None:
        window = getattr(config, names.window_config, None)
    else:
        window = None
    return int(window) if window is not None else None
