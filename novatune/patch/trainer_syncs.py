"""The per-micro-batch host sync of a transformers Trainer's logging filter, moved onto the device.

With `logging_nan_inf_filter` on (its default), the Trainer's loop (`_run_epoch`) asks after every micro-batch
whether the loss is NaN or inf (`torch.isnan(tr_loss_step) or torch.isinf(tr_loss_step)`, a Python bool of a CUDA
tensor): the host waits there for that micro-batch's backward, the GPU then drains, and the next forward runs at
the host's queueing pace. The filter only shapes the logged loss: a non-finite micro-batch loss adds the running
average `_tr_loss / (1 + global_step - _globalstep_last_logged)` instead of itself.

`novatune.patch(trainer)` computes the same choice on the device: the trainer's `training_step` returns
`where(isfinite(loss), loss, running average)`, which the loop adds to `_tr_loss` as it adds any loss, and the
trainer's own filter is turned off (report.revert() turns it back on). The logged values are the same; what trains
is untouched (the filter never touched the gradients). It applies where the Trainer's loop is the one read here
(FILTER_SOURCE in its source); elsewhere the sync stays, with the reason in the report.
"""
from __future__ import annotations

import inspect
import types

import torch

from novatune.patch.report import PatchReport

# the lines of transformers' Trainer loop this module reproduces (transformers 5.17 - 5.24: in _run_epoch)
FILTER_SOURCE = ("and (torch.isnan(tr_loss_step) or torch.isinf(tr_loss_step))",
                 "self._tr_loss += self._tr_loss / (1 + self.state.global_step - self._globalstep_last_logged)")
LOOP_METHODS = ("_run_epoch", "_inner_training_loop")


def _source(cls, name: str) -> str:
    try:
        return inspect.getsource(getattr(cls, name))
    except (AttributeError, OSError, TypeError):
        return ""


def why_not(trainer) -> str | None:
    """None when the filter can move to the device for this trainer, else why not."""
    args = getattr(trainer, "args", None)
    if args is None or not getattr(args, "logging_nan_inf_filter", False):
        return "the trainer's logging NaN/inf filter is off"
    if not any(all(line in _source(type(trainer), name) for line in FILTER_SOURCE) for name in LOOP_METHODS):
        return "this Trainer's training loop is not the one novatune has read (its NaN/inf filter differs)"
    if "training_step" in trainer.__dict__:
        return "the trainer's training_step is already replaced on the instance"
    return None


def training_step(self, *args, **kwargs):
    """The class's training_step, its loss put through the logging filter on the device (module docstring)."""
    loss = type(self).training_step(self, *args, **kwargs)
    running = self._tr_loss / (1 + self.state.global_step - self._globalstep_last_logged)
    return torch.where(torch.isfinite(loss), loss, running.to(loss.dtype))


def filter_on_device(trainer, report: PatchReport) -> None:
    """Move the trainer's logging NaN/inf filter onto the device (module docstring), or say why not."""
    why = why_not(trainer)
    if why is not None:
        if getattr(getattr(trainer, "args", None), "logging_nan_inf_filter", False):
            report.add("trainer.training_step", "trainer_nan_filter", "note",
                       f"the Trainer reads each micro-batch's loss on the host (logging_nan_inf_filter): {why}")
        return
    trainer.training_step = types.MethodType(training_step, trainer)
    trainer.args.logging_nan_inf_filter = False
    report.add("trainer.training_step", "trainer_nan_filter", "replaced",
               "the Trainer's logging NaN/inf filter of each micro-batch's loss runs on the device (no host sync "
               "per micro-batch; the same logged values)")

    def undo():
        trainer.__dict__.pop("training_step", None)
        trainer.args.logging_nan_inf_filter = True

    report._undo.append(undo)
