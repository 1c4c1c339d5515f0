"""The run's memory policy: which decoder layers keep, recompute, recompute selectively or offload their activations.

`resolve(cfg, est, ...)` turns memory.policy into one policy per layer (auto: novatune.memory.planner.choose under
memory.budget_gib, default the card's free memory minus a margin) and predicts the peak; it runs before the model
is built, so a plan that cannot fit stops the run with the numbers and the fix. `install(model, plan, device)`
puts the policies on the built model's decoder layers (after checkpointing and LoRA, before novatune.patch).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from novatune.memory import planner
from novatune.memory.offload import OffloadEngine
from novatune.memory.policy import KEPT, POLICIES, UNIFORM, expand_layers
from novatune.memory.policy import install as install_policies
from novatune.memory.stream import FrozenWeightStreamer, StreamingRefused, install_streaming, uninstall_streaming
from novatune.parallel import wrap as pwrap
from novatune.patch.specs import spec_for
from novatune.patch.tiled import MLPTiling
from novatune.train.arch import is_sparse_layer, routed_experts
from novatune.train.config import memory_policy
from novatune.train.errors import SetupError

GiB = 2**30
MARGIN = 0.08  # of the card's memory: CUDA context, allocator fragmentation, workspaces
# rates assumed where no GPU can be measured (an H100 SXM-class card: measured bf16 matmul, HBM copy, PCIe 5)
ASSUMED = planner.Hardware(matmul_tflops=700.0, hbm_gbps=3000.0, link_gbps=50.0,
                           source="assumed H100-class rates (run on the GPU to measure)")


@dataclass
class MemoryPlan:
    """What the session installed and predicted (the metrics rows log `predicted_peak_gib` beside the peak)."""
    plan: planner.Plan
    policy: str  # memory.policy as resolved (auto, checkpoint, ...)
    hardware: planner.Hardware
    tokens: int  # per micro-batch
    offload_min_bytes: int = 1 << 20
    predicted_tokens_per_s: float | None = None  # at measured rates only (auto on a GPU)
    engine: OffloadEngine | None = None
    streamer: FrozenWeightStreamer | None = None
    parallel: object | None = None  # the ParallelConfig planned with (FSDP2's unset settings chosen), or None

    @property
    def predicted_peak_gib(self) -> float:
        return self.plan.peak_bytes / GiB


def hardware(device: torch.device) -> planner.Hardware:
    """The card's matmul rate, memory and host-link bandwidth, measured (a second or two); assumed on the CPU."""
    if device.type != "cuda":
        return ASSUMED
    from novatune.measure.timing import copy_bandwidth_gbps, host_link_gbps, matmul_tflops

    with torch.cuda.device(device):
        hw = planner.Hardware(matmul_tflops(), copy_bandwidth_gbps(2**28), host_link_gbps(),
                              source=f"measured on {torch.cuda.get_device_name(device)}")
    torch.cuda.empty_cache()
    return hw


def default_budget(device: torch.device | None, budget_gib: float | None = None,
                   gpu_mem_gib: float | None = None) -> tuple[int | None, str]:
    """The memory to plan for: memory.budget_gib as given; else a card of --gpu-mem GiB minus the margin; else
    this card's free memory minus the margin; None without a GPU."""
    if budget_gib:
        return int(budget_gib * GiB), "memory.budget_gib"
    if gpu_mem_gib:
        return int(gpu_mem_gib * GiB * (1 - MARGIN)), f"{gpu_mem_gib:g} GiB minus {MARGIN:.0%}"
    if device is not None and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free - MARGIN * total), f"{torch.cuda.get_device_name(device)}: free memory minus {MARGIN:.0%}"
    return None, "no GPU: no budget (pass --gpu-mem or memory.budget_gib)"


def layer_shape(cfg, mconf, trained_share: float) -> planner.LayerShape:
    h = mconf.hidden_size
    hd = getattr(mconf, "head_dim", None) or h // mconf.num_attention_heads
    tokens = cfg.train.micro_batch * cfg.data.max_length
    # causal attention within documents: a query sees about half its document; synthetic data names its median
    doc = min([s.median_length for s in cfg.data.sources if s.type == "synthetic"] or [cfg.data.max_length])
    dtype_bytes = 4 if cfg.model.dtype == "fp32" else 2
    tiling = MLPTiling(cfg.memory.tiled_mlp, mconf.intermediate_size)
    chunk = tiling.chunk_rows_for(dtype_bytes) if cfg.model.patch and tiling.applies_to(tokens, dtype_bytes) else None
    q, kv = mconf.num_attention_heads * hd, mconf.num_key_value_heads * hd
    return planner.LayerShape(hidden=h, q_dim=q, kv_dim=kv, intermediate=mconf.intermediate_size,
                              heads=mconf.num_attention_heads, tokens=tokens, dtype_bytes=dtype_bytes,
                              attended_keys=min(doc, cfg.data.max_length) / 2, trained_share=trained_share,
                              fused=bool(cfg.model.patch), mlp_chunk_tokens=chunk,
                              lean_elements=lean_elements(cfg, mconf, h, q, kv))


def lean_elements(cfg, mconf, h: int, q: int, kv: int) -> int:
    """Elements per token a `lean` layer computes again instead of keeping (memory/lean_keep.py), counted where an
    op offers them and a consumer saves them: the two pre-norms' outputs where they run novatune's rms_norm (not
    Gemma's or GPT-OSS's output-rounded norm, not OLMo 2's post-norms, whose outputs only join the residual), read
    by projections that save their input (full fine-tuning: LoRA's frozen base weights save none); and the rotated
    q and k where novatune's fused per-head q/k norm + RoPE makes them (saved by attention). 0 without
    novatune.patch: stock modules offer nothing."""
    options = cfg.model.patch_options
    spec = spec_for(getattr(mconf, "model_type", ""))
    if not cfg.model.patch or spec is None or cfg.method.type != "full" or not options.get("rms_norm", True):
        return 0
    plain_norm = spec.norm_rounding == "normalised" and not spec.norm_offset  # novatune's rms_norm op
    norms = 2 * h if plain_norm and not spec.post_norms else 0
    # patch/apply.py fuses the q/k norms with RoPE for per-head norms of the plain kind only
    fused_qk = (plain_norm and spec.attention.q_norm is not None and spec.attention.qk_norm_scope == "head"
                and options.get("fuse_qk_norm_rope", True) and options.get("rope", True))
    return norms + (q + kv if fused_qk else 0)


def layer_costs(cfg, mconf, hw: planner.Hardware) -> list[planner.LayerCost]:
    """One cost per decoder layer. A sparse MoE layer is planned as what one token multiplies by: its top-k
    experts' intermediate size (Mixtral's and GPT-OSS's intermediate_size is one expert's), routed."""
    trained = 0.0 if cfg.method.type in ("lora", "qlora") else 1.0
    shape = layer_shape(cfg, mconf, trained)
    dense = planner.layer_cost(shape, hw)
    experts = routed_experts(mconf)
    if experts is None:
        return [dense] * mconf.num_hidden_layers
    per_expert = experts[1]
    sparse = planner.layer_cost(replace(shape, intermediate=mconf.num_experts_per_tok * per_expert, routed=True,
                                        top_k=mconf.num_experts_per_tok, mlp_chunk_tokens=None), hw)
    return [sparse if is_sparse_layer(mconf, layer) else dense for layer in range(mconf.num_hidden_layers)]


def resolve(cfg, est: dict, mconf, hw: planner.Hardware, budget: int | None, shards: int = 1) -> planner.Plan:
    """One policy per decoder layer for memory.policy, its predicted peak (est's static bytes + activations) and
    time. auto picks the fastest that fits; a fixed policy is evaluated as asked (plan.fits says whether).
    `shards`: FSDP2's world size (weights, gradients and optimizer states are split across the ranks)."""
    n = mconf.num_hidden_layers
    costs = layer_costs(cfg, mconf, hw)
    static = static_bytes(est, shards) + outside_layers_bytes(cfg, mconf) + fsdp2_held_bytes(cfg, est, mconf, shards)
    fresh = fresh_gradients(cfg, mconf, est, shards)
    host = host_budget(shards)
    policy = memory_policy(cfg.memory)
    transients = {"outside": loss_transient_bytes(cfg, mconf, into_grad=False),
                  "graphs": layer_graphs(cfg, mconf, costs, shards, int(est["dequant"]))}

    def policies_plan(saved: int = 0, allowed: tuple[str, ...] = POLICIES, outside: int | None = None) -> planner.Plan:
        """memory.policy's plan with `saved` bytes fewer static (the room frozen-weight streaming makes) and, when
        given, the loss's working memory `outside`."""
        if outside is not None:
            return replace_outside(outside, saved, allowed)
        if policy == "auto":
            return planner.choose(costs, static - saved, budget, allowed, fresh, host, **transients)
        if policy == "per-layer":
            try:
                layers = expand_layers(cfg.memory.layers, n)
            except ValueError as e:
                raise SetupError(f"memory.layers: {e}") from None
            return planner.evaluate(layers, costs, static - saved, budget, fresh, host, **transients)
        return planner.evaluate([UNIFORM[policy]] * n, costs, static - saved, budget, fresh, host, **transients)

    def replace_outside(outside: int, saved: int, allowed: tuple[str, ...]) -> planner.Plan:
        transients["outside"], standard = outside, transients["outside"]
        try:
            return policies_plan(saved, allowed)
        finally:
            transients["outside"] = standard

    plan = policies_plan()
    # auto and every layer kept within the budget: no plan can be faster, so the alternative is not searched
    asked = cfg.memory.lm_head_grad_in_forward is True
    fastest = plan.fits and all(p == "keep" for p in plan.policies)
    if lm_head_grad_applies(cfg) and (asked or not fastest):
        # lm_head's gradient into .grad by the loss's forward (memory.lm_head_grad_in_forward): taken when asked,
        # or (auto) where the plan without it does not fit and with it does, or where it makes a faster plan fit
        # the first micro-step still runs the standard loss, but before any gradient exists
        first = loss_transient_bytes(cfg, mconf) - int(est["gradients"] / shards)
        alt = policies_plan(outside=max(loss_transient_bytes(cfg, mconf, into_grad=True), first))
        alt = replace(alt, seconds=alt.seconds + into_grad_seconds(cfg, mconf, hw), lm_head_grad_in_forward=True)
        if asked or (alt.fits and (not plan.fits or alt.seconds < plan.seconds)):
            alt.notes.append(f"lm_head's gradient into .grad by the loss's forward (memory.lm_head_grad_in_forward): "
                             f"the loss holds {alt.outside_transient_bytes / GiB:.2f} GiB at the forward's end, not "
                             f"{plan.outside_transient_bytes / GiB:.2f}")
            plan = alt
    if policy == "auto" and budget is None:
        plan.notes.append("no memory budget known (no GPU, no memory.budget_gib): every layer keeps its "
                          "activations")
    return _streaming(cfg, mconf, plan, costs, policies_plan, hw, host, shards)


def stream_layer_bytes(cfg, mconf) -> int:
    """One decoder layer's frozen weights as streaming moves them: the matrices (bf16, or NF4's packed bytes for
    QLoRA: its absmax stays on the device) and the norms."""
    shape = layer_shape(cfg, mconf, 0.0)
    hd = shape.q_dim // mconf.num_attention_heads
    norms = (2 * shape.hidden + 2 * hd) * shape.dtype_bytes
    gemm = -(-shape.gemm_params // 2) if cfg.method.type == "qlora" else shape.gemm_params * shape.dtype_bytes
    return gemm + norms


def _streaming(cfg, mconf, plan: planner.Plan, costs, policies_plan, hw, host, shards: int) -> planner.Plan:
    """memory.stream_frozen_layers on top of the policies' plan: N streams N layers; auto streams the fewest that
    make a plan over the budget fit (LoRA/QLoRA on one process only)."""
    setting = cfg.memory.stream_frozen_layers
    n = mconf.num_hidden_layers
    if setting == 0 or (setting == "auto" and (plan.fits or plan.budget_bytes is None)):
        return plan
    why = None
    if cfg.method.type not in ("lora", "qlora"):
        why = ("full fine-tuning trains every weight, and streaming moves only frozen ones; set "
               "memory.stream_frozen_layers: 0, or method.type: lora or qlora")
    elif shards != 1 or cfg.parallel.strategy != "none":
        why = "it runs on one process only (parallel.strategy: none); FSDP2 already shards the weights"
    if why is not None:
        if setting == "auto":
            plan.notes.append(f"frozen-weight streaming not used: {why}")
            return plan
        raise SetupError(f"memory.stream_frozen_layers: {setting}: {why}")
    fs = planner.FrozenStream(stream_layer_bytes(cfg, mconf), hw.link_gbps)
    if setting != "auto":
        try:
            return planner.with_streaming(plan, costs, int(setting), fs, host)
        except ValueError as e:
            raise SetupError(f"memory.stream_frozen_layers: {e}; lower it or use a recomputing memory.policy") \
                from None
    allowed = tuple(p for p in POLICIES if p not in KEPT)
    candidates = n if memory_policy(cfg.memory) == "auto" else sum(p not in KEPT for p in plan.policies)
    best = planner.fewest_streamed(lambda saved: policies_plan(saved, allowed), costs, candidates, fs, host)
    if best is None:
        plan.notes.append(f"streaming the frozen weights of all {candidates} recomputed layers would not fit either")
        return plan
    best.notes.append(f"frozen weights of {len(best.streamed)} layers streamed from host memory (memory."
                      f"stream_frozen_layers auto): {best.stream_saved_bytes / GiB:.2f} GiB saved, "
                      f"{best.stream_h2d_bytes / 1e9:.1f} GB host-to-device per micro-batch")
    return best


# (tokens x hidden) tensors alive outside the decoder layers at the backward's start: the embedding output and its
# gradient, the final norm's input and output, the fused cross-entropy's saved hidden state and its input gradient
# (fp32: two tensors' worth), the residual stream's gradient. Measured: Qwen3-4B, 262,144-token rows, every layer
# offloaded: 55.8 GiB peak against 46.2 planned without this term (9.6 GiB = 7.7 such bf16 tensors).
OUTSIDE_LAYERS_HIDDEN = 8


def layer_graphs_asked(cfg) -> bool:
    """The run asks for novatune's CUDA graphs of the decoder layers (patch/graphs.py): novatune.patch on and
    model.patch_options.cuda_graphs not false; its "auto" captures LoRA/QLoRA layers only."""
    graphs = dict(cfg.model.patch_options or {}).get("cuda_graphs", "auto")
    return bool(cfg.model.patch) and graphs is not False and (graphs != "auto" or cfg.method.type in ("lora", "qlora"))


def layer_graphs_forward_only(cfg) -> bool:
    """The layers' graphs hold their forward only (cuda_graphs "forward")."""
    return dict(cfg.model.patch_options or {}).get("cuda_graphs", "auto") == "forward"


def layer_graphs(cfg, mconf, costs: list[planner.LayerCost], shards: int = 1,
                 dequant: int = 0) -> planner.LayerGraphs | None:
    """The decoder layers' CUDA graphs, where the run captures them: asked for (layer_graphs_asked), a GPU, one
    process without FSDP2 (the run keeps the layers eager under it: patch/graph_install.py keep_layers_eager). None
    where the layers always run eagerly. The planner counts them only for an assignment the graphs take (every layer
    recomputed). `dequant`: QLoRA's dequantised weights of one layer, which the static bytes count; a backward
    graph holds them in its pool (session21-4: the QLoRA example's pool 0.69 GiB, 0.34 planned without them)."""
    if not layer_graphs_asked(cfg) or cfg.model.device == "cpu" or shards != 1 or cfg.parallel.strategy == "fsdp2":
        return None
    tokens, dtype_bytes = cfg.train.micro_batch * cfg.data.max_length, 4 if cfg.model.dtype == "fp32" else 2
    if layer_graphs_forward_only(cfg):
        return planner.LayerGraphs(pool=max((c.bytes["keep"] for c in costs), default=0),
                                   buffers=tokens * mconf.hidden_size * dtype_bytes, forward_only=True)
    return planner.LayerGraphs(pool=max((c.graph_pool for c in costs), default=0),
                               buffers=3 * tokens * mconf.hidden_size * dtype_bytes, from_static=dequant)


def fused_loss(cfg) -> bool:
    """Whether the run's loss is novatune's fused cross-entropy (model.patch, and its cross_entropy option on)."""
    return bool(cfg.model.patch) and bool((cfg.model.patch_options or {}).get("cross_entropy", True))


def lm_head_grad_applies(cfg) -> bool:
    """Whether the loss may add lm_head's gradient into .grad in its forward (memory.lm_head_grad_in_forward, not
    false): novatune's fused loss training lm_head, accumulation, one process (the trainer's promise)."""
    return (fused_loss(cfg) and cfg.method.type == "full" and cfg.train.grad_accum > 1
            and cfg.parallel.strategy == "none" and cfg.memory.lm_head_grad_in_forward is not False)


def into_grad_seconds(cfg, mconf, hw: planner.Hardware) -> float:
    """Per micro-batch, what adding lm_head's gradient into .grad by token chunks costs over the standard path: each
    chunk's GEMM reads and writes the (V, H) .grad, where the standard forward wrote grad_W once and its backward's
    one pass read it and .grad and wrote .grad (4 passes); only the accumulating micro-steps (all but a step's
    first) take it."""
    from novatune.kernels.linear_cross_entropy import plan_into_chunk

    e = 4 if cfg.model.dtype == "fp32" else 2
    tokens = cfg.train.micro_batch * cfg.data.max_length
    chunks = -(-tokens // plan_into_chunk(tokens, mconf.vocab_size, torch.float32 if e == 4 else torch.bfloat16))
    table = mconf.vocab_size * mconf.hidden_size * e
    extra = max(0, 2 * chunks - 4) * table / (hw.hbm_gbps * 1e9)
    return extra * (cfg.train.grad_accum - 1) / cfg.train.grad_accum


def loss_transient_bytes(cfg, mconf, into_grad: bool = False) -> int:
    """The loss's working memory beyond the static terms, at the end of the forward: novatune's fused
    cross-entropy's logits buffer, as its kernel plans it (one (chunk x vocab) block; the (tokens x vocab) logits
    into which lm_head's gradient is written in its in-place mode; one (tokens x slice) block and an fp32 input
    gradient in its vocab-slice mode). Stock HF's logits are static already (est["logits_stock"]). `into_grad`:
    lm_head's gradient goes into .grad by token chunks (lm_head_grad_applies): from a step's second micro-step on,
    when the gradients (static) exist, one chunk's logits; the first micro-step's full logits come before any
    gradient exists, so the forwards with gradients set the peak."""
    from novatune.kernels.linear_cross_entropy import plan_into_chunk, plan_mode

    if not fused_loss(cfg):
        return 0
    tokens, vocab, hidden = cfg.train.micro_batch * cfg.data.max_length, mconf.vocab_size, mconf.hidden_size
    fp32 = cfg.model.dtype == "fp32"
    e = 4 if fp32 else 2
    grad_weight = cfg.method.type not in ("lora", "qlora")  # lm_head trains in full fine-tuning only
    # the mode the patch will run: model.patch_options.cross_entropy_mode (config_checks refuses other strings).
    # A final logit soft-cap (Gemma 2; 0 or None: none, as the patch reads it) never runs in place: "auto" plans
    # around it, and the patch refuses "inplace" with one
    asked = str((cfg.model.patch_options or {}).get("cross_entropy_mode", "auto"))
    softcap = getattr(mconf, "final_logit_softcapping", None) or None
    dtype = torch.float32 if fp32 else torch.bfloat16
    if into_grad:
        return plan_into_chunk(tokens, vocab, dtype) * vocab * e
    mode, size = plan_mode(tokens, vocab, hidden, dtype, grad_weight,
                           mode="auto" if softcap is not None and asked == "inplace" else asked, softcap=softcap)
    if mode == "inplace":
        return tokens * vocab * e
    if mode == "vocab":
        return tokens * size * e + tokens * hidden * 4
    return size * vocab * e


def outside_layers_bytes(cfg, mconf) -> int:
    tokens = cfg.train.micro_batch * cfg.data.max_length
    return OUTSIDE_LAYERS_HIDDEN * tokens * mconf.hidden_size * (4 if cfg.model.dtype == "fp32" else 2)


def fresh_gradients(cfg, mconf, est: dict, shards: int = 1) -> planner.FreshGradients | None:
    """One micro-batch per optimizer step: the gradients are born in the backward (planner.FreshGradients); with
    accumulation (or FSDP2, whose unsharded gradients follow their own schedule) they count as static."""
    if cfg.train.grad_accum != 1 or shards != 1:
        return None
    shape = layer_shape(cfg, mconf, 0.0 if cfg.method.type in ("lora", "qlora") else 1.0)
    layer = int(shape.gemm_params * shape.trained_share * shape.dtype_bytes)
    other = max(0, int(est["gradients"]) - mconf.num_hidden_layers * layer)
    return planner.FreshGradients(layer=layer, other=other)


HOST_SHARE = 0.7  # of the host's available memory the offloaded inputs may pin (the process needs the rest)


def host_budget(processes: int = 1) -> planner.HostBudget | None:
    """Pinned host memory for offloaded layer inputs: HOST_SHARE of /proc/meminfo's MemAvailable, split over this
    host's processes; None where the kernel does not say (no check)."""
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    share = int(kib * 1024 * HOST_SHARE / max(processes, 1))
    return planner.HostBudget(share, f"{HOST_SHARE:.0%} of the host's available memory")


def static_bytes(est: dict, shards: int = 1) -> int:
    """Everything but the decoder layers' activations: weights, gradients, optimizer states (split over FSDP2's
    `shards`), live dequantised weights, and stock HF's logits when the fused cross-entropy is off. An input
    embedding whose gradient waits as rows (memory.embedding_grad) has no gradient during the forwards, where the
    peak is, but its rows instead: est["embedding_grad_rows"] is the table's bytes less the rows'."""
    grads = est["gradients"] - est.get("embedding_grad_rows", 0)
    sharded = (est["weights"] + grads + est["optimizer"]) / shards
    return int(sharded + est["dequant"] + (0 if est["fused_loss"] else est["logits_stock"]))


def embedding_grad_rows(cfg, vocab: int | None = None) -> bool:
    """Whether the run keeps its input embedding's gradient as rows between micro-steps
    (memory/embedding_grad.py): never with one micro-step per optimizer step (nothing to keep apart); `rows`
    where asked; `auto` for full fine-tuning in one process where the rows a step keeps, (grad_accum - 1) x
    tokens per micro-batch, are under half the table's `vocab` rows (else they save too little, or cost more than
    the table). The model-level refusals (a tied or frozen table, ...) come when the model exists."""
    mode, ga = cfg.memory.embedding_grad, cfg.train.grad_accum
    if ga <= 1:
        return False
    if mode == "auto":
        kept = (ga - 1) * cfg.train.micro_batch * cfg.data.max_length
        return (cfg.method.type == "full" and cfg.parallel.strategy == "none"
                and (vocab is None or 2 * kept < vocab))
    return mode == "rows"


def embedding_rows_bytes(cfg, hidden: int, dtype_bytes: int) -> int:
    """What the rows hold at the last micro-step's forward: (grad_accum - 1) micro-steps of tokens x (hidden
    values + an int64 id)."""
    tokens = cfg.train.micro_batch * cfg.data.max_length
    return (cfg.train.grad_accum - 1) * tokens * (hidden * dtype_bytes + 8)


def fsdp2_held_bytes(cfg, est: dict, mconf, shards: int) -> int:
    """What FSDP2 holds on each rank beyond its shards (the plans of six measured 2- and 4-GPU runs stand 0-5%
    above their peaks, tests/memory/test_fsdp2_plan.py):
    * gathered weights: the whole model when the layers stay gathered for the step (parallel.reshard_after_forward
      false; over one rank the gathered copy is a second copy), and with units of several layers
      (parallel.layers_per_unit) a unit's reduce-scatter input beyond one layer's; else the root unit
      (embeddings, lm_head), which is never resharded, its other ranks' part, and with units of several layers
      the layers a unit and its prefetched neighbour gather beyond one layer each, and the unit's whole
      gradients and their reduce-scatter input (parallel.reduce_dtype) beyond one layer's;
    * across 2+ ranks, gradients in the reduce dtype (parallel.reduce_dtype: the trained parameters', or fp32) before
      their reduce-scatter: the whole model's, summed over the micro-batches, with one reduction per step
      (parallel.gradient_sync step, grad_accum > 1), less the sharded gradients that come only after it, plus the
      root's reduce-scatter output; else the root's (its reduction waits for the whole backward)."""
    if cfg.parallel.strategy != "fsdp2":
        return 0
    keep = not pwrap.reshards_after_forward(cfg.parallel.reshard_after_forward, shards)
    per_param = est["weights"] / max(1, est["params"])
    root = mconf.vocab_size * mconf.hidden_size * (1 if getattr(mconf, "tie_word_embeddings", False) else 2)
    if shards == 1:
        return int(est["weights"]) if keep else 0
    gathered = est["weights"] if keep else root * per_param * (1 - 1 / shards)
    grad_elem = est["gradients"] / max(1, est["trainable"])  # bytes per trained element of a gradient
    # the reduce dtype as parallel/wrap.py chooses it from the trained parameters' (grad_elem: 2 for bf16 weights,
    # 4 for fp32 adapters)
    trained = frozenset({torch.float32 if grad_elem >= 4 else torch.bfloat16})
    reduce_elem = 4 if pwrap.fsdp2_reduce_dtype(cfg.parallel.reduce_dtype, shards, trained) is not None else grad_elem
    unit = pwrap.unit_size(cfg.parallel.layers_per_unit, shards, keep)
    layer = (est["weights"] - root * per_param) / max(1, mconf.num_hidden_layers)
    layer_trained = layer / per_param * est["trainable"] / max(1, est["params"])
    if not keep and unit > 1:
        # a unit and the next one prefetched are gathered at once: 2 x (unit - 1) more layers; and a unit's
        # gradients are whole, with their reduce-scatter input, until the unit's reduction: (unit - 1) more
        gathered += 2 * (unit - 1) * layer * (1 - 1 / shards)
        gathered += (unit - 1) * layer_trained * (grad_elem + reduce_elem)
    elif keep and unit > 1:
        # the whole gradients are counted below; at a unit's reduction its reduce-scatter input (reduce dtype)
        # sits beside them: (unit - 1) layers more than units of one
        gathered += (unit - 1) * layer_trained * reduce_elem
    step_sync = cfg.train.grad_accum > 1 and not pwrap.syncs_every_micro_batch(cfg.parallel.gradient_sync, "fsdp2",
                                                                               shards)
    root_trained = root if est["trainable"] >= root and cfg.method.type == "full" else 0
    # step: every gradient whole in the reduce dtype until its reduction (the root's last, with its reduce-scatter
    # output beside it), the sharded gradients born as the reductions finish
    grads = (reduce_elem * (est["trainable"] + root_trained / shards) - est["gradients"] / shards if step_sync
             else reduce_elem * root_trained)
    return int(gathered + grads)


def fsdp2_fastest_that_fits(cfg, est: dict, mconf, hw: planner.Hardware, budget: int | None,
                            shards: int) -> tuple[object, str | None]:
    """FSDP2 across 2+ ranks with parallel.reshard_after_forward and gradient_sync both unset: the layers stay
    gathered for the step and the gradients are reduced once per step (one all-gather and one reduce-scatter per
    unit of layers per step: 1.905x one process on 2 H200s, session19-4) where the plan fits the budget at that
    cost; else every
    layer is resharded after its forward and the gradients after each micro-batch (the memory-lean default).
    Returns the config with both set, and a line saying which and why (None when nothing was chosen)."""
    p = cfg.parallel
    if p.strategy != "fsdp2" or shards < 2 or p.reshard_after_forward is not None or p.gradient_sync != "auto":
        return cfg, None
    fast = replace(cfg, parallel=replace(p, reshard_after_forward=False, gradient_sync="step"))
    lean = replace(cfg, parallel=replace(p, reshard_after_forward=True, gradient_sync="micro_batch"))
    held = fsdp2_held_bytes(fast, est, mconf, shards)
    if budget is not None and resolve(fast, est, mconf, hw, budget, shards).fits:
        return fast, (f"parallel: fsdp2 keeps the gathered layers for the step and reduces the gradients once per "
                      f"step (+{held / GiB:.1f} GiB per rank, within the {budget / GiB:.1f} GiB budget)")
    why = "no memory budget known" if budget is None else f"+{held / GiB:.1f} GiB per rank would not fit"
    return lean, (f"parallel: fsdp2 reshards each layer after its forward and reduces the gradients after every "
                  f"micro-batch (keeping the layers gathered for the step: {why})")


def predicted_tokens_per_s(cfg, mconf, plan: planner.Plan, hw: planner.Hardware) -> float:
    """Tokens per second of the decoder layers' time plus lm_head's (forward, input gradient and, when it trains,
    its weight gradient) at the same GEMM rate; embeddings, norms outside the layers and the optimizer are left
    out (a few percent of a step)."""
    head_flops = (4 if cfg.method.type in ("lora", "qlora") else 6) * mconf.vocab_size * mconf.hidden_size
    tokens = cfg.train.micro_batch * cfg.data.max_length
    rate = hw.matmul_tflops * 1e12 * planner.GEMM_EFFICIENCY
    return tokens / (plan.seconds + head_flops * tokens / rate)


def host_message(plan: planner.Plan) -> str:
    return (f"the offloaded layer inputs need {plan.offloaded_bytes / GiB:.1f} GiB of pinned host memory (blocks "
            f"in whole pages) but the host budget is {(plan.host_budget_bytes or 0) / GiB:.1f} GiB "
            f"({HOST_SHARE:.0%} of the host's available memory)")


def no_fit_message(plan: planner.Plan, policy: str, budget_source: str) -> str:
    which = "the smallest plan" if policy == "auto" else "the plan"
    if plan.host_limited and (plan.budget_bytes is None or plan.peak_bytes <= plan.budget_bytes):
        return (f"memory.policy {policy}: {which} ({plan.describe()}) fits the GPU but {host_message(plan)}; lower "
                f"data.max_length or train.micro_batch, or run on a host with more memory")
    return (f"memory.policy {policy}: {which} ({plan.describe()}) needs {plan.peak_bytes / GiB:.1f} GiB "
            f"(weights, gradients and optimizer states {plan.static_bytes / GiB:.1f} GiB, activations "
            f"{(plan.activation_bytes + plan.transient_bytes) / GiB:.1f} GiB) but the budget is "
            f"{plan.budget_bytes / GiB:.1f} GiB ({budget_source}); lower data.max_length or train.micro_batch "
            f"(raise train.grad_accum for the same batch), use method.type: lora or qlora, or raise "
            f"memory.budget_gib" + "".join(f"; {n}" for n in plan.notes if "stream" in n))


def plan_for_run(cfg, est: dict, mconf, device: torch.device, console=None, shards: int = 1) -> MemoryPlan:
    """The session's memory plan, before the model exists: the budget, the resolved policies (auto: at the card's
    measured rates). auto that cannot fit raises SetupError with the numbers and the fix; a fixed policy over the
    budget is warned about with the same numbers (the estimate may be pessimistic; the run goes on)."""
    policy = memory_policy(cfg.memory)
    measured = policy == "auto" and device.type == "cuda"
    hw = hardware(device) if measured else ASSUMED
    budget, source = default_budget(device, cfg.memory.budget_gib)
    cfg, fsdp2_choice = fsdp2_fastest_that_fits(cfg, est, mconf, hw, budget, shards)
    if console is not None and fsdp2_choice:
        console.print(fsdp2_choice, highlight=False, markup=False)
    plan = resolve(cfg, est, mconf, hw, budget, shards)
    if policy == "auto" and not plan.fits:
        raise SetupError(no_fit_message(plan, policy, source))
    if console is not None and not plan.fits:
        console.print(f"[bold yellow]warning: {no_fit_message(plan, policy, source)}; or set memory.policy: "
                      f"auto[/]", highlight=False)
    if console is not None and policy not in ("none", "checkpoint"):
        console.print(f"memory: {policy} -> {plan.describe()}; predicted peak {plan.peak_bytes / GiB:.1f} GiB"
                      + (f" of {budget / GiB:.1f} GiB ({source})" if budget else "")
                      + "".join(f"; {n}" for n in plan.notes), highlight=False)
    tokens = cfg.train.micro_batch * cfg.data.max_length
    speed = predicted_tokens_per_s(cfg, mconf, plan, hw) if measured else None
    return MemoryPlan(plan, policy, hw, tokens, cfg.memory.offload_min_bytes, speed, parallel=cfg.parallel)


def needs_checkpointing(mp: MemoryPlan | None, cfg=None) -> bool:
    """Whether HF's gradient checkpointing goes on: some layer does not keep its activations."""
    if mp is None:
        return memory_policy(cfg.memory) != "none"
    return any(p != "keep" for p in mp.plan.policies)


def install(model, mp: MemoryPlan, layers: list, device: torch.device) -> MemoryPlan:
    """Put the plan's policies on the decoder layers (checkpointing is on whenever a layer does not keep)."""
    if all(p == "recompute" for p in mp.plan.policies) or not needs_checkpointing(mp):
        return mp  # HF's own checkpointing (or none) is exactly that
    mp.engine = OffloadEngine(device, mp.offload_min_bytes) if "offload" in mp.plan.policies else None
    install_policies(layers, mp.plan.policies, mp.engine)
    return mp


def start_streaming(mp: MemoryPlan, layers: list, device: torch.device) -> str:
    """Stream the plan's layers' frozen weights (memory/stream.py); returns the console line."""
    try:
        mp.streamer = install_streaming(layers, mp.plan.streamed, device)
    except StreamingRefused as e:
        raise SetupError(f"memory.stream_frozen_layers: {e}") from None
    st, which = mp.streamer.stats, ",".join(map(str, mp.plan.streamed))
    return (f"memory: frozen weights of {len(mp.plan.streamed)} decoder layers streamed from pinned host memory "
            f"(layers {which}): {st['host_bytes'] / GiB:.2f} GiB on the host, two device "
            f"slots of {mp.streamer.slot_bytes() / 2 / GiB:.2f} GiB; {mp.plan.stream_h2d_bytes / 1e9:.1f} GB copied "
            f"per micro-batch")


def stop_streaming(mp: MemoryPlan, layers: list) -> None:
    """Every streamed weight back in its own device storage; the layers run unstreamed from here."""
    if mp.streamer is not None:
        uninstall_streaming(layers, mp.streamer)
        mp.streamer = None


def configure_allocator(mem, device: torch.device) -> str | None:
    """Turn on the caching allocator's expandable segments for a CUDA run (memory.expandable_segments), before the
    first allocation. Returns what was done, for the console, or None when nothing applies. A user's
    PYTORCH_CUDA_ALLOC_CONF is left as it is: it already says how the allocator should behave."""
    if device.type != "cuda":
        return None
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        return f"allocator: PYTORCH_CUDA_ALLOC_CONF={os.environ['PYTORCH_CUDA_ALLOC_CONF']} (as set)"
    if not mem.expandable_segments:
        return None
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    return "allocator: expandable segments (memory.expandable_segments)"
