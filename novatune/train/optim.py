"""The optimizer (`train.optimizer`), its state's size, and the learning-rate schedule.

    adamw             torch.optim.AdamW (fused on CUDA); moments in the parameter's dtype, as stock trainers run it.
                      With bf16 weights an update below half a bf16 spacing rounds away: at lr 1e-5 most weights
                      never move (tests/train/test_optim.py measures it).
                      Over FSDP2's DTensor parameters, the same update runs on the local shards (ShardLocalAdamW).
                      `train.adamw_kernel: novatune` runs the same update through novatune's kernel instead
                      (FusedClipAdamW: one pass per parameter, the gradient-clipping scale applied inside it, so the
                      separate pass that scales every gradient goes away); its state_dict is torch.optim.AdamW's.
                      `auto` (the default) takes it for a patched model's full fine-tuning on CUDA, torch's
                      otherwise (LoRA, stock models, the CPU, or fused_adamw false). Over FSDP2's DTensor parameters
                      it updates each rank's local shards, as ShardLocalAdamW does; DDP's are plain tensors.
    adamw_kahan       AdamW with fp32 moments and a compensated (Kahan) bf16 weight update (novatune.ops.adamw_kahan):
                      the weights follow an fp32-master AdamW's, rounded to bf16, for 2 extra bytes per bf16
                      parameter instead of a 4-byte master copy. fp32 parameters (LoRA adapters) need no buffer.
    adamw_8bit        bitsandbytes AdamW8bit: moments in 8 bits, blockwise scales (~2 bytes per parameter).
    paged_adamw       bitsandbytes PagedAdamW: fp32 moments in CUDA unified memory, paged to the host when the GPU
                      runs short.
    paged_adamw_8bit  both.
`optimizer_state_bytes(name, params)` says what each one keeps, so a memory planner can choose.

Weight decay applies to matrices only (2-D+ parameters); norms and biases are excluded, the usual practice.
Schedule: linear warmup from 0 over `warmup` steps, then linear or cosine decay to `min_lr_ratio * lr` at the
last step (constant: flat after warmup). Implemented as a LambdaLR so its state_dict is just the step count.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

from novatune.ops.adamw import FusedClipAdamW, trains_most_weights
from novatune.parallel.optim import ShardLocalAdamW, closure_loss
from novatune.train.errors import SetupError

OPTIMIZERS = ("adamw", "adamw_kahan", "adamw_8bit", "paged_adamw", "paged_adamw_8bit")
BNB_OPTIMIZERS = {"adamw_8bit": "AdamW8bit", "paged_adamw": "PagedAdamW", "paged_adamw_8bit": "PagedAdamW8bit"}
PAGED = frozenset({"paged_adamw", "paged_adamw_8bit"})  # state that CUDA may page out to host memory
BNB_FIX = "pip install bitsandbytes, or set train.optimizer: adamw (or adamw_kahan)"
# bitsandbytes' 8-bit optimizers: tensors of fewer elements keep fp32 moments; blockwise scales per 256 elements
BNB_MIN_8BIT_SIZE = 4096
BNB_BLOCK = 256


def warmup_steps(warmup: float, total_steps: int) -> int:
    return int(warmup) if warmup >= 1 else int(round(warmup * total_steps))


def lr_lambda(step: int, total: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the base lr for optimizer step `step` (0-based: the lr used by the (step+1)-th update)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    if schedule == "linear":
        decay = 1.0 - progress
    else:
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * decay


def state_bytes(name: str, numel: int, element_size: int) -> int:
    """Bytes of optimizer state `name` keeps for one trainable tensor of `numel` elements of `element_size` bytes."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    n = numel
    if name == "adamw":
        return 2 * n * element_size  # exp_avg, exp_avg_sq in the parameter's dtype
    if name == "adamw_kahan":
        return 8 * n + (n * element_size if element_size < 4 else 0)  # fp32 moments + the compensation
    if name == "paged_adamw" or n < BNB_MIN_8BIT_SIZE:
        return 8 * n  # bitsandbytes' 32-bit states are fp32 whatever the parameter's dtype
    return 2 * n + 2 * 4 * math.ceil(n / BNB_BLOCK)  # two uint8 moments, an fp32 scale per block each


def optimizer_state_bytes(name: str, params: Iterable[torch.Tensor]) -> int:
    """Bytes of optimizer state `name` keeps for `params` (trainable tensors; meta tensors are fine). Paged
    optimizers' state may live on the host (PAGED); everything else stays on the parameters' device."""
    return sum(state_bytes(name, p.numel(), p.element_size()) for p in params) if name in OPTIMIZERS else \
        state_bytes(name, 0, 0)


class AdamWKahan(torch.optim.Optimizer):
    """AdamW with fp32 moments and a Kahan-compensated weight update (module docstring; the math is in
    novatune/reference/adamw_kahan.py). Same hyperparameters and schedule as torch.optim.AdamW."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        from novatune.ops.adamw_kahan import adamw_kahan_step

        loss = closure_loss(closure)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("train.optimizer adamw_kahan: sparse gradients are not supported")
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
                    st["exp_avg_sq"] = torch.zeros_like(st["exp_avg"])
                    if p.element_size() < 4:
                        st["compensation"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                st["step"] += 1
                adamw_kahan_step(p.data, st.get("compensation"), st["exp_avg"], st["exp_avg_sq"],
                                 p.grad.contiguous(), lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                                 eps=group["eps"], weight_decay=group["weight_decay"], step=st["step"])
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        # torch casts every floating state tensor to its parameter's dtype on load: the fp32 moments of a bf16
        # parameter would come back bf16. Put the saved fp32 values back (moved to the parameter's device).
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        for g_saved, group in zip(state_dict["param_groups"], self.param_groups):
            for pid, p in zip(g_saved["params"], group["params"]):
                for key in ("exp_avg", "exp_avg_sq"):
                    if pid in saved and key in saved[pid]:
                        self.state[p][key] = saved[pid][key].to(device=p.device, dtype=torch.float32)


GROUP_FLAGS = ("foreach", "fused", "capturable", "differentiable")


def live_group_flags(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """`state_dict` with each saved param group's implementation flags replaced by the live optimizer's.
    Optimizer.load_state_dict takes a group's settings from the file, so a checkpoint of novatune's AdamW kernel
    (foreach off, fused unset) would turn a torch.optim.AdamW(fused=True) that resumes it into torch's
    one-tensor-at-a-time path (and leave its step counts where the file put them). How this process steps is the
    live optimizer's choice; the hyperparameters (lr, betas, eps, weight decay) stay the checkpoint's."""
    if len(state_dict["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"the checkpoint's optimizer has {len(state_dict['param_groups'])} parameter groups, this "
                         f"run's {len(optimizer.param_groups)}: it was written for other trainable weights")
    groups = [{**saved, **{k: live[k] for k in GROUP_FLAGS if k in live}}
              for saved, live in zip(state_dict["param_groups"], optimizer.param_groups, strict=True)]
    return {**state_dict, "param_groups": groups}


def _bnb_class(name: str):
    try:
        import bitsandbytes as bnb
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken native library
        raise SetupError(f"train.optimizer: {name} needs bitsandbytes ({type(e).__name__}); {BNB_FIX}") from None
    return getattr(bnb.optim, BNB_OPTIMIZERS[name])


def adamw_kernel(tcfg, device: torch.device, patched: bool, full: bool) -> str:
    """train.adamw_kernel resolved: "novatune" or "torch". auto takes novatune's kernel for a patched model's adamw
    on CUDA when most of its weights train (`full`: full fine-tuning, where the update is one long pass over large
    tensors; LoRA's many small adapters suit torch's multi-tensor launches and have not been measured with it).
    fused_adamw true asks for a one-pass AdamW, which the kernel is (torch's fused one with adamw_kernel: torch);
    fused_adamw false asks for torch's foreach AdamW and keeps it. torch's also stays on the CPU and for stock
    models."""
    choice = getattr(tcfg, "adamw_kernel", "torch")
    if choice != "auto":
        return choice
    usable = (getattr(tcfg, "optimizer", "adamw") == "adamw" and device.type == "cuda" and patched and full
              and tcfg.fused_adamw is not False)
    return "novatune" if usable else "torch"


def build_optimizer(model, tcfg, device: torch.device, patched: bool = False) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": tcfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    hyper = dict(lr=tcfg.lr, betas=tuple(tcfg.betas), eps=tcfg.eps, weight_decay=tcfg.weight_decay)
    name = getattr(tcfg, "optimizer", "adamw")
    sharded = any(isinstance(p, DTensor) for g in groups for p in g["params"])
    if adamw_kernel(tcfg, device, patched, trains_most_weights(model)) == "novatune":
        if name != "adamw":
            raise SetupError(f"train.adamw_kernel novatune runs train.optimizer adamw, not {name}; set "
                             "train.adamw_kernel: torch")
        return FusedClipAdamW(groups, **hyper)
    if name == "adamw_kahan":
        return AdamWKahan(groups, **hyper)
    if name in BNB_OPTIMIZERS:
        return _bnb_class(name)(groups, **hyper)
    fused = tcfg.fused_adamw if tcfg.fused_adamw is not None else device.type == "cuda"
    kw = {"fused": True} if fused else {}  # else torch's default (foreach on CUDA)
    # FSDP2's parameters are DTensors: the same AdamW, its update run on the local shards (parallel/optim.py)
    cls = ShardLocalAdamW if sharded else torch.optim.AdamW
    return cls(groups, lr=tcfg.lr, betas=tuple(tcfg.betas), eps=tcfg.eps, **kw)


def build_scheduler(opt, tcfg, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    w = warmup_steps(tcfg.warmup, total_steps)
    if w > total_steps:
        warnings.warn(f"train.warmup is {w} steps but the run has {total_steps}: the learning rate never reaches "
                      f"train.lr (its last step uses {total_steps / w:.0%} of it); shorten train.warmup or give it as "
                      f"a fraction of the run (< 1)", stacklevel=2)
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_lambda(s, total_steps, w, tcfg.schedule, tcfg.min_lr_ratio))
