"""What the trainer does when a step's loss or gradient norm is not finite (`train.on_nonfinite`).

The loss and the gradient norm (which clipping computes anyway) are checked once per optimizer step, after the
step's backward passes; nothing is checked per micro-batch. How the host learns the result:

  read at once    (skip mode, or an optimizer that cannot take the decision on the device): the two values are read
                  before the optimizer touches the weights: one host sync per step, after which the GPU idles
                  while the host queues the update and the next forward.
  read a step late  (stop mode with an optimizer that takes torch's `found_inf` flag: novatune's AdamW kernel, or
                  torch's fused AdamW): the device computes found_inf from the two values and the optimizer leaves
                  every weight and moment as it is when it is set; the values are copied to host memory without
                  waiting, and read once the next step is queued (by then the GPU has finished them), or before
                  anything reads the run's state: a metrics row, a checkpoint, the export, the end of the loop. So a
                  non-finite step still never changes the weights, and no checkpoint or export is written after it;
                  the run may have queued one more (finite) step when it stops.

  stop (default)  the run ends with NonFiniteError naming the step; the bad update is never applied, so the last
                  checkpoint (and the weights in memory) stay finite.
  skip            the step's gradients are dropped: the optimizer does not step, so its moments and the weights
                  are untouched. The step still counts (the data it consumed stays consumed and the learning-rate
                  schedule advances, as torch's GradScaler does on an overflow), and its metrics row has loss null
                  and `skipped: true`. More than `train.max_skipped_steps` consecutive skips stop the run: a run
                  that only skips is not training.

The same read also catches a run that trains nothing while staying finite: a gradient norm of exactly 0.0 on
ZERO_GRADIENT_STEPS steps in a row (weights a huge learning rate has saturated, every target masked, nothing
trainable) ends the run with ZeroGradientError instead of finishing, checkpointing and exporting a model that
never learned.

Checkpoints and exports check the weights themselves (`require_finite`), so a non-finite tensor never reaches
disk whatever produced it.
"""
from __future__ import annotations

import math

import torch

from novatune.ops.linear_cross_entropy import promise_broken


class UnhealthyTraining(RuntimeError):
    """The run stopped because it no longer trains (the CLI exits 3); the message names where and what to do."""


class NonFiniteError(UnhealthyTraining):
    """Training produced (or was given) non-finite numbers; the message names where and what to do."""


class ZeroGradientError(UnhealthyTraining):
    """The gradients were exactly zero for ZERO_GRADIENT_STEPS optimizer steps in a row: nothing trains.
    `dead_from`: the last step whose update changed the weights into ones with no gradient (the step before the
    first zero), when the loss stayed positive (the weights no longer reach it: saturated, or nothing trainable);
    a checkpoint from it on holds those weights (the loop sets them aside). None when the loss was zero (nothing
    to learn in those batches: masked targets), which says nothing against the weights."""

    def __init__(self, message: str, dead_from: int | None = None):
        super().__init__(message)
        self.dead_from = dead_from


ZERO_GRADIENT_STEPS = 3  # consecutive steps whose whole-model gradient norm is exactly 0.0


CHUNK = 1 << 26  # elements checked at once: the boolean temporary stays <= 64 MiB next to a multi-GB embedding


def _all_finite(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    return torch.stack([torch.isfinite(c).all() for c in flat.split(CHUNK)]).all() if flat.numel() else \
        torch.ones((), dtype=torch.bool, device=t.device)


def nonfinite_names(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors holding a NaN or an infinity."""
    floats = {n: t for n, t in tensors.items() if t.is_floating_point()}
    if not floats:
        return []
    ok: dict[str, bool] = {}
    for device in {t.device for t in floats.values()}:  # one host copy per device, not one per tensor
        names = [n for n, t in floats.items() if t.device == device]
        ok.update(zip(names, torch.stack([_all_finite(floats[n]) for n in names]).cpu().tolist()))
    return [n for n in floats if not ok[n]]


def require_finite(tensors: dict[str, torch.Tensor], what: str, fix: str) -> None:
    bad = nonfinite_names(tensors)
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise NonFiniteError(f"{what}: {len(bad)} tensor(s) hold NaN/inf ({shown}); {fix}")


def as_json_number(x):
    """A float for a JSON file: non-finite values become null (JSON has no NaN)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def takes_found_inf(optimizer) -> bool:
    """Whether `optimizer.step()` honours a device `found_inf` flag (torch's GradScaler protocol) by leaving the
    weights and moments as they are: novatune's AdamW kernel, and torch's fused Adam / AdamW (its foreach and
    single-tensor paths refuse the flag)."""
    from novatune.ops.adamw import FusedClipAdamW

    if isinstance(optimizer, FusedClipAdamW):
        return True
    return type(optimizer) in (torch.optim.AdamW, torch.optim.Adam) and all(
        g.get("fused") for g in optimizer.param_groups)


def stack_scalars(scalars: list[torch.Tensor]) -> torch.Tensor:
    """One-element tensors (a loss, a gradient norm) as one fp32 vector on the first one's device."""
    return torch.stack([torch.as_tensor(t).detach().float().reshape(()).to(scalars[0].device) for t in scalars])


class HostCopy:
    """A device vector (stack_scalars) copied to host memory without waiting: on CUDA into pinned memory behind an
    event, so `values()` waits for the copy alone, not for the work queued after it (a plain read of a device
    tensor waits for everything queued on the stream)."""

    def __init__(self, flat: torch.Tensor):
        self.event = None
        if flat.device.type == "cuda":
            self.host = torch.empty(flat.shape, dtype=torch.float32, pin_memory=True)
            self.host.copy_(flat, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(flat.device))  # the stream the copy was queued on
        else:
            self.host = flat

    def values(self) -> list[float]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class StepGuard:
    """Decides, once per optimizer step, whether the step's update may be applied: at once (allow), or on the
    device with the host reading the outcome a step late (defer, resolve: the module docstring)."""

    def __init__(self, mode: str, max_skipped: int):
        self.mode, self.max_skipped = mode, max_skipped
        self.consecutive = 0
        self.skipped: list[int] = []
        self.zero_since: int | None = None  # first step of the current run of exactly-zero gradient norms
        self.pending: list[tuple[int, HostCopy]] = []  # deferred steps, oldest first

    def defers(self, optimizer) -> bool:
        """Whether the check may be read a step late with this optimizer: stop mode (a skip must know before the
        next step whether to count it), and an optimizer that takes found_inf."""
        return self.mode == "stop" and takes_found_inf(optimizer)

    def defer(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """Queue the copy of `step`'s values to host memory without waiting for them (resolve reads them), and
        return the optimizer's device flag: 1.0 (fp32, 0-dim, as GradScaler makes it) when the loss or the gradient
        norm is not finite, else 0.0."""
        pair = stack_scalars([loss, grad_norm])
        self.pending.append((step, HostCopy(pair)))
        return (~torch.isfinite(pair).all()).float()

    def resolve(self, keep: int = 0) -> None:
        """Check every deferred step but the newest `keep`, oldest first, waiting for each one's values (a step the
        GPU finished costs no wait); raises as allow() does."""
        while len(self.pending) > keep:
            step, copy = self.pending.pop(0)
            loss_v, norm_v = copy.values()
            self._judge(step, loss_v, norm_v)

    def allow(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """True: apply the update of `step` (1-based). False (skip mode): drop it. Raises NonFiniteError (stop), or
        ZeroGradientError after ZERO_GRADIENT_STEPS steps in a row with a gradient norm of exactly zero."""
        loss_v, norm_v = stack_scalars([loss, grad_norm]).tolist()  # the one sync of the check
        return self._judge(step, loss_v, norm_v)

    def _judge(self, step: int, loss_v: float, norm_v: float) -> bool:
        if math.isfinite(loss_v) and math.isfinite(norm_v):
            self.consecutive = 0
            self._zero_check(step, loss_v, norm_v)
            return True
        self.zero_since = None  # a non-finite step is not a zero-gradient one: the run of zeros starts again
        what = f"step {step}: loss {loss_v:.4g}, grad norm {norm_v:.4g}"
        if promise_broken():  # not the data's fault: the fused loss's contract broke
            raise NonFiniteError(f"non-finite gradient at {what}: the fused loss added lm_head's gradient into .grad "
                                 f"for grad_output 1.0, but its backward got another (the loss was scaled or "
                                 f"reused after the model returned it). The update was not applied. Call "
                                 f".backward() on the model's loss itself, or train outside the Session's "
                                 f"forward_backward")
        if self.mode != "skip":
            raise NonFiniteError(f"non-finite training at {what}. The update was not applied and no checkpoint "
                                 f"was written after it. Fix: lower train.lr, check the data and the starting "
                                 f"weights, or set train.on_nonfinite: skip to drop such steps")
        self.consecutive += 1
        self.skipped.append(step)
        if self.consecutive > self.max_skipped:
            raise NonFiniteError(f"non-finite training at {what}: {self.consecutive} consecutive steps skipped "
                                 f"(train.max_skipped_steps={self.max_skipped}). Fix: lower train.lr or check the "
                                 f"data and the starting weights")
        return False

    def _zero_check(self, step: int, loss: float, grad_norm: float) -> None:
        if grad_norm != 0.0:
            self.zero_since = None
            return
        self.zero_since = step if self.zero_since is None else self.zero_since
        if step - self.zero_since + 1 >= ZERO_GRADIENT_STEPS:
            dead = loss > 0  # a positive loss the weights no longer change: they are dead, not the data
            aside = (f", and any checkpoint from step {max(self.zero_since - 1, 1)} on (weights that no longer "
                     "train) is set aside") if dead else ""
            raise ZeroGradientError(
                f"the gradients were exactly zero on steps {self.zero_since}-{step} (loss {loss:.4g}): nothing "
                f"trains, so the run stops without exporting{aside}. Usual causes: a learning rate that saturated "
                f"the weights (lower train.lr and start a new run), every target token masked (data.loss_on, the "
                f"labels), or no trainable parameters (method, LoRA targets)",
                dead_from=self.zero_since - 1 if dead else None)
