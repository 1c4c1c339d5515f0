"""The causal LM's loss forward: lm_head + cross-entropy as novatune's fused linear cross-entropy.

Two calling conventions are honoured, both computing exactly what the caller expects:

* transformers (`model(..., labels=..., num_items_in_batch=...)`, as `Trainer.compute_loss` calls it): the loss is
  HF's ForCausalLMLoss (shift by one, mean over non-ignored labels, or sum / num_items_in_batch), `logits` is None
  in training because the logits are never materialised.
* TRL's fused LM head (`model(..., labels=..., fused_lm_head=True)`, as `SFTTrainer.compute_loss` calls it): a
  `FusedCausalLMOutput`-like output with the per-token `log_probs` (zero on ignored labels), `entropy`, `is_top1`,
  `label_mask` and `loss`. The gradient comes from the fused kernel, which produces the gradient of the SUM of the
  token log-probs; so `log_probs` accepts only a gradient that weights every non-ignored token the same (TRL's
  "nll" loss: sum / token count). A per-token weighting (TRL's "dft" loss, RL trainers) raises in the backward
  instead of training on a wrong gradient; `patch(trainer)` refuses those trainers up front. The values of
  `log_probs`, `entropy` and `is_top1` come from the fused kernel's own pass over the logits (its per-token
  statistics: -log p, entropy, first argmax), so TRL's per-step metrics cost no second lm_head GEMM.

The stock forward (whatever was on the model before: HF's, or a trainer's wrapper) is kept in the binding, which
the installed forward object holds, so a second binding on top of a wrapper that calls the first one never recurses,
and a binding that was reverted while a wrapper still holds it delegates to its stock forward. The installed forward
is an object holding (model, binding), not a closure: `copy.deepcopy(model)` (an EMA, a teacher, a DPO reference)
gives the copy a forward that runs the copy's own weights, and `torch.save(model)` pickles it. It presents the stock
forward's signature and binds positional arguments by it.
"""
from __future__ import annotations

import inspect
import types
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from novatune.ops.linear_cross_entropy import linear_cross_entropy


@dataclass
class LossBinding:
    """What the loss forward needs besides the module's own attributes (ce mode, lm_head: set by apply.py and
    rewritten by the tuner as `_novatune_ce_mode`).

    `stock` is the forward that was on the model before: a function of the model's class called with the model
    (HF's forward; kept unbound so that a copy of the model calls it with the copy), or any other callable (a
    trainer's wrapper), called as is."""

    stock: Callable
    report: object  # PatchReport: counts the fused-loss calls
    stock_takes_model: bool = False  # stock is the class's function: call it with the model first
    active: bool = True
    pending: bool = False  # a loss forward is running: the decoder's pre-hook consumes it (see `check_bypass`)
    noted: set = field(default_factory=set)  # report notes already written

    def call_stock(self, model, *args, **kwargs):
        return self.stock(model, *args, **kwargs) if self.stock_takes_model else self.stock(*args, **kwargs)


class LossForward:
    """The causal LM's instance-level forward while patched: the loss forward, or the stock one once reverted."""

    def __init__(self, model: torch.nn.Module, binding: LossBinding, signature: inspect.Signature | None):
        self.model, self.binding, self.__signature__ = model, binding, signature

    def __call__(self, *args, **kwargs):
        if args:
            kwargs = self._keywords(args, kwargs)
        if not self.binding.active:
            return self.binding.call_stock(self.model, **kwargs)
        return causal_lm_forward(self.model, self.binding, **kwargs)

    def _keywords(self, args: tuple, kwargs: dict) -> dict:
        """Positional arguments named by the stock forward's signature (input_ids, attention_mask, position_ids,
        the cache, inputs_embeds, labels, ...), as the stock forward would bind them."""
        if self.__signature__ is None:
            raise TypeError("novatune's loss forward takes keyword arguments only here (the stock forward's "
                            "signature is unknown): call model(input_ids=..., labels=...)")
        bound = self.__signature__.bind_partial(*args, **kwargs).arguments
        out = {}
        for name, value in bound.items():
            if self.__signature__.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                out.update(value)
            else:
                out[name] = value
        return out


def bind(model: torch.nn.Module, binding: LossBinding) -> Callable[[], None]:
    """Install the loss forward on `model` (instance level); returns the undo."""
    previous = model.__dict__.get("forward")
    stock = binding.stock
    if isinstance(stock, types.MethodType) and stock.__self__ is model:
        binding.stock, binding.stock_takes_model = stock.__func__, True
    try:
        signature = inspect.signature(stock)
    except (TypeError, ValueError):
        signature = None
    forward = LossForward(model, binding, signature)
    model.__dict__["forward"] = forward

    def undo():
        binding.active = False
        if model.__dict__.get("forward") is forward:  # something wrapped it since: leave theirs in place
            if previous is None:
                model.__dict__.pop("forward", None)
            else:
                model.__dict__["forward"] = previous

    return undo


def is_loss_forward(fn) -> bool:
    """Whether `fn` (a model's instance-level forward) is novatune's loss forward."""
    return isinstance(fn, LossForward)


def causal_lm_forward(self, binding: LossBinding, input_ids=None, attention_mask=None, position_ids=None,
                      inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, fused_lm_head=False,
                      **kwargs):
    """Training with labels, or any call with TRL's `fused_lm_head=True`: hidden states -> fused linear
    cross-entropy; the logits are never materialised. Anything else: the stock forward.

    The KV cache travels in **kwargs under whichever name the caller used (`cache`, or the older
    `past_key_values`), so the stock forward sees exactly the call it would have seen (naming both makes
    transformers warn)."""
    call = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                inputs_embeds=inputs_embeds, use_cache=use_cache)
    if kwargs.get("output_router_logits") and self.__dict__.get("_novatune_aux_loss") is None:
        # a mixture-of-experts model whose router loss the patch does not compute (no MoE spec): the stock
        # forward runs, and the report says so
        if fused_lm_head:
            raise ValueError("fused_lm_head=True with output_router_logits=True: novatune's fused head does not add "
                             "the router's load-balancing loss; drop one of them")
        _note_once(binding, "output_router_logits", "calls with output_router_logits=True run the stock loss "
                   "forward (it adds the router's load-balancing loss, which the fused loss does not compute)")
        return _stock_call(self, binding, call, labels, logits_to_keep, kwargs)
    if fused_lm_head:
        if labels is None and kwargs.get("shift_labels") is None:
            raise ValueError("fused_lm_head=True needs labels (or shift_labels): the fused head scores labels")
        return _trl_fused_head(self, binding, call, labels, kwargs)
    if labels is None or not self.training:
        if labels is None and self.training and torch.is_grad_enabled():
            _note_once(binding, "no_labels", "training forwards without labels return the logits (the caller "
                       "computes its own loss from them; the fused loss runs only on calls with labels)")
        return _stock_call(self, binding, call, labels, logits_to_keep, kwargs)
    weight = _head_weight(self, binding)
    if weight is None:  # the head was wrapped after the patch: its module computes the loss
        return _stock_call(self, binding, call, labels, logits_to_keep, kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    # the backbone's output is read as a ModelOutput; a caller asking for a tuple gets the loss output's tuple
    return_dict = kwargs.pop("return_dict", None)
    shift_labels = kwargs.pop("shift_labels", None)
    num_items = kwargs.get("num_items_in_batch")
    router_loss = _wants_router_loss(self, kwargs)
    outputs = _backbone(self, binding, call, kwargs)
    hidden = outputs.last_hidden_state  # (b, s, H)
    if shift_labels is None:
        # HF's ForCausalLMLoss: position t predicts token t+1; the last position of each row predicts nothing
        shift_labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
    shift_labels = shift_labels.to(hidden.device)
    # HF divides the summed loss by num_items_in_batch when given (gradient accumulation), else takes the mean
    loss = linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), weight, shift_labels.reshape(-1),
                                reduction="mean" if num_items is None else "sum", normalizer=num_items,
                                mode=_ce_mode(self, binding), softcap=self._novatune_softcap)
    if router_loss:
        out = _with_router_loss(self, loss, outputs, attention_mask)
    else:  # training: use_cache=False, no cache to return
        out = CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=outputs.hidden_states,
                                     attentions=outputs.attentions)
    return out.to_tuple() if return_dict is False else out


def _stock_call(self, binding: LossBinding, call: dict, labels, logits_to_keep, kwargs: dict):
    """The stock forward, called by the loss forward on purpose (no labels, evaluation, a router loss it cannot
    add): the decoder's pre-hook must not count it as a forward that bypassed the loss (check_bypass)."""
    binding.pending = True
    try:
        return binding.call_stock(self, **call, labels=labels, logits_to_keep=logits_to_keep, **kwargs)
    finally:
        binding.pending = False


def _ce_mode(self, binding: LossBinding) -> str:
    """The fused loss's plan: the patch's (or a tuned) cross_entropy_mode, except that final logit soft-capping
    (Gemma 2) has no "inplace" plan: a tuned "inplace" then runs as "auto" (which never picks it), and the report
    says so."""
    mode = self._novatune_ce_mode
    if self._novatune_softcap is not None and mode == "inplace":
        _note_once(binding, "softcap_mode", "cross_entropy_mode 'inplace' runs as 'auto': the final logit "
                   "soft-capping has no in-place plan")
        return "auto"
    return mode


def _wants_router_loss(self, kwargs: dict) -> bool:
    """MoE families: whether this call adds the load-balancing loss (the call's output_router_logits, else the
    config's, as the stock forward resolves it); the flag is passed on to the backbone, which then records the
    router logits."""
    if self.__dict__.get("_novatune_aux_loss") is None:
        return False
    wants = kwargs.get("output_router_logits")
    wants = bool(self.config.output_router_logits if wants is None else wants)
    kwargs["output_router_logits"] = wants
    return wants


def _with_router_loss(self, loss, outputs, attention_mask):
    """The stock MoE causal LM's loss: loss + router_aux_loss_coef * load_balancing_loss_func(router logits, ...),
    computed by the family's own function on the same logits the stock forward would give it."""
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast

    aux = self._novatune_aux_loss(outputs.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask)
    loss = loss + self.router_aux_loss_coef * aux.to(loss.device)
    return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux, logits=None, hidden_states=outputs.hidden_states,
                                     attentions=outputs.attentions, router_logits=outputs.router_logits)


def _note_once(binding: LossBinding, key: str, text: str) -> None:
    if key not in binding.noted:
        binding.noted.add(key)
        binding.report.add("", "note", "note", text)


def _backbone(self, binding: LossBinding, call: dict, kwargs: dict):
    binding.report.calls["cross_entropy"] += 1
    binding.pending = True
    try:
        return getattr(self, self._novatune_base_attr)(**call, **kwargs)
    finally:
        binding.pending = False


def is_plain_head(head) -> bool:
    """A head the fused loss can multiply by directly: a bias-free Linear with a floating weight (not quantised)."""
    return isinstance(head, torch.nn.Linear) and head.bias is None and head.weight.dtype.is_floating_point


def _module_hooked(module: torch.nn.Module) -> bool:
    """Hooks of the module's own (forward, backward, pre or not), which only the module's call runs."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def _head_weight(self, binding: LossBinding) -> torch.Tensor | None:
    """The LM head's weight for the fused loss, looked up on each call: PEFT (a LoRA on lm_head, modules_to_save),
    `resize_token_embeddings` or a user can replace the head after the patch, and the loss must train the head the
    model has now. A plain bias-free Linear gives its weight; any other module (whose forward adds what the weight
    alone does not: a LoRA delta, a bias, an adapter switch), or a head with hooks of its own, gives None, and the
    caller runs the module itself, with a note in the report."""
    head = getattr(self, self._novatune_lm_head_attr)
    if _module_hooked(head):
        if "lm_head_hooked" not in binding.noted:
            text = (f"{self._novatune_lm_head_attr} has module hooks: the loss runs through the module, so that "
                    "they see its call (its logits materialised, not fused)")
            warnings.warn("novatune: " + text, stacklevel=3)
            _note_once(binding, "lm_head_hooked", text)
        return None
    if head is self._novatune_lm_head:
        return head.weight
    if is_plain_head(head):
        # a new plain head (a resized vocabulary): bound from now on, so the old one is not kept alive
        self.__dict__["_novatune_lm_head"] = head
        return head.weight
    if "lm_head_replaced" not in binding.noted:
        text = (f"{self._novatune_lm_head_attr} became {type(head).__module__}.{type(head).__name__} after the "
                "patch: the loss runs "
                "through that module (its logits materialised, not fused)")
        warnings.warn("novatune: " + text, stacklevel=3)
        _note_once(binding, "lm_head_replaced", text)
    return None


def _trl_fused_head(self, binding: LossBinding, call: dict, labels, kwargs: dict):
    """TRL's `fused_lm_head=True` contract (trl.trainer.utils.add_fused_lm_head), with novatune's fused loss."""
    shift_labels = kwargs.pop("shift_labels", None)
    num_items = kwargs.pop("num_items_in_batch", None)
    router_loss = _wants_router_loss(self, kwargs)
    call["use_cache"] = False
    outputs = _backbone(self, binding, call, kwargs)
    hidden = outputs.last_hidden_state
    # TRL's shapes are (b, s - 1) without shift_labels. All s positions go through the GEMMs, the last one with an
    # ignored target, and the outputs drop it: slicing the hidden states to s - 1 rows instead makes the logits'
    # leading dimension odd (4095), which sends cuBLAS to a slow unaligned kernel (the profile of
    # bench/experiments/exp_trl_overhead.py: bench/results/traces/trl_overhead_d29fdeb.txt).
    trim = shift_labels is None
    targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100) if trim else shift_labels
    targets = targets.to(hidden.device)
    mask = targets != -100
    flat_targets = targets.reshape(-1)
    weight = _head_weight(self, binding)
    if weight is None:
        log_probs, entropy, is_top1 = _token_fields_through_head(self, hidden, targets)
    else:
        # one pass over the logits: the loss and its gradient, and TRL's per-token statistics from the same sweep
        nll_sum, stats = linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), weight, flat_targets,
                                              reduction="sum", mode=_ce_mode(self, binding),
                                              return_token_stats=True, softcap=self._novatune_softcap)
        log_probs = _UniformlyWeightedLogProbs.apply(nll_sum, -stats.nll.view(mask.shape), mask)
        entropy, is_top1 = stats.entropy.view(mask.shape), (stats.argmax == flat_targets).view(mask.shape)
    if trim:
        log_probs, entropy, is_top1, mask = (t[:, :-1] for t in (log_probs, entropy, is_top1, mask))
    divisor = mask.sum().clamp(min=1) if num_items is None else num_items
    loss = -log_probs.sum() / divisor
    aux = None
    if router_loss:
        # as TRL's own fused head: the unweighted load-balancing loss in `aux_loss` (SFTTrainer adds
        # router_aux_loss_coef x aux_loss to its loss), and the weighted one added to `loss`
        aux = self._novatune_aux_loss(outputs.router_logits, self.num_experts, self.num_experts_per_tok,
                                      call["attention_mask"]).to(loss.device)
        loss = loss + self.router_aux_loss_coef * aux
    return _FusedOutput(loss=loss, log_probs=log_probs, entropy=entropy, is_top1=is_top1, label_mask=mask,
                        aux_loss=aux)


def _token_fields_through_head(self, hidden: torch.Tensor, targets: torch.Tensor):
    """TRL's per-token fields (log_probs zero on ignored targets, entropy, is_top1) from the logits of the head
    module the model has now (a wrapped head: _head_weight), with the final soft-cap the fused passes apply.
    The logits are materialised in fp32; autograd differentiates log_probs as the stock head would."""
    logits = getattr(self, self._novatune_lm_head_attr)(hidden).float()
    if self._novatune_softcap is not None:
        logits = self._novatune_softcap * torch.tanh(logits / self._novatune_softcap)
    log_softmax = torch.log_softmax(logits, dim=-1)
    mask = targets != -100
    picked = log_softmax.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(log_softmax.exp() * log_softmax).sum(-1)
        is_top1 = logits.argmax(-1) == targets
    return picked.masked_fill(~mask, 0.0), entropy, is_top1


class _FusedOutput(OrderedDict):
    """The fields of TRL's FusedCausalLMOutput, readable as attributes and as keys (ModelOutput style)."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            if name in ("log_sum_sq_probs", "mean_logits"):
                return None  # TRL's optional fields, not requested by SFTTrainer
            raise AttributeError(name) from None


class _UniformlyWeightedLogProbs(torch.autograd.Function):
    """Per-token log-probs whose gradient flows through the fused loss's SUM.

    forward: values (the fused kernel's per-token -nll). backward: the caller's gradient must weight every
    non-ignored token the same, w (TRL's nll loss: w = -1 / token count); then d(sum_t w lp_t) = -w d(nll_sum),
    passed to the fused kernel's precomputed gradient as its scale. A non-uniform weighting cannot be expressed
    through a sum: it raises (on CUDA without a host sync, as a device-side assert)."""

    @staticmethod
    def forward(ctx, nll_sum, log_probs, mask):
        ctx.save_for_backward(mask)
        return log_probs.clone()

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        grad = grad.float()
        count = mask.sum().clamp(min=1)
        w = (grad * mask).sum() / count
        spread = ((grad - w).abs() * mask).amax() if mask.numel() else grad.new_zeros(())
        torch._assert_async(spread <= 1e-5 * w.abs() + 1e-30,
                            "novatune's fused loss gives the gradient of the SUM of the token log-probs; this "
                            "caller weights tokens differently (e.g. TRL loss_type='dft'): patch with "
                            "cross_entropy=False")
        return -w, None, None


def bypass_pre_hook(model: torch.nn.Module, stack: torch.nn.Module, args) -> None:
    """The decoder stack's forward pre-hook (bound to its causal LM with functools.partial)."""
    check_bypass(model.__dict__.get("_novatune_loss_binding"), stack)


def check_bypass(binding: LossBinding | None, stack: torch.nn.Module) -> None:
    """Called by the decoder's pre-hook on every training forward with gradients: a forward that did not come
    through the loss forward means someone else computes the loss (e.g. TRL's SFTTrainer, built after
    `novatune.patch(model)`, installs its own LM head on top). The report then says so, and a warning names the
    way out."""
    if binding is None or not binding.active or not stack.training or not torch.is_grad_enabled():
        return
    if binding.pending:
        return
    report = binding.report
    report.calls["bypassed_loss"] += 1
    if report.calls["bypassed_loss"] > 1:
        return
    why = ("the fused loss is NOT in use: a training forward reached the decoder without novatune's loss forward "
           "(something replaced or wraps the model's forward after novatune.patch, e.g. TRL's SFTTrainer installs "
           "its own fused LM head when it is built: call novatune.patch(trainer) after building the trainer)")
    for e in report.entries:
        if e.kind == "cross_entropy" and e.action == "replaced":
            e.action, e.detail = "skipped", why
    warnings.warn("novatune: " + why, RuntimeWarning, stacklevel=3)
