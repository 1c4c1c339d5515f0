"""Cross-field rules of the config, checked before anything heavy runs. Each failure names the key and the fix.

Single-field type and enum checks happen when the config is built (config.py); here: ranges, the model/arch
choice, data paths, loss_on vs format, LoRA/QLoRA settings.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from novatune.train.errors import ConfigError

if TYPE_CHECKING:  # annotations only: config.load() calls validate(), so a runtime import would be a circle
    from novatune.train.config import Config, MemoryConfig

MIN_MAX_LENGTH = 16


def memory_policy(mem: MemoryConfig) -> str:
    """memory.policy with its default resolved: checkpoint when gradient_checkpointing is on, else none (here, not in
    config.py, so that the checks read it without importing config.py; config.py re-exports it)."""
    if mem.policy is not None:
        return mem.policy
    return "checkpoint" if mem.gradient_checkpointing else "none"


def _positive(value, key: str, what: str = "a positive integer") -> None:
    if value is None or value < 1:
        raise ConfigError(key, f"must be {what}, got {value!r}", f"set {key} to 1 or more")


def _check_qlora(cfg: Config) -> None:
    import importlib.util

    from novatune.train.qlora import BNB_FIX

    if importlib.util.find_spec("bitsandbytes") is None:  # a broken install is caught when the model is built
        raise ConfigError("method.type", BNB_FIX, "pip install bitsandbytes, or set method.type: lora")
    m = cfg.model
    if m.dtype == "fp32" and m.device in ("cuda", "auto"):
        import torch

        if m.device == "cuda" or torch.cuda.is_available():
            # fp32 compute dequantises every NF4 weight into an fp32 buffer and runs fp32 GEMMs: twice the bytes
            # and a fraction of the bf16 tensor-core rate, which is what QLoRA exists to avoid. The CPU keeps fp32
            # (tests: bitsandbytes' CPU backend computes in any dtype).
            raise ConfigError("model.dtype", "qlora needs bf16 compute on CUDA (fp32 makes every dequantised "
                              "weight and GEMM fp32)", "set model.dtype: bf16 (or auto)")


def _check_memory(cfg: Config) -> None:
    from novatune.memory.policy import POLICIES

    mem = cfg.memory
    if mem.policy == "none" and mem.gradient_checkpointing:
        raise ConfigError("memory.policy", "none keeps every activation, but memory.gradient_checkpointing is true",
                          "drop memory.gradient_checkpointing (memory.policy decides), or choose memory.policy: "
                          "checkpoint")
    if mem.policy == "per-layer" and not mem.layers:
        raise ConfigError("memory.layers", "memory.policy per-layer needs one policy per decoder layer",
                          "set memory.layers, e.g. [offload*30, keep*6]")
    if mem.layers and mem.policy != "per-layer":
        raise ConfigError("memory.layers", f"is only read with memory.policy: per-layer (policy is {mem.policy})",
                          "set memory.policy: per-layer, or remove memory.layers")
    for item in mem.layers:
        name, _, count = item.partition("*")
        if name.strip() not in POLICIES or (count and not count.strip().isdigit()):
            raise ConfigError("memory.layers", f"{item!r} is not a layer policy",
                              f"use one of {', '.join(POLICIES)}, optionally with *N for N layers in a row")
    if mem.offload_min_bytes < 0:
        raise ConfigError("memory.offload_min_bytes", f"must be >= 0, got {mem.offload_min_bytes}",
                          "set 0 to offload every saved tensor, or a size in bytes (default 1048576)")
    streamed = mem.stream_frozen_layers
    if streamed != "auto" and streamed < 0:
        raise ConfigError("memory.stream_frozen_layers", f"must be auto or >= 0, got {streamed}",
                          "set 0 to keep every weight on the GPU, N to stream N layers' frozen weights, or auto")
    if streamed not in ("auto", 0) and cfg.method.type == "full":
        raise ConfigError("memory.stream_frozen_layers", f"{streamed} layers to stream, but full fine-tuning trains "
                          "every weight (streaming moves only frozen ones)",
                          "set memory.stream_frozen_layers: 0, or method.type: lora or qlora")
    if streamed not in ("auto", 0) and memory_policy(mem) in ("none", "recompute_mlp"):
        raise ConfigError("memory.stream_frozen_layers", f"{streamed} layers to stream, but no layer is recomputed "
                          f"whole (memory.policy {memory_policy(mem)}): a streamed layer's weights come back for the "
                          f"recompute before its backward",
                          "set memory.policy: checkpoint (or auto), or memory.stream_frozen_layers: 0")
    if mem.embeddings_on_host:
        _check_embeddings_on_host(cfg)
    if mem.embedding_grad == "rows" and cfg.parallel.strategy != "none":
        raise ConfigError("memory.embedding_grad", f"rows keeps the input embedding's gradient out of autograd until "
                          f"a step's last backward, but parallel.strategy {cfg.parallel.strategy} reduces or shards "
                          f"every gradient as each backward makes it", "set memory.embedding_grad: auto or dense")
    if mem.lm_head_grad_in_forward is True:
        fused_loss = bool(cfg.model.patch) and bool((cfg.model.patch_options or {}).get("cross_entropy", True))
        why = ("parallel.strategy " + cfg.parallel.strategy + " reduces the gradients across processes"
               if cfg.parallel.strategy != "none" else "LoRA/QLoRA do not train lm_head"
               if cfg.method.type != "full" else "train.grad_accum is 1: no .grad exists before a backward"
               if cfg.train.grad_accum <= 1 else "novatune's fused loss does not run (model.patch or its "
               "cross_entropy option is off)" if not fused_loss else None)
        if why is not None:
            raise ConfigError("memory.lm_head_grad_in_forward", f"true, but {why}", "set it to auto or false")
    if mem.budget_gib is not None and mem.budget_gib <= 0:
        raise ConfigError("memory.budget_gib", f"must be > 0, got {mem.budget_gib}",
                          "set the GPU memory to plan for in GiB, or null for the card's free memory")


def _check_embeddings_on_host(cfg: Config) -> None:
    key, off = "memory.embeddings_on_host", "or set memory.embeddings_on_host: false"
    if cfg.method.type not in ("lora", "qlora"):
        raise ConfigError(key, "full fine-tuning trains the input embedding (only a frozen one moves to the host)",
                          f"set method.type: lora or qlora, {off}")
    if cfg.method.type == "qlora" and cfg.method.quantize_embeddings is not False:
        raise ConfigError(key, "qlora quantises the input embedding to NF4 (method.quantize_embeddings, its "
                          "default): that table is already 4-bit on the GPU", f"set method.quantize_embeddings: "
                          f"false to keep it in bf16 on the host, {off}")
    if cfg.parallel.strategy != "none":
        raise ConfigError(key, f"parallel.strategy {cfg.parallel.strategy} wraps every parameter on the GPU",
                          f"set parallel.strategy: none, {off}")
    if cfg.model.device == "cpu":
        raise ConfigError(key, "model.device is cpu: the table is in host memory already", f"{off}")


def _check_optimizer(cfg: Config) -> None:
    import importlib.util

    from novatune.train.optim import BNB_FIX, BNB_OPTIMIZERS

    t = cfg.train
    if t.optimizer in BNB_OPTIMIZERS and importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError("train.optimizer", f"{t.optimizer} needs bitsandbytes, which is not installed", BNB_FIX)
    if t.optimizer != "adamw" and t.fused_adamw is not None:
        raise ConfigError("train.fused_adamw", f"applies to train.optimizer: adamw, not {t.optimizer}",
                          "drop train.fused_adamw, or set train.optimizer: adamw")
    if t.adamw_kernel == "novatune" and (t.optimizer != "adamw" or t.fused_adamw is False):
        foreach = ", fused_adamw false (torch's foreach AdamW)" if t.fused_adamw is False else ""
        fix = "drop train.fused_adamw: false" if t.optimizer == "adamw" else "set train.optimizer: adamw"
        raise ConfigError("train.adamw_kernel", f"novatune's kernel runs train.optimizer adamw in place of torch's "
                          f"(here {t.optimizer}{foreach})",
                          f"set train.adamw_kernel: torch (torch's fused or foreach AdamW), or {fix}")
    if t.optimizer != "adamw" and cfg.parallel.strategy == "fsdp2":
        raise ConfigError("train.optimizer", f"{t.optimizer} does not take FSDP2's sharded (DTensor) parameters",
                          "set train.optimizer: adamw with parallel.strategy: fsdp2, or parallel.strategy: ddp")


def validate(cfg: Config, base_dir: Path | None = None) -> Config:
    from novatune.data.sources import detect_type, resolve_path
    from novatune.train.arch import ARCHS

    m, d, t = cfg.model, cfg.data, cfg.train
    # model
    if bool(m.name) == bool(m.arch):
        raise ConfigError("model", "set exactly one of model.name (pretrained weights: HF id or local path) and "
                          "model.arch (random init)",
                          f"e.g. model.arch: qwen3-tiny, or model.name: ./my-model (archs: {', '.join(ARCHS)})")
    if m.arch and m.arch not in ARCHS:
        import difflib

        close = difflib.get_close_matches(m.arch, list(ARCHS), n=1)
        raise ConfigError("model.arch", f"unknown architecture {m.arch!r}",
                          (f"did you mean {close[0]!r}? " if close else "") + f"choose one of {', '.join(ARCHS)}")
    if m.arch and ARCHS[m.arch].get("vocab_size") == "auto" and not m.tokenizer and \
            "vocab_size" not in m.arch_overrides:
        raise ConfigError("model.tokenizer", f"arch {m.arch} takes its vocab size from the tokenizer",
                          "set model.tokenizer (a local folder, or 'demo') or model.arch_overrides.vocab_size")
    # data
    if not d.sources:
        raise ConfigError("data.sources", "no data sources",
                          "add one, e.g. sources: [{path: train.jsonl}] or [{type: synthetic, num_docs: 200}]")
    for i, s in enumerate(d.sources):
        key = f"data.sources[{i}]"
        if s.type == "synthetic":
            _positive(s.num_docs, f"{key}.num_docs")
            _positive(s.median_length, f"{key}.median_length")
            _positive(s.min_length, f"{key}.min_length")
            if s.sigma < 0:
                raise ConfigError(f"{key}.sigma", f"must be >= 0, got {s.sigma}", f"set {key}.sigma to e.g. 0.7")
            continue
        if not s.path:
            raise ConfigError(f"{key}.path", "missing", f"set {key}.path to a .jsonl/.json/.parquet file or a "
                                                        f"datasets save_to_disk folder (or type: synthetic)")
        p = resolve_path(s.path, base_dir)
        if not p.exists():
            raise ConfigError(f"{key}.path", f"not found: {p}",
                              "fix the path (relative paths are tried against the working directory, then the "
                              "config file's folder)")
        if s.type == "auto" and detect_type(p) is None:
            raise ConfigError(f"{key}.type", f"cannot tell the format of {p}",
                              "set type: jsonl, json, parquet or datasets")
        if s.limit is not None:
            _positive(s.limit, f"{key}.limit")
    if d.max_length < MIN_MAX_LENGTH:
        raise ConfigError("data.max_length", f"{d.max_length} is too small to hold a training document",
                          f"set data.max_length to at least {MIN_MAX_LENGTH} (typical: 2048 or 4096)")
    fmt_loss = {"text": ("all",), "tokens": ("all",)}
    if d.format in fmt_loss and d.loss_on not in fmt_loss[d.format]:
        raise ConfigError("data.loss_on", f"{d.loss_on!r} needs a prompt/assistant part, which format "
                          f"{d.format!r} does not have", "set data.loss_on: all, or use format messages / "
                          "prompt_completion / alpaca")
    if any(s.type == "synthetic" for s in d.sources) and d.format not in ("auto", "tokens"):
        raise ConfigError("data.format", f"synthetic sources are pre-tokenized; format {d.format!r} cannot apply",
                          "set data.format: auto (or tokens)")
    # method
    if cfg.method.type == "qlora":
        _check_qlora(cfg)
        if cfg.method.quantize_embeddings is None:
            cfg.method.quantize_embeddings = True
    elif cfg.method.quantize_embeddings:
        raise ConfigError("method.quantize_embeddings", f"NF4 embeddings are part of qlora, not "
                          f"{cfg.method.type}", "set method.type: qlora, or drop method.quantize_embeddings")
    if cfg.method.type in ("lora", "qlora"):
        _positive(cfg.method.r, "method.r")
        if cfg.method.alpha <= 0:
            raise ConfigError("method.alpha", f"must be > 0, got {cfg.method.alpha}", "set method.alpha, e.g. 2 x r")
        if not 0 <= cfg.method.dropout < 1:
            raise ConfigError("method.dropout", f"must be in [0, 1), got {cfg.method.dropout}",
                              "set method.dropout to e.g. 0.0 or 0.05")
        if not cfg.method.targets and not cfg.method.target_parameters:
            raise ConfigError("method.targets", "empty", "set method.targets: all-linear, or e.g. [q_proj, v_proj]")
        if cfg.method.target_parameters and cfg.method.dropout:
            raise ConfigError("method.dropout", f"{cfg.method.dropout} with method.target_parameters: PEFT applies "
                              "no dropout to a parameter's input (it cannot be factored out of W + B A)",
                              "set method.dropout: 0, or drop method.target_parameters")
    # train
    if t.max_steps is None:
        _positive(t.epochs, "train.epochs")
    else:
        _positive(t.max_steps, "train.max_steps")
    _positive(t.micro_batch, "train.micro_batch")
    _positive(t.grad_accum, "train.grad_accum")
    for key in ("lr", "eps", "warmup", "min_lr_ratio", "weight_decay", "max_grad_norm"):
        value = getattr(t, key)
        if not math.isfinite(value):  # inf passed the range checks below; one step with it ruins the weights
            raise ConfigError(f"train.{key}", f"must be a finite number, got {value}", f"set train.{key} to a number")
    if not t.lr > 0:
        raise ConfigError("train.lr", f"must be > 0, got {t.lr}", "set train.lr, e.g. 2e-5 (full) or 2e-4 (LoRA)")
    if not t.eps > 0:  # AdamW divides by sqrt(v) + eps: zero or negative can divide by zero
        raise ConfigError("train.eps", f"must be > 0, got {t.eps}", "set train.eps, e.g. 1e-8")
    if t.warmup < 0:
        raise ConfigError("train.warmup", f"must be >= 0, got {t.warmup}",
                          "set train.warmup to a step count (>= 1) or a fraction of the run (< 1)")
    if not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError("train.min_lr_ratio", f"must be in [0, 1], got {t.min_lr_ratio}", "e.g. 0.0 or 0.1")
    if t.weight_decay < 0:
        raise ConfigError("train.weight_decay", f"must be >= 0, got {t.weight_decay}", "e.g. 0.0 or 0.1")
    if len(t.betas) != 2 or not all(0 <= b < 1 for b in t.betas):
        raise ConfigError("train.betas", f"must be two numbers in [0, 1), got {t.betas}", "e.g. [0.9, 0.999]")
    if t.max_grad_norm < 0:
        raise ConfigError("train.max_grad_norm", f"must be >= 0, got {t.max_grad_norm}", "e.g. 1.0 (0: no clipping)")
    if t.max_skipped_steps < 0:
        raise ConfigError("train.max_skipped_steps", f"must be >= 0, got {t.max_skipped_steps}", "e.g. 3")
    _check_optimizer(cfg)
    if cfg.parallel.strategy != "none" and cfg.method.type == "qlora":
        raise ConfigError("parallel.strategy", f"{cfg.parallel.strategy} with qlora is not supported yet: the "
                          "bitsandbytes NF4 base weights (Params4bit with their quantisation state) cannot be "
                          "sharded by fully_shard, nor broadcast as plain parameters by DDP",
                          "use method.type: lora (frozen bf16 base, sharded) or parallel.strategy: none")
    units = cfg.parallel.layers_per_unit
    if units is not None and units < 1:
        raise ConfigError("parallel.layers_per_unit", f"must be >= 1, got {units}",
                          "e.g. 4 (decoder layers per FSDP2 unit), or leave it unset for the default")
    if cfg.parallel.reduce_dtype == "fp32" and cfg.parallel.strategy == "ddp":
        raise ConfigError("parallel.reduce_dtype", "fp32 applies to fsdp2; DDP all-reduces the gradients in their "
                          "own dtype", "leave parallel.reduce_dtype: auto with ddp, or use parallel.strategy: fsdp2")
    _check_memory(cfg)
    if cfg.memory.tiled_mlp is True and not m.patch:
        raise ConfigError("memory.tiled_mlp", "the tiled MLP is part of novatune's patch, and model.patch is false",
                          "set model.patch: true, or memory.tiled_mlp: auto / false")
    ce_mode = (m.patch_options or {}).get("cross_entropy_mode", "auto")
    if ce_mode not in ("auto", "tokens", "vocab", "inplace"):
        raise ConfigError("model.patch_options.cross_entropy_mode", f"{ce_mode!r} is not a mode of the fused loss",
                          "choose auto, tokens, vocab or inplace (or leave it unset: auto)")
    if "tiled_mlp" in (m.patch_options or {}):
        raise ConfigError("model.patch_options.tiled_mlp", "the MLP tiling is a memory setting",
                          "set memory.tiled_mlp (auto, true or false) instead")
    # checkpoint / logging
    if cfg.checkpoint.save_every < 0:
        raise ConfigError("checkpoint.save_every", f"must be >= 0, got {cfg.checkpoint.save_every}",
                          "set a step interval, or 0 for no intermediate checkpoints")
    _positive(cfg.checkpoint.keep, "checkpoint.keep")
    if not cfg.checkpoint.output_dir:
        raise ConfigError("checkpoint.output_dir", "empty", "set checkpoint.output_dir, e.g. runs/my-run")
    if cfg.checkpoint.resume not in ("auto", "never") and not Path(cfg.checkpoint.resume).exists():
        raise ConfigError("checkpoint.resume", f"not found: {cfg.checkpoint.resume}",
                          "use auto (latest in output_dir), never, or the path of a checkpoints/step_N folder")
    _positive(cfg.logging.every, "logging.every")
    if cfg.logging.peak_tflops is not None and cfg.logging.peak_tflops <= 0:
        raise ConfigError("logging.peak_tflops", "must be > 0", "set the GPU's dense bf16 TFLOP/s, or null")
    return cfg
