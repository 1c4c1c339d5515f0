"""Mistral: Llama layout; sliding_window applies only to documents longer than the window."""
from novatune.patch.spec import FamilySpec

SPEC = FamilySpec(
    name="mistral",
    model_types=("mistral",),
    norm_classes=("MistralRMSNorm",),
    attention_classes=("MistralAttention",),
    mlp_classes=("MistralMLP",),
)
