"""Qwen2 / Qwen2.5: Llama layout with a bias on q/k/v (the projections are called as modules, so the bias is kept)."""
from novatune.patch.spec import FamilySpec

SPEC = FamilySpec(
    name="qwen2",
    model_types=("qwen2",),
    norm_classes=("Qwen2RMSNorm",),
    attention_classes=("Qwen2Attention",),
    mlp_classes=("Qwen2MLP",),
    notes="use_sliding_window=True layers keep stock attention when a document is longer than the window",
)
