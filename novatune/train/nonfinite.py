"""What the trainer does when a step's loss or gradient norm is not finite (`train.on_nonfinite`).

The check costs one host sync per optimizer step: the loss and the gradient norm (which clipping computes anyway)
are combined on the device and read once, after the step's backward passes and before the optimizer touches the
weights. Nothing is checked per micro-batch.

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


class UnhealthyTraining(RuntimeError):
    """The run stopped because it no longer trains (the CLI exits 3); the message names where and what to do."""


class NonFiniteError(UnhealthyTraining):
    """Training produced (or was given) non-finite numbers; the message names where and what to do."""


class ZeroGradientError(UnhealthyTraining):
    """The gradients were exactly zero for ZERO_GRADIENT_STEPS optimizer steps in a row: nothing trains."""


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


class StepGuard:
    """Decides, once per optimizer step, whether the step's update may be applied."""

    def __init__(self, mode: str, max_skipped: int):
        self.mode, self.max_skipped = mode, max_skipped
        self.consecutive = 0
        self.skipped: list[int] = []
        self.zero_since: int | None = None  # first step of the current run of exactly-zero gradient norms

    def allow(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """True: apply the update of `step` (1-based). False (skip mode): drop it. Raises NonFiniteError (stop), or
        ZeroGradientError after ZERO_GRADIENT_STEPS steps in a row with a gradient norm of exactly zero."""
        loss_v, norm_v = torch.stack([loss.detach().float().reshape(()),
                                      torch.as_tensor(grad_norm).detach().float().reshape(()).to(loss.device)
                                      ]).tolist()  # the one sync of the check
        if math.isfinite(loss_v) and math.isfinite(norm_v):
            self.consecutive = 0
            self._zero_check(step, loss_v, norm_v)
            return True
        self.zero_since = None  # a non-finite step is not a zero-gradient one: the run of zeros starts again
        what = f"step {step}: loss {loss_v:.4g}, grad norm {norm_v:.4g}"
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
            raise ZeroGradientError(
                f"the gradients were exactly zero on steps {self.zero_since}-{step} (loss {loss:.4g}): nothing "
                f"trains, so the run stops before checkpointing or exporting it. Usual causes: a learning rate that "
                f"saturated the weights (lower train.lr), every target token masked (data.loss_on, the labels), or "
                f"no trainable parameters (method, LoRA targets)")
