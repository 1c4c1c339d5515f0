"""Qwen3 dense (Qwen/Qwen3-*): Llama layout plus per-head RMSNorm on q and k before RoPE; tied embeddings on the
small sizes (the fused cross-entropy then writes its lm_head gradient into the embedding)."""
from novatune.patch.spec import AttentionSpec, FamilySpec

SPEC = FamilySpec(
    name="qwen3",
    model_types=("qwen3",),
    norm_classes=("Qwen3RMSNorm",),
    attention_classes=("Qwen3Attention",),
    mlp_classes=("Qwen3MLP",),
    honours=("sliding_window", "layer_types", "use_sliding_window"),
    attention=AttentionSpec(q_norm="q_norm", k_norm="k_norm", window_attr="sliding_window"),
    notes="layer_types may mark sliding-window layers (off by default): their window is applied per document",
)
