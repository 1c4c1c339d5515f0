"""PEFT LoRA projections -> novatune's fused LoRA linear (novatune.ops.lora_linear), bound per instance.

`novatune.patch` finds every PEFT LoRA layer (FamilySpec.lora says how to recognise one) and, on each attention
and MLP projection whose adapter the fused op computes exactly, binds `lora_linear_forward` on the instance (as
apply.py's `_bind` does for the other modules; revert restores PEFT's forward). QLoRA layers (PEFT's bnb
Linear4bit over a bitsandbytes NF4 Linear4bit) are fused too: the base weight goes to the op as a
novatune.ops.nf4.DequantWeight, dequantised (bit-identical to bnb's dequantize_4bit, in the layer's compute dtype)
for each GEMM and dropped after it, as bnb's own matmul_4bit does, but with the LoRA GEMMs fused around it. Inside a
gradient-checkpointed layer (training) the recomputed forward's dense weight is kept for the backward's dx GEMM
instead: one dequantisation fewer per linear, at most one layer's dense weights alive (the first forward's saved
tensors are not kept under checkpointing). The NF4 view of bnb's state is built once per weight.
Everything else is reported as skipped with the reason: DoRA and other variants, several active adapters, merged
adapters, other quantised or custom base layers (FP4, 8-bit), a bias in lora_B, fan_in_fan_out (Conv1D) layers,
LoRA outside the projections (lm_head, embeddings). The SwiGLU MLP and the attention forwards *call* the projection
modules, so they pick the fused forward up with no change.

The bound forward computes what PEFT's `Linear.forward` computes for one active vanilla adapter:
    result = base_layer(x) + lora_B(lora_A(dropout(x.to(A.dtype)))) * scaling
dropout = nn.Identity (or any dropout in eval mode): the fast path, x feeds both branches.
dropout active: the exact path - PEFT's own call sequence `dropout(self._cast_input_dtype(x, A.dtype))`, so the
same random numbers are drawn in the same order and a seeded run matches PEFT stock mask for mask; the dropped x
is the LoRA branch's input only.
Per call, PEFT's stock forward runs instead whenever the layer's state stops matching what was checked at patch
time (adapters disabled, merged, another active adapter, a variant added) or the call is outside the fast path's
contract (extra args such as `adapter_names`, autocast, an input dtype other than the base weight's): those are
PEFT's semantics, not ours to re-implement, and the report's detail line says so.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as _module_mod  # the global-hook registries (read per grouped call)

from novatune.ops.lora import lora_linear, lora_linear_group
from novatune.ops.nf4 import DequantWeight, from_bnb
from novatune.patch.report import PatchReport
from novatune.patch.spec import FamilySpec, LoRASpec

RUNTIME_NOTE = ("fused LoRA layers run PEFT's own forward for any call made with adapters disabled, merged or "
                "switched, under autocast, or with extra arguments (adapter_names)")


def is_lora_layer(module: nn.Module, names: LoRASpec) -> bool:
    return hasattr(module, names.lora_a) and hasattr(module, names.base_layer)


def is_qlora_layer(module: nn.Module, names: LoRASpec) -> bool:
    cls = type(module)
    return cls.__module__ == names.qlora_module and cls.__name__ in names.qlora_classes


def vanilla_adapter_refusal(module: nn.Module, names: LoRASpec) -> str | None:
    """Why a PEFT LoRA layer (or parameter wrapper) is not one unmerged, vanilla adapter, as the fused ops compute
    it; None when it is."""
    if getattr(module, "merged", False):
        return "adapter merged into the base weight (the stock forward is a single GEMM already)"
    active = list(getattr(module, "active_adapters", []))
    if len(active) != 1:
        return f"{len(active)} active adapters (the fused forward computes exactly one)"
    adapter = active[0]
    if adapter not in getattr(module, names.lora_a):
        return f"active adapter {adapter!r} has no LoRA weights on this layer"
    if getattr(module, names.use_dora, {}).get(adapter, False) or adapter in getattr(module, names.variants, {}):
        return f"adapter {adapter!r} is a LoRA variant (DoRA/aLoRA/...), not vanilla LoRA"
    return None


def skip_reason(module: nn.Module, names: LoRASpec) -> str | None:
    """Why the fused forward cannot stand in for this LoRA layer's forward, or None when it can."""
    cls = type(module)
    base = getattr(module, names.base_layer)
    bcls = type(base)
    if is_qlora_layer(module, names):
        if bcls.__module__ != names.qlora_base_module or bcls.__name__ not in names.qlora_base_classes:
            return f"QLoRA base layer is {bcls.__module__}.{bcls.__name__}, not a bitsandbytes Linear4bit"
        qs = getattr(base.weight, "quant_state", None)
        if qs is None or qs.quant_type != "nf4":
            return f"4-bit base weight is {getattr(qs, 'quant_type', 'not quantised')}, not NF4"
        if getattr(base, "compute_dtype", None) is None:
            return "bitsandbytes Linear4bit without a compute_dtype"
    elif cls.__module__ != names.module or cls.__name__ not in names.classes:
        return (f"LoRA layer {cls.__module__}.{cls.__name__} is not a plain PEFT LoRA Linear or an NF4 QLoRA "
                f"Linear4bit (other quantised LoRA layers are not fused)")
    elif bcls.__module__ != names.base_module or bcls.__name__ not in names.base_classes:
        return f"base layer is {bcls.__module__}.{bcls.__name__}, not a plain nn.Linear (quantised?)"
    if getattr(module, "fan_in_fan_out", False):
        return "fan_in_fan_out (Conv1D-style transposed weight)"
    why = vanilla_adapter_refusal(module, names)
    if why is not None:
        return why
    adapter = module.active_adapters[0]
    la, lb = getattr(module, names.lora_a)[adapter], getattr(module, names.lora_b)[adapter]
    if not (isinstance(la, nn.Linear) and isinstance(lb, nn.Linear)):
        return f"lora_A/lora_B are {type(la).__name__}/{type(lb).__name__}, not nn.Linear"
    if lb.bias is not None or la.bias is not None:
        return "bias in lora_A/lora_B (lora_bias=True) is not fused"
    if not isinstance(getattr(module, names.scaling).get(adapter), (int, float)):
        return f"scaling for {adapter!r} is not a number"
    if getattr(module, "cast_input_dtype_enabled", True) is False:
        return "input dtype casting disabled (peft.helpers.disable_input_dtype_casting)"
    return None


def _projections(model: nn.Module, spec: FamilySpec) -> dict[int, str]:
    """id(module) -> "attention"/"mlp" for every projection slot of the family's attention and MLP modules."""
    slots = {}
    attn = spec.attention
    attn_names = ((attn.qkv_proj,) if attn.qkv_proj is not None else (attn.q_proj, attn.k_proj, attn.v_proj)) + (
        attn.o_proj,)
    mlp_names = ((spec.mlp.gate_up_proj,) if spec.mlp.gate_up_proj is not None else (
        spec.mlp.gate_proj, spec.mlp.up_proj)) + (spec.mlp.down_proj,)
    for module in model.modules():
        cls = type(module).__name__
        names = attn_names if cls in spec.attention_classes else mlp_names if cls in spec.mlp_classes else ()
        for n in names:
            proj = getattr(module, n, None)
            if proj is not None:
                slots[id(proj)] = "attention" if names is attn_names else "mlp"
    return slots


def apply_lora(model: nn.Module, spec: FamilySpec, report: PatchReport, *, enabled: bool, bind,
               skip: frozenset | set = frozenset()) -> None:
    """Bind the fused LoRA forward on every fusable LoRA projection; report the rest. `bind` is apply._bind;
    `skip`: module paths already reported (a later patch call adds only adapters that came since)."""
    names = spec.lora
    slots = None
    for path, module in model.named_modules():
        if not is_lora_layer(module, names) or type(module).__name__ in names.param_wrapper_classes:
            continue  # LoRA on a parameter (PEFT's target_parameters): patch/moe_lora.py reports it
        if path in skip:
            continue
        if slots is None:
            slots = _projections(model, spec)
        if not enabled:
            report.add(path, "lora", "skipped", "lora=False")
            continue
        if id(module) not in slots:
            report.add(path, "lora", "skipped", "LoRA outside the attention/MLP projections keeps PEFT's forward")
            continue
        why = skip_reason(module, names)
        if why is not None:
            report.add(path, "lora", "skipped", why)
            continue
        adapter = module.active_adapters[0]
        r = getattr(module, names.lora_a)[adapter].out_features
        drop = getattr(module, names.dropout)[adapter]
        p = float(getattr(drop, "p", 0.0)) if not isinstance(drop, nn.Identity) else 0.0
        bind(module, lora_linear_forward, report, _novatune_lora=names, _novatune_lora_adapter=adapter,
             _novatune_ckpt_owner=(_checkpoint_owner(model, path),), _novatune_nf4=None)
        mode = "no dropout: fast path" if p == 0.0 else f"dropout {p:g}: exact path (PEFT's dropout, LoRA branch)"
        kind = "fused QLoRA linear (NF4 dequantised per GEMM, " if is_qlora_layer(module, names) else \
            "fused LoRA linear ("
        report.add(path, "lora", "replaced", f"{kind}{slots[id(module)]}, r={r}, {mode})")
    if skip:
        return  # the notes below were written by the first call, if they apply
    if report.replaced("lora"):
        report.add("", "note", "note", RUNTIME_NOTE)
    if any("QLoRA" in str(r) for r in report.replaced("lora")):
        report.add("", "note", "note", "with novatune's attention forward (attention=True), a layer's QLoRA q/k/v "
                                       "projections run as one grouped op (one stacked dequantised weight, one "
                                       "GEMM) unless a module hook or an off-fast-path call needs their own forward")


def _checkpoint_owner(model: nn.Module, path: str) -> nn.Module | None:
    """The nearest enclosing module with HF's `gradient_checkpointing` switch (transformers 5: the decoder layer,
    a GradientCheckpointingLayer; older versions: the base model), or None. Read at every QLoRA forward, so
    turning checkpointing on or off after patching is seen."""
    parts = path.split(".")
    for i in range(len(parts) - 1, -1, -1):
        owner = model.get_submodule(".".join(parts[:i])) if i else model
        if hasattr(owner, "gradient_checkpointing"):
            return owner
    return None


def _dequant_weight(module: nn.Module, weight, quant, dtype: torch.dtype) -> DequantWeight:
    """The layer's NF4 stand-in (views bnb's storage; dequantised per GEMM), built once per (weight, quant state,
    storage, dtype), compared by identity: reading bnb's state costs ~tens of µs of host time per call, and a QLoRA
    micro-step makes ~750 of these calls on a host-bound step. A new Params4bit (`.to()`, re-quantisation, a loaded
    checkpoint) changes the key and rebuilds it."""
    cached = getattr(module, "_novatune_nf4", None)
    if (cached is None or cached[0] is not weight or cached[1] is not quant or cached[2] != weight.data_ptr()
            or cached[3] != dtype):
        # holds weight and quant (so neither id can be reused while cached); rebuilt when either is replaced
        cached = (weight, quant, weight.data_ptr(), dtype, DequantWeight(from_bnb(weight), dtype))
        module._novatune_nf4 = cached
    return cached[4]


def _fast_path(self, x):
    """(weight, lora_a, lora_b, scaling, dropout) for the fused op on this call, or None when PEFT's stock forward
    must run (the layer's state or the call left the fast path's contract: module docstring)."""
    names, adapter = self._novatune_lora, self._novatune_lora_adapter
    base = getattr(self, names.base_layer)
    weight = base.weight
    quant = getattr(weight, "quant_state", None)
    # QLoRA: the GEMMs run in the base layer's compute dtype (bnb casts x to it); the fast path takes x already in it
    dense_dtype = base.compute_dtype if quant is not None else weight.dtype
    if (self.disable_adapters or self.merged or self.active_adapters != [adapter]
            or adapter in getattr(self, names.variants, ()) or x.dtype != dense_dtype
            or torch.is_autocast_enabled(x.device.type)):
        return None
    if quant is not None:
        weight = _dequant_weight(self, weight, quant, dense_dtype)
        owner = self._novatune_ckpt_owner[0]
        # HF checkpoints a layer when its `gradient_checkpointing` is on and it trains (GradientCheckpointingLayer)
        weight.keep_for_backward = bool(owner is not None and owner.training
                                        and getattr(owner, "gradient_checkpointing", False))
    drop = getattr(self, names.dropout)[adapter]
    return (weight, getattr(self, names.lora_a)[adapter].weight, getattr(self, names.lora_b)[adapter].weight,
            getattr(self, names.scaling)[adapter], drop)


def lora_linear_forward(self, x, *args, **kwargs):
    """PEFT LoRA Linear forward for one vanilla adapter through novatune.ops.lora_linear (module docstring)."""
    fast = None if (args or kwargs) else _fast_path(self, x)
    if fast is None:
        return self._novatune_stock_forward(x, *args, **kwargs)
    weight, lora_a, lora_b, scaling, drop = fast  # lora_a (r, in), lora_b (out, r)
    bias = getattr(self, self._novatune_lora.base_layer).bias
    if isinstance(drop, nn.Identity) or not drop.training:  # PEFT's Dropout in eval draws no random numbers
        return lora_linear(x, weight, bias, lora_a, lora_b, scaling)
    # exact path: PEFT's cast then dropout, drawing the same random numbers as PEFT stock
    x_lora = drop(self._cast_input_dtype(x, lora_a.dtype) if hasattr(self, "_cast_input_dtype")
                  else x.to(lora_a.dtype))
    return lora_linear(x, weight, bias, lora_a, lora_b, scaling, x_lora=x_lora)


def _global_module_hooks() -> bool:
    return bool(_module_mod._global_forward_pre_hooks or _module_mod._global_forward_hooks
                or _module_mod._global_backward_pre_hooks or _module_mod._global_backward_hooks)


def grouped_qlora(modules, x) -> tuple | None:
    """The outputs of several fused QLoRA projections of the same input (an attention layer's q/k/v) from one
    grouped op (novatune.ops.lora_linear_group: one stacked dequantised weight, one big GEMM, one x·Aᵀ GEMM), or
    None when any member must take its own forward: not a fused LoRA layer, off the fast path, not NF4, a bias, an
    active dropout, or scalings that differ. Same products as the members' own forwards; it saves launches and
    host time, which is what a QLoRA step is short of (LOG.md, session 3)."""
    if _global_module_hooks():
        return None
    members = []
    for m in modules:
        if getattr(m.__dict__.get("forward"), "__func__", None) is not lora_linear_forward:
            return None  # not (or no longer) a fused LoRA layer
        if m._forward_pre_hooks or m._forward_hooks or m._backward_pre_hooks or m._backward_hooks:
            return None  # the op does not call the module: its hooks (PEFT's adapter_names, FSDP, users') must run
        fast = _fast_path(m, x)
        if fast is None:
            return None
        weight, lora_a, lora_b, scaling, drop = fast
        if (not isinstance(weight, DequantWeight) or getattr(m, m._novatune_lora.base_layer).bias is not None
                or not (isinstance(drop, nn.Identity) or not drop.training)):
            return None
        members.append(fast)
    if len({f[3] for f in members}) != 1:
        return None
    return lora_linear_group(x, [f[0] for f in members], [f[1] for f in members], [f[2] for f in members],
                             members[0][3])
