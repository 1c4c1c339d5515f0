"""`novatune plan`: how much GPU memory a config needs, before it runs.

The model is built on the meta device (no memory, exact parameter count). Estimates, per GPU:

  weights      params x bytes(dtype)                      (LoRA: + adapter params; memory.embeddings_on_host:
                                                          - the input embedding table, which lives on the host)
  gradients    trainable x bytes(dtype)
  optimizer    train.optimizer's state (novatune.train.optim.state_bytes): adamw 2 states x trainable x
               bytes(dtype) (torch's AdamW keeps states in the param dtype); adamw_kahan 8 + 2 (bf16) bytes per
               trainable parameter; the 8-bit ones ~2; paged_adamw 8 (pageable to the host)
  activations  stock HF modules, per token per layer ~ (20 h + 18 q + 18 kv + 8 i) x bytes/2 bytes: RMSNorm's fp32
               copies (~10 h each norm), q/k projections + q/k-norm fp32 copies + RoPE + attention in/out, the four
               (tokens x intermediate) MLP tensors. With gradient checkpointing: each layer's input (h) plus one
               layer recomputed in the backward.
  logits       stock HF: tokens x vocab x 12 bytes (bf16 logits, fp32 upcast, fp32 log-softmax and its gradient);
               novatune.patch's fused linear cross-entropy never materialises them (~0).

QLoRA (method.type qlora): every linear but lm_head is bitsandbytes NF4 with double quantisation, exactly as
novatune.train.qlora builds it, per quantised tensor of n weights:
               n/2 (two 4-bit codes per byte) + n/64 (uint8 absmax per 64-weight block) + 4 x n/(64*256) (fp32
               second-level scales per 256 absmax) + per tensor 4 (fp32 offset) + 16 x 4 (NF4 code table) +
               256 x 4 (8-bit absmax code table)
               method.quantize_embeddings (default for qlora) puts the input embedding in the same NF4 layout
               (the same per-tensor sum, V x H weights) unless it is tied to lm_head;
               norms, lm_head (and a tied embedding) stay in the compute dtype; the adapters, their gradients and both
               AdamW states are fp32 (PEFT keeps adapters in fp32 over 4-bit and bf16 bases); plus one dequantised
               weight (the largest linear, compute dtype) alive at a time: bnb's matmul_4bit dequantises per GEMM
               and drops the copy after it; novatune's fused QLoRA linear does too, except inside a checkpointed
               layer, where the recomputed forward's dense weights serve the backward: one layer's linears.

Checked against docs/BENCHMARKS.md's H200 peaks (headline workload, checkpointing on): stock 38.5 GiB estimated vs 39.0
measured; with fused cross-entropy 31.5 vs 32.2 (varlen + Liger); LoRA r16 16.2 vs 17.0 (stock) and 9.3 vs 9.8.
Without checkpointing the patched model needs less than estimated (fused norms/SwiGLU keep fewer copies).
"""
from __future__ import annotations

from pathlib import Path

from novatune.memory import embedding_grad
from novatune.memory.host_embedding import lookup_refusal
from novatune.train.errors import ConfigError
from novatune.train.memory import MARGIN, embedding_grad_rows, embedding_rows_bytes, fused_loss, host_message
from novatune.train.optim import state_bytes

GiB = 2**30
# bitsandbytes' NF4 layout as novatune.train.qlora quantises (blocksize 64, double quantisation of the absmax in
# blocks of 256 with an 8-bit dynamic code); see the module docstring for the per-tensor sum
NF4_BLOCK, ABSMAX_BLOCK = 64, 256
NF4_CODE, ABSMAX_CODE = 16, 256  # fp32 entries of each tensor's two code tables


def nf4_bytes(n: int) -> int:
    """Bytes bitsandbytes holds for one NF4 double-quantised tensor of n weights (module docstring)."""
    blocks = -(-n // NF4_BLOCK)
    return -(-n // 2) + blocks + 4 * -(-blocks // ABSMAX_BLOCK) + 4 * (1 + NF4_CODE + ABSMAX_CODE)


def _quantised_linears(model) -> list[int]:
    """Weight counts of the linears novatune.train.qlora.quantize_linears_ turns into NF4 (all but lm_head)."""
    import torch.nn as nn

    return [m.weight.numel() for name, m in model.named_modules()
            if type(m) is nn.Linear and name.rsplit(".", 1)[-1] != "lm_head"]


def _lora_params(model, targets: list[str], r: int, parameters: list[str] = ()) -> int:
    """Adapter parameters: r x (in + out) per targeted linear; r x E x (in + out) per targeted expert weight
    (PEFT's ParamWrapper: lora_A (r E, in), lora_B (out, r E))."""
    import torch.nn as nn

    from novatune.train.model import target_parameters

    wanted = target_parameters(model, list(parameters)) if parameters else []
    total = 0
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            key = f"{name}.{pname}"
            if p.dim() == 3 and any(key == w or key.endswith("." + w) for w in wanted):
                total += r * p.shape[0] * (p.shape[1] + p.shape[2])
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear) or name.endswith("lm_head"):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if targets == ["all-linear"] or leaf in targets:
            total += r * (mod.in_features + mod.out_features)
    return total


def plan(cfg, base_dir: Path | None = None, gpu_mem_gib: float | None = None, mconf=None, hw=None,
         nproc: int = 1) -> dict:
    """The estimate of the module docstring, and the memory plan (est["memory_plan"], train/memory.py) under the
    budget: memory.budget_gib, else a card of `gpu_mem_gib`, else this card's free memory. `hw`: the card's rates
    (planner.Hardware; default: measured on this GPU, assumed without one). `nproc`: the processes of a
    parallel.strategy fsdp2 run, each planned as one rank with its shards (and FSDP2's unset settings chosen as
    the run would choose them); ddp and one process plan the whole model per GPU."""
    import torch
    from transformers import AutoModelForCausalLM

    from novatune.train.model import load_tokenizer, model_config

    if mconf is None:
        tok = load_tokenizer(cfg.model, base_dir) if cfg.model.arch else None
        mconf = model_config(cfg.model, tok, base_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(mconf)
    n_params = sum(p.numel() for p in model.parameters())
    # auto: bf16 on a GPU (what a plan is for, where model.device is auto), fp32 where the config says cpu
    b = 4 if cfg.model.dtype == "fp32" or (cfg.model.dtype == "auto" and cfg.model.device == "cpu") else 2
    qlora = cfg.method.type == "qlora"
    lora = cfg.method.type in ("lora", "qlora")
    adapters = _lora_params(model, cfg.method.targets, cfg.method.r, cfg.method.target_parameters) if lora else 0
    trainable = adapters if lora else n_params
    quant = _quantised_linears(model) if qlora else []
    emb = model.get_input_embeddings().weight
    # quantize_embeddings None means "not validated yet": qlora's default, true (validate.py)
    emb_nf4 = (emb.numel() if qlora and cfg.method.quantize_embeddings is not False
               and not getattr(mconf, "tie_word_embeddings", False) else 0)
    # LoRA and QLoRA: fp32 adapters (PEFT upcasts adapters over bf16 and 4-bit bases; the measured weights of the
    # seed LoRA r16 run are the bf16 base + 4 bytes per adapter parameter)
    tb = 4 if lora else b
    weights = n_params * b + adapters * tb
    if qlora:
        weights = ((n_params - sum(quant) - emb_nf4) * b + sum(nf4_bytes(n) for n in quant)
                   + (nf4_bytes(emb_nf4) if emb_nf4 else 0) + adapters * tb)
    # memory.embeddings_on_host: the frozen table lives in host memory (config_checks refuses the methods, parallel
    # strategies and devices it cannot serve; the model's own refusals are found here, before any weight loads)
    host_embedding = 0
    if cfg.memory.embeddings_on_host:
        why = lookup_refusal(model)
        if why is not None:
            raise ConfigError("memory.embeddings_on_host", f"the input embedding: {why}",
                              "set memory.embeddings_on_host: false")
        host_embedding = emb.numel() * b
    h, i_sz, L, V = mconf.hidden_size, mconf.intermediate_size, mconf.num_hidden_layers, mconf.vocab_size
    hd = getattr(mconf, "head_dim", None) or h // mconf.num_attention_heads
    q, kv = mconf.num_attention_heads * hd, mconf.num_key_value_heads * hd
    tokens = cfg.train.micro_batch * cfg.data.max_length
    per_layer = (20 * h + 18 * q + 18 * kv + 8 * i_sz) * b / 2 * tokens
    act_full = L * per_layer
    act_ckpt = L * tokens * h * b + per_layer
    logits_stock = tokens * V * 12
    # dequantised weights alive at once: one GEMM's (stock, or novatune without checkpointing); novatune inside a
    # checkpointed layer keeps the recomputed forward's dense W for the backward: one layer's linears
    dequant = max(quant, default=0) * b
    if qlora and cfg.model.patch and cfg.memory.gradient_checkpointing:
        dequant = sum(quant) // L * b
    # train.optimizer, where the config names one (AdamW otherwise); its state bytes per parameter: the planner's
    optimizer = getattr(cfg.train, "optimizer", None) or "adamw"
    est = {
        "model": cfg.model.arch or cfg.model.name, "params": n_params, "trainable": trainable,
        "vocab_size": mconf.vocab_size,
        "dtype_bytes": b, "tokens_per_micro_batch": tokens, "qlora": qlora,
        "quantised_params": sum(quant), "nf4_embedding_params": emb_nf4, "dequant": dequant,
        "weights": weights - host_embedding, "host_embedding": host_embedding, "gradients": trainable * tb,
        "optimizer_name": optimizer,
        "optimizer": state_bytes(optimizer, trainable, tb),
        "activations_no_ckpt": act_full, "activations_ckpt": act_ckpt, "logits_stock": logits_stock,
        "gradient_checkpointing": cfg.memory.gradient_checkpointing, "patch": cfg.model.patch,
        "fused_loss": fused_loss(cfg), "grad_accum": cfg.train.grad_accum,
    }
    # memory.embedding_grad: an untied trained table's gradient waits as rows until the step's last backward; the
    # forwards hold the rows instead of the table's gradient
    if (cfg.method.type == "full" and embedding_grad_rows(cfg, mconf.vocab_size)
            and embedding_grad.why_not(model) is None):
        est["embedding_grad_rows"] = emb.numel() * b - embedding_rows_bytes(cfg, emb.shape[1], b)
    static = est["weights"] + est["gradients"] + est["optimizer"] + est["dequant"]
    # stock keeps the table on the device
    est["peak_stock"] = (static + host_embedding + (act_ckpt if cfg.memory.gradient_checkpointing else act_full)
                         + logits_stock)
    _memory_plan(cfg, est, mconf, gpu_mem_gib, hw, nproc)
    return est


def _memory_plan(cfg, est: dict, mconf, gpu_mem_gib: float | None, hw, nproc: int = 1) -> None:
    """est["memory_plan"] (per-layer policies, peak, time) and the verdict against the budget."""
    import torch

    from novatune.train.config import memory_policy
    from novatune.train.memory import (
        ASSUMED,
        default_budget,
        fsdp2_fastest_that_fits,
        hardware,
        layer_costs,
        predicted_tokens_per_s,
        resolve,
    )

    gpu = torch.device("cuda") if torch.cuda.is_available() and not gpu_mem_gib else None
    budget, source = default_budget(gpu, cfg.memory.budget_gib, gpu_mem_gib)
    if hw is None:
        hw = hardware(gpu) if gpu is not None else ASSUMED
    shards = nproc if cfg.parallel.strategy == "fsdp2" else 1
    cfg, choice = fsdp2_fastest_that_fits(cfg, est, mconf, hw, budget, shards)
    est.update(nproc=nproc, strategy=cfg.parallel.strategy, parallel_choice=choice)
    mp = resolve(cfg, est, mconf, hw, budget, shards)
    est.update(memory_plan=mp, hardware=hw, peak=mp.peak_bytes, budget=budget, budget_source=source,
               gpu_mem=budget / (1 - MARGIN) if budget and source != "memory.budget_gib" else budget,
               gpu_source=source if budget else None)
    est["policy"] = memory_policy(cfg.memory)
    est["oom"] = budget is not None and not mp.fits
    est["advice"] = _advice(cfg, est) if est["oom"] else []
    est["layer_costs"] = layer_costs(cfg, mconf, hw)
    est["tokens_per_s"] = predicted_tokens_per_s(cfg, mconf, mp, hw)


def _advice(cfg, est: dict) -> list[str]:
    tips = []
    if est["policy"] not in ("auto", "offload"):
        tips.append("--set memory.policy=auto (the planner offloads or recomputes layers until the run fits)")
    if est["policy"] == "none":
        saved = (est["activations_no_ckpt"] - est["activations_ckpt"]) / GiB
        tips.append(f"--set memory.gradient_checkpointing=true (saves ~{saved:.1f} GiB)")
    if not cfg.model.patch:
        tips.append(f"--set model.patch=true (fused cross-entropy saves ~{est['logits_stock'] / GiB:.1f} GiB)")
    elif not est["fused_loss"]:
        tips.append(f"drop model.patch_options.cross_entropy: false (the fused loss saves "
                    f"~{est['logits_stock'] / GiB:.1f} GiB)")
    if cfg.method.type == "full":
        tips.append("--set method.type=lora (gradients and optimizer states for the adapters only)")
    if cfg.method.type == "lora":
        per = nf4_bytes(est["params"]) / est["params"]
        tips.append(f"--set method.type=qlora (NF4 base weights: ~{per:.2f} bytes per weight instead of "
                    f"{est['dtype_bytes']})")
    if cfg.train.micro_batch > 1:
        tips.append("lower train.micro_batch and raise train.grad_accum (same tokens per optimizer step)")
    tips.append("lower data.max_length")
    return tips


def _parallel_lines(est: dict) -> list[str]:
    """What one process of several holds: fsdp2 shards the weights, gradients and optimizer states (the lines
    below are the whole model's; the peak is one rank's); ddp keeps a whole replica on every GPU."""
    n, strategy = est.get("nproc", 1), est.get("strategy", "none")
    if n <= 1:
        return []
    if strategy == "fsdp2":
        return [f"  {n} processes, fsdp2: each rank holds 1/{n} of the weights, gradients and optimizer states "
                f"below; the peak is one rank's", *([f"  {est['parallel_choice']}"] if est["parallel_choice"] else [])]
    if strategy == "ddp":
        return [f"  {n} processes, ddp: every GPU holds the whole model, its gradients and optimizer states"]
    return [f"  {n} processes asked, but parallel.strategy is {strategy}: planned as one process (set "
            f"parallel.strategy fsdp2 or ddp)"]


def _layer_cost_lines(costs: list, g) -> list[str]:
    """Each policy's kept bytes and time for a layer; one block per kind of layer where they differ (an MoE model
    with dense layers among its routed ones: Qwen-MoE's mlp_only_layers / decoder_sparse_step)."""
    kinds: list[tuple] = []  # (cost, layer indices)
    for i, c in enumerate(costs):
        for cost, layers in kinds:
            if cost == c:
                layers.append(i)
                break
        else:
            kinds.append((c, [i]))
    lines = []
    for cost, layers in kinds:
        pad = "    "
        if len(kinds) > 1:
            lines.append(f"    layers {_ranges(layers)}:")
            pad = "      "
        lines += [f"{pad}{p:<13} {g(cost.bytes[p])}  {1e3 * cost.seconds[p]:7.2f} ms"
                  for p in ("keep", "lean", "recompute_mlp", "selective", "recompute", "offload")
                  if p != "lean" or cost.bytes["lean"] < cost.bytes["keep"]]  # lean only where it keeps less
    return lines


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, start = [], indices[0]
    for prev, cur in zip(indices, [*indices[1:], None]):
        if cur is None or cur != prev + 1:  # a run ends at prev
            out.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = cur
    return ", ".join(out)


def _transient_lines(mp, g) -> list[str]:
    """The peak's transient: the CUDA graphs' pool where the layers run as graphs, else the eager layer's."""
    loss = f"  loss working memory          {g(mp.outside_transient_bytes)}   (the fused loss's logits buffer)"
    if mp.graph_pool_bytes:
        return [f"  CUDA-graph pool              {g(mp.graph_pool_bytes)}   (a layer's replayed work; a private pool, "
                "reserved beside everything else)", loss,
                f"  backward transient           {g(mp.transient_bytes)}   (the loss, or an eagerly recomputed layer)"]
    return [loss, f"  backward transient           {g(mp.transient_bytes)}   (one recomputed layer, or the loss; "
                  "offload slots)"]


def render(est: dict) -> str:
    def g(x):
        return f"{x / GiB:8.2f} GiB"

    mp, hw = est["memory_plan"], est["hardware"]
    sharded = est.get("nproc", 1) > 1 and est.get("strategy") == "fsdp2"  # peak_stock is one whole replica's
    n = est["params"]
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
    emb = " + NF4 input embedding" if est["nf4_embedding_params"] else ""
    share = (est["quantised_params"] + est["nf4_embedding_params"]) / n
    wdesc = (f"NF4 linears{emb} ({share:.0%} of the weights), {est['dtype_bytes']}-byte rest, fp32 adapters"
             if est["qlora"] else f"{est['dtype_bytes']}-byte weights")
    lines = [f"novatune plan: {est['model']}, {size} parameters "
             f"({est['trainable'] / 1e6:,.1f}M trainable), {wdesc}, "
             f"{est['tokens_per_micro_batch']:,} tokens per micro-batch",
             *_parallel_lines(est),
             f"  weights                      {g(est['weights'])}"
             + (f"   (+ {g(est['host_embedding']).strip()} input embedding table on the host)"
                if est.get("host_embedding") else ""),
             f"  gradients                    {g(est['gradients'])}"
             + (f"   (the input embedding's gradient as rows until a step's last backward: "
                f"{g(est['embedding_grad_rows']).strip()} less in the forwards; memory.embedding_grad)"
                if est.get("embedding_grad_rows") else ""),
             f"  {'optimizer states (' + est['optimizer_name'] + ')':<28} {g(est['optimizer'])}",
             *([f"  dequantised weights (live)   {g(est['dequant'])}"
                + ("   (held in the CUDA-graph pool below)" if mp.graph_pool_bytes else "")] if est["qlora"] else []),
             f"  logits (stock HF loss)       {g(est['logits_stock'])}"
             + ("   (~0 with novatune.patch's fused cross-entropy)" if est["fused_loss"] else "   <- this run"),
             "  per decoder layer and micro-batch (kept until its backward / forward + backward time):",
             *_layer_cost_lines(est["layer_costs"], g),
             f"  memory policy {est['policy']}: {mp.describe()}",
             f"  activations kept             {g(mp.activation_bytes)}",
             *_transient_lines(mp, g),
             f"  predicted peak               {g(est['peak'])}"
             + (f"   (stock HF modules: {g(est['peak_stock']).strip()})" if est["patch"] and not sharded else ""),
             f"  predicted speed              {est['tokens_per_s']:8,.0f} tok/s   ({hw.matmul_tflops:.0f} TFLOP/s "
             f"matmul, {hw.link_gbps:.0f} GB/s host link: {hw.source})",
             *[f"  note: {n}" for n in mp.notes]]
    if mp.streamed:
        ga = est.get("grad_accum", 1)
        lines.append(f"  frozen weights streamed      {len(mp.streamed)} layers ({', '.join(map(str, mp.streamed))}): "
                     f"{mp.stream_saved_bytes / GiB:.2f} GiB saved (two slots kept), "
                     f"{mp.stream_h2d_bytes / 1e9:.1f} GB host-to-device per micro-batch, "
                     f"{ga * mp.stream_h2d_bytes / 1e9:.1f} GB per optimizer step")
    if mp.offloaded_bytes:
        lines.append(f"  offloaded to the host        {g(mp.offloaded_bytes)}   (pinned; host budget "
                     f"{g(mp.host_budget_bytes).strip() if mp.host_budget_bytes is not None else 'not checked'})")
    if mp.host_limited:
        lines.append(f"WARNING: {host_message(mp)}; lower data.max_length or train.micro_batch, or use a host with "
                     "more memory")
    if est["budget"]:
        lines.append(f"  budget                       {g(est['budget'])}   ({est['budget_source']})")
        if est["oom"] and mp.peak_bytes > est["budget"]:
            lines.append("WARNING: this run will likely run out of GPU memory. Try:")
            lines += [f"  - {t}" for t in est["advice"]]
        elif not est["oom"]:
            lines.append(f"  fits, with {(est['budget'] - est['peak']) / GiB:.1f} GiB to spare")
    else:
        lines.append("  no GPU here: pass --gpu-mem GiB to check against a GPU's memory")
    return "\n".join(lines)
