"""Registered torch.library ops (fake + autograd) with a functional and a module form per op.

    from novatune.ops import rms_norm, swiglu, apply_rope, linear_cross_entropy, varlen_attention, lora_linear
    from novatune.ops import moe_experts, moe_experts_lora, route

Precision: the elementwise, norm and rotary ops compute in fp32 whatever their inputs (bf16, fp16, fp32: what
training uses) and return the input's dtype; a float64 input is computed in fp32 too, so float64 gradcheck is
not their test (the tests compare against fp32 references with per-dtype tolerances). lora_linear computes in
the input's dtype, float64 included.

The functionals are imported eagerly: `novatune.ops.rms_norm` must be the function, not the submodule of the same
name (ARCHITECTURE.md's public names), and binding it here, after the submodule import, guarantees that.
"""
from novatune.attention.backends import varlen_attention
from novatune.ops.clamped_swiglu import clamped_swiglu
from novatune.ops.geglu import geglu, geglu_mlp
from novatune.ops.linear_cross_entropy import linear_cross_entropy
from novatune.ops.lora import lora_linear
from novatune.ops.moe import moe_experts
from novatune.ops.moe_lora import moe_experts_lora
from novatune.ops.moe_routing import route
from novatune.ops.offset_rms_norm import offset_rms_norm
from novatune.ops.qk_norm_rope import qk_norm_rope
from novatune.ops.rms_norm import NovaRMSNorm, rms_norm
from novatune.ops.rope import apply_rope
from novatune.ops.swiglu import swiglu, swiglu_gate_up, swiglu_mlp

__all__ = ["rms_norm", "NovaRMSNorm", "offset_rms_norm", "swiglu", "swiglu_gate_up", "swiglu_mlp", "geglu",
           "geglu_mlp", "clamped_swiglu", "apply_rope", "qk_norm_rope", "linear_cross_entropy", "varlen_attention",
           "lora_linear", "moe_experts", "moe_experts_lora", "route"]
