"""A transformers Trainer's AdamW through novatune's kernel, with the gradient clipping folded into the update
(`novatune.patch(trainer)`), as `novatune train` steps it (train.adamw_kernel auto).

The Trainer builds torch.optim.AdamW (`optim="adamw_torch"` / `"adamw_torch_fused"`, the defaults) when train()
starts, and before each optimizer step clips the gradients with `accelerator.clip_grad_norm_`: one pass that reads
every gradient for the norm and one that scales every gradient, then AdamW's own pass. Patched:
- the optimizer it builds is novatune.ops.adamw.FusedClipAdamW, the same update (the same parameter groups,
  learning rate, betas, eps and weight decay; torch.optim.AdamW's state_dict, so its checkpoints resume either way);
- `accelerator.clip_grad_norm_` computes the same norm (returned and logged as before) and hands the clipping
  coefficient to the optimizer, which applies it inside its update instead of a pass over every gradient (so a
  callback's on_pre_optimizer_step / on_optimizer_step sees the gradients unclipped).
Where the Trainer's optimizer is already a FusedClipAdamW (passed in `optimizers=`), only the clipping is folded.

Left to torch, with the reason in the report: another `optim`, an optimizer or optimizer class the user gave,
adapters (LoRA: most weights frozen; many small tensors, which torch's multi-tensor launches suit), fp16 (its
GradScaler unscales the gradients inside clip_grad_norm_), DeepSpeed / FSDP / other accelerate back ends whose
clipping is their own, and devices other than CUDA (the kernel's speed is the point; the CPU runs its fp32
reference). report.revert() restores both.
"""
from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from novatune.ops.adamw import FusedClipAdamW, clip_coefficient, trains_most_weights
from novatune.ops.grad_norm import total_norm
from novatune.patch.report import PatchReport

TORCH_ADAMW = ("adamw_torch", "adamw_torch_fused")
ON_DEVICES = ("cuda",)  # where the Trainer's optimizer is swapped (tests add "cpu")


def _inner_optimizer(trainer):
    opt = getattr(trainer, "optimizer", None)
    return getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer wraps the real one


def _why_not(trainer) -> str | None:
    args = trainer.args
    optim = str(getattr(getattr(args, "optim", None), "value", getattr(args, "optim", None)))
    existing = getattr(trainer, "optimizer", None)
    if existing is not None and not isinstance(_inner_optimizer(trainer), FusedClipAdamW):
        return "the trainer's optimizer already exists (given, or built before the patch)"
    if getattr(trainer, "optimizer_cls_and_kwargs", None) is not None:
        return "the trainer was given an optimizer class"
    if existing is None and optim not in TORCH_ADAMW:
        return f"optim={optim!r} is not torch's AdamW"
    if existing is None and not trains_most_weights(trainer.model):
        return "adapters train (LoRA): torch's multi-tensor AdamW suits many small tensors"
    accelerator = trainer.accelerator
    if getattr(args, "fp16", False) or getattr(accelerator, "scaler", None) is not None \
            or str(getattr(accelerator, "mixed_precision", "no")) == "fp16":
        return "fp16: the GradScaler unscales the gradients inside clip_grad_norm_ and may skip a step"
    kind = str(getattr(getattr(accelerator, "distributed_type", None), "value", "NO"))
    if kind not in ("NO", "MULTI_GPU"):
        return f"accelerate's {kind} back end clips the gradients its own way"
    if any(isinstance(p, DTensor) for p in trainer.model.parameters() if p.requires_grad):
        return "the weights are DTensors (sharded or tensor-parallel): their norm needs the ranks' shards"
    if getattr(args, "device", torch.device("cpu")).type not in ON_DEVICES:
        return f"the trainer runs on {args.device.type}, not CUDA"
    return None


class FoldedClip:
    """accelerator.clip_grad_norm_ for a FusedClipAdamW: the norm of the gradients (torch's get_total_norm through
    novatune.ops.grad_norm), and the clipping coefficient handed to the optimizer instead of scaling the
    gradients. Any other optimizer, or a norm other than 2, takes accelerate's own path."""

    def __init__(self, trainer, inner):
        self.trainer, self.inner = trainer, inner

    def __call__(self, parameters, max_norm, norm_type=2):
        opt = _inner_optimizer(self.trainer)
        scaler = getattr(self.trainer.accelerator, "scaler", None)
        if not isinstance(opt, FusedClipAdamW) or float(norm_type) != 2.0 or scaler is not None:
            return self.inner(parameters, max_norm, norm_type)
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        grads = [p.grad for p in parameters if p.grad is not None]
        norm = total_norm(grads)
        if not math.isinf(float(max_norm)):
            opt.clip_coef = clip_coefficient(norm, max_norm).float()
        return norm


class _KernelAdamWChoice:
    """The Trainer's get_optimizer_cls_and_kwargs with torch's AdamW answered by FusedClipAdamW: asked when the
    optimizer is built, so it reads the arguments of that moment (a hyperparameter search's trial included) and
    keeps the Trainer's own choice of learning rate, betas and eps; any other optimizer passes through."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, args, model=None):
        cls, kwargs = self.inner(args, model)
        if cls is not torch.optim.AdamW:
            return cls, kwargs
        return FusedClipAdamW, {k: v for k, v in kwargs.items() if k in ("lr", "betas", "eps", "weight_decay")}


def fused_adamw(trainer, report: PatchReport) -> None:
    """Swap the Trainer's torch AdamW for FusedClipAdamW and fold its clipping (module docstring), or say why not."""
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is None or not hasattr(trainer, "args") or not hasattr(accelerator, "clip_grad_norm_"):
        return
    if isinstance(accelerator.__dict__.get("clip_grad_norm_"), FoldedClip):
        return  # patched before
    why = _why_not(trainer)
    if why is not None:
        report.add("trainer.optimizer", "trainer_adamw", "note", f"the trainer's optimizer stays torch's: {why}")
        return
    undo = []
    if getattr(trainer, "optimizer", None) is None and hasattr(trainer, "get_optimizer_cls_and_kwargs"):
        trainer.get_optimizer_cls_and_kwargs = _KernelAdamWChoice(trainer.get_optimizer_cls_and_kwargs)
        undo.append(lambda: vars(trainer).pop("get_optimizer_cls_and_kwargs", None))
    accelerator.clip_grad_norm_ = FoldedClip(trainer, accelerator.clip_grad_norm_)
    undo.append(lambda: accelerator.__dict__.pop("clip_grad_norm_", None))
    report._undo.extend(undo)
    report.add("trainer.optimizer", "trainer_adamw", "replaced",
               "AdamW through novatune's kernel, the gradient clipping applied inside its update (the same update "
               "and logged norm; torch.optim.AdamW's state_dict)")
