"""PEFT LoRA on the fused expert weights (`LoraConfig(target_parameters=[...])`) -> novatune.ops.moe_experts_lora.

PEFT adapts a 3-D expert parameter with a ParamWrapper around the experts module (one wrapper per parameter,
nested when gate_up and down are both targeted). Its forward registers a parametrization that replaces the weight
by W + s * B A for every expert (one baddbmm over the whole stack, in the weight's dtype) and runs the module. The
experts module itself already runs novatune's expert MLP (patch/moe.py); this binds the outermost wrapper's
forward so the adapters go inside the grouped GEMMs instead (novatune/ops/moe_lora.py): the same function, with no
(E, out, in) delta formed at each forward and again in the backward.

PEFT's storage, read at every call (a view, no copy): lora_A (r * E, in) holds A_e in rows e*r .. e*r + r - 1;
lora_B (out, r * E) holds B_e in the columns j*E + e (B's rank index is the slow one) - PEFT's own
`get_delta_factors` split. `in` / `out` are the projection's, whatever the base weight's transposition.

Refused with the reason (PEFT's forward stays): a wrapped parameter other than the experts' gate_up / down
weights, the experts module not running novatune's expert MLP, several active adapters, merged adapters, a LoRA
variant (DoRA), a bias in lora_B, dropout, factors whose shapes are not PEFT's split. Per call, PEFT's forward runs
instead when the wrappers' state left what was checked (adapters disabled, merged or switched) or the call carries
extra arguments.
"""
from __future__ import annotations

from torch import nn

from novatune.ops.moe_lora import moe_experts_lora
from novatune.patch.lora import vanilla_adapter_refusal
from novatune.patch.moe import experts_arguments, experts_forward, output_unread
from novatune.patch.report import PatchReport
from novatune.patch.spec import FamilySpec


def wrapper_chain(module: nn.Module, names) -> tuple[list[nn.Module], nn.Module]:
    """(the ParamWrappers from the outermost in, the module they wrap) for a PEFT ParamWrapper."""
    chain = []
    while type(module).__name__ in names.param_wrapper_classes and hasattr(module, names.base_layer):
        chain.append(module)
        module = getattr(module, names.base_layer)
    return chain, module


def _refusal(chain: list[nn.Module], experts: nn.Module, spec: FamilySpec) -> str | None:
    names, moe = spec.lora, spec.moe
    if type(experts).__name__ not in moe.experts_classes:
        return f"LoRA on a parameter of {type(experts).__name__}, not of a routed-experts module: PEFT's forward"
    if getattr(experts.__dict__.get("forward"), "__func__", None) is not experts_forward:
        return "the experts module runs its stock forward (see its moe_experts entry): PEFT's forward"
    seen = set()
    for w in chain:
        param = getattr(w, "parameter_name", None)
        if param not in (moe.gate_up, moe.down) or param in seen:
            return f"LoRA on {param!r}: only the experts' {moe.gate_up!r} and {moe.down!r} weights are fused"
        seen.add(param)
        why = _wrapper_refusal(w, names)
        if why:
            return f"{param}: {why}"
    adapters = {w.active_adapters[0] for w in chain}
    if len(adapters) != 1:
        return f"the wrappers' active adapters differ ({sorted(adapters)})"
    return None


def _wrapper_refusal(w: nn.Module, names) -> str | None:
    why = vanilla_adapter_refusal(w, names)
    if why is not None:
        return why
    adapter = w.active_adapters[0]
    if not isinstance(getattr(w, names.dropout)[adapter], nn.Identity):
        return "LoRA dropout on expert weights (PEFT refuses it too: x cannot be factored out)"
    la, lb = getattr(w, names.lora_a)[adapter], getattr(w, names.lora_b)[adapter]
    if la.bias is not None or lb.bias is not None:
        return "bias in lora_A/lora_B (lora_bias=True)"
    e, r = w.num_experts, getattr(w, "r", {}).get(adapter)
    if (not isinstance(r, int) or tuple(la.weight.shape) != (r * e, w.in_features)
            or tuple(lb.weight.shape) != (w.out_features, r * e)):
        return (f"lora_A {tuple(la.weight.shape)} / lora_B {tuple(lb.weight.shape)} are not PEFT's (r*E, in) / "
                f"(out, r*E) split for E={e}, r={r}")
    if not isinstance(getattr(w, names.scaling).get(adapter), (int, float)):
        return f"scaling for {adapter!r} is not a number"
    return None


def _factors(w: nn.Module, adapter: str, names):
    """(A (E, r, in), B (E, out, r), scaling): views of PEFT's lora_A / lora_B (module docstring)."""
    e = w.num_experts
    a = getattr(w, names.lora_a)[adapter].weight
    b = getattr(w, names.lora_b)[adapter].weight
    return (a.view(e, -1, a.shape[1]), b.view(b.shape[0], -1, e).permute(2, 0, 1),
            getattr(w, names.scaling)[adapter])


def experts_lora_forward(self, hidden_states, top_k_index=None, top_k_weights=None, *args, **kwargs):
    """The outermost ParamWrapper's forward: the experts' op with every wrapped weight's adapter inside."""
    chain, experts, names = self._novatune_moe_lora
    adapter = chain[0].active_adapters[0] if chain[0].active_adapters else None
    if (args or kwargs or top_k_index is None
            or any(w.disable_adapters or w.merged or w.active_adapters != [adapter] for w in chain)):
        return self._novatune_stock_forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
    lora = {w.parameter_name: _factors(w, adapter, names) for w in chain}
    moe = experts._novatune_moe
    tensors, layout = experts_arguments(experts)
    return moe_experts_lora(hidden_states, top_k_index, top_k_weights, *tensors, gate_up_lora=lora.get(moe.gate_up),
                            down_lora=lora.get(moe.down), **layout, ids_from_router=True,
                            output_unread=output_unread(experts))


def apply_moe_lora(model: nn.Module, spec: FamilySpec, report: PatchReport, bind, *, enabled: bool,
                   skip: frozenset | set = frozenset()) -> None:
    """Bind experts_lora_forward on the outermost PEFT ParamWrapper of every adapted experts module, or report
    why PEFT's forward stays. `skip`: module paths already reported (by an earlier patch call)."""
    names = spec.lora
    inner = set()
    for path, module in model.named_modules():
        if type(module).__name__ not in names.param_wrapper_classes or id(module) in inner:
            continue
        chain, experts = wrapper_chain(module, names)
        inner.update(id(w) for w in chain[1:])
        if path in skip:
            continue
        if not enabled:
            report.add(path, "moe_lora", "skipped", "lora=False")
            continue
        why = "the family has no routed experts" if spec.moe is None else _refusal(chain, experts, spec)
        if why:
            report.add(path, "moe_lora", "skipped", why)
            continue
        bind(module, experts_lora_forward, report, _novatune_moe_lora=(chain, experts, names))
        adapter = chain[0].active_adapters[0]
        ranks = ", ".join(f"{w.parameter_name} r={w.r[adapter]}" for w in chain)
        report.add(path, "moe_lora", "replaced", f"LoRA inside the experts' grouped GEMMs ({ranks}; no delta "
                                                 "weight formed)")
