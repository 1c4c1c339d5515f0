"""Qwen2 / Qwen2.5: Llama layout with a bias on q/k/v (the projections are called as modules, so the bias is kept)."""
from novatune.patch.spec import AttentionSpec, FamilySpec

SPEC = FamilySpec(
    name="qwen2",
    model_types=("qwen2",),
    norm_classes=("Qwen2RMSNorm",),
    attention_classes=("Qwen2Attention",),
    mlp_classes=("Qwen2MLP",),
    attention=AttentionSpec(window_attr="sliding_window"),
    honours=("sliding_window", "layer_types", "use_sliding_window"),
    notes="use_sliding_window=True: the window of each sliding layer is applied per document",
)
