"""One run builder: `build(config) -> Session`, and the training step every consumer runs.

The trainer (train/loop.py), `novatune bench` (every stack), `novatune validate`, `novatune eval` and `novatune tune`
build their model here, so a figure any of them reports comes from the model and the step the trainer runs.

Build order (fixed): seed -> tokenizer -> data -> [before_model hook] -> model -> QLoRA embedding quantisation ->
gradient checkpointing + LoRA (train/model.prepare) -> novatune.patch -> [model_hook] -> optimizer -> scheduler.
A stack that is not novatune (stock HF, a peer) is the same build with other options: `model.patch=false`, another
attention implementation, a `before_model` hook (Liger patches HF's classes before the model exists) or a
`model_hook` (switch a built model's attention).

One optimizer step = `grad_accum` micro-batches, in two calls so a caller can look at the loss before the weights
change:
  out = session.forward_backward(micro_batches)   # gradients accumulated and clipped*; out.loss, out.grad_norm
  session.apply_update()                          # optimizer + scheduler step, gradients zeroed
  (or session.skip_update(): gradients dropped, weights unchanged, the schedule advances)
`session.step(micro_batches)` does both. Neither synchronises with the GPU: the loss and the norm stay on the
device until the caller reads them. *With novatune's AdamW kernel (train.adamw_kernel) the clipping coefficient
goes to the optimizer, which applies it inside its update; the gradients themselves stay unscaled.

The loss is normalised by the number of target tokens in the whole accumulated batch: every micro-batch forward
gets `num_items_in_batch = N` (HF's loss, and the patched fused cross-entropy, then compute sum(CE) / N), so the
gradients add up to those of one big batch. Nothing is divided by grad_accum again (that would be the gradient
accumulation bug, trl #2175). The step's loss is the sum of the micro-batch losses: the mean CE per target token.
Every forward passes `use_cache=False`: Qwen3's default use_cache=True silently disables HF's packed-sequence
detection, and attention would cross documents.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from novatune.data.collate import model_inputs
from novatune.data.dataset import BatchStream, PackedData, build_data
from novatune.memory import embedding_grad, host_embedding
from novatune.ops.adamw import clip_coefficient
from novatune.ops.grad_norm import final_gradient_squares
from novatune.ops.linear_cross_entropy import grad_output_promised, reset_promise_flags
from novatune.parallel import wrap as pwrap
from novatune.parallel.dist import Dist
from novatune.parallel.dist import setup as setup_dist
from novatune.patch.graph_install import keep_layers_eager
from novatune.patch.host_offsets import HOST_OFFSETS_KWARG, HostOffsets
from novatune.train.config import memory_policy
from novatune.train.errors import SetupError
from novatune.train.memory import (
    ASSUMED,
    MemoryPlan,
    configure_allocator,
    embedding_grad_rows,
    layer_graphs_asked,
    needs_checkpointing,
    plan_for_run,
    start_streaming,
    stop_streaming,
)
from novatune.train.memory import install as install_memory_plan
from novatune.train.metrics import flops_per_token
from novatune.train.model import (
    apply_patch,
    build_model,
    load_tokenizer,
    model_config,
    param_counts,
    pick_device,
    pick_dtype,
    prepare,
)
from novatune.train.optim import FusedClipAdamW, build_optimizer, build_scheduler
from novatune.train.plan import plan as estimate
from novatune.train.preflight import cpu_step_warning


def call_inputs(mb: dict, device: torch.device, packed_kwargs: str | None, wrapped: bool = False) -> dict:
    """A micro-batch as the model call's keyword arguments (data/collate.py `model_inputs`). `wrapped` (DDP or
    FSDP2): their forward first moves every tensor argument to the GPU, and a CPU tensor's copy there blocks the
    host until the GPU has drained its queue; the patched attention would then read the offsets back (a second
    wait), once per micro-batch. So the host-side document offsets go as HostOffsets, a plain object the wrappers
    pass through and the decoder's pre-hook reads without touching the device (patch/host_offsets.py)."""
    inputs = model_inputs(mb, device, packed_kwargs)
    if wrapped and packed_kwargs == "host":
        for key in ("cu_seq_lens_k", "max_length_q", "max_length_k"):
            inputs.pop(key, None)
        cu, ids = inputs.pop("cu_seq_lens_q"), inputs["input_ids"]
        inputs[HOST_OFFSETS_KWARG] = HostOffsets(tuple(cu.tolist()), ids.shape[0], ids.shape[1])
    return inputs


def forward_backward(model, micro_batches: list[dict], device: torch.device, packed_kwargs: str | None,
                     loss_scale: float = 1.0, grad_sync=None, promise_grad_output: bool = False,
                     final_squares: bool = False):
    """Accumulate the gradients of one optimizer step; returns the step's loss (a 0-dim tensor, not synced).

    Under several processes each micro-batch dict carries the global micro-batch's `global_target_tokens`: the
    loss is normalised by the whole global batch, and `loss_scale` (the world size) undoes the ranks' gradient
    averaging. `grad_sync(last)` gives the context of each backward (when the gradients are reduced); it is given
    for a DDP or FSDP2 model only (`call_inputs`' `wrapped`).
    The returned loss is this rank's part; the session sums it over the ranks. `promise_grad_output`: one process
    (no grad_sync) promises the fused loss its grad_output (memory.lm_head_grad_in_forward). `final_squares`: the
    last backward runs under novatune.ops.grad_norm.final_gradient_squares (kernels that store a gradient's final
    value record its squares for the step's norm); only where nothing changes the gradients before that norm."""
    n_items = max(1, sum(mb.get("global_target_tokens", mb["num_target_tokens"]) for mb in micro_batches))
    total = torch.zeros((), device=device)
    embedding_grad.discard(pwrap.unwrap(model))  # rows of a step abandoned before its last backward
    # one process: each loss below gets grad_output 1.0 from its own .backward(), which lets the fused loss add
    # lm_head's gradient into its existing .grad in the forward (ops/linear_cross_entropy.py, checked there)
    promises = promise_grad_output and grad_sync is None and loss_scale == 1.0
    if promises:
        reset_promise_flags()  # a broken promise is reported by the step that broke it, not by later ones
    for i, mb in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        ctx = grad_sync(last) if grad_sync is not None else contextlib.nullcontext()
        # the promise covers the forward only (the loss reads it there); its backward below gives grad_output 1.0
        promise = grad_output_promised(1.0) if promises and not mb.get("idle") else contextlib.nullcontext()
        with ctx, embedding_grad.micro_step(pwrap.unwrap(model), last):
            with promise:
                out = model(**call_inputs(mb, device, packed_kwargs, wrapped=grad_sync is not None),
                            num_items_in_batch=n_items, use_cache=False)
            # loss = sum CE(micro-batch) / n_items: summing these is the whole batch's mean. An idle micro-batch
            # (a rank with no row left at an epoch's end, data/dataset.py) runs for the collectives only: x 0 also
            # drops what is not a token loss (an MoE router's aux loss)
            scale = 0.0 if mb.get("idle") else loss_scale
            with final_gradient_squares() if final_squares and last else contextlib.nullcontext():
                (out.loss * scale if scale != 1.0 else out.loss).backward()
        if not mb.get("idle"):
            total += out.loss.detach().float()
    return total


def row_padding(cfg) -> int | None:
    """Tokens per row every micro-batch is padded to (data.pad_rows), or None for its longest row. auto pads packed
    rows to max_length where the layers run as CUDA graphs (patch/graphs.py): a graph set serves one batch shape,
    and best-fit rows end a few tokens short of max_length in varying amounts (measured on the LoRA example's
    rows: 44 of 160 exactly 4096), so without it most batches run eagerly. The graphs take recomputed layers only,
    on a GPU: a full fine-tuning (cuda_graphs True or "forward") pads under the policies that may recompute every
    layer; LoRA dropout keeps the layers eager (its random draws), and rows of their own length keep PEFT's
    draws."""
    mode = cfg.data.pad_rows
    if mode == "auto":
        if cfg.method.type in ("lora", "qlora"):
            graphed = layer_graphs_asked(cfg) and not cfg.method.dropout
        else:  # auto and per-layer plans may recompute every layer too (the graphs then run): a few padded tokens
            graphed = (layer_graphs_asked(cfg) and memory_policy(cfg.memory) in ("checkpoint", "auto", "per-layer")
                       and pick_device(cfg.model.device).type == "cuda")
        mode = "max_length" if cfg.data.packing and graphed else "longest"
    return cfg.data.max_length if mode == "max_length" else None


def packed_kwargs_mode(cfg, report) -> str | None:
    """How the document offsets reach the model: "device" for stock flash-attention (it reads cu_seq_lens on the
    GPU), "host" for novatune's patched attention (its PackedBatch takes the host copy: no sync), None for stock
    sdpa/eager (HF finds the documents from position_ids)."""
    if cfg.model.attention.startswith("flash_attention"):
        return "device"
    if report is not None:
        return "host"
    return None


# families whose stock attention mask ignores the per-document position_ids of packed rows in the transformers 5
# releases novatune supports (GPT-OSS builds its causal and sliding masks without them): packed documents attend to
# each other on the stock path. novatune's patched attention keeps them apart.
STOCK_MASK_WITHOUT_DOCUMENTS = {"gpt_oss": "GPT-OSS"}


def stock_packing_crosses_documents(cfg, report, model_config) -> str | None:
    """The warning for a run on packed rows whose attention stays stock (unpatched, or the patch left a layer's
    attention stock) in a family whose stock mask does not see the documents (STOCK_MASK_WITHOUT_DOCUMENTS), else
    None. A warning, not an error: the bench's stock stack trains
    HF as shipped on purpose, and says so in its config."""
    family = STOCK_MASK_WITHOUT_DOCUMENTS.get(getattr(model_config, "model_type", ""))
    if family is None or not cfg.data.packing or cfg.model.attention.startswith("flash_attention"):
        return None
    if report is not None and report.replaced("attention") and not report.skipped("attention"):
        return None  # every layer runs novatune's attention, which keeps the documents apart
    why = "model.patch: false" if report is None else "novatune's attention not applied to every layer"
    return (f"warning: stock {family} attention ({why}) builds its mask without the packed rows' document "
            "boundaries: packed documents attend to each other. Patch the attention (model.patch: true, no "
            "patch_options.attention: false) or set data.packing: false")


def cpu_threads_for_load(console) -> None:
    """On a CPU that other processes already keep busy, train with one thread: OpenMP threads spinning against
    other processes' threads made a 2-thread run ~5x slower than a 1-thread one on a shared 2-core machine
    (matmul 7 vs 33 GFLOP/s; the demo 344 s vs 64 s). An explicit OMP_NUM_THREADS is always respected."""
    cores = os.cpu_count() or 1
    if os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads() < 2 or not hasattr(os, "getloadavg"):
        return
    load = os.getloadavg()[0]
    if load >= cores:
        torch.set_num_threads(1)
        if console is not None:
            console.print(f"[yellow]the CPU is busy (load {load:.1f} on {cores} cores): training with 1 thread; "
                          f"set OMP_NUM_THREADS to choose[/]")


@dataclass
class StepOutput:
    loss: torch.Tensor  # 0-dim, on the device: mean CE per target token of the accumulated batch
    grad_norm: torch.Tensor  # 0-dim, pre-clip total norm of the trainable parameters' gradients


@dataclass
class Session:
    """A built run: what the trainer steps and what bench / proof / eval / tune measure."""
    cfg: object
    model: torch.nn.Module
    tokenizer: object
    data: PackedData
    stream: BatchStream
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    patch_report: object  # PatchReport, or None when model.patch is false
    device: torch.device
    dtype: torch.dtype
    total_steps: int
    packed_kwargs: str | None
    weights_bytes: int | None = None  # CUDA memory allocated once the model is built and patched (QLoRA: NF4)
    dist: Dist = dataclasses.field(default_factory=Dist)  # rank, world size, strategy (novatune/parallel)
    memory_plan: MemoryPlan | None = None  # per-layer policies and the predicted peak (train/memory.py)

    def __post_init__(self):
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        clip = self.cfg.train.max_grad_norm
        self.clip = clip if clip > 0 else float("inf")
        self.strategy = self.dist.strategy if self.dist.active else "none"
        # FSDP2 units that keep their gathered parameters after forward keep them across the step's micro-batches
        self.keep_gathered = self.strategy == "fsdp2" and not pwrap.reshards_after_forward(
            self.cfg.parallel.reshard_after_forward, self.dist.world)
        self.sync_every_micro_batch = pwrap.syncs_every_micro_batch(self.cfg.parallel.gradient_sync, self.strategy,
                                                                    self.dist.world)
        self._sync_flags: dict = {}  # the FSDP2 flags last set (pwrap.grad_sync)
        # FSDP2's units and per-parameter records, found once: the step sets their flags and hands their gradients
        self.fsdp_units = pwrap.fsdp_units(self.model) if self.strategy == "fsdp2" else []
        self._fsdp_records = pwrap.fsdp_param_records(self.fsdp_units)
        # one rank: the gradients go to the shards without FSDP2's reduction (parallel/wrap.py)
        self.hand_over = pwrap.hands_over_gradients(self._fsdp_records, self.strategy, self.dist.world)
        # lm_head's gradient into .grad by the loss's forward: as the memory plan chose (train/memory.py), or asked
        asked = self.cfg.memory.lm_head_grad_in_forward
        self.lm_head_grad_in_forward = (self.memory_plan.plan.lm_head_grad_in_forward if self.memory_plan is not None
                                        else asked is True)

    @property
    def inner_model(self) -> torch.nn.Module:
        """The model under a DDP wrapper (FSDP2 shards in place: the model itself)."""
        return pwrap.unwrap(self.model)

    @property
    def lora(self) -> bool:
        return self.cfg.method.type in ("lora", "qlora")

    @property
    def base_config(self):
        """The transformers config of the model under any PEFT wrapper (for FLOP counts)."""
        inner = self.inner_model
        return getattr(inner, "get_base_model", lambda: inner)().config

    def next_micro_batches(self) -> list[dict]:
        """The next optimizer step's `grad_accum` micro-batches (host tensors, document offsets computed). A run
        measured in epochs (train.epochs, no max_steps) ends each epoch with a step of what is left of it, as
        HF Trainer does: rows of the next epoch never join it, so a one-epoch run trains each row once."""
        n = self.cfg.train.grad_accum
        if not self.cfg.train.max_steps:
            n = min(n, self.stream.left_in_epoch())
        return [self.stream.next() for _ in range(n)]

    def batches(self, steps: int, pin: bool | None = None) -> list[list[dict]]:
        """The next `steps` optimizer steps' micro-batches, collated up front; pinned on CUDA, so each copy to the
        GPU is asynchronous (a pageable source makes CUDA synchronise the stream first)."""
        pin = self.device.type == "cuda" if pin is None else pin
        out = []
        for _ in range(steps):
            mbs = self.next_micro_batches()
            if pin:
                for mb in mbs:
                    for k in ("input_ids", "position_ids", "labels"):
                        mb[k] = mb[k].pin_memory()
            out.append(mbs)
        return out

    def forward_backward(self, micro_batches: list[dict]) -> StepOutput:
        """Gradients of one optimizer step, accumulated over the micro-batches and clipped; nothing synced. With
        novatune's AdamW kernel (FusedClipAdamW) the gradients stay unscaled and the optimizer takes the clipping
        coefficient, which it applies inside its update: what apply_update() computes is the same."""
        if self.strategy == "none":
            # with novatune's AdamW the norm below reads the gradients right after the last backward
            loss = forward_backward(self.model, micro_batches, self.device, self.packed_kwargs,
                                    promise_grad_output=self.lm_head_grad_in_forward,
                                    final_squares=isinstance(self.optimizer, FusedClipAdamW))
        else:
            loss = forward_backward(self.model, micro_batches, self.device, self.packed_kwargs,
                                    pwrap.loss_scale(self.strategy, self.dist.world),
                                    lambda last: pwrap.grad_sync(self.model, self.strategy, last, self.keep_gathered,
                                                                 self.sync_every_micro_batch, self._sync_flags,
                                                                 self.hand_over, self.fsdp_units or None))
            self.finish_backward()
            self.dist.sum_(loss)  # the global batch's mean CE per target token, on every rank
        if isinstance(self.optimizer, FusedClipAdamW):  # the optimizer applies the clipping scale itself
            norm = pwrap.grad_norm(self.params)
            if self.clip != float("inf"):
                self.optimizer.clip_coef = clip_coefficient(norm, self.clip).float()
            return StepOutput(loss, norm)
        if self.strategy == "none":
            return StepOutput(loss, torch.nn.utils.clip_grad_norm_(self.params, self.clip))
        return StepOutput(loss, pwrap.clip_grad_norm(self.params, self.clip))

    def finish_backward(self) -> None:
        """What follows a step's last backward outside autograd: over one FSDP2 rank, the gradients handed to the
        sharded parameters (parallel/wrap.py `hand_over_gradients`); nothing otherwise. Whoever runs backward
        without forward_backward (the bench's diagnostics) calls it before reading or dropping the gradients."""
        if self.hand_over and not pwrap.hand_over_gradients(self._fsdp_records) and self.params \
                and all(p.grad is None for p in self.params):
            # FSDP2 was told not to reduce: gradients it holds where the hand-over does not look would be lost
            raise RuntimeError("FSDP2 over one process: the step's gradients were not found on the gathered "
                               "parameters (this torch's FSDP2 keeps them elsewhere); set parallel.strategy: none "
                               "for one process")

    def apply_update(self, found_inf: torch.Tensor | None = None) -> None:
        """The optimizer and scheduler step on the accumulated gradients, then the gradients are dropped.
        `found_inf` (an optimizer nonfinite.takes_found_inf accepts): a device flag, nonzero to leave the weights and
        moments as they are (train/nonfinite.py)."""
        if found_inf is not None:
            self.optimizer.found_inf = found_inf  # torch's fused AdamW reads it as GradScaler sets it
        try:
            self.optimizer.step()
        finally:
            if found_inf is not None:
                self.optimizer.found_inf = None  # torch's keeps the attribute: the next step must not see it
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def skip_update(self) -> None:
        """Drop the accumulated gradients without touching the weights or the optimizer state. The step still
        counts, so the learning-rate schedule advances (as torch's GradScaler does on an overflow): a skipped
        step keeps the rest of the run on the schedule it was configured with."""
        self.optimizer.zero_grad(set_to_none=True)
        if isinstance(self.optimizer, FusedClipAdamW):
            self.optimizer.clip_coef = None
        with warnings.catch_warnings():  # torch warns when the scheduler steps without an optimizer step
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            self.scheduler.step()

    def step(self, micro_batches: list[dict]) -> StepOutput:
        """One whole optimizer step: forward_backward, then apply_update."""
        out = self.forward_backward(micro_batches)
        self.apply_update()
        return out

    def stop_streaming(self) -> None:
        """Every streamed frozen weight, and a host-resident input embedding, back in device storage (before an
        export or a merge reads them)."""
        if self.memory_plan is not None:
            stop_streaming(self.memory_plan, pwrap.decoder_layers(self.inner_model))
        host_embedding.restore(self.inner_model)

    def release_optimizer_state(self) -> None:
        """Free the optimizer's moments (2x the trainable weights in fp32) once training is over; the model, data
        and tokenizer stay for whoever checks the trained model."""
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer.state.clear()

    def flops_per_token(self, avg_attended_keys: float) -> float:
        """Model FLOPs per trained token (LoRA: frozen matmuls at forward + input gradient)."""
        return flops_per_token(self.base_config, avg_attended_keys, 0.0 if self.lora else 1.0)

    def param_counts(self) -> tuple[int, int]:
        return param_counts(self.model)


def pad_id_of(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0


def build_patched_model(cfg, device, dtype, tokenizer, base_dir: Path | None = None, console=None,
                        before_model: Callable | None = None, select: Callable | None = None,
                        memory_plan: MemoryPlan | None = None):
    """The model as the trainer trains it: built (QLoRA: NF4 linears), input embedding quantised when configured,
    checkpointing and LoRA, the memory plan's per-layer policies, then novatune.patch. Returns (model, patch
    report or None)."""
    if before_model is not None:
        before_model(model_config(cfg.model, tokenizer, base_dir))
    qlora = cfg.method.type == "qlora"
    model = build_model(cfg.model, device, dtype, tokenizer, base_dir, seed=cfg.train.seed, qlora=qlora)
    if qlora and cfg.method.quantize_embeddings:
        from novatune.train.qlora import quantize_embeddings_

        # before prepare(): enable_input_require_grads hooks the module get_input_embeddings() returns then
        msg = quantize_embeddings_(model, dtype)
        if console is not None:
            console.print(msg, highlight=False, markup=False)
    model = prepare(model, cfg, needs_checkpointing(memory_plan, cfg))
    if memory_plan is not None:
        install_memory_plan(model, memory_plan, pwrap.decoder_layers(model), device)
    report = apply_patch(model, cfg.model, select, tiled_mlp=cfg.memory.tiled_mlp)
    if report is not None and console is not None:
        console.print(str(report), highlight=False, markup=False)
    if memory_plan is not None and memory_plan.plan.streamed:
        # after the patch: the streamer moves the parameters the patched modules compute with
        msg = start_streaming(memory_plan, pwrap.decoder_layers(model), device)
        if console is not None:
            console.print(msg, highlight=False, markup=False)
    if cfg.memory.embeddings_on_host:
        # the gather checks no id: every id the data holds is < vocab_size (data/dataset.py), padding included here
        rows, pad = model.get_input_embeddings().num_embeddings, pad_id_of(tokenizer)
        vocab = getattr(model.config, "vocab_size", rows)
        if vocab > rows or pad >= rows:
            raise SetupError(f"memory.embeddings_on_host: the table has {rows} rows, but the data may hold ids up to "
                             f"the config's vocab_size {vocab} and the padding id {pad}; resize the embeddings to the "
                             f"tokenizer, or set memory.embeddings_on_host: false")
        try:
            freed = host_embedding.place_on_host(model)
        except host_embedding.HostEmbeddingRefused as e:
            raise SetupError(str(e)) from None
        if console is not None:
            console.print(f"memory: input embedding table in mapped host memory ({freed / 2**30:.2f} GiB off the "
                          f"GPU; memory.embeddings_on_host)", highlight=False, markup=False)
    if embedding_grad_rows(cfg, model.get_input_embeddings().num_embeddings):
        why = embedding_grad.why_not(model)
        if why is None:
            saved = embedding_grad.install(model)
            msg = (f"memory: the input embedding's gradient kept as rows between micro-steps (the later forwards hold "
                   f"the rows, not its {saved / 2**30:.2f} GiB; memory.embedding_grad)")
        elif cfg.memory.embedding_grad == "rows":
            raise SetupError(f"memory.embedding_grad: rows: {why}; set memory.embedding_grad: auto or dense")
        else:
            msg = f"memory: the input embedding's gradient stays dense ({why})"
        if console is not None:
            console.print(msg, highlight=False, markup=False)
    return model, report


def memory_plan_for(cfg, base_dir, mconf, device, console, dist: Dist) -> MemoryPlan | None:
    """The run's memory plan (train/memory.py), before the model is built. Under the stock policies (none,
    checkpoint) the plan only predicts the peak: a model the estimate cannot build on the meta device trains
    without the prediction, and says so; any other policy, or an explicit memory.stream_frozen_layers (which the
    plan carries out), needs the plan and raises."""
    shards = dist.world if dist.active and dist.strategy == "fsdp2" else 1
    try:
        est = estimate(cfg, base_dir, mconf=mconf, hw=ASSUMED)
    except Exception as e:  # noqa: BLE001 - any failure of the estimate; re-raised where the plan is needed
        explicit_stream = cfg.memory.stream_frozen_layers not in ("auto", 0)
        if memory_policy(cfg.memory) not in ("none", "checkpoint") or explicit_stream:
            raise  # the plan carries out these settings: without it they would be ignored
        if console is not None:
            console.print(f"memory: no predicted peak for this model ({type(e).__name__}: {e})", highlight=False,
                          markup=False)
        return None
    return plan_for_run(cfg, est, mconf, device, console, shards)


def join(cfg) -> Dist:
    """This process's place in the run (parallel.strategy; novatune/parallel/dist.py)."""
    return setup_dist(cfg.parallel.strategy, pick_device(cfg.model.device).type)


def build(cfg, base_dir: Path | None = None, console=None, before_model: Callable | None = None,
          model_hook: Callable | None = None, total_steps: int | None = None, dist: Dist | None = None,
          select: Callable | None = None) -> Session:
    """Build the configured run (module docstring). `before_model(transformers_config)` runs before the model
    exists; `model_hook(model)` once it is built, prepared and patched, before the optimizer exists (snapshot the
    weights, switch a peer's attention). `total_steps` overrides the schedule's length (default: train.max_steps,
    or the epochs' worth of optimizer steps). `dist`: the process group joined (default: join(cfg)); ddp/fsdp2
    wrap the model after the patch and before the optimizer exists. `select(model, tune, tune_tokens) ->
    Selection` is the tune engine's choice for a patched model (the layer above passes
    novatune.tune.patching.selection_for; train sits below tune)."""
    dist = dist if dist is not None else join(cfg)
    device = pick_device(cfg.model.device)
    if device.type == "cuda" and dist.active:
        device = torch.device("cuda", dist.local_rank)
    dtype = pick_dtype(cfg.model.dtype, device)
    allocator = configure_allocator(cfg.memory, device)
    if allocator and console is not None:
        console.print(allocator, highlight=False)
    if device.type == "cpu":
        cpu_threads_for_load(console)
    seed = cfg.train.seed
    torch.manual_seed(seed)
    random.seed(seed)

    tokenizer = load_tokenizer(cfg.model, base_dir)
    mconf = model_config(cfg.model, tokenizer, base_dir)
    slow = cpu_step_warning(mconf, device, cfg.train.micro_batch * cfg.train.grad_accum * cfg.data.max_length)
    if slow and console is not None:
        console.print(f"[bold yellow]{slow}[/]", highlight=False)
    data = build_data(cfg.data, tokenizer, mconf.vocab_size, base_dir)
    if console is not None:
        console.print(f"data: {data.stats.summary()}", highlight=False)

    memory_plan = memory_plan_for(cfg, base_dir, mconf, device, console, dist)
    if memory_plan is not None and memory_plan.parallel is not None:  # FSDP2's settings the plan chose
        cfg = dataclasses.replace(cfg, parallel=memory_plan.parallel)
    model, report = build_patched_model(cfg, device, dtype, tokenizer, base_dir, console, before_model, select,
                                        memory_plan)
    if model_hook is not None:
        model_hook(model)
    crossing = stock_packing_crosses_documents(cfg, report, mconf)
    if crossing and console is not None:
        console.print(f"[bold yellow]{crossing}[/]", highlight=False)
    weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    if console is not None:
        n_total, n_train = param_counts(model)
        console.print(f"model: {type(model).__name__} {n_total / 1e6:,.2f}M parameters ({n_train / 1e6:,.2f}M "
                      f"trainable), {str(dtype).replace('torch.', '')} on {device}", highlight=False)

    if dist.active:
        reshard = pwrap.reshards_after_forward(cfg.parallel.reshard_after_forward, dist.world)
        model = pwrap.wrap(model, dist.strategy, dtype, device, reshard, dist.world,
                           pwrap.unit_size(cfg.parallel.layers_per_unit, dist.world, keep_gathered=not reshard),
                           cfg.parallel.reduce_dtype)
        if dist.strategy == "fsdp2":  # the planner counts no graphs under FSDP2 (train/memory.py layer_graphs)
            keep_layers_eager(model, "FSDP2 gathers the layers' parameters into new storage each step (a graph "
                                     "replays fixed addresses)")
    opt = build_optimizer(model, cfg.train, device, patched=cfg.model.patch)
    if console is not None and isinstance(opt, FusedClipAdamW):
        console.print("optimizer: AdamW through novatune's kernel, the clipping scale applied inside it "
                      "(train.adamw_kernel: torch for torch's fused AdamW)", highlight=False)
    stream = BatchStream(data.rows, cfg.train.micro_batch, seed, cfg.data.shuffle, pad_id=pad_id_of(tokenizer),
                         rank=dist.rank, world=dist.world, pad_to=row_padding(cfg))
    if total_steps is None:
        # an epoch is ceil(micro-batches / grad_accum) steps, its last one short (next_micro_batches), as HF
        # Trainer counts them (max_steps = ceil(epochs x update steps per epoch))
        total_steps = cfg.train.max_steps or math.ceil(
            cfg.train.epochs * math.ceil(stream.batches_per_epoch / cfg.train.grad_accum))
    sched = build_scheduler(opt, cfg.train, total_steps)
    return Session(cfg, model, tokenizer, data, stream, opt, sched, report, device, dtype, total_steps,
                   packed_kwargs_mode(cfg, report), weights, dist, memory_plan)
