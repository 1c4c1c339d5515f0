"""What a family spec must declare before its forwards may replace a module: every attribute that changes the math.

`refusals(config, spec)` reads each MATH_ATTRIBUTE (patch/spec.py) from the config: a non-neutral value the spec
does not list in `honours` refuses every module of that attribute's kind, with the reason. `attention_refusal`
checks what lives on an attention module instead of the config (its own window, sinks, soft-capping, q/k norms,
non-causal, projections that do not fit the spec's names or a fused [q | k | v] width); `mlp_refusal` the MLP's
projections. The forwards then implement exactly the declared quirks: `layer_window` is the one sliding window they
apply, `qkv_split` the one split of a fused projection, `rotary_dim` the rotated width the report names.
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
    return _projection_refusal(module, spec)


def _projection_refusal(module: nn.Module, spec: FamilySpec) -> str | None:
    """Why the spec's projection names do not fit this attention module, or None."""
    cls, names = type(module).__name__, spec.attention
    wanted = (names.qkv_proj,) if names.qkv_proj is not None else (names.q_proj, names.k_proj, names.v_proj)
    missing = [n for n in (*wanted, names.o_proj) if getattr(module, n, None) is None]
    if missing:
        return f"{cls} has no {', '.join(missing)} (the {spec.name} spec's projections)"
    if names.qkv_proj is None:
        return None
    split = qkv_split(module)
    out = getattr(getattr(module, names.qkv_proj), "out_features", None)
    if split is None or out != sum(split):
        return (f"{cls}.{names.qkv_proj} has {out} outputs, not the q/k/v split {split} its config's head counts "
                f"give")
    return None


def qkv_split(module: nn.Module) -> tuple[int, int, int] | None:
    """(q, k, v) widths of a fused [q | k | v] projection, from the module's config head counts and head_dim."""
    config = getattr(module, "config", None)
    hq, hk = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if hq is None or hk is None:
        return None
    return hq * module.head_dim, hk * module.head_dim, hk * module.head_dim


def rotary_dim(config, head_dim: int) -> int | None:
    """The rotated features per head when partial rotary is on (the model's tables are this wide), else None."""
    factor = config_value(config, "partial_rotary_factor")
    if factor is None or float(factor) == 1.0:
        return None
    return int(head_dim * float(factor))


def mlp_refusal(module: nn.Module, spec: FamilySpec) -> str | None:
    """Why the spec's MLP projection names do not fit this module, or None."""
    names = spec.mlp
    wanted = (names.gate_up_proj,) if names.gate_up_proj is not None else (names.gate_proj, names.up_proj)
    missing = [n for n in (*wanted, names.down_proj) if getattr(module, n, None) is None]
    if missing:
        return f"{type(module).__name__} has no {', '.join(missing)} (the {spec.name} spec's projections)"
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
