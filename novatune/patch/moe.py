"""Sparse MoE wiring: the router and the experts module of each MoE block get novatune's forwards.

The block's own forward stays stock and keeps calling `self.gate(...)` / `self.experts(...)` (or whatever the
family names them), so what it does around them (jitter, shared experts, reshapes) is unchanged, and transformers'
output recorder still sees the router's logits (its hook sits on the router module): `output_router_logits` and
the load-balancing loss work as in stock.

    router forward    logits = x @ W^T (+ b) in the input dtype, then novatune.ops.moe_routing.route with the family's
                      recipe (RouterSpec) -> (logits, weights, expert ids), the stock router's return value
    experts forward   novatune.ops.moe.moe_experts(x, ids, weights, gate_up, down, biases) with the layout read
                      from the module (transformers' use_experts_implementation attributes)
"""
from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn as nn
import torch.nn.functional as F

from novatune.ops.moe import ACTIVATIONS, moe_experts
from novatune.ops.moe_routing import route
from novatune.patch.report import PatchReport
from novatune.patch.spec import FamilySpec, MoESpec, RouterSpec


def router_forward(self, hidden_states):
    names: RouterSpec = self._novatune_router
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    bias = getattr(self, names.bias) if names.bias is not None else None
    logits = F.linear(x, getattr(self, names.weight), bias)  # (T, E)
    renorm = names.renormalize if isinstance(names.renormalize, bool) else bool(getattr(self, names.renormalize))
    weights, ids = route(logits, getattr(self, names.top_k), scoring=names.scoring, renormalize=renorm,
                         softmax_fp32=names.softmax_fp32,
                         weights_dtype=torch.float32 if names.weights_dtype == "float32" else None)
    return logits, weights, ids


def experts_arguments(self) -> tuple[tuple, dict]:
    """(gate_up, down, gate_up_bias, down_bias), {transposed, interleaved, activation} of a bound experts module,
    read at each call (PEFT's LoRA wrappers swap the weights for adapted ones while they run the module)."""
    if getattr(self, "_is_expert_parallel", False):
        raise RuntimeError("novatune's expert MLP does not implement expert parallelism (its sentinel expert ids): "
                           "revert the patch (report.revert()) or patch before sharding experts")
    names: MoESpec = self._novatune_moe
    bias = getattr(self, "has_bias", names.bias)
    tensors = (getattr(self, names.gate_up), getattr(self, names.down),
               getattr(self, names.gate_up_bias) if bias else None, getattr(self, names.down_bias) if bias else None)
    return tensors, dict(transposed=bool(getattr(self, "is_transposed", names.transposed)),
                         interleaved=not getattr(self, "is_concatenated", not names.interleaved),
                         activation=self._novatune_activation)


_OUTPUT_UNREAD = contextvars.ContextVar("novatune_moe_output_unread", default=False)


@contextlib.contextmanager
def outputs_unread():
    """Inside it, the decoder layers run only to be differentiated through (patch/graphs.py's captured recompute,
    whose result roots the backward and is never read): experts modules whose family declares that their output
    feeds only residual adds (MoESpec.output_feeds_residual) skip their down projection and combine."""
    token = _OUTPUT_UNREAD.set(True)
    try:
        yield
    finally:
        _OUTPUT_UNREAD.reset(token)


def output_unread(experts: nn.Module) -> bool:
    """Whether this experts module's output goes unread now (outputs_unread and its family's declaration)."""
    return _OUTPUT_UNREAD.get() and experts._novatune_moe.output_feeds_residual


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    tensors, layout = experts_arguments(self)
    # the ids are the router's top-k over E logits: in range by construction, so the op's range check is spared
    return moe_experts(hidden_states, top_k_index, top_k_weights, *tensors, **layout, ids_from_router=True,
                       wgrad_in_place=self._novatune_wgrad_in_place, output_unread=output_unread(self))


def experts_refusal(module: nn.Module, config, moe: MoESpec) -> tuple[str | None, str | None]:
    """(why the experts module computes something moe_experts does not, or None; the activation to use)."""
    cls = type(module).__name__
    if getattr(module, "_is_expert_parallel", False):
        return f"{cls} is sharded for expert parallelism, which novatune's expert MLP does not implement", None
    if getattr(module, "has_gate", True) is False:
        return f"{cls} has no gate (plain activation experts), which novatune's expert MLP does not implement", None
    if getattr(module, "has_post_expert_norm", False):
        return f"{cls} normalises each expert's output, which novatune's expert MLP does not implement", None
    for attr in (moe.gate_up, moe.down):
        if not isinstance(getattr(module, attr, None), torch.Tensor) or getattr(module, attr).dim() != 3:
            return f"{cls} has no 3-D {attr!r} expert weight", None
    weight = getattr(module, moe.gate_up)
    if weight.is_cuda and weight.dtype != torch.bfloat16:
        return f"{cls} holds {weight.dtype} weights on CUDA; torch's grouped_mm takes bf16 only", None
    gate = getattr(type(module), "_apply_gate", None)
    if gate is not None and gate.__name__ != "_default_apply_gate":
        if moe.custom_gate_activation is None:
            return f"{cls} defines its own gate ({gate.__qualname__}), which the spec declares no activation for", None
        for attr, value in moe.gate_constants:
            if getattr(module, attr, None) != value:
                return (f"{cls}.{attr} = {getattr(module, attr, None)!r}; novatune's {moe.custom_gate_activation} "
                        f"activation computes the gate at {attr} = {value}"), None
        return None, moe.custom_gate_activation
    act = str(getattr(config, "hidden_act", "?"))
    if act not in moe.activations:
        return f"hidden_act={act!r} is not SiLU", None
    return None, "silu"


def apply_moe(model: nn.Module, spec: FamilySpec, report: PatchReport, bind, *, enabled: bool,
              wgrad_in_place: bool = True) -> None:
    """Bind the router and experts forwards on every MoE block of `model` (spec.moe), or record why not.
    `wgrad_in_place`: patch(moe_wgrad_in_place=...)."""
    moe = spec.moe
    if moe is None:
        return
    for path, module in model.named_modules():
        cls = type(module).__name__
        if cls in moe.router_classes:
            if not enabled:
                report.add(path, "moe_router", "skipped", "moe=False")
                continue
            bind(module, router_forward, report, _novatune_router=moe.router)
            report.add(path, "moe_router", "replaced", f"novatune routing ({moe.router.scoring}; logits returned "
                                                        "for the load-balancing loss)")
        elif cls in moe.experts_classes:
            why, activation = experts_refusal(module, model.config, moe) if enabled else ("moe=False", None)
            if why or activation not in ACTIVATIONS:
                report.add(path, "moe_experts", "skipped", why or f"activation {activation!r} is not implemented")
                continue
            bind(module, experts_forward, report, _novatune_moe=moe, _novatune_activation=activation,
                 _novatune_wgrad_in_place=wgrad_in_place)
            report.add(path, "moe_experts", "replaced",
                       "novatune expert MLP: one sort per layer, Triton dispatch/combine, grouped GEMMs, "
                       f"{activation} GLU (no host sync)" + ("; weight gradients added into .grad where autograd would "
                                                            "add them" if wgrad_in_place else ""))
