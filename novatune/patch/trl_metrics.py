"""TRL SFTTrainer's per-micro-batch metrics without a host sync between the forward and the backward.

`SFTTrainer.compute_loss` (trl 1.15 / 1.16) reads its entropy and token-accuracy metrics with `.item()` right after
the forward, before the backward is queued: the host waits for the GPU once per micro-batch, and the backward then
runs at the host's queueing pace. With novatune's fused head the loss itself needs no such wait, so
`novatune.patch(trainer)` binds a compute_loss on the trainer instance that computes the same loss with the same
calls and appends the same metric values as `Deferred` numbers: each becomes a float when TRL's `log` averages it
(`sum(values) / len(values)`), after the optimizer step is queued.

The bound method takes over only where it computes exactly TRL's default branch, which this module knows by the
source of `SFTTrainer.compute_loss` (KNOWN_SOURCES: a hash per reviewed version): one process, loss_type "nll", no
compute_loss_func, no label smoothing, no router aux loss, padding-free inputs (position_ids, no attention_mask,
whose token count TRL also reads with a sync), and return_outputs=False. Any other call runs TRL's own method; an
unknown TRL source, a subclass's own compute_loss or several processes leave the trainer as it is, with the reason
in the patch report.
"""
from __future__ import annotations

import hashlib
import inspect
import types

import torch

from novatune.patch.report import PatchReport

# sha256 (first 16 hex) of inspect.getsource(SFTTrainer.compute_loss) for the TRL versions read and matched
KNOWN_SOURCES = {"ca448211ff653fe6": "trl 1.15.0 / 1.16.0"}


class Deferred:
    """A metric value still on the device; a float the first time arithmetic or float() needs it."""

    __slots__ = ("tensor", "_value")

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self._value = tensor.detach(), None

    def __float__(self) -> float:
        if self._value is None:
            self._value = float(self.tensor.item())
            self.tensor = None
        return self._value

    def __add__(self, other):
        return float(self) + float(other)

    __radd__ = __add__

    def __truediv__(self, other):
        return float(self) / float(other)

    def __rtruediv__(self, other):
        return float(other) / float(self)

    def __repr__(self) -> str:
        return f"Deferred({float(self)!r})"


def _source_key(cls) -> str | None:
    try:
        return hashlib.sha256(inspect.getsource(cls.compute_loss).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        return None


def why_not(trainer) -> str | None:
    """None when the deferred-metrics compute_loss may be bound on this trainer, else the reason it is not."""
    sft = next((c for c in type(trainer).__mro__ if c.__name__ == "SFTTrainer" and c.__module__.startswith("trl")),
               None)
    if sft is None:
        return "not a TRL SFTTrainer"
    if type(trainer).compute_loss is not sft.compute_loss:
        return f"{type(trainer).__name__} defines its own compute_loss"
    if _source_key(sft) not in KNOWN_SOURCES:
        return "this TRL version's SFTTrainer.compute_loss is not one novatune has matched"
    if getattr(trainer.accelerator, "num_processes", 1) != 1:
        return "several processes (the metrics are gathered across ranks)"
    return None


def _takes_over(self, inputs: dict, return_outputs: bool) -> bool:
    return (not return_outputs and self.compute_loss_func is None and self.label_smoother is None
            and self.args.loss_type == "nll" and not self.aux_loss_enabled and "attention_mask" not in inputs
            and "position_ids" in inputs)


def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """SFTTrainer.compute_loss's default branch (module docstring), its metrics deferred."""
    if not _takes_over(self, inputs, return_outputs):
        return type(self).compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
    mode = "train" if self.model.training else "eval"
    inputs["use_cache"] = False
    outputs = model(**inputs, fused_lm_head=True)
    per_token_loss = -outputs.log_probs
    num_tokens = outputs.label_mask.sum() if num_items_in_batch is None else num_items_in_batch
    loss = per_token_loss.sum() / torch.as_tensor(num_tokens).clamp(min=1)
    if self.args.average_tokens_across_devices and num_items_in_batch is not None:
        loss = loss * (self.accelerator.num_processes // self.get_tp_size())
    with torch.no_grad():
        num_valid = outputs.label_mask.sum()
        some = num_valid > 0
        denominator = num_valid.clamp(min=1)
        entropy = torch.where(some, outputs.entropy.detach().sum() / denominator, 0.0)
        accuracy = torch.where(some, outputs.is_top1.sum() / denominator, 0.0)
    self._metrics[mode]["entropy"].append(Deferred(entropy))
    self._metrics[mode]["mean_token_accuracy"].append(Deferred(accuracy))
    if mode == "train":
        self._total_train_tokens += inputs["position_ids"].size(1) // self._tp_size
    self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
    return loss


def defer_metric_syncs(trainer, report: PatchReport, lm_head_attr: str) -> None:
    """Bind the deferred-metrics compute_loss on `trainer` (module docstring), or note why not."""
    why = why_not(trainer)
    if why is not None:
        report.add(lm_head_attr, "trainer_metrics", "note", f"TRL's per-micro-batch metric syncs stay: {why}")
        return
    trainer.compute_loss = types.MethodType(compute_loss, trainer)
    report.add(lm_head_attr, "trainer_metrics", "replaced",
               "SFTTrainer's entropy / token-accuracy metrics read at logging time instead of after each forward "
               f"({KNOWN_SOURCES[_source_key(type(trainer))]}; other calls run TRL's own compute_loss)")

    def undo():
        trainer.__dict__.pop("compute_loss", None)

    report._undo.append(undo)
