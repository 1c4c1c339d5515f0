"""What the generic applier needs to know about a model family: data, not code.

A family spec names the Hugging Face classes and attribute paths; `apply.py` does the same work for every family.
Only `patch/specs/` knows Hugging Face class names (docs/ARCHITECTURE.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class AttentionSpec:
    """Attribute names inside one attention module (Llama layout: separate q/k/v/o projections)."""

    q_proj: str = "q_proj"
    k_proj: str = "k_proj"
    v_proj: str = "v_proj"
    o_proj: str = "o_proj"
    # one fused projection whose output is [q | k | v], split by head counts (num_attention_heads x head_dim, then
    # num_key_value_heads x head_dim twice: Phi-3); q_proj / k_proj / v_proj are then unused
    qkv_proj: str | None = None
    q_norm: str | None = None  # RMSNorm on q before RoPE (Qwen3, OLMo 2)
    k_norm: str | None = None
    # what a q/k norm normalises: "head" = each head's head_dim features, after the reshape to heads (Qwen3);
    # "projection" = the whole num_heads x head_dim projection output, before the reshape (OLMo 2)
    qk_norm_scope: str = "head"
    # sliding-window attention: the layer's window is this attention-module attribute (Qwen2/3 set it per layer
    # from config.layer_types) or this config attribute for every layer (Mistral); None on both = no window
    window_attr: str | None = None
    window_config: str | None = None
    # attention sinks (GPT-OSS): this attention-module attribute holds one learned logit per query head, added to
    # every softmax denominator; None = the family has none (a module that has them is then refused)
    sinks: str | None = None
    # the rotary tables the model passes: "full" = HF's (b, s, head_dim) cos/sin; "half" = (b, s, head_dim / 2),
    # applied to the two halves of each head (GPT-OSS): the same rotation as "full" with each table repeated
    rope_tables: str = "full"
    # attention logit soft-capping (Gemma 2): this attention-module attribute holds the cap (None or a number);
    # scores become cap * tanh(scores / cap) after the scale, on the backends that can (SOFTCAP_BACKENDS).
    # None = the family applies none (a module whose attn_logit_softcapping is set is then refused, unless the
    # spec honours attn_logit_softcapping: its stock forward ignores the attribute, Gemma 3)
    softcap: str | None = None


@dataclass(frozen=True)
class MLPSpec:
    """down(act(gate(x)) * up(x)): SwiGLU (act = SiLU, Llama families) or GeGLU (act = gelu with the tanh
    approximation, Gemma families; `glu="geglu"`)."""

    gate_proj: str = "gate_proj"
    up_proj: str = "up_proj"
    down_proj: str = "down_proj"
    activations: tuple[str, ...] = ("silu", "swish")  # values of config.<act_config> the fused kernel computes
    act_config: str = "hidden_act"  # the config attribute naming the activation (Gemma 2/3: hidden_activation)
    glu: str = "swiglu"  # the fused op: "swiglu" (novatune.ops.swiglu) or "geglu" (novatune.ops.geglu)
    # one fused projection whose output is [gate | up], two equal halves (Phi-3); gate_proj / up_proj then unused
    gate_up_proj: str | None = None


@dataclass(frozen=True)
class RouterSpec:
    """A top-k router module: logits = x @ weight^T (+ bias), then the family's recipe (novatune.ops.moe_routing.route).

    scoring "softmax_topk" (softmax over experts, top-k, optional renormalisation: Qwen3-MoE, Mixtral) or
    "topk_softmax" (top-k of the logits, softmax over the k: GPT-OSS). `renormalize` is a bool, or the router
    attribute that holds it (Qwen3-MoE's norm_topk_prob). weights_dtype "logits" casts the weights to the logits'
    dtype (Qwen3-MoE, GPT-OSS); "float32" keeps them fp32 (Mixtral)."""

    scoring: str = "softmax_topk"
    renormalize: bool | str = False
    softmax_fp32: bool = True
    weights_dtype: str = "logits"
    top_k: str = "top_k"
    weight: str = "weight"
    bias: str | None = None


@dataclass(frozen=True)
class MoESpec:
    """The routed-experts modules of a sparse MoE block. The block's own forward stays stock (so anything it does
    around the router and the experts - jitter, shared experts, reshapes - is unchanged); the router and the experts
    module get novatune's forwards. The experts' layout (transposed, interleaved gate/up, biases) is read from the
    attributes transformers' `use_experts_implementation` sets on the module; one the op cannot honour (no gate,
    a post-expert norm, expert parallelism, a custom gate without a declared activation) refuses the module."""

    router_classes: tuple[str, ...]
    experts_classes: tuple[str, ...]
    router: RouterSpec = field(default_factory=RouterSpec)
    gate_up: str = "gate_up_proj"  # (E, 2I, H), or (E, H, 2I) when the module's is_transposed
    down: str = "down_proj"  # (E, H, I), or (E, I, H)
    gate_up_bias: str = "gate_up_proj_bias"  # read only when the module's has_bias
    down_bias: str = "down_proj_bias"
    num_experts: str = "num_experts"
    # config.hidden_act values computed as silu(gate) * up ("silu" in novatune.ops.moe.ACTIVATIONS)
    activations: tuple[str, ...] = ("silu", "swish")
    # a family whose experts class defines its own gate names the ACTIVATIONS entry that computes it here
    custom_gate_activation: str | None = None
    # the family's load-balancing loss, a function of the modeling module (what the stock causal LM calls when
    # output_router_logits is on); the fused loss forward adds it exactly as stock does
    aux_loss: str | None = "load_balancing_loss_func"
    # the experts' layout where the module does not carry transformers' use_experts_implementation attributes
    # (is_transposed, is_concatenated, has_bias): GPT-OSS's (E, H, 2I) interleaved weights with biases
    transposed: bool = False
    interleaved: bool = False
    bias: bool = False
    # module attributes that must hold these values for custom_gate_activation to compute the module's gate
    gate_constants: tuple[tuple[str, float], ...] = ()
    # the experts' output reaches the decoder layer's output through reshapes and residual adds only (no
    # post-MoE norm or product that saves it for its backward): a recompute whose result nobody reads may then
    # skip the experts' down projection and combine (ops.moe's output_unread; patch/graphs.py). Qwen3-MoE,
    # Mixtral and GPT-OSS in transformers 5: block = reshape(experts(...)), layer = residual + block.
    output_feeds_residual: bool = False


@dataclass(frozen=True)
class LoRASpec:
    """PEFT's LoRA layer layout (peft.tuners.lora.layer.Linear wraps a projection in place). The same for every
    family today; a field of FamilySpec so a family (or a PEFT release) with other names changes data, not code.

    A module is a LoRA layer when it has `lora_a` and `base_layer` (PEFT's LoraLayer protocol: this also finds the
    quantised and embedding variants, so they can be reported as skipped); it is fusable only when its class is
    one of `classes` in `module` and the base layer's class is one of `base_classes` (a plain nn.Linear)."""

    module: str = "peft.tuners.lora.layer"
    classes: tuple[str, ...] = ("Linear",)
    base_module: str = "torch.nn.modules.linear"  # with base_classes: torch.nn.Linear exactly (bnb's
    base_classes: tuple[str, ...] = ("Linear",)  # Linear4bit and other quantised subclasses live elsewhere)
    # QLoRA: PEFT's bitsandbytes LoRA layer over a bnb NF4 Linear4bit (fused with a dequantise-on-the-fly weight)
    qlora_module: str = "peft.tuners.lora.bnb"
    qlora_classes: tuple[str, ...] = ("Linear4bit",)
    qlora_base_module: str = "bitsandbytes.nn.modules"
    qlora_base_classes: tuple[str, ...] = ("Linear4bit",)
    base_layer: str = "base_layer"
    # PEFT's wrapper of one targeted parameter (LoraConfig.target_parameters; nested when several parameters of a
    # module are targeted): on routed-experts weights the MoE LoRA applier fuses it (patch/moe_lora.py)
    param_wrapper_classes: tuple[str, ...] = ("ParamWrapper",)
    lora_a: str = "lora_A"  # ModuleDict adapter -> nn.Linear(in, r, bias=False)
    lora_b: str = "lora_B"  # ModuleDict adapter -> nn.Linear(r, out)
    scaling: str = "scaling"  # dict adapter -> alpha / r (or alpha / sqrt(r) with rsLoRA)
    dropout: str = "lora_dropout"  # ModuleDict adapter -> nn.Dropout or nn.Identity
    use_dora: str = "use_dora"  # dict adapter -> bool
    variants: str = "lora_variant"  # dict adapter -> DoRA/aLoRA/... variant object (newer PEFT)


@dataclass(frozen=True)
class MathAttribute:
    """A config attribute that changes what a module computes. With a value outside `neutral` it must be in the
    family spec's `honours` (the forwards implement it), or the applier refuses every module of `kind` with the
    reason (kind "model": the whole model). A spec never binds a forward that computes something else."""

    name: str
    kind: str  # attention | cross_entropy | rms_norm | mlp | model
    neutral: tuple
    what: str


# The attributes Hugging Face families use to change the Llama-layout math. Read from the config, or from
# config.rope_parameters (transformers 5 keeps rotary settings there).
MATH_ATTRIBUTES: tuple[MathAttribute, ...] = (
    MathAttribute("sliding_window", "attention", (None,), "sliding-window attention"),
    MathAttribute("layer_types", "attention", (None, "full_attention"), "per-layer attention types"),
    MathAttribute("use_sliding_window", "attention", (None, False), "sliding-window attention"),
    MathAttribute("attention_chunk_size", "attention", (None,), "chunked attention"),
    MathAttribute("attn_logit_softcapping", "attention", (None, 0, 0.0), "attention logit soft-capping"),
    MathAttribute("partial_rotary_factor", "attention", (None, 1, 1.0), "partial rotary embedding"),
    MathAttribute("query_pre_attn_scalar", "attention", (None,), "query scaling by query_pre_attn_scalar"),
    MathAttribute("attention_multiplier", "attention", (None, 1, 1.0), "attention score multiplier"),
    MathAttribute("use_qk_norm", "attention", (None, False), "q/k normalisation"),
    MathAttribute("use_bidirectional_attention", "attention", (None, False), "bidirectional attention"),
    MathAttribute("final_logit_softcapping", "cross_entropy", (None, 0, 0.0), "final logit soft-capping"),
    MathAttribute("logits_scaling", "cross_entropy", (None, 1, 1.0), "logit scaling"),
    MathAttribute("logit_scale", "cross_entropy", (None, 1, 1.0), "logit scaling"),
    MathAttribute("output_multiplier", "cross_entropy", (None, 1, 1.0), "logit multiplier"),
    MathAttribute("lm_head_multiplier", "cross_entropy", (None, 1, 1.0), "logit multiplier"),
    MathAttribute("embedding_multiplier", "model", (None, 1, 1.0), "embedding scaling"),
    MathAttribute("scale_emb", "model", (None, 1, 1.0), "embedding scaling"),
    MathAttribute("residual_multiplier", "model", (None, 1, 1.0), "residual scaling"),
    MathAttribute("output_router_logits", "cross_entropy", (None, False),
                  "the router's load-balancing loss added to the language-model loss"),
)


def config_value(config, name: str):
    """The attribute from the config, else from config.rope_parameters (a dict in transformers 5)."""
    value = getattr(config, name, None)
    rope = getattr(config, "rope_parameters", None)
    if value is None and isinstance(rope, dict):
        value = rope.get(name)
    return value


def is_neutral(attr: MathAttribute, value) -> bool:
    if isinstance(value, (list, tuple)):  # per-layer lists (layer_types): every entry neutral
        return all(v in attr.neutral for v in value)
    return value in attr.neutral


@dataclass(frozen=True)
class FamilySpec:
    name: str
    model_types: tuple[str, ...]  # config.model_type values this spec covers
    norm_classes: tuple[str, ...]  # RMSNorm classes: every instance gets the fused kernel
    attention_classes: tuple[str, ...]
    mlp_classes: tuple[str, ...]
    norm_eps_attr: str = "variance_epsilon"
    attention: AttentionSpec = field(default_factory=AttentionSpec)
    mlp: MLPSpec = field(default_factory=MLPSpec)
    lora: LoRASpec = field(default_factory=LoRASpec)
    base_model_attr: str = "model"  # CausalLM -> decoder stack
    lm_head_attr: str = "lm_head"
    # MATH_ATTRIBUTES the forwards implement for this family (any other non-neutral one is refused)
    honours: tuple[str, ...] = ()
    # RMSNorm computes x_hat * (offset + w) (Gemma: 1, the weight stored zero-centred); a non-zero offset needs
    # norm_rounding "output" (novatune.ops.offset_rms_norm computes both, as Gemma does)
    norm_offset: float = 0.0
    moe: MoESpec | None = None  # sparse MoE families: the router and experts modules
    # where RMSNorm rounds to the input dtype: "normalised" = w * round(x_hat) with the result in promote(x, w)
    # (Llama, Qwen); "output" = round(w * x_hat) in x's dtype, one rounding (GPT-OSS, T5)
    norm_rounding: str = "normalised"
    # module classes kept stock on purpose: (class name, report kind, why), listed in the patch report
    stock_modules: tuple[tuple[str, str, str], ...] = ()
    # decoder-layer norms applied to a sublayer's output before the residual add (OLMo 2's post_attention_layernorm
    # and post_feedforward_layernorm). The decoder layer's own forward stays stock, so the order is stock's; the
    # norms get the fused kernel like every RMSNorm and the report lists them as kind "post_norm"
    post_norms: tuple[str, ...] = ()
    notes: str = ""
