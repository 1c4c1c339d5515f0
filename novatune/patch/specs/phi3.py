"""Phi-3 / Phi-3.5 / Phi-4-mini (model_type phi3): Llama-layout decoder with one fused [q | k | v] projection
(split by the head counts) and one fused [gate | up] projection (two halves); partial rotary (Phi-4-mini rotates
the first 3/4 of each head: the model's tables are that wide and the RoPE op passes the rest through); LongRoPE
tables built by the model's own rotary embedding from the position_ids it is given and used as they are (so the
short / long factor choice is stock's, made from the packed batch's largest position); config.sliding_window on
every layer, applied per document. resid_pdrop stays in the stock decoder layer (its nn.Dropout draws as stock
does); embd_pdrop is read by no stock forward."""
from novatune.patch.spec import AttentionSpec, FamilySpec, MLPSpec

SPEC = FamilySpec(
    name="phi3",
    model_types=("phi3",),
    norm_classes=("Phi3RMSNorm",),
    attention_classes=("Phi3Attention",),
    mlp_classes=("Phi3MLP",),
    attention=AttentionSpec(qkv_proj="qkv_proj", window_config="sliding_window"),
    mlp=MLPSpec(gate_up_proj="gate_up_proj"),
    honours=("sliding_window", "partial_rotary_factor"),
    notes="fused qkv / gate_up projections; partial rotary and LongRoPE tables as the model builds them",
)
