"""Mistral: Llama layout; config.sliding_window (every layer) is applied per document."""
from novatune.patch.spec import AttentionSpec, FamilySpec

SPEC = FamilySpec(
    name="mistral",
    model_types=("mistral",),
    norm_classes=("MistralRMSNorm",),
    attention_classes=("MistralAttention",),
    mlp_classes=("MistralMLP",),
    attention=AttentionSpec(window_config="sliding_window"),
    honours=("sliding_window",),
)
