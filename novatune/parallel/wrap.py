"""The model wrapped for its strategy, after novatune.patch and gradient checkpointing have been applied.

FSDP2 (`fully_shard`): each decoder layer, or each run of `parallel.layers_per_unit` consecutive layers, is one FSDP
unit (its parameters gathered just before its forward, and before its backward), then the root takes what is left
(embeddings, final norm, lm_head); over one rank, by default, the root is the only unit (`unit_size`). The patched
modules run on the gathered parameters: fully_shard swaps each module's parameters for DTensors between uses and
back to plain tensors inside the unit's forward, so a patched forward sees ordinary tensors. Frozen parameters (the LoRA
base) are sharded too: FSDP2 groups parameters per unit whatever their requires_grad, and only reduces the
gradients that exist. With bf16 weights the policy computes in bf16 and accumulates and reduces the gradients in
the trained parameters' own dtype (bf16 in full fine-tuning, fp32 for LoRA adapters), as the one-process path and
DDP do, unless parallel.reduce_dtype is fp32 (fsdp2_reduce_dtype).

One process (world of one): there is no other rank to sum with, so nothing is reduced. The gradients accumulate
over the micro-batches on the gathered parameters in their own dtype, as the plain path accumulates them, and after
the step's last backward each one becomes its sharded parameter's gradient without a copy (`hand_over_gradients`:
over one rank a shard is the whole tensor). FSDP2's own reduction over one rank copies every gradient twice and
synchronises the host with the GPU once per unit (the copy-in's chunk_cat), leaving the GPU idle for the host's
per-parameter work: ten 2.8-5.7 ms gaps per step on the seed workload. By default (`parallel.reshard_after_forward`
unset) the gathered layers are also kept for the whole optimizer step: gathered once per step, freed after the last
micro-batch's backward, before the optimizer writes the shards (a sharded copy of one rank frees no memory by
resharding).

DDP: `DistributedDataParallel` over the whole model, gradients all-reduced in buckets during the backward of the
last micro-batch (or of every micro-batch: parallel.gradient_sync micro_batch).

Both average the gradients over the ranks. The trainer's loss is already normalised by the target tokens of the
whole global batch, so `loss_scale(world)` (x world) turns that average back into the sum: N ranks then give the
gradient of one process at the same global batch.
"""
from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor

from novatune.ops.adamw import clip_coefficient
from novatune.ops.grad_norm import total_norm


def decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated transformer blocks of an HF causal LM (under a PEFT wrapper too)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(base, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(base).__name__} has no .model.layers: the per-layer FSDP2 units cannot be found; "
                         f"use parallel.strategy: ddp for this model")
    return list(layers)


def reshards_after_forward(setting: bool | None, world: int) -> bool:
    """`parallel.reshard_after_forward`: as set, else True across 2+ ranks (memory) and False over one (speed)."""
    return setting if setting is not None else world > 1


# Decoder layers per FSDP2 unit across 2+ ranks when the layers stay gathered for the step. A unit there gathers
# and reduces once per step; what it costs every micro-batch is host time (FSDP2 hooks each unit's forward,
# recompute and backward), and the seed's step is host-bound. Seed workload on 2 H200s, FSDP2 beside one process
# (bench/results/bench.jsonl): 1.600x with units of 1 layer (session19-1), 1.838x with units of 4 (session19-3);
# units of 12 ran as fast as 4 in an experiment (bench/results/traces/session19-2). Units of 4 leave only the first
# unit's all-gather and the last one's reduce-scatter outside the compute.
KEPT_GATHERED_UNIT = 4


def unit_size(setting: int | None, world: int, keep_gathered: bool) -> int:
    """`parallel.layers_per_unit`: as set, else
    * over one rank where the gathered layers stay for the step: 0 (no unit per layer: the root unit holds the
      whole model). A unit there has nothing to free, gather or reduce apart from the others, and costs only host
      time (units of 4 gave 0.956-0.966 of the plain path, `session12-1/2`);
    * across 2+ ranks where they stay gathered: KEPT_GATHERED_UNIT layers (4), for the same reason, keeping the
      step's one all-gather and reduce-scatter per unit overlapped with the neighbouring units' compute;
    * resharding after forward: one layer per unit (each unit's gather and reduction overlap the neighbouring
      layers' compute, and only two layers are gathered at a time)."""
    if setting is not None:
        if setting < 1:
            raise ValueError(f"parallel.layers_per_unit must be >= 1 (got {setting})")
        return setting
    if not keep_gathered:
        return 1
    return 0 if world == 1 else KEPT_GATHERED_UNIT


def fsdp2_reduce_dtype(setting: str, world: int, trained_dtypes=frozenset({torch.bfloat16})) -> torch.dtype | None:
    """`parallel.reduce_dtype` as FSDP2's policy takes it (its param_dtype is bf16 for bf16 weights): None (reduce
    in bf16) or torch.float32. Over one rank nothing is reduced: None. `trained_dtypes`: the dtypes of the
    parameters that train.

    auto keeps the gradients in the dtype the one-process path accumulates them in, and DDP all-reduces them in:
    the trained parameters' own. With bf16 weights (full fine-tuning) that is bf16: 2 ranks x 4 micro-batches round
    as often as 1 process x 8. With fp32 trained parameters (LoRA adapters over a bf16 base) it is fp32, since
    FSDP2's bf16 compute would otherwise hand them bf16 gradients to accumulate. fp32 always accumulates and
    reduces in fp32, at a cost in memory (whole fp32 gradients between reductions) and time: on 2 H200s fp32
    added ~47 ms of GPU adds per step to a ~1.1 s host-bound step (bench/results/traces/session19-2), and the seed
    ran at 1.838x one process in fp32 (session19-3), 1.905x in bf16 (session19-4)."""
    if setting not in ("auto", "fp32"):
        raise ValueError(f"parallel.reduce_dtype must be auto or fp32 (got {setting!r})")
    if world < 2:
        return None
    if setting == "fp32" or any(dt != torch.bfloat16 for dt in trained_dtypes):
        return torch.float32
    return None


def trained_dtypes(model) -> frozenset:
    """The dtypes of `model`'s parameters that train (the weights' dtype in full fine-tuning, fp32 for adapters)."""
    return frozenset(p.dtype for p in model.parameters() if p.requires_grad) or frozenset({torch.bfloat16})


def wrap(model, strategy: str, dtype: torch.dtype, device: torch.device, reshard_after_forward: bool = True,
         world: int = 1, layers_per_unit: int = 1, reduce_dtype: str = "auto"):
    """The model wrapped for `strategy` (fsdp2 | ddp); the returned module is what the trainer calls."""
    if strategy == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=fsdp2_reduce_dtype(
            reduce_dtype, world, trained_dtypes(model))) if dtype == torch.bfloat16 else MixedPrecisionPolicy()
        layers = decoder_layers(model) if layers_per_unit > 0 else []  # 0: the root unit only
        for start in range(0, len(layers), max(1, layers_per_unit)):
            # a list makes one unit: gathered and reduced together, its hooks fire once per forward and backward
            unit = layers[start:start + layers_per_unit]
            fully_shard(unit if len(unit) > 1 else unit[0], mp_policy=mp, reshard_after_forward=reshard_after_forward)
        # the root's parameters are used again right after its forward (lm_head in the backward): keep them
        fully_shard(model, mp_policy=mp, reshard_after_forward=False)
        return model
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index if device.index is not None else torch.cuda.current_device()] \
            if device.type == "cuda" else None
        # the reduced gradients stay in the all-reduce buckets (the parameters' .grad are views of them) instead of
        # being copied back out. The micro-batches under no_sync still accumulate outside the buckets (the
        # gradients are set to None between steps), so the peak keeps one copy: 39.49 GiB on the seed either way
        return DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)
    raise ValueError(f"unknown parallel strategy {strategy!r}")


def unwrap(model):
    """The module DDP wraps (FSDP2 wraps in place: the model itself)."""
    return getattr(model, "module", model) if type(model).__name__ == "DistributedDataParallel" else model


def loss_scale(strategy: str, world: int) -> float:
    """What each rank's loss is multiplied by so the ranks' averaged gradients equal the global batch's."""
    return float(world) if strategy in ("ddp", "fsdp2") else 1.0


def syncs_every_micro_batch(setting: str, strategy: str, world: int) -> bool:
    """`parallel.gradient_sync`: micro_batch | step as set; auto: every micro-batch for FSDP2 across 2+ ranks (its
    gradients then stay sharded; once per step it would accumulate whole gradients, in parallel.reduce_dtype, on
    every rank), once per step otherwise (DDP holds whole gradients either way; one rank has nothing to reduce
    with). Left unset with reshard_after_forward, the memory plan sets both (train/memory.py)."""
    if setting == "auto":
        return strategy == "fsdp2" and world > 1
    return setting == "micro_batch"


def grad_sync(model, strategy: str, last: bool, keep_gathered: bool = False, every_micro_batch: bool = False,
              memo: dict | None = None, hand_over: bool = False, units: list | None = None):
    """A context for one micro-batch's backward. Gradient communication on the last micro-batch of a step only
    (the others accumulate locally; the same result with one reduction per step instead of grad_accum), or on
    every micro-batch (`every_micro_batch`). `keep_gathered` (FSDP2 units that do not reshard after forward): the
    gathered parameters also stay after the backward of every micro-batch but the last, so the next micro-batch
    gathers nothing; the last one reshards, before the optimizer updates the shards. `memo` (a dict kept by the
    caller) remembers the FSDP2 flags last set: each setter walks every module of the model, so they are set only
    when they change (twice per optimizer step instead of once per micro-batch); given the FSDP2 `units`
    (`fsdp_units`, found once), each is set alone instead of by a walk over every module. `hand_over` (one rank,
    `hands_over_gradients`): FSDP2 reduces nothing; the caller hands the gradients over after the last backward."""
    sync = (last or every_micro_batch) and not hand_over
    if strategy == "ddp" and not sync:
        return model.no_sync()
    if strategy == "fsdp2":
        flags = (sync, keep_gathered and last)
        if memo is None or memo.get("fsdp2_flags") != flags:
            recurse = units is None
            for unit in [model] if recurse else units:
                unit.set_requires_gradient_sync(sync, recurse=recurse)
                if keep_gathered:
                    unit.set_reshard_after_backward(flags[1], recurse=recurse)
            if memo is not None:
                memo["fsdp2_flags"] = flags
    return contextlib.nullcontext()


def fsdp_units(model) -> list:
    """The modules fully_shard made FSDP2 units (decoder layers or runs of them, and the root)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def fsdp_param_records(units: list) -> list:
    """FSDP2's per-parameter records (FSDPParam) of `units`; [] where this torch lays them out otherwise (the
    caller then leaves the reduction to FSDP2). They live as long as the units: found once per run."""
    found = []
    for unit in units:
        state = unit._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # torch releases with one group per module
            group = getattr(state, "_fsdp_param_group", None)
            groups = [] if group is None else [group]
        for group in groups:
            found.extend(getattr(group, "fsdp_params", []))
    return found


def hands_over_gradients(records: list, strategy: str, world: int) -> bool:
    """FSDP2 over one rank, where every parameter's shard is its whole tensor on this device: the gradients can be
    handed to the sharded parameters without FSDP2's reduction (`hand_over_gradients`). Not with FSDP2's CPU
    offload (its gradients go to host memory) or a torch whose FSDP2 lacks what the hand-over reads. `records`:
    fsdp_param_records."""
    if strategy != "fsdp2" or world != 1:
        return False
    needed = ("sharded_param", "sharded_size", "to_sharded_dtensor", "offload_to_cpu")
    return bool(records) and all(
        all(hasattr(r, a) for a in needed) and not r.offload_to_cpu
        and tuple(r.sharded_size) == tuple(r.sharded_param.shape) and r.sharded_param.to_local().numel()
        == r.sharded_param.numel() for r in records)


@torch.no_grad()
def hand_over_gradients(records: list) -> int:
    """After the last backward of a step over one rank (`hands_over_gradients`; FSDP2 told to reduce nothing):
    each gradient accumulated on a gathered parameter becomes its sharded parameter's gradient, a DTensor over
    the same storage. Returns how many were handed over. The gathered parameters are already freed by FSDP2's
    reshard after that backward; their gradients are separate tensors and stay alive in the shards. `records`:
    fsdp_param_records."""
    moved = 0
    for record in records:
        gathered = getattr(record, "_unsharded_param", None)
        accumulated = getattr(record, "unsharded_accumulated_grad", None)  # a reduce dtype other than the grads'
        grad = accumulated if accumulated is not None else (None if gathered is None else gathered.grad)
        if grad is None:
            continue
        if accumulated is not None:
            record.unsharded_accumulated_grad = None
        else:
            gathered.grad = None
        sharded = record.sharded_param
        grad = grad.to(sharded.dtype).contiguous()
        if sharded.grad is None:
            sharded.grad = record.to_sharded_dtensor(grad)
        else:  # gradients kept from an earlier step (zero_grad not called): accumulate as autograd would
            sharded.grad.to_local().add_(grad)
        moved += 1
    return moved


def grad_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """The total gradient norm over all ranks (pre-clip).

    With sharded (DTensor) gradients the norm of the local shards is not the model's norm. FSDP2 shards every
    gradient along dim 0 over one mesh dimension, so the squared norms of the local shards add up to the model's:
    the norm runs on the local tensors (novatune.ops.grad_norm's kernels, none of DTensor's per-tensor dispatch,
    which costs host time on every step) with one all-reduce of the squared sum across 2+ ranks. Over one rank this
    is the plain path's computation on the same tensors. Other placements take DTensor's own path."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    if not isinstance(grads[0], DTensor):
        return total_norm(grads)
    if not _local_shards(grads):
        total = torch.nn.utils.get_total_norm(grads, 2.0, error_if_nonfinite=False, foreach=None)
        return total.full_tensor() if isinstance(total, DTensor) else total
    total = total_norm([g.to_local() for g in grads])
    mesh = grads[0].device_mesh
    if mesh.size() > 1:
        squared = total.float().square()
        torch.distributed.all_reduce(squared, group=mesh.get_group())
        total = squared.sqrt().to(total.dtype)
    return total


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """The total gradient norm over all ranks' shards (pre-clip, grad_norm), and the gradients clipped to
    `max_norm`: clip_grads_with_norm_'s arithmetic, on the local shards where grad_norm summed them."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or not isinstance(grads[0], DTensor):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    total = grad_norm(params)
    if not _local_shards(grads):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=None)
        return total
    torch._foreach_mul_([g.to_local() for g in grads], clip_coefficient(total, max_norm))
    return total


def _local_shards(grads: list) -> bool:
    """Every gradient a DTensor sharded along one mesh dimension: its local shards' squared norms add up."""
    return all(isinstance(g, DTensor) and g.device_mesh.ndim == 1 and g.placements[0].is_shard() for g in grads)
