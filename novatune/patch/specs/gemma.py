"""Gemma (google/gemma-*), Gemma 2 and Gemma 3 text (Gemma3ForCausalLM, model_type gemma3_text).

What every Gemma computes differently from Llama, and where it is honoured:
* RMSNorm x_hat * (1 + w), the product in fp32 and one rounding to x's dtype: norm_offset 1.0 with norm_rounding
  "output" (novatune.ops.offset_rms_norm), on every norm, Gemma 3's q/k norms included (they run unfused:
  qk_norm_rope computes Llama's norm).
* The gated MLP's gate is gelu with the tanh approximation (gelu_pytorch_tanh): novatune.ops.geglu.
* Embeddings scaled by sqrt(hidden) (rounded to the embedding dtype): done by the model's own embedding module,
  which the patch leaves stock.
Gemma 2 and 3 add: pre- and post-norms around attention and MLP (the decoder layer's forward stays stock; its four
norms are patched modules), attention logit soft-capping (Gemma 2: the attention module's attn_logit_softcapping,
on the backends that can: flex on CUDA, reference on the CPU), final logit soft-capping (inside the fused
cross-entropy, token chunks or vocab slices), sliding-window layers from config.layer_types (the module's
sliding_window, per document), the query scale 1 / sqrt(query_pre_attn_scalar) (the module's `scaling`, which
the attention forward uses). Gemma 3's per-layer-type rotary bases come from the model's own rotary module, which
hands each layer its tables. Gemma 3's attention keeps attn_logit_softcapping as an attribute but its forward
passes no soft-cap to the attention (transformers 5.17-5.39): its spec honours the attribute by ignoring it too,
as stock does."""
from novatune.patch.spec import AttentionSpec, FamilySpec, MLPSpec

_GELU_TANH = ("gelu_pytorch_tanh", "gelu_python_tanh")  # both are gelu(approximate="tanh")
_HONOURS = ("sliding_window", "layer_types", "attn_logit_softcapping", "final_logit_softcapping",
            "query_pre_attn_scalar")

GEMMA = FamilySpec(
    name="gemma",
    model_types=("gemma",),
    norm_classes=("GemmaRMSNorm",),
    attention_classes=("GemmaAttention",),
    mlp_classes=("GemmaMLP",),
    norm_eps_attr="eps",
    norm_offset=1.0,
    norm_rounding="output",
    mlp=MLPSpec(activations=_GELU_TANH, act_config="hidden_act", glu="geglu"),
)

GEMMA2 = FamilySpec(
    name="gemma2",
    model_types=("gemma2",),
    norm_classes=("Gemma2RMSNorm",),
    attention_classes=("Gemma2Attention",),
    mlp_classes=("Gemma2MLP",),
    norm_eps_attr="eps",
    norm_offset=1.0,
    norm_rounding="output",
    mlp=MLPSpec(activations=_GELU_TANH, act_config="hidden_activation", glu="geglu"),
    attention=AttentionSpec(window_attr="sliding_window", softcap="attn_logit_softcapping"),
    honours=_HONOURS,
    notes="attention logit soft-capping, sliding windows per document, final logit soft-capping in the fused loss",
)

GEMMA3 = FamilySpec(
    name="gemma3",
    model_types=("gemma3_text",),
    norm_classes=("Gemma3RMSNorm",),
    attention_classes=("Gemma3Attention",),
    mlp_classes=("Gemma3MLP",),
    norm_eps_attr="eps",
    norm_offset=1.0,
    norm_rounding="output",
    mlp=MLPSpec(activations=_GELU_TANH, act_config="hidden_activation", glu="geglu"),
    attention=AttentionSpec(q_norm="q_norm", k_norm="k_norm", window_attr="sliding_window"),
    honours=_HONOURS,
    notes="5 sliding : 1 global layers (layer_types), windows per document; q/k norms Gemma-style",
)
