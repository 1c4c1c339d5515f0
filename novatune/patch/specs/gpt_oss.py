"""GPT-OSS (openai/gpt-oss-*): Llama-layout attention with biases on q/k/v/o, per-head attention sinks and
sliding-window layers alternating with full ones (config.layer_types); YaRN rotary tables built by the model and
passed to the attention (so the scaling is the model's own) at half the head size; RMSNorm rounding once after the
weight. The mixture-of-experts block keeps its own forward; its router (top-k of the biased logits, softmax over
the k in the logits' dtype) and experts ((E, H, 2I) interleaved gate/up with biases, the clamped SwiGLU at
alpha 1.702 / limit 7.0) run novatune's routing and grouped-GEMM expert MLP."""
from novatune.ops.clamped_swiglu import ALPHA, LIMIT
from novatune.patch.spec import AttentionSpec, FamilySpec, MoESpec, RouterSpec

SPEC = FamilySpec(
    name="gpt_oss",
    model_types=("gpt_oss",),
    norm_classes=("GptOssRMSNorm",),
    attention_classes=("GptOssAttention",),
    mlp_classes=(),
    attention=AttentionSpec(window_attr="sliding_window", sinks="sinks", rope_tables="half"),
    honours=("sliding_window", "layer_types", "output_router_logits"),
    norm_rounding="output",
    moe=MoESpec(router_classes=("GptOssTopKRouter",), experts_classes=("GptOssExperts",),
                router=RouterSpec(scoring="topk_softmax", softmax_fp32=False, bias="bias"),
                transposed=True, interleaved=True, bias=True, custom_gate_activation="gpt_oss",
                gate_constants=(("alpha", ALPHA), ("limit", LIMIT)),
                output_feeds_residual=True),
    notes="attention sinks and the sliding window of each sliding layer are applied per document",
)
