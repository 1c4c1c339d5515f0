"""Named architectures for random-init runs (no weights are downloaded; speed does not depend on weight values).

`model.arch: qwen3-4b` builds the Qwen3-4B-Instruct-2507 architecture with random weights; `model.arch_overrides`
changes any config field (`num_hidden_layers: 2`). `vocab_size: auto` (the tiny demo archs) takes the
tokenizer's size.
"""
from __future__ import annotations

import difflib
import inspect
from typing import Any

# Phi-4-mini-instruct's LongRoPE long factors (one per rotated frequency: 96 / 2), from its config.json
PHI4_MINI_LONG_FACTOR = [
    1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649, 2.446418898,
    2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845, 5.351743533, 5.984965424,
    6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158, 11.70738129, 13.09260651, 14.64173252,
    16.37415215, 18.31155283, 20.47818807, 22.90118105, 25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6,
    32.61, 32.64, 32.66, 32.7, 32.71, 32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77]

ARCHS: dict[str, dict[str, Any]] = {
    # docs/BENCHMARKS.md's headline model: Qwen/Qwen3-4B-Instruct-2507
    "qwen3-4b": dict(model_type="qwen3", hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=5e6, max_position_embeddings=262144),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960),
    # the embedded demo: 3.3M parameters (501-token vocab), 60 steps train in ~25 s on two CPU cores
    "qwen3-tiny": dict(model_type="qwen3", hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size="auto",
                       tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=2048),
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                         tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=5e5, max_position_embeddings=131072,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)),
    # Qwen/Qwen3-30B-A3B: 48 layers, every one sparse (128 experts, top-8, expert intermediate 768); the MoE bench
    # config cuts it to 8 layers with model.arch_overrides
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, vocab_size=151936, tie_word_embeddings=False, rms_norm_eps=1e-6,
                          rope_theta=1e6, max_position_embeddings=40960),
    # openai/gpt-oss-20b: 24 layers alternating sliding-window (128) and full attention (GptOssConfig derives
    # layer_types from the layer count, so a cut keeps the alternation), 32 experts top-4 (expert intermediate
    # 2880, clamped SwiGLU at limit 7), 64 query / 8 KV heads of 64, attention biases and sinks, YaRN rotary (factor
    # 32 over 4096 positions); its router loss coefficient is 0.9 but output_router_logits is off (not added)
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                        num_local_experts=32, num_experts_per_tok=4, num_attention_heads=64, num_key_value_heads=8,
                        head_dim=64, sliding_window=128, vocab_size=201088, tie_word_embeddings=False,
                        rms_norm_eps=1e-5, attention_bias=True, swiglu_limit=7.0, router_aux_loss_coef=0.9,
                        output_router_logits=False, max_position_embeddings=131072, rope_theta=150000.0,
                        rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                          truncate=False, original_max_position_embeddings=4096),
                        pad_token_id=199999, eos_token_id=200002),
    # google/gemma-2-2b: GeGLU, (1 + w) norms, pre/post norms, sliding window 4096 on every other layer, attention
    # logits soft-capped at 50 and final logits at 30, query scale 256^-0.5, a 256k vocabulary (tied)
    "gemma-2-2b": dict(model_type="gemma2", hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=256000,
                       tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=8192,
                       hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=4096,
                       attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    # google/gemma-3-4b-pt's text model (Gemma3ForCausalLM): 5 sliding (window 1024, rotary base 1e4) : 1 global
    # (base 1e6, linear scaling x8) layers, q/k norms, a 262k vocabulary (tied), no soft-capping
    "gemma-3-4b": dict(model_type="gemma3_text", hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=262208,
                       tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=131072,
                       hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=1024,
                       final_logit_softcapping=None, attn_logit_softcapping=None,
                       rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                        "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                           "rope_theta": 1e6}}),
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=32768),
    # microsoft/Phi-4-mini-instruct: fused qkv / gate_up projections, 24 query / 8 KV heads of 128, partial rotary
    # 0.75 (96 of 128 features rotate), LongRoPE (short factors below 4096 positions, long ones past), a window
    # wider than any row, 200k vocabulary, tied embeddings
    "phi-4-mini": dict(model_type="phi3", hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                       num_attention_heads=24, num_key_value_heads=8, vocab_size=200064, tie_word_embeddings=True,
                       rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=131072,
                       original_max_position_embeddings=4096, sliding_window=262144, resid_pdrop=0.0,
                       embd_pdrop=0.0, attention_dropout=0.0, pad_token_id=199999, bos_token_id=199999,
                       eos_token_id=200020,
                       rope_scaling=dict(rope_type="longrope", partial_rotary_factor=0.75,
                                         original_max_position_embeddings=4096,
                                         short_factor=[1.0] * 48, long_factor=PHI4_MINI_LONG_FACTOR)),
    # allenai/OLMo-2-1124-7B: post-norm layers, q/k norms over the whole projection, 32 heads (no GQA)
    "olmo-2-7b": dict(model_type="olmo2", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, vocab_size=100352, tie_word_embeddings=False,
                      rms_norm_eps=1e-6, rope_theta=5e5, max_position_embeddings=4096, attention_bias=False,
                      pad_token_id=100277, eos_token_id=100257, bos_token_id=None),
}


def arch_config(name: str, overrides: dict | None = None, vocab_size: int | None = None):
    """A transformers config for a named architecture (ValueError naming the choices if unknown)."""
    from transformers import AutoConfig

    if name not in ARCHS:
        raise ValueError(f"unknown architecture {name!r}; choose one of {', '.join(ARCHS)}")
    spec = {**ARCHS[name], **(overrides or {})}
    model_type = spec.pop("model_type")
    if spec.get("vocab_size") in ("auto", None):
        if vocab_size is None:
            raise ValueError(f"architecture {name!r} takes its vocab_size from the tokenizer; set model.tokenizer "
                             f"or model.arch_overrides.vocab_size")
        spec["vocab_size"] = vocab_size
    cls = type(AutoConfig.for_model(model_type))
    params = inspect.signature(cls.__init__).parameters
    # transformers 5 keeps RoPE settings in `rope_parameters`; older 4.x configs take rope_theta/rope_scaling
    theta, scaling = spec.pop("rope_theta", None), spec.pop("rope_scaling", None)
    if "rope_parameters" in params:
        rope = dict(scaling or {"rope_type": "default"})
        if theta is not None:
            rope["rope_theta"] = theta
        spec.setdefault("rope_parameters", rope)
    else:
        if theta is not None:
            spec["rope_theta"] = theta
        if scaling is not None:
            spec["rope_scaling"] = scaling
    spec["use_cache"] = False  # training: HF's use_cache=True disables packed-sequence detection
    check_overrides(overrides, cls, extra=ARCHS[name])
    config = cls(**spec)
    check_heads(config)
    return config


def check_overrides(overrides: dict | None, cls, extra=(), built=None) -> None:
    """ValueError for an override key the config class does not know: transformers configs keep unknown keyword
    arguments as plain attributes, so a typo (num_hidden_layer) would otherwise train the default silently."""
    known = set(inspect.signature(cls.__init__).parameters) | set(dir(cls)) | set(extra)
    known |= set(vars(built) if built is not None else vars(cls()))
    known -= {"self", "kwargs"}
    for key in overrides or {}:
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(k for k in known if not k.startswith("_")), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(f"override {key!r} is not a field of {cls.__name__}; {hint}use a field of the model's "
                             f"config (its config.json keys)")


def check_heads(config) -> None:
    """ValueError for head counts the attention cannot split (HF would fail only at the first forward)."""
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    hidden, head_dim = getattr(config, "hidden_size", None), getattr(config, "head_dim", None)
    if not heads or heads < 1 or (kv is not None and kv < 1):
        raise ValueError(f"num_attention_heads {heads} / num_key_value_heads {kv} must be >= 1")
    if kv and heads % kv:
        raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}; choose head "
                         f"counts where it is (e.g. num_key_value_heads={1 if heads % 2 else 2})")
    if not head_dim and hidden and hidden % heads:
        raise ValueError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}; choose a divisor "
                         f"or set head_dim")


def count_matmul_params(config) -> int:
    """Parameters that take part in matmuls per token (attention + MLP projections + lm_head): the N of 6N.
    Sparse MoE layers count what one token multiplies by: the router and its top-k experts."""
    h = config.hidden_size
    hd = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    attention = h * (q + 2 * kv) + q * h
    dense_mlp = 3 * h * config.intermediate_size
    experts = routed_experts(config)
    total = 0
    for layer in range(config.num_hidden_layers):
        mlp = dense_mlp
        if experts and is_sparse_layer(config, layer):
            count, inter = experts
            mlp = h * count + config.num_experts_per_tok * 3 * h * inter
        total += attention + mlp
    return total + h * config.vocab_size


def routed_experts(config) -> tuple[int, int] | None:
    """(experts per sparse layer, one expert's intermediate size) of an MoE config, else None. Qwen-MoE stores the
    expert's size as moe_intermediate_size (its intermediate_size is the dense layers'); Mixtral and GPT-OSS store it
    as intermediate_size."""
    count = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not count:
        return None
    return count, getattr(config, "moe_intermediate_size", None) or config.intermediate_size


def is_sparse_layer(config, layer: int) -> bool:
    """Qwen-MoE's rule (mlp_only_layers, decoder_sparse_step); families without those keys are sparse throughout."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return layer not in (getattr(config, "mlp_only_layers", None) or []) and (layer + 1) % step == 0


def attention_flops_per_token(config, avg_keys: float) -> float:
    """docs/BENCHMARKS.md's formula: 3 (fwd+bwd) x 4 (QK^T and PV, 2 flops each) x avg attended keys x q_heads x
    head_dim x layers."""
    hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 3 * 4 * avg_keys * config.num_attention_heads * hd * config.num_hidden_layers
