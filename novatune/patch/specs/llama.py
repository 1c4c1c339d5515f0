"""Llama 2/3/3.x."""
from novatune.patch.spec import FamilySpec

SPEC = FamilySpec(
    name="llama",
    model_types=("llama",),
    norm_classes=("LlamaRMSNorm",),
    attention_classes=("LlamaAttention",),
    mlp_classes=("LlamaMLP",),
)
