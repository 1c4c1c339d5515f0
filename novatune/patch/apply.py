"""The one generic applier: `patch(target) -> PatchReport`.

It patches *instances* (never global classes): each matched module gets an instance-level `forward` (the stock
forward is kept on the module as `_novatune_stock_forward`), the decoder stack gets a forward pre-hook that builds
the per-batch PackedBatch. Nothing about parameters, buffers or state_dict changes, so optimizers, checkpoints,
PEFT and gradient checkpointing see the same model. `report.revert()` undoes every change.
"""
from __future__ import annotations

import functools
import inspect
import sys
import warnings
from dataclasses import dataclass, field

import torch.nn as nn

from novatune.attention.backends import SINK_BACKENDS, SOFTCAP_BACKENDS
from novatune.patch import forwards, loss, quirks
from novatune.patch.host_offsets import read_offsets_on_host
from novatune.patch.lora import apply_lora
from novatune.patch.moe import apply_moe
from novatune.patch.moe_lora import apply_moe_lora
from novatune.patch.report import PatchReport
from novatune.patch.spec import FamilySpec
from novatune.patch.specs import spec_for, supported_model_types
from novatune.patch.tiled import AUTO_MIN_BYTES, MLPTiling
from novatune.patch.tiled import check_mode as check_tiled_mlp
from novatune.patch.trainer_optim import fused_adamw
from novatune.patch.trainer_syncs import filter_on_device, freeze_after_first_step
from novatune.patch.trainers import is_trl, trainer_refusal
from novatune.patch.trl_metrics import defer_metric_syncs
from novatune.patch.versions import check_transformers

ATTENTION_BACKENDS = ("auto", "flex", "varlen", "flash", "fa4", "cudnn", "sdpa", "sdpa_docs", "reference")


@dataclass
class PatchState:
    """Per-model state the hooks read (stored on the decoder stack as `_novatune_state`)."""

    report: PatchReport
    all_attention_patched: bool = False
    graphs: object = None  # novatune.patch.graphs.LayerGraphRunner when cuda_graphs applies
    tiling: MLPTiling | None = None  # the MLPs' tiling (batches it tiles run without CUDA graphs)
    _noted: set = field(default_factory=set)

    def note_once(self, key: str, text: str) -> None:
        if key not in self._noted:
            self._noted.add(key)
            self.report.add("", "note", "note", text)


def _unwrap(target) -> tuple[nn.Module, str, object]:
    """Trainer -> its model; PEFT model -> the transformers model inside. Returns (hf_model, how it was found,
    the trainer or None)."""
    how, trainer = type(target).__name__, None
    if not isinstance(target, nn.Module) and hasattr(target, "model") and hasattr(target, "args"):
        trainer, target = target, target.model  # transformers/TRL Trainer
        how += ".model"
    if hasattr(target, "get_base_model") and callable(target.get_base_model):
        target = target.get_base_model()  # peft.PeftModel
        how += " -> PEFT base model"
    if not isinstance(target, nn.Module) or not hasattr(target, "config"):
        raise TypeError(f"novatune.patch expects a transformers model, a PEFT model or a Trainer; got {how}")
    return target, how, trainer


class ModuleForward:
    """`fn(module, ...)` as a module's instance-level forward, read like a bound method (`__func__`, `__self__`).
    An object, not a types.MethodType: pickling a bound method stores it as getattr(module, fn.__name__), which
    does not exist on the module, while this object pickles `fn` by its qualified name; a deep copy of the model
    binds the copy's forwards to the copy's modules."""

    def __init__(self, fn, module: nn.Module):
        self.__func__, self.__self__ = fn, module

    def __call__(self, *args, **kwargs):
        return self.__func__(self.__self__, *args, **kwargs)


def _bind(module: nn.Module, fn, report: PatchReport, **attrs) -> None:
    """Give `module` an instance-level forward `fn`, keeping the stock one for fallback and for revert."""
    had_instance_forward = "forward" in module.__dict__
    old = module.__dict__.get("forward")
    # written into __dict__ directly: nn.Module.__setattr__ would register a module-valued attribute (the lm_head)
    # as a second child, changing named_modules() and the state_dict
    module.__dict__["_novatune_stock_forward"] = module.forward
    module.__dict__.update(attrs)
    module.__dict__["forward"] = ModuleForward(fn, module)

    def undo():
        if had_instance_forward:
            module.__dict__["forward"] = old
        else:
            module.__dict__.pop("forward", None)
        for k in ("_novatune_stock_forward", *attrs):
            module.__dict__.pop(k, None)

    report._undo.append(undo)


def _shared_qk_eps(attn: nn.Module, spec: FamilySpec) -> float | None:
    """eps for the fused q/k-norm + RoPE kernel, or None when this attention has no (compatible) q/k norms."""
    if (spec.attention.q_norm is None or spec.attention.qk_norm_scope != "head" or spec.norm_offset
            or spec.norm_rounding != "normalised"):
        # the fused kernel normalises each head with Llama's norm (a projection-wide norm, or Gemma 3's (1 + w)
        # norms, run on their own)
        return None
    qn, kn = getattr(attn, spec.attention.q_norm, None), getattr(attn, spec.attention.k_norm, None)
    if qn is None or kn is None or type(qn).__name__ not in spec.norm_classes:
        return None
    eps = getattr(qn, spec.norm_eps_attr, None), getattr(kn, spec.norm_eps_attr, None)
    return float(eps[0]) if eps[0] is not None and eps[0] == eps[1] else None


def patch(target, *, rms_norm: bool = True, swiglu: bool = True, rope: bool = True, attention: str | bool = "auto",
          cross_entropy: bool = True, cross_entropy_mode: str = "auto", fuse_qk_norm_rope: bool = True,
          early_tied_grad: bool | None = None, swiglu_inplace_backward: bool = True, lora: bool = True,
          cuda_graphs: bool | str = "auto", tiled_mlp: bool | str = "auto", strict: bool = False,
          selection=None, moe: bool = True, moe_wgrad_in_place: bool = True,
          linear_wgrad_in_place: bool | str = "auto") -> PatchReport:
    """Patch a transformers CausalLM (Qwen3, Qwen2, Llama, Mistral, Qwen3-MoE, Mixtral, GPT-OSS, Gemma, Gemma 2,
    Gemma 3 text, Phi-3 / Phi-4-mini, OLMo 2), a PEFT model wrapping one, or a Trainer.

    rms_norm / swiglu / cross_entropy: fused kernels for every RMSNorm, the SwiGLU MLPs and lm_head + loss.
    cross_entropy_mode: "auto" | "tokens" | "vocab" | "inplace" (novatune.ops.linear_cross_entropy; auto picks
    "inplace" in training when tokens >= hidden: three GEMMs, the weight gradient written into the logits' memory).
    fuse_qk_norm_rope: Qwen3's q/k norms and RoPE in one kernel each way (H200: 65.6 µs fwd+bwd vs 109.2 for the
    separate kernels; +2% end to end, bench/results). False keeps the separate rms_norm and rope kernels.
    The fused loss's backward adds lm_head's weight gradient into its existing .grad where autograd would add it
    there itself (novatune/ops/grad_accumulation.py), a weight tied to the embedding included.
    early_tied_grad: deprecated, no effect (a FutureWarning when given). It sent a tied weight's lm_head gradient
    into .grad through a stand-in leaf, which gradient hooks on the weight and torch.autograd.grad did not see.
    swiglu_inplace_backward: the MLP's backward writes the gate/up gradients over the (dead) gate/up activations,
    as Liger does: -2 x tokens x intermediate x 2 bytes per layer in the backward (152 MiB at Qwen3-4B x 4096).
    A second backward through the same graph (retain_graph=True) then raises; set False for that. A projection
    with a forward hook (which may keep its output) keeps its output unwritten.
    lora: PEFT LoRA Linear layers on the attention/MLP projections run novatune.ops.lora_linear (one vanilla
    adapter, plain nn.Linear base; dropout > 0 keeps PEFT's exact random draws); anything else stays PEFT's and
    is listed as skipped (novatune/patch/lora.py). PEFT LoRA on the routed experts' weights (target_parameters)
    runs inside the grouped GEMMs of novatune's expert MLP (novatune/patch/moe_lora.py).
    cuda_graphs: with gradient checkpointing and novatune's attention on CUDA, each checkpointed decoder layer's
    forward, and its recompute+backward, replay from CUDA graphs instead of op by op from Python
    (novatune/patch/graphs.py). "auto" (default): with fused LoRA/QLoRA layers (an adapter step is host-bound);
    True: for any layers; "forward": the forward only, the backward recomputing eagerly (for a host too slow for
    its GPU: on a fast one it measured 3-4% slower than eager full fine-tuning); True and "forward" raise when they
    cannot apply; False never. Batches the graphs cannot take run the stock checkpointed layers, named in the
    report.
    tiled_mlp: "auto" (default) | True | False: the MLP runs on row chunks of a long batch, each recomputed in the
    backward, so its (tokens x intermediate) activations never exist whole (novatune/patch/tiled.py); "auto" tiles
    batches whose intermediate activation exceeds 1 GiB (Qwen3-4B: from 55k tokens), True any batch longer than
    one chunk. Same values; an extra MLP forward per tiled batch.
    rope + attention: novatune's attention forward (RoPE kernel, packed-row attention). `attention` picks the
    backend: "auto" (fastest available, recorded in the report), "flex", "varlen", "flash" (varlen's kernels through
    aten's ops), "fa4" (FlashAttention-4, the flash-attn-4 package), "cudnn", "sdpa", "sdpa_docs"
    (one SDPA call per document: the CPU's packed-row path), "reference"; False keeps stock attention.
    moe: the routed experts and their router run novatune's MoE op (novatune/patch/moe.py).
    moe_wgrad_in_place: the experts' weight gradients are added into their existing .grad where autograd would add
    them there itself (one process, no hooks on them: novatune/ops/moe_wgrad.py), inside the grouped GEMM on a GPU
    (novatune/kernels/moe_wgrad.py): micro-batches after the first write no fresh gradient (1.1 GiB per
    Qwen3-30B-A3B layer) and skip autograd's separate add. On by default; False returns them to autograd.
    linear_wgrad_in_place: the same for the dense projections that are plain nn.Linear modules (attention and MLP):
    the weight gradient is added into the existing .grad by the GEMM itself (novatune/ops/linear.py), one pass
    instead of a fresh gradient and autograd's add. "auto" (default): on for families whose spec declares
    post-norms (spec.post_norms: OLMo 2, where a norm reads the MLP's output inside the layer's checkpoint), off
    elsewhere; and the MLP's down projection returns its gradient to autograd while the MLP runs under a checkpoint
    of its own (memory.policy recompute_mlp, the tiled MLP's chunks). This autograd Function saves its inputs after
    its GEMM, so a checkpoint's recompute can no longer stop before the down projection's GEMM where nothing inside
    the checkpoint reads that output: on Qwen3-4B 144 more GEMMs per step, 2.1% slower (bench.jsonl
    session29-1, the timeline session29-2); OLMo-2-7B under recompute_mlp 10,972 tok/s against 11,339 returned
    (session30-2); in another call 11,706 with the down projection alone returned against 11,650
    (session30-3). OLMo-2-7B, whose post-norm reads it, gained 1.1-1.3% (session24-3, session29-1,
    session29-5). Elsewhere, with the down projection left out, it measured +1.4% on the seed under
    recompute_mlp (session30-3) but -5% under full-layer checkpointing and -7% on the MoE cut's kept layers
    (session30-4): off there. True or False asks for it everywhere or nowhere.
    strict=True raises instead of skipping anything the spec cannot patch.
    selection: a novatune.ops.dispatch.Selection (tuned implementations as a value, e.g. from `novatune tune`'s
    cache; novatune.patch(model, tune=...) builds one) installed with the patch; its choices are listed in the
    report (report.choices) and report.revert() removes them.
    Idempotent: patching a patched model returns its existing report.
    """
    check_transformers()
    model, how, trainer = _unwrap(target)
    existing = getattr(model, "_novatune_report", None)
    options = {k: v for k, v in locals().items() if k in _PATCH_DEFAULTS and k != "early_tied_grad"}
    if early_tied_grad is not None:
        warnings.warn("novatune.patch(early_tied_grad=...) has no effect and will be removed: the fused loss's "
                      "backward adds a tied lm_head's gradient into the weight's existing .grad where autograd "
                      "would, which gradient hooks and torch.autograd.grad see; drop the argument",
                      FutureWarning, stacklevel=3)  # the caller of novatune.patch (novatune/__init__.py's)
    if existing is not None and not existing.reverted:
        _check_same_options(existing, options)
        _patch_late_adapters(model, existing, lora)
        if trainer is not None:
            _rebind_loss_over_trainer(model, existing, trainer)
            spec = spec_for(getattr(model.config, "model_type", "?"))
            if spec is not None:
                _defer_trainer_metrics(trainer, existing, spec)
            _host_offsets(trainer, existing)
            _trainer_syncs(trainer, existing)
        _recheck_lm_head(model, existing)
        return existing
    check_tiled_mlp(tiled_mlp)
    if linear_wgrad_in_place not in ("auto", True, False):
        raise ValueError(f"linear_wgrad_in_place={linear_wgrad_in_place!r}: choose 'auto', True or False")
    if attention not in (False, *ATTENTION_BACKENDS):
        raise ValueError(f"attention={attention!r}: choose one of {ATTENTION_BACKENDS} or False")
    model_type = getattr(model.config, "model_type", "?")
    spec = spec_for(model_type)
    report = PatchReport(family=spec.name if spec else None, model_class=type(model).__name__, options=options)
    if spec is None:
        msg = f"model_type {model_type!r} has no novatune spec (supported: {', '.join(supported_model_types())})"
        if strict:
            raise ValueError(msg)
        report.add("", "model", "skipped", msg)
        return report
    if how != type(model).__name__:
        report.add("", "target", "note", f"patched {how}")
    refused = quirks.refusals(model.config, spec)  # once per model: every module of a refused kind reads it
    whole_model = refused.get("model")
    if whole_model:
        if strict:
            raise ValueError(whole_model)
        report.add("", "model", "skipped", whole_model)
        return report
    if cross_entropy_mode not in ("auto", "tokens", "vocab", "inplace"):
        raise ValueError(f"cross_entropy_mode={cross_entropy_mode!r}: choose auto, tokens, vocab or inplace")
    # auto: the families whose spec declares post-norms, with the MLP's down projection under forwards._down_wgrad's
    # rule (None: as asked for every projection)
    auto_wgrad = linear_wgrad_in_place == "auto"
    down_wgrad = bool(spec.post_norms) if auto_wgrad else None
    linear_wgrad_in_place = bool(spec.post_norms) if auto_wgrad else linear_wgrad_in_place
    _apply_spec(model, spec, report, refused, rms_norm=rms_norm, swiglu=swiglu, rope=rope, attention=attention,
                cross_entropy=cross_entropy, ce_mode=cross_entropy_mode, fuse_qk=fuse_qk_norm_rope,
                swiglu_inplace=swiglu_inplace_backward, tiled_mlp=tiled_mlp,
                wgrad_in_place=linear_wgrad_in_place, down_wgrad=down_wgrad,
                trainer_refusal=trainer_refusal(trainer, model))
    apply_moe(model, spec, report, _bind, enabled=moe, wgrad_in_place=moe_wgrad_in_place)
    apply_moe_lora(model, spec, report, _bind, enabled=lora)
    apply_lora(model, spec, report, enabled=lora, bind=_bind)
    _defer_trainer_metrics(trainer, report, spec)
    _host_offsets(trainer, report)
    _trainer_syncs(trainer, report)
    if strict and report.skipped():
        report.revert()
        raise RuntimeError("novatune.patch(strict=True) could not patch everything:\n" + str(report))
    if cuda_graphs not in (True, False, "auto", "forward"):
        raise ValueError(f"cuda_graphs={cuda_graphs!r}: choose 'auto', 'forward', True or False")
    state = _find_state(model)
    if cuda_graphs and state is not None:
        from novatune.patch import graph_install

        graph_install.install(model, state[0], state[1], report, cuda_graphs)
    elif cuda_graphs in (True, "forward"):
        raise ValueError(f"cuda_graphs={cuda_graphs!r} needs novatune's attention forward (attention != False)")
    if selection is not None:
        selection.apply(model, report)
    model._novatune_report = report
    report._undo.insert(0, lambda: model.__dict__.pop("_novatune_report", None))
    return report


_PATCH_DEFAULTS = {name: p.default for name, p in inspect.signature(patch).parameters.items()
                   if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _check_same_options(report: PatchReport, options: dict) -> None:
    """A second patch() of a patched model returns its report: an option it asks for that differs from the first
    call's would silently not apply, so it raises instead."""
    differ = {k: v for k, v in options.items()
              if k != "selection" and v != _PATCH_DEFAULTS[k] and report.options.get(k, _PATCH_DEFAULTS[k]) != v}
    if differ:
        first = {k: report.options.get(k, _PATCH_DEFAULTS[k]) for k in differ}
        raise ValueError(f"this model is already patched with {first}; this call asks for {differ}, which the "
                         "existing patch does not change: call report.revert() (the report patch() returned) "
                         "first, then patch with the new options")


def _patch_late_adapters(model: nn.Module, report: PatchReport, lora: bool) -> None:
    """PEFT adapters added after the model was patched (get_peft_model, or a trainer's peft_config, then
    patch(trainer)): their LoRA layers get the fused forwards now, as a first patch would have given them."""
    seen = {e.path for e in report.entries if e.kind in ("lora", "moe_lora")}
    spec = spec_for(getattr(model.config, "model_type", "?"))
    if spec is None:
        return
    before = len(report.entries)
    apply_moe_lora(model, spec, report, _bind, enabled=lora, skip=seen)
    apply_lora(model, spec, report, enabled=lora, bind=_bind, skip=seen)
    if len(report.entries) > before:
        report.add("", "note", "note", "LoRA adapters added after the first novatune.patch were patched by a later "
                   "call (CUDA graphs were decided at the first call: patch after adding adapters to use them)")


def _recheck_lm_head(model: nn.Module, report: PatchReport) -> None:
    """A head replaced since the first patch (a LoRA on lm_head, modules_to_save, a resized vocabulary): the loss
    forward looks it up on each call (patch/loss.py: _head_weight); the report says now which path it takes."""
    attr = model.__dict__.get("_novatune_lm_head_attr")
    if attr is None:
        return
    head = getattr(model, attr)
    plain = loss.is_plain_head(head)
    for e in report.entries:
        if e.kind != "cross_entropy" or e.action not in ("replaced", "skipped"):
            continue
        if plain and e.action == "skipped" and "after the first patch" in e.detail:  # merged back, say
            e.action, e.detail = "replaced", _loss_detail(model)
        elif not plain:
            e.action, e.detail = "skipped", (f"lm_head became {type(head).__module__}.{type(head).__name__} after "
                                             "the first patch: the loss runs through that module (a LoRA delta or "
                                             "an adapter switch is not in the weight the fused loss multiplies by)")


def _patch_mlp(module: nn.Module, path: str, spec: FamilySpec, config, report: PatchReport, refused: dict, *,
               swiglu: bool, swiglu_inplace: bool, tiling: MLPTiling | None, wgrad_in_place: bool,
               down_wgrad: bool | None) -> None:
    act = str(getattr(config, spec.mlp.act_config, "?"))
    tiled = "" if tiling is None else f"; tiled along the sequence ({_tiling_words(tiling)})"
    why = (refused.get("mlp", "swiglu=False") if not swiglu or "mlp" in refused else
           f"{spec.mlp.act_config}={act!r} is not what novatune {spec.mlp.glu} computes ({spec.mlp.activations})"
           if act not in spec.mlp.activations else quirks.mlp_refusal(module, spec))
    if why is None:
        _bind(module, forwards.swiglu_mlp_forward, report, _novatune_mlp=spec.mlp,
              _novatune_swiglu_inplace=swiglu_inplace, _novatune_tiling=tiling,
              _novatune_linear_wgrad=wgrad_in_place, _novatune_down_wgrad=down_wgrad)
        gate_up = "fused gate_up GEMM" if spec.mlp.gate_up_proj else "gate/up GEMMs"
        down = " (the down projection's too, except under a checkpoint of the MLP's own)" if down_wgrad else ""
        report.add(path, "mlp", "replaced", f"{gate_up} + novatune {spec.mlp.glu} + down GEMM"
                   + (" (gradients written over gate/up)" if swiglu_inplace else "")
                   + (f"; weight gradients accumulated inside the GEMMs{down}" if wgrad_in_place else "") + tiled)
        return
    report.add(path, "mlp", "skipped", why)
    if tiling is not None and "mlp" not in refused:
        # the stock MLP is still row-wise: tiling it computes the same function
        _bind(module, forwards.tiled_stock_mlp_forward, report, _novatune_tiling=tiling)
        report.add(path, "tiled_mlp", "replaced", f"stock MLP{tiled}")


def _patch_norm(module: nn.Module, path: str, kind: str, spec: FamilySpec, report: PatchReport) -> None:
    _bind(module, forwards.rms_norm_forward, report, _novatune_eps_attr=spec.norm_eps_attr,
          _novatune_norm_rounding=spec.norm_rounding, _novatune_norm_offset=float(spec.norm_offset))
    op = "offset_rms_norm" if spec.norm_rounding == "output" else "rms_norm"
    report.add(path, kind, "replaced", f"novatune {op} (Triton on CUDA, fp32 reference on CPU)"
               + ("; one rounding after the weight, in fp32" if spec.norm_rounding == "output" else "")
               + (f"; weight offset {spec.norm_offset:g} (x_hat * ({spec.norm_offset:g} + w))"
                  if spec.norm_offset else "")
               + ("; on the sublayer's output before the residual add (the layer's stock order)"
                  if kind == "post_norm" else ""))


def _tiling_words(tiling: MLPTiling) -> str:
    return ("every batch longer than one chunk" if tiling.mode is True else
            f"batches whose intermediate activation exceeds {AUTO_MIN_BYTES / 2**30:g} GiB")


def _bind_attention(module: nn.Module, path: str, spec: FamilySpec, config, report: PatchReport, *, backend,
                    qk_eps: float | None, wgrad_in_place: bool) -> None:
    window = quirks.layer_window(module, config, spec)
    # sinks / soft-capping: only the backends that apply them may be set on this module later (a tuned selection
    # included)
    softcap = getattr(module, spec.attention.softcap, None) if spec.attention.softcap else None
    allowed = ({"_novatune_attn_backend_allowed": ("auto", *SINK_BACKENDS)} if _has_sinks(module, spec) else
               {"_novatune_attn_backend_allowed": ("auto", *SOFTCAP_BACKENDS)} if softcap is not None else {})
    split = quirks.qkv_split(module) if spec.attention.qkv_proj is not None else None
    _bind(module, forwards.attention_forward, report, _novatune_attn=spec.attention, _novatune_attn_backend=backend,
          _novatune_fuse_qk_norm=qk_eps is not None, _novatune_qk_eps=qk_eps, _novatune_window=window,
          _novatune_qkv_split=split, _novatune_linear_wgrad=wgrad_in_place, **allowed)
    extra = "; q/k-norm + RoPE fused in one kernel" if qk_eps is not None else ""
    extra += f"; fused {spec.attention.qkv_proj} split {list(split)}" if split else ""
    extra += ("; q/k norms over the whole projection" if spec.attention.q_norm is not None
              and spec.attention.qk_norm_scope == "projection" else "")
    rotary = quirks.rotary_dim(config, module.head_dim)
    extra += f"; partial rotary (first {rotary} of {module.head_dim} features)" if rotary else ""
    extra += f"; sliding window {window} per document" if window is not None else ""
    extra += "; attention sinks per head" if _has_sinks(module, spec) else ""
    extra += f"; logits soft-capped at {softcap}" if softcap is not None else ""
    report.add(path, "attention", "replaced", f"novatune rope + packed attention (backend={backend}){extra}")


def _has_sinks(module: nn.Module, spec: FamilySpec) -> bool:
    return spec.attention.sinks is not None and getattr(module, spec.attention.sinks, None) is not None


def _find_state(model: nn.Module):
    """(decoder stack, its PatchState) when the attention was patched, else None."""
    for m in model.modules():
        st = m.__dict__.get("_novatune_state")
        if st is not None:
            return m, st
    return None


def _apply_spec(model: nn.Module, spec: FamilySpec, report: PatchReport, refused: dict[str, str], *, rms_norm,
                swiglu, rope, attention, cross_entropy, ce_mode, fuse_qk, swiglu_inplace,
                tiled_mlp="auto", trainer_refusal=None, wgrad_in_place: bool = False,
                down_wgrad: bool | None = None) -> None:
    """Bind the spec's forwards module by module; `refused` (quirks.refusals of this model) names the kinds the
    spec cannot honour."""
    config = model.config
    tiling = MLPTiling(tiled_mlp, int(config.intermediate_size)) if tiled_mlp is not False else None
    base = getattr(model, spec.base_model_attr, None)
    is_causal_lm = base is not None and hasattr(model, spec.lm_head_attr)
    stack = base if is_causal_lm else model  # a bare decoder stack (e.g. AutoModel) can be patched too
    state = PatchState(report, tiling=tiling)
    attn_total = attn_done = 0
    qk_norm_names = {spec.attention.q_norm, spec.attention.k_norm} - {None}
    stock_kept = {cls: (kind, why) for cls, kind, why in spec.stock_modules}
    for path, module in model.named_modules():
        cls = type(module).__name__
        leaf = path.rsplit(".", 1)[-1]
        if cls in spec.norm_classes:
            kind = "qk_norm" if leaf in qk_norm_names else "post_norm" if leaf in spec.post_norms else "rms_norm"
            why = (refused.get("rms_norm", "rms_norm=False") if not rms_norm or "rms_norm" in refused else
                   None if hasattr(module, spec.norm_eps_attr) else
                   f"no attribute {spec.norm_eps_attr!r} (eps) on {cls}")
            if why:
                report.add(path, kind, "skipped", why)
            else:
                _patch_norm(module, path, kind, spec, report)
        elif cls in spec.mlp_classes:
            _patch_mlp(module, path, spec, config, report, refused, swiglu=swiglu, swiglu_inplace=swiglu_inplace,
                       tiling=tiling, wgrad_in_place=wgrad_in_place, down_wgrad=down_wgrad)
        elif cls in stock_kept:
            kind, why = stock_kept[cls]
            report.add(path, kind, "skipped", why)
        elif cls in spec.attention_classes:
            attn_total += 1
            why = ("attention=False" if attention is False else "rope=False" if not rope else
                   refused.get("attention") or quirks.attention_refusal(module, spec, attention))
            if why:
                report.add(path, "attention", "skipped", why)
                continue
            _bind_attention(module, path, spec, config, report, backend=attention,
                            qk_eps=_shared_qk_eps(module, spec) if rms_norm and fuse_qk and "rms_norm" not in refused
                            else None, wgrad_in_place=wgrad_in_place)
            attn_done += 1
    # only when every layer reads the PackedBatch may HF's mask construction be skipped (attention dropout sends
    # training forwards to the stock attention, which needs the mask)
    state.all_attention_patched = (attn_total > 0 and attn_done == attn_total
                                   and not getattr(config, "attention_dropout", 0.0))
    if attn_done:
        stack._novatune_state = state
        handle = stack.register_forward_pre_hook(forwards.decoder_pre_hook, with_kwargs=True)
        report.add(spec.base_model_attr if is_causal_lm else "", "packing", "replaced",
                   "PackedBatch built once per batch (cu_seqlens on the host), shared by every layer")

        def undo_hook():
            handle.remove()
            stack.__dict__.pop("_novatune_state", None)

        report._undo.append(undo_hook)
    if not is_causal_lm:
        if base is not None:  # a task head over the decoder (sequence classification: a reward model)
            report.add("", "note", "note", f"{type(model).__name__} has no {spec.lm_head_attr}: its own head and loss "
                       "stay stock (novatune's fused loss is the causal LM's)")
        return
    lm_head = getattr(model, spec.lm_head_attr)
    if not cross_entropy:
        report.add(spec.lm_head_attr, "cross_entropy", "skipped", "cross_entropy=False")
    elif not isinstance(lm_head, nn.Linear) or lm_head.bias is not None:
        with_bias = " with bias" if getattr(lm_head, "bias", None) is not None else ""
        report.add(spec.lm_head_attr, "cross_entropy", "skipped",
                   f"lm_head is {type(lm_head).__name__}{with_bias}"
                   " (fused CE needs a plain bias-free Linear; a LoRA-wrapped lm_head keeps stock loss)")
    elif "cross_entropy" in refused:
        report.add(spec.lm_head_attr, "cross_entropy", "skipped", refused["cross_entropy"])
    elif trainer_refusal:
        report.add(spec.lm_head_attr, "cross_entropy", "skipped", trainer_refusal)
    elif isinstance(aux := _aux_loss_function(model, spec), str):
        report.add(spec.lm_head_attr, "cross_entropy", "skipped", aux)
    else:
        _bind_loss(model, stack, report, _novatune_base_attr=spec.base_model_attr, _novatune_lm_head=lm_head,
                   _novatune_lm_head_attr=spec.lm_head_attr, _novatune_ce_mode=ce_mode,
                   _novatune_aux_loss=aux, _novatune_softcap=_final_softcap(config, ce_mode))
        report.add(spec.lm_head_attr, "cross_entropy", "replaced", _loss_detail(model))


def _final_softcap(config, ce_mode: str) -> float | None:
    """The final logit soft-cap the fused loss applies (Gemma 2), or None. Only reached when the spec honours it
    (quirks.refusals refuses the loss otherwise)."""
    softcap = getattr(config, "final_logit_softcapping", None) or None
    if softcap is not None and ce_mode == "inplace":
        raise ValueError(f"cross_entropy_mode={ce_mode!r}: this model soft-caps its final logits "
                         f"(final_logit_softcapping={softcap}), which the fused loss has no in-place plan for; "
                         "use cross_entropy_mode='auto', 'tokens' or 'vocab'")
    return softcap


def _aux_loss_function(model: nn.Module, spec: FamilySpec):
    """The family's load-balancing loss function (the one its stock causal LM calls when output_router_logits is
    on), None for dense families, or a string saying why it cannot be found."""
    if spec.moe is None or spec.moe.aux_loss is None:
        return None
    fn = getattr(sys.modules.get(type(model).__module__), spec.moe.aux_loss, None)
    return fn if callable(fn) else (f"{type(model).__module__} has no {spec.moe.aux_loss!r} (the router loss the "
                                    "fused loss must add); this transformers release changed the family")


def _loss_detail(model: nn.Module) -> str:
    tied = model._novatune_lm_head.weight is getattr(model.get_input_embeddings(), "weight", None)
    return (f"fused linear cross-entropy (mode {model._novatune_ce_mode}, fp32 lm_head grad; logits=None in "
            "training; TRL's fused_lm_head honoured)" + ("; tied embeddings" if tied else "")
            + (f"; final logits soft-capped at {model._novatune_softcap} inside the fused passes"
               if model.__dict__.get("_novatune_softcap") is not None else ""))


def _bind_loss(model: nn.Module, stack: nn.Module, report: PatchReport, **attrs) -> None:
    """The loss forward on the causal LM, plus a pre-hook on the decoder stack that notices training forwards that
    bypass it (report.calls, loss.check_bypass)."""
    binding = loss.LossBinding(stock=model.forward, report=report)
    model.__dict__.update(attrs)
    undo_forward = loss.bind(model, binding)
    model.__dict__["_novatune_loss_binding"] = binding
    # a partial of a module-level function, not a closure: a copy of the model (deepcopy) checks its own binding
    handle = stack.register_forward_pre_hook(functools.partial(loss.bypass_pre_hook, model))

    def undo():
        handle.remove()
        undo_forward()
        for k in ("_novatune_loss_binding", *attrs):
            model.__dict__.pop(k, None)

    report._undo.append(undo)


def _defer_trainer_metrics(trainer, report: PatchReport, spec) -> None:
    """A TRL trainer whose loss the fused head computes reads its metrics at logging time (patch/trl_metrics.py)."""
    if trainer is None or not is_trl(trainer) or "compute_loss" in trainer.__dict__:
        return
    if any(e.action == "replaced" for e in report.entries if e.kind == "cross_entropy"):
        defer_metric_syncs(trainer, report, spec.lm_head_attr)


def _host_offsets(trainer, report: PatchReport) -> None:
    """A trainer of a model whose packed attention is patched gets its batches' offsets from the collator's CPU
    tensors (patch/host_offsets.py)."""
    if trainer is not None and report.replaced("packing"):
        read_offsets_on_host(trainer, report)


def _trainer_syncs(trainer, report: PatchReport) -> None:
    """A Trainer's per-micro-batch logging filter runs on the device, the objects alive after its first step are
    frozen out of the garbage collector's walks (patch/trainer_syncs.py), and its AdamW steps through novatune's
    kernel with the clipping folded in (patch/trainer_optim.py)."""
    if trainer is not None:
        filter_on_device(trainer, report)
        freeze_after_first_step(trainer, report)
        fused_adamw(trainer, report)


def _rebind_loss_over_trainer(model: nn.Module, report: PatchReport, trainer) -> None:
    """`patch(trainer)` on a model patched before the trainer was built: a trainer that replaced the model's
    forward (TRL's fused LM head) now sits on top of the loss forward; put the loss forward back on top of it, or
    record why it cannot be."""
    binding = model.__dict__.get("_novatune_loss_binding")
    if binding is None or not binding.active:
        return
    refusal = trainer_refusal(trainer, model)
    entries = [e for e in report.entries if e.kind == "cross_entropy"]
    if not refusal and loss.is_loss_forward(model.__dict__.get("forward")):
        return  # still on top, and the trainer trains on what it computes
    if refusal:
        binding.active = False
        for e in entries:
            e.action, e.detail = "skipped", refusal
        return
    new = loss.LossBinding(stock=model.forward, report=report)
    undo_forward = loss.bind(model, new)
    model.__dict__["_novatune_loss_binding"] = new
    report._undo.append(undo_forward)
    for e in entries:
        e.action, e.detail = "replaced", _loss_detail(model)
