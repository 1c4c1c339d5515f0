"""Qwen3-MoE (Qwen/Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k norms) and RMSNorm; every sparse
layer's router (softmax in fp32, top-k, renormalised when norm_topk_prob) and experts (concatenated gate/up,
nn.Linear layout, no bias) run novatune's routing and grouped-GEMM expert MLP. Dense layers (mlp_only_layers,
decoder_sparse_step) are SwiGLU MLPs. The attention module's sliding_window applies to every layer."""
from novatune.patch.spec import AttentionSpec, FamilySpec, MoESpec, RouterSpec

SPEC = FamilySpec(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    norm_classes=("Qwen3MoeRMSNorm",),
    attention_classes=("Qwen3MoeAttention",),
    mlp_classes=("Qwen3MoeMLP",),
    honours=("sliding_window", "output_router_logits"),
    attention=AttentionSpec(q_norm="q_norm", k_norm="k_norm", window_attr="sliding_window"),
    moe=MoESpec(router_classes=("Qwen3MoeTopKRouter",), experts_classes=("Qwen3MoeExperts",),
                router=RouterSpec(scoring="softmax_topk", renormalize="norm_topk_prob", weights_dtype="logits"),
                output_feeds_residual=True),
)
