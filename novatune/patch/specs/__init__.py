"""Registry of family specs, keyed by `config.model_type`. Add a family: one file here plus one import line."""
from __future__ import annotations

from novatune.patch.spec import FamilySpec
from novatune.patch.specs import gemma, gpt_oss, llama, mistral, mixtral, olmo2, phi3, qwen2, qwen3, qwen3_moe

FAMILIES: tuple[FamilySpec, ...] = (qwen3.SPEC, qwen2.SPEC, llama.SPEC, mistral.SPEC, qwen3_moe.SPEC, mixtral.SPEC,
                                    gpt_oss.SPEC, gemma.GEMMA, gemma.GEMMA2, gemma.GEMMA3, phi3.SPEC, olmo2.SPEC)


def spec_for(model_type: str) -> FamilySpec | None:
    for spec in FAMILIES:
        if model_type in spec.model_types:
            return spec
    return None


def supported_model_types() -> list[str]:
    return sorted(t for spec in FAMILIES for t in spec.model_types)
