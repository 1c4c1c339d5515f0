"""OLMo 2 (allenai/OLMo-2-*, model_type olmo2): post-norm decoder layers (post_attention_layernorm and
post_feedforward_layernorm normalise the attention and MLP outputs before each residual add; the decoder layer's
stock forward keeps that order) and q/k RMSNorm over the whole projection (num_heads x head_dim wide, before the
reshape to heads). Its RMSNorm rounds once after the weight (`(w * x_hat).to(dtype)`), and its rotary tables stay
fp32, so RoPE rounds once from fp32 as the op does."""
from novatune.patch.spec import AttentionSpec, FamilySpec

SPEC = FamilySpec(
    name="olmo2",
    model_types=("olmo2",),
    norm_classes=("Olmo2RMSNorm",),
    attention_classes=("Olmo2Attention",),
    mlp_classes=("Olmo2MLP",),
    attention=AttentionSpec(q_norm="q_norm", k_norm="k_norm", qk_norm_scope="projection"),
    norm_rounding="output",
    post_norms=("post_attention_layernorm", "post_feedforward_layernorm"),
    notes="post-norm layers; q/k norms over the whole projection",
)
