"""Cross-entropy of the lm_head without materialising the fp32 logits: `novatune.ops.linear_cross_entropy`.

    loss = linear_cross_entropy(hidden, lm_weight, labels)          # labels already shifted (HF's shift)
    loss = linear_cross_entropy(hidden, lm_weight, labels, normalizer=num_items_in_batch)   # grad accumulation

Same value and gradients as F.cross_entropy((hidden @ lm_weight.T).float(), labels, ignore_index, reduction)
up to rounding (the logits chunk is computed in the input dtype, as HF does before its .float()).

    loss = linear_cross_entropy(hidden, lm_weight, labels, mode="vocab")     # force a plan (default "auto")

mode: "tokens" (chunks of tokens against the whole vocab: 3 GEMMs; at Qwen3-4B x 4096 tokens one chunk, i.e.
the full bf16 logits + grad_W: 1.95 GiB), "vocab" (two passes over vocab slices: 4 GEMMs, the logits never exist
beyond one (T, Vc) slice, grad_W written slice by slice with fp32 accumulation inside one GEMM per slice),
"inplace" (3 GEMMs on transposed logits, grad_W written into the memory of logits already consumed and returned as
that buffer: extra peak ~ T*V*e, 1.22 GiB at Qwen3-4B x 4096; needs tokens >= hidden, else "tokens"), "auto"
("inplace" when grad_W is wanted, T >= H and (T-H)*V*e <= 1 GiB; else "vocab" whenever the full logits would
exceed 256 MiB and grad_W is wanted; else token chunks). Details: novatune.kernels.linear_cross_entropy.

Reductions: "mean" divides by the non-ignored labels of THIS call; "sum" is the plain sum; `normalizer` (number or
0-dim tensor) overrides both: loss = sum / normalizer. Passing HF's num_items_in_batch (target tokens of the whole
accumulated batch) makes the micro-batch gradients add up to the large-batch gradient exactly (trl #2175).
All labels ignored: "sum" -> 0, "mean" -> NaN (0/0, as F.cross_entropy), gradients zero; never an error.
reduction="none" is not supported: the gradients are computed in the forward, before a per-token grad_output
could be known (the chunking is what saves the memory).

Ops:
  novatune::linear_cross_entropy(hidden (T,H), weight (V,H), labels (T,), divisor 0-dim, bias?, ignore_index,
      grad_hidden, grad_weight, grad_bias, chunk_tokens, mode="auto", vocab_slice=0, token_stats=False)
      (vocab_slice: columns per slice of "vocab", rows of the temp block of "inplace"; 0 = planned)
      -> (loss, dhidden, dweight, dbias, nll (T,), stats (2, T) = (lse, entropy), argmax (T,) int64)
      mutates nothing (the trainer's grad_output promise takes an eager path of its own, which adds grad_W into
      lm_head's .grad: see "grad_W into .grad" below). The gradients (already divided by the divisor) come out
      of the forward; those not
      requested (no requires_grad, or grad mode off: eval) are never computed and come back as empty (0,) tensors;
      so do the token statistics unless token_stats (the functional's return_token_stats: TokenStats).
  novatune::linear_cross_entropy_scale_(grad!, grad_output) -> ()
      The eager backward: multiplies a saved gradient by grad_output IN PLACE, which avoids a second (V, H)
      buffer at the backward's memory peak (0.78 GB at Qwen3-4B). Consequence: a second backward through the
      same graph (retain_graph=True) raises autograd's "modified by an inplace operation" error instead of
      returning wrongly scaled gradients. When traced (torch.compile, AOTAutograd, make_fx) the backward scales
      out of place with plain torch ops instead: AOTAutograd's partitioner rejects a backward that mutates a
      saved forward output, and inside a compiled graph the mutation would be functionalised into a copy anyway.
      Where autograd would add the weight's gradient into an existing `.grad` itself (a Parameter under gradient
      accumulation, novatune.ops.moe_wgrad's rules; a weight tied to the embedding too), the eager backward adds
      grad_W * grad_output into that .grad in one pass and returns None for it: one pass over the (V, H) gradient
      instead of two. The saved gradient is then left as it is, so a second
      backward through the graph then adds again instead of raising.

Device rule (novatune.ops._backend): CUDA (or CPU under TRITON_INTERPRET=1) -> the Triton row kernel between
cuBLAS GEMMs (novatune.kernels.linear_cross_entropy); CPU -> the same chunk / slice loops in fp32 plain PyTorch,
so memory stays bounded on the CPU too.
"""
from __future__ import annotations

import contextlib
import functools
import math
import threading
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from novatune.kernels import linear_cross_entropy as _k
from novatune.ops._backend import use_triton
from novatune.ops.contract import Candidate, OpSpec, compiled
from novatune.ops.grad_accumulation import accumulates_into_grad, grad_takes_adds
from novatune.reference import linear_cross_entropy as _ref

_REDUCTIONS = ("mean", "sum")


@torch.library.custom_op("novatune::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(hidden: Tensor, weight: Tensor, labels: Tensor, divisor: Tensor, bias: Tensor | None,
                            ignore_index: int, grad_hidden: bool, grad_weight: bool, grad_bias: bool,
                            chunk_tokens: int, mode: str = "auto", vocab_slice: int = 0,
                            token_stats: bool = False,
                            softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    T = hidden.shape[0]
    stats = top = None
    if token_stats:
        stats = torch.empty(2, T, device=hidden.device, dtype=torch.float32)  # lse, entropy
        top = torch.empty(T, device=hidden.device, dtype=torch.int64)
    with torch.autocast(hidden.device.type, enabled=False):  # dtypes were settled by the caller
        loss, rows, gh, gw, gb = _k.linear_cross_entropy_fwd(
            hidden, weight, labels, divisor, bias=bias, ignore_index=ignore_index, grad_hidden=grad_hidden,
            grad_weight=grad_weight, grad_bias=grad_bias, chunk_tokens=chunk_tokens or None, mode=mode,
            vocab_slice=vocab_slice or None, use_triton=use_triton(hidden),
            token_stats=None if stats is None else (stats[0], stats[1], top), softcap=softcap or None)
    def empty(like, dtype=None):  # a fresh one per slot: outputs of a custom op must not alias each other
        return like.new_empty(0, dtype=dtype)

    return (loss, empty(hidden) if gh is None else gh, empty(weight) if gw is None else gw,
            empty(weight) if gb is None else gb, rows if token_stats else empty(hidden, torch.float32),
            empty(hidden, torch.float32) if stats is None else stats,
            empty(labels, torch.int64) if top is None else top)


@linear_cross_entropy_op.register_fake
def _(hidden, weight, labels, divisor, bias, ignore_index, grad_hidden, grad_weight, grad_bias, chunk_tokens,
      mode="auto", vocab_slice=0, token_stats=False, softcap=0.0):
    torch._check(hidden.dim() == 2 and weight.dim() == 2 and hidden.shape[1] == weight.shape[1],
                 lambda: "linear_cross_entropy: hidden (T, H) and weight (V, H) expected")
    loss = hidden.new_empty((), dtype=torch.float32)
    gh = hidden.new_empty(hidden.shape) if grad_hidden else hidden.new_empty(0)
    gw = weight.new_empty(weight.shape) if grad_weight else weight.new_empty(0)
    gb = bias.new_empty(bias.shape) if (grad_bias and bias is not None) else weight.new_empty(0)
    T = hidden.shape[0] if token_stats else 0
    return (loss, gh, gw, gb, hidden.new_empty(T, dtype=torch.float32),
            hidden.new_empty((2, T) if token_stats else (0,), dtype=torch.float32),
            labels.new_empty(T, dtype=torch.int64))


@torch.library.custom_op("novatune::linear_cross_entropy_scale_", mutates_args=("grad",))
def linear_cross_entropy_scale_(grad: Tensor, grad_output: Tensor) -> None:
    _k.linear_cross_entropy_bwd(grad_output, grad, use_triton=use_triton(grad))


@linear_cross_entropy_scale_.register_fake
def _(grad, grad_output):
    return None


def _setup_context(ctx, inputs, output) -> None:
    _, dhidden, dweight, dbias, *_token_stats = output
    ctx.save_for_backward(dhidden, dweight, dbias)
    hidden, weight, bias = inputs[0], inputs[1], inputs[4]
    # the Parameter whose .grad the backward may add the weight's gradient into (a tied lm_head/embedding weight
    # too: its embedding part then accumulates as usual); only for a trained weight
    ctx.weight_param = weight if type(weight) is nn.Parameter and weight.requires_grad else None
    ctx.input_shapes = (hidden.shape, weight.shape, None if bias is None else bias.shape)
    # Only the loss is used downstream. By default autograd hands the backward a ZERO tensor for every other output
    # (allocated at the start of the backward: a (V, H) one for dweight, 0.72 GiB at Qwen3-4B, which set the
    # training step's memory peak); the backward ignores them, so let them stay None.
    ctx.set_materialize_grads(False)


def _traced(*tensors: Tensor) -> bool:
    """Anything but plain eager: torch.compile / export, a dispatch mode (make_fx, fake, functionalisation), or
    tensor subclasses (FakeTensor, FunctionalTensor)."""
    return (torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None
            or any(type(t) is not torch.Tensor for t in tensors))


def _backward(ctx, g_loss, _g_dhidden, _g_dweight, _g_dbias, *_g_token_stats):
    # Only the loss is differentiable in practice; the gradient outputs and the token statistics are internal (the
    # functional detaches them).
    saved = ctx.saved_tensors
    in_place = not _traced(g_loss, *saved)
    grads = []
    needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[4])
    for i, (need, g, shape) in enumerate(zip(needs, saved, ctx.input_shapes)):
        if not need:
            grads.append(None)
        elif g.numel() == 0:  # an input with no elements (0 tokens): its gradient is empty, not missing
            grads.append(g.new_zeros(shape))
        elif in_place and i == 1 and _adds_into_grad(ctx.weight_param, g):
            # micro-batches after the first under gradient accumulation: the chain rule and autograd's addition in
            # one pass over the (V, H) gradient instead of two (scale in place, then AccumulateGrad's add)
            into = ctx.weight_param.grad
            _k.linear_cross_entropy_bwd_into(g_loss, g, into, use_triton=use_triton(g))
            torch.autograd.graph.increment_version(into)  # as AccumulateGrad's in-place add would
            grads.append(None)
        elif in_place:
            torch.ops.novatune.linear_cross_entropy_scale_(g, g_loss)
            grads.append(g)
        else:  # fp32 multiply, one rounding: the same numbers as the kernel
            grads.append((g.float() * g_loss.float()).to(g.dtype))
    gh, gw, gb = grads
    return gh, gw, None, None, gb, None, None, None, None, None, None, None, None, None


def _adds_into_grad(param: nn.Parameter | None, grad: Tensor) -> bool:
    """Where autograd would add `grad` into `param.grad` itself (novatune.ops.moe_wgrad's rules), of the same shape,
    dtype and layout."""
    if param is None or not accumulates_into_grad(param):
        return False
    into = param.grad
    return (into is not None and into.shape == grad.shape and into.dtype == grad.dtype and into.is_contiguous()
            and grad.is_contiguous())


linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


def _divisor(labels: Tensor, ignore_index: int, reduction: str, normalizer) -> Tensor:
    """The denominator as a 0-dim fp32 device tensor (no host sync)."""
    dev = labels.device
    if normalizer is not None:
        if torch.is_tensor(normalizer):
            return normalizer.detach().to(device=dev, dtype=torch.float32).reshape(())
        return torch.full((), float(normalizer), device=dev, dtype=torch.float32)
    if reduction == "mean":
        return (labels != ignore_index).sum().to(torch.float32)
    return torch.ones((), device=dev, dtype=torch.float32)


def _check_label_range(labels: Tensor, vocab: int, ignore_index: int) -> None:
    """Labels outside [0, V) other than ignore_index raise, as F.cross_entropy does.

    A host tensor is checked directly (IndexError "Target X is out of bounds.", PyTorch's CPU error). A device
    tensor gets torch._assert_async: the check is queued with the kernels and fails the stream (as PyTorch's own
    CUDA cross-entropy does with its device-side assert) instead of forcing a host sync every step."""
    bad = ((labels < 0) | (labels >= vocab)) & (labels != ignore_index)
    if labels.device.type == "cpu" and not _traced(labels):
        if bool(bad.any()):
            raise IndexError(f"Target {int(labels[bad][0])} is out of bounds.")
        return
    torch._assert_async(~bad.any(), f"linear_cross_entropy: a target is out of bounds [0, {vocab}) and is not "
                                    f"ignore_index {ignore_index}")


# ----------------------------------------------------------------------------------------------- grad_W into .grad
# The trainer's promise of the loss's grad_output (novatune.train.session.forward_backward, where the memory plan
# chose it: memory.lm_head_grad_in_forward). Under it, where autograd would add lm_head's gradient into an existing
# `.grad` (micro-steps after the first under gradient accumulation), the forward adds grad_W x grad_output into
# that .grad chunk by chunk (kernels' `into`; the call's mode, chunk_tokens and vocab_slice are not used then): the
# (V, H) gradient buffer and the full logits never exist, which lowers the forward's memory peak by about
# (T - chunk) x V x 2 bytes (0.9 GiB at Qwen3-30B-A3B's 4,096 tokens), and the backward's pass over the (V, H)
# gradient goes. The price is precision and traffic: each chunk's GEMM (fp32 inside) rounds into the bf16 .grad,
# 5-7 roundings per micro-step at 4,096 tokens where the backward path rounds twice (a CPU comparison over 8 chunks
# and 8 micro-batches measured 2.4x the relative error against fp32), and each chunk reads and writes the whole
# .grad. So the planner takes it only where its memory is needed.
# The forward writes .grad: a forward under the promise whose backward never runs leaves its gradient there (the
# trainer's steps always run it). The backward checks the promise: a grad_output that differs (the loss scaled or
# reused after the model returned it) sets a device flag and writes NaN into one element of .grad, so the step's
# gradient norm is not finite and the trainer's non-finite check stops the run; `promise_broken()` tells it why
# (nothing waits for the host) and `reset_promise_flags()` clears the flags.
_state = threading.local()  # .promised: the promises of this thread's open contexts
_broken: dict = {}  # device -> 0-dim bool flag


def _promises() -> list:
    if not hasattr(_state, "promised"):
        _state.promised = []
    return _state.promised


@contextlib.contextmanager
def grad_output_promised(value: float = 1.0):
    """Around a forward whose loss's backward will get exactly `value` as grad_output (module comment above)."""
    promised = _promises()
    promised.append(float(value))
    try:
        yield
    finally:
        promised.pop()


def promise_broken() -> bool:
    """Whether any backward met a grad_output other than the promised one (reads device flags: a host sync)."""
    return any(bool(flag) for flag in _broken.values())


def reset_promise_flags() -> None:
    _broken.clear()


def _into_grad_param(weight: Tensor, hidden: Tensor, bias: Tensor | None, softcap, stats: bool):
    """The Parameter whose existing .grad the forward may add grad_W into under a promise, or None."""
    if not _promises() or stats or (bias is not None and bias.requires_grad) or _traced(hidden, weight.detach()):
        return None
    param = weight if type(weight) is nn.Parameter else None
    if param is None or not weight.requires_grad or not grad_takes_adds(param):
        return None
    grad = param.grad
    return param if grad is not None and grad.is_contiguous() else None


class _LossIntoGrad(torch.autograd.Function):
    """The fused loss with grad_W added into lm_head's existing .grad by the forward (module comment above)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, divisor, bias, ignore_index, softcap, param, promised):
        into = param.grad
        with torch.autocast(hidden.device.type, enabled=False):
            loss, _rows, gh, _gw, _gb = _k.linear_cross_entropy_fwd(
                hidden, weight, labels, divisor, bias=bias, ignore_index=ignore_index,
                grad_hidden=hidden.requires_grad, grad_weight=False, use_triton=use_triton(hidden),
                softcap=softcap, into=into, alpha=promised)
        torch.autograd.graph.increment_version(into)  # as AccumulateGrad's in-place add would
        ctx.save_for_backward(gh)
        ctx.into, ctx.promised = into, promised
        return loss

    @staticmethod
    def backward(ctx, g_loss):
        bad = g_loss.detach().float() != ctx.promised
        flag = _broken.get(bad.device)
        _broken[bad.device] = bad if flag is None else flag | bad
        ctx.into.view(-1)[:1].add_(torch.where(bad, float("nan"), 0.0).to(ctx.into.dtype))
        (gh,) = ctx.saved_tensors
        if gh is not None:
            torch.ops.novatune.linear_cross_entropy_scale_(gh, g_loss)
        return gh, None, None, None, None, None, None, None, None


class TokenStats(NamedTuple):
    """Per-token statistics of the logits, from the fused loss's own pass over them (no second lm_head GEMM);
    each of labels' shape, no gradient. fp32 from the logits as the loss sees them (input dtype, read in fp32).

    nll      -log p(label) = lse - z_label (the token's loss before the reduction; its log-prob is -nll)
    lse      log sum_v exp(z_v)
    entropy  -sum_v p_v log p_v = lse - sum_v p_v z_v (TRL's formula)
    argmax   the first index of the largest logit (torch.argmax's rule), int64
    Ignored tokens (ignore_index) get 0, 0, 0 and -1."""

    nll: Tensor
    lse: Tensor
    entropy: Tensor
    argmax: Tensor


def linear_cross_entropy(hidden: Tensor, lm_weight: Tensor, labels: Tensor, ignore_index: int = -100,
                         reduction: str = "mean", normalizer=None, bias: Tensor | None = None, *,
                         chunk_tokens: int | None = None, mode: str = "auto", vocab_slice: int | None = None,
                         return_token_stats: bool = False, softcap: float | None = None):
    """Cross-entropy of (hidden @ lm_weight.T + bias) against labels, fused and chunked; a 0-dim fp32 loss, or
    (loss, TokenStats) with return_token_stats=True (the statistics come from the same pass over the logits).

    hidden (..., H), lm_weight (V, H) (may be the tied embedding's Parameter), labels (...) int, aligned with
    hidden (shift them first, as HF's ForCausalLMLoss does). normalizer: loss = sum / normalizer (overrides
    reduction). mode: "auto" (default), "tokens", "vocab" or "inplace" (see the module docstring). chunk_tokens:
    tokens per chunk (implies mode "tokens"), vocab_slice: vocab columns per slice (implies "vocab" unless mode is
    "inplace": then the rows of its temp block); default: planned by novatune.kernels.linear_cross_entropy.plan_mode.
    softcap: the loss of softcap * tanh(logits / softcap) (Gemma 2's final logit soft-capping, gradient through the
    tanh), applied inside the fused passes of modes "tokens" and "vocab" ("auto" never plans "inplace" with it;
    an explicit "inplace" raises).
    """
    if softcap is not None and not float(softcap) > 0:
        raise ValueError(f"linear_cross_entropy: softcap must be a positive number (or None), got {softcap}")
    if mode not in _k.MODES:
        raise ValueError(f"linear_cross_entropy: mode must be one of {_k.MODES}, got {mode!r}")
    if ((chunk_tokens and mode in ("vocab", "inplace")) or (vocab_slice and mode == "tokens")
            or (chunk_tokens and vocab_slice)):
        raise ValueError("linear_cross_entropy: chunk_tokens goes with mode 'tokens', vocab_slice with 'vocab' or "
                         f"'inplace' (got mode={mode!r}, chunk_tokens={chunk_tokens}, vocab_slice={vocab_slice})")
    for name, size in (("chunk_tokens", chunk_tokens), ("vocab_slice", vocab_slice)):
        if size is not None and not (isinstance(size, int) and size > 0):
            raise ValueError(f"linear_cross_entropy: {name} must be a positive int (or None: planned), got {size!r}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"linear_cross_entropy: reduction must be one of {_REDUCTIONS}, got {reduction!r} "
                         "('none' is unsupported: the gradients are computed in the forward)")
    H = hidden.shape[-1]
    if lm_weight.dim() != 2 or lm_weight.shape[1] != H:
        raise ValueError(f"linear_cross_entropy: lm_weight must be (V, {H}), got {tuple(lm_weight.shape)}")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"linear_cross_entropy: labels {tuple(labels.shape)} must match hidden's leading dims "
                         f"{tuple(hidden.shape[:-1])} (shift them before the call)")
    if bias is not None and tuple(bias.shape) != (lm_weight.shape[0],):
        raise ValueError(f"linear_cross_entropy: bias must be ({lm_weight.shape[0]},), got {tuple(bias.shape)}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"linear_cross_entropy: labels must be int64 or int32, got {labels.dtype}")
    dev = hidden.device
    for name, t in (("lm_weight", lm_weight), ("bias", bias)):
        if t is not None and t.device != dev:  # a meta weight would give a garbage loss, another GPU a crash
            raise ValueError(f"linear_cross_entropy: {name} is on {t.device} but hidden on {dev}: move them to one "
                             "device (a meta weight has not been materialised: load or initialise it first)")
    if torch.is_autocast_enabled(dev.type):  # what F.linear would do under autocast (differentiable casts)
        dt = torch.get_autocast_dtype(dev.type)
        hidden, lm_weight = hidden.to(dt), lm_weight.to(dt)
        bias = None if bias is None else bias.to(dt)
    if hidden.dtype != lm_weight.dtype or (bias is not None and bias.dtype != hidden.dtype):
        raise TypeError(f"linear_cross_entropy: hidden ({hidden.dtype}), lm_weight ({lm_weight.dtype}) and bias "
                        "must share a dtype (as F.linear requires)")

    h2 = hidden.reshape(-1, H)  # (T, H)
    y = labels.reshape(-1).to(dev)  # (T,)
    _check_label_range(y, lm_weight.shape[0], int(ignore_index))
    divisor = _divisor(y, ignore_index, reduction, normalizer)
    grad_on = torch.is_grad_enabled()
    param = (_into_grad_param(lm_weight, h2, bias, softcap, return_token_stats)
             if grad_on and hidden.requires_grad else None)
    if param is not None:  # the trainer's promise: grad_W into lm_head's existing .grad by the forward
        return _LossIntoGrad.apply(h2, lm_weight, y, divisor, bias, int(ignore_index),
                                   None if softcap is None else float(softcap), param, _promises()[-1])
    loss, _gh, _gw, _gb, nll, stats, top = torch.ops.novatune.linear_cross_entropy(
        h2, lm_weight, y, divisor, bias, int(ignore_index), grad_on and hidden.requires_grad,
        grad_on and lm_weight.requires_grad, grad_on and bias is not None and bias.requires_grad,
        int(chunk_tokens or 0), mode, int(vocab_slice or 0), bool(return_token_stats), float(softcap or 0.0))
    if not return_token_stats:
        return loss
    shape = labels.shape
    return loss, TokenStats(nll.detach().view(shape), stats[0].detach().view(shape), stats[1].detach().view(shape),
                            top.view(shape))


class NovaLinearCrossEntropy(nn.Module):
    """Module form: `NovaLinearCrossEntropy(ignore_index, reduction, mode)(hidden, lm_weight, labels, normalizer)`."""

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", mode: str = "auto"):
        super().__init__()
        if reduction not in _REDUCTIONS:
            raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
        if mode not in _k.MODES:
            raise ValueError(f"mode must be one of {_k.MODES}, got {mode!r}")
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.mode = mode

    def forward(self, hidden: Tensor, lm_weight: Tensor, labels: Tensor, normalizer=None,
                bias: Tensor | None = None) -> Tensor:
        return linear_cross_entropy(hidden, lm_weight, labels, self.ignore_index, self.reduction, normalizer, bias,
                                    mode=self.mode)


# ----------------------------------------------------------------------------------------------- the contract
# A model-level op: patch applies the chosen plan as the causal LM's `_novatune_ce_mode` (its cross_entropy_mode).
_IGNORE = -100
MODES = ("tokens", "vocab", "inplace")


def _make_inputs(shape, dtype, device, gen, batch: int = 1) -> dict:
    """shape key (tokens, hidden, vocab): hidden (T, H) (or (b, T/b, H)), logits ~ N(0, 4) (peaked and flat rows),
    every 7th label ignored (never the row the NaN check poisons: the flat middle of hidden)."""
    t, h, v = shape
    hidden = torch.randn(t, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) * (2.0 / math.sqrt(h))
    labels = torch.randint(0, v, (t,), generator=gen)
    nan_row = (t * h // 2) // h
    labels[(torch.arange(t) % 7 == 3) & (torch.arange(t) != nan_row)] = _IGNORE
    lead = (batch, t // batch) if batch > 1 else (t,)
    return {"hidden": hidden.reshape(*lead, h).to(device=device, dtype=dtype),
            "weight": weight.to(device=device, dtype=dtype), "labels": labels.reshape(lead).to(device)}


def _call_cases(dtype, device, gen) -> list:
    return [("causal LM (b, s, h) labels (b, s)", _make_inputs((2 * 37, 48, 300), dtype, device, gen, batch=2)),
            ("(T, h)", _make_inputs((41, 32, 257), dtype, device, gen)),
            ("tokens >= hidden", _make_inputs((97, 16, 130), dtype, device, gen))]


def _noncontig(inputs) -> dict:
    h = inputs["hidden"]
    pad = torch.zeros(*h.shape[:-1], h.shape[-1] + 8, dtype=h.dtype, device=h.device)
    pad[..., 4:4 + h.shape[-1]] = h
    return dict(inputs, hidden=pad[..., 4:4 + h.shape[-1]])


def _odd_shapes(shape, device_type: str) -> list:
    """The real shape, 37 tokens, and (when tokens >= hidden) hidden + 37 tokens, so "inplace" runs its own
    path at an odd count too."""
    t, h, v = shape
    out = [tuple(shape)]
    for s in [(37, h, v)] + ([(h + 37, h, v)] if t >= h else []):
        if s not in out:
            out.append(s)
    return out


def _mode_fn(mode: str):
    return lambda hidden, weight, labels: linear_cross_entropy(hidden, weight, labels, mode=mode)


def _candidates(shape, dtype, device: str) -> list:
    t, h, _v = shape
    out = [Candidate("linear_cross_entropy", "hf_eager", "eager", make=lambda: _ref.hf_linear_ce, selectable=False),
           Candidate("linear_cross_entropy", "novatune_default", "default", {"mode": "auto"},
                     make=lambda: _mode_fn("auto"))]
    for m in MODES:
        params = {"mode": m} if m != "inplace" or t >= h else {"mode": m, "note": "tokens < hidden: runs as 'tokens'"}
        out.append(Candidate("linear_cross_entropy", f"mode_{m}", "triton", params,
                             make=functools.partial(_mode_fn, m)))
    out.append(Candidate("linear_cross_entropy", "torch_compile", "compile", make=lambda: compiled(_ref.hf_linear_ce),
                         deterministic=False, selectable=False))
    return out


def _model_shape(config, tokens: int, docs: int) -> tuple:
    return (tokens, int(config.hidden_size), int(config.vocab_size))


SPEC = OpSpec(
    trace_kind="loss", once_per_step=True,
    name="linear_cross_entropy", tensor_args=("hidden", "weight"), make_inputs=_make_inputs,
    reference=_ref.linear_cross_entropy_ref, stock=_ref.hf_linear_ce,
    floor_bytes=lambda shape, dtype: 0,  # GEMM-bound: no HBM floor
    candidates=_candidates, call_cases=_call_cases, noncontiguous=_noncontig,
    layout="hidden (T, H), weight (V, H) contiguous",
    shape_of=lambda hidden, weight, labels, *_: (hidden.numel() // hidden.shape[-1], hidden.shape[-1],
                                                 weight.shape[0]),
    dtype_of=lambda hidden, *_: str(hidden.dtype)[6:],
    dy_shape=lambda shape: (), odd_shapes=_odd_shapes, memory_rule=True,
    setting=("_novatune_ce_mode", "mode"), model_shape=_model_shape,
    signature="linear_cross_entropy(hidden (..., H), lm_weight (V, H), labels (...)) -> 0-dim fp32 mean loss over "
              "labels != -100; differentiable in hidden and lm_weight",
)
