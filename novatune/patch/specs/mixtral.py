"""Mixtral (mistralai/Mixtral-8x7B): Mistral's attention (config.sliding_window on every layer, applied per
document); every layer's router (softmax in fp32, top-k, always renormalised, weights kept in fp32) and experts
(concatenated gate/up, nn.Linear layout, no bias) run novatune's routing and grouped-GEMM expert MLP. The block's
router jitter (router_jitter_noise, training only) stays in the stock block forward, so it is unchanged."""
from novatune.patch.spec import AttentionSpec, FamilySpec, MoESpec, RouterSpec

SPEC = FamilySpec(
    name="mixtral",
    model_types=("mixtral",),
    norm_classes=("MixtralRMSNorm",),
    attention_classes=("MixtralAttention",),
    mlp_classes=(),
    attention=AttentionSpec(window_config="sliding_window"),
    honours=("sliding_window", "output_router_logits"),
    moe=MoESpec(router_classes=("MixtralTopKRouter",), experts_classes=("MixtralExperts",),
                router=RouterSpec(scoring="softmax_topk", renormalize=True, weights_dtype="float32"),
                output_feeds_residual=True),
)
