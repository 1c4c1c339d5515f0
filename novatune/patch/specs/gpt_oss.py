"""GPT-OSS (openai/gpt-oss-*): Llama-layout attention with biases on q/k/v/o, per-head attention sinks and
sliding-window layers alternating with full ones (config.layer_types); YaRN rotary tables built by the model and
passed to the attention (so the scaling is the model's own) at half the head size; RMSNorm rounding once after the
weight. The mixture-of-experts block (router + experts with the clamped SwiGLU) stays stock until the MoE op
drives it; the report lists it."""
from novatune.patch.spec import AttentionSpec, FamilySpec

SPEC = FamilySpec(
    name="gpt_oss",
    model_types=("gpt_oss",),
    norm_classes=("GptOssRMSNorm",),
    attention_classes=("GptOssAttention",),
    mlp_classes=(),
    attention=AttentionSpec(window_attr="sliding_window", sinks="sinks", rope_tables="half"),
    honours=("sliding_window", "layer_types"),
    norm_rounding="output",
    stock_modules=(("GptOssMLP", "moe", "experts: wired to the MoE op after merge (router and experts run "
                    "transformers' own forward)"),),
    notes="attention sinks and the sliding window of each sliding layer are applied per document",
)
