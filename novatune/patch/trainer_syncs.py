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

Two more pieces of the loop's host work per micro-batch are done once per optimizer step instead. On a step whose
GPU work is queued about as fast as the host can queue it (full fine-tuning of a 4B model here), every
millisecond of host time per micro-batch shows in the step time:
- `model.train()` at the top of each training_step walks every module (~600 in a 36-layer model, 2-4 ms). On the
  micro-batches after the first of a step, with the model still in training mode, the walk is skipped: nothing in
  the loop changes a module's mode between the micro-batches of one step (evaluation and callbacks' step hooks run
  between steps, and the next step walks again).
- `floating_point_ops(inputs)` (the logged `total_flos`) counts the model's parameters on every micro-batch
  (`num_parameters(exclude_embeddings=True)` walks every module and parameter, ~4 ms). The count is read once per
  optimizer step and the same 6 x tokens x parameters is returned.

And Python's garbage collector, whose full collections land at random inside training steps: as `novatune train`
does, the objects alive once the first optimizer step of a train() call has ended are frozen out of its walks
(novatune/measure/gc_freeze.py), and handed back when that train() call ends, however it ends (an exception
included: train() is wrapped). On a CPU probe this was most of what TRL's loop spent beyond the trainer's (LOG.md,
session 13).
"""
from __future__ import annotations

import inspect

import torch

from novatune.measure.gc_freeze import LongLivedFreeze
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


# transformers' Trainer.floating_point_ops, reproduced with the parameter count read once per step
FLOPS_SOURCE = "return 6 * inputs[main_input].numel() * self.model.num_parameters(exclude_embeddings=True)"


def training_step(self, *args, **kwargs):
    """The class's training_step, its loss put through the logging filter on the device (module docstring)."""
    loss = type(self).training_step(self, *args, **kwargs)
    return _filtered(self, loss)


def _filtered(trainer, loss: torch.Tensor) -> torch.Tensor:
    running = trainer._tr_loss / (1 + trainer.state.global_step - trainer._globalstep_last_logged)
    return torch.where(torch.isfinite(loss), loss, running.to(loss.dtype))


class _StillTraining:
    """Stands in for `model.train` during a training_step whose model is already in training mode: train(True) on
    a model still in training mode returns it without the walk. Any other call (eval(), or train() after an eval()
    inside the step, as generation in an RL trainer does) removes the stand-in and runs the real walk, so every
    later call in the step is the real one too."""

    def __init__(self, model):
        self.model = model

    def __call__(self, mode: bool = True):
        if mode and self.model.training:
            return self.model
        vars(self.model).pop("train", None)
        return type(self.model).train(self.model, mode)


class TrainingStep:
    """The trainer's training_step as `novatune.patch(trainer)` runs it: the class's own, with the model's
    train() walk skipped after the first micro-batch of a step, and its loss through the logging filter on the
    device where `nan_filter` (module docstring)."""

    def __init__(self, trainer, nan_filter: bool):
        self.trainer, self.nan_filter = trainer, nan_filter
        self.walked = None  # (model, global_step) of the last real train() walk

    def __call__(self, model, *args, **kwargs):
        trainer = self.trainer
        here = (id(model), trainer.state.global_step)
        skip = model.training and self.walked == here and "train" not in vars(model)
        self.walked = here
        if skip:
            vars(model)["train"] = _StillTraining(model)
        try:
            loss = type(trainer).training_step(trainer, model, *args, **kwargs)
        finally:
            if skip:
                vars(model).pop("train", None)
        return _filtered(trainer, loss) if self.nan_filter else loss


class FlopCount:
    """Trainer.floating_point_ops with the model's parameter count read once per optimizer step."""

    def __init__(self, trainer):
        self.trainer, self.counted = trainer, None  # (global_step, count)

    def __call__(self, inputs) -> int:
        model = self.trainer.model
        main_input = getattr(model, "main_input_name", "input_ids")
        if main_input not in inputs or not hasattr(model, "num_parameters"):
            return 0
        step = self.trainer.state.global_step
        if self.counted is None or self.counted[0] != step:
            self.counted = (step, model.num_parameters(exclude_embeddings=True))
        return 6 * inputs[main_input].numel() * self.counted[1]


class GcFreeze:
    """A TrainerCallback (duck-typed: the handler calls every event by name; the ones not here do nothing): the
    objects alive after the first optimizer step of each train() call are frozen out of the garbage collector's
    walks, and unfrozen when the call ends or the patch is reverted (module docstring)."""

    def __init__(self):
        self.pending = False  # freeze at the next step's end
        self.long_lived = LongLivedFreeze()

    def __getattr__(self, event: str):
        if event.startswith("on_"):
            return _nothing
        raise AttributeError(event)

    def on_train_begin(self, args, state, control, **kwargs):
        self.release()  # a train() that raised outside ReleasingTrain left its freeze: hand it back first
        self.pending = True

    def on_step_end(self, args, state, control, **kwargs):
        if self.pending:
            self.pending = False
            self.long_lived.freeze()

    def on_train_end(self, args, state, control, **kwargs):
        self.pending = False
        self.release()

    def release(self) -> None:
        self.long_lived.release()


def _nothing(*args, **kwargs):
    return None


class ReleasingTrain:
    """The trainer's train() with GcFreeze's freeze handed back however it ends: on_train_end never fires when
    train() raises (an out-of-memory error, Ctrl-C), and a freeze left behind would keep the dead trainer's
    reference cycles from ever being collected."""

    def __init__(self, trainer, callback: GcFreeze, inner=None):
        self.trainer, self.callback, self.inner = trainer, callback, inner  # inner: an instance-level train()

    def __call__(self, *args, **kwargs):
        try:
            if self.inner is not None:
                return self.inner(*args, **kwargs)
            return type(self.trainer).train(self.trainer, *args, **kwargs)
        finally:
            self.callback.pending = False
            self.callback.release()


def freeze_after_first_step(trainer, report: PatchReport) -> None:
    """Add GcFreeze to the trainer's callbacks and ReleasingTrain over its train() (once), both undone on revert."""
    handler = getattr(trainer, "callback_handler", None)
    if handler is None or not hasattr(trainer, "add_callback") or not callable(getattr(trainer, "train", None)):
        return
    if any(isinstance(c, GcFreeze) for c in handler.callbacks):
        return  # patched before
    callback = GcFreeze()
    trainer.add_callback(callback)
    had = "train" in vars(trainer)
    inner = vars(trainer).get("train")
    trainer.train = ReleasingTrain(trainer, callback, inner)

    def undo():
        callback.release()
        handler.pop_callback(callback)  # None (no error) if the user removed it already
        if had:
            trainer.train = inner
        else:
            vars(trainer).pop("train", None)

    report._undo.append(undo)
    report.add("trainer.callbacks", "trainer_host_work", "replaced",
               "objects alive after the first optimizer step are frozen out of the garbage collector's full walks "
               "(gc.freeze, as novatune train does; unfrozen when train() ends)")


def filter_on_device(trainer, report: PatchReport) -> None:
    """Move the trainer's logging NaN/inf filter onto the device and its per-micro-batch module walks to once per
    step (module docstring), or say why not."""
    if not hasattr(trainer, "training_step") or not hasattr(getattr(trainer, "state", None), "global_step"):
        return
    if isinstance(trainer.__dict__.get("training_step"), TrainingStep):
        return  # patched before (a second patch() call)
    why = why_not(trainer)
    if why is not None and getattr(getattr(trainer, "args", None), "logging_nan_inf_filter", False):
        report.add("trainer.training_step", "trainer_nan_filter", "note",
                   f"the Trainer reads each micro-batch's loss on the host (logging_nan_inf_filter): {why}")
    undo = []
    if "training_step" not in trainer.__dict__:
        trainer.training_step = TrainingStep(trainer, nan_filter=why is None)
        undo.append(lambda: trainer.__dict__.pop("training_step", None))
        report.add("trainer.training_step", "trainer_host_work", "replaced",
                   "the model's train() walk runs on the first micro-batch of each optimizer step, not on every one "
                   "(the model stays in training mode in between)")
        if why is None:
            trainer.args.logging_nan_inf_filter = False
            undo.append(lambda: setattr(trainer.args, "logging_nan_inf_filter", True))
            report.add("trainer.training_step", "trainer_nan_filter", "replaced",
                       "the Trainer's logging NaN/inf filter of each micro-batch's loss runs on the device (no host "
                       "sync per micro-batch; the same logged values)")
    if "floating_point_ops" not in trainer.__dict__ and FLOPS_SOURCE in _source(type(trainer), "floating_point_ops"):
        trainer.floating_point_ops = FlopCount(trainer)
        undo.append(lambda: trainer.__dict__.pop("floating_point_ops", None))
        report.add("trainer.floating_point_ops", "trainer_host_work", "replaced",
                   "the logged FLOP count reads the model's parameter count once per optimizer step (the same "
                   "values; not a walk of every parameter per micro-batch)")
    report._undo.extend(undo)
