"""Typed run configuration: nested dataclasses, loaded from YAML, overridden with `--set a.b=c`.

Every value is checked against its field's type when the config is built, and cross-field rules are checked by
`validate()`. Each error is a `ConfigError` that names the key (``train.lr``), what was wrong, and the fix, e.g.

    config error at train.schedul: unknown key. Did you mean 'schedule'? (keys of train: epochs, max_steps, ...)

The resolved config (defaults filled in) is printed at the start of every run and saved as
`<output_dir>/config.yaml`, which loads back to the same config (YAML round-trip).
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from novatune.train.config_checks import memory_policy  # noqa: F401 - re-exported: callers import it from here
from novatune.train.errors import ConfigError  # noqa: F401 - re-exported: callers import it from here


# ----------------------------------------------------------------------------------------------- the sections
@dataclass
class ModelConfig:
    name: str | None = None  # HF id or local path to load pretrained weights from
    arch: str | None = None  # named architecture for random init (see novatune.train.arch.ARCHS)
    arch_overrides: dict = field(default_factory=dict)  # e.g. {num_hidden_layers: 2}
    tokenizer: str | None = None  # local path, or "demo" (bundled); default: model.name
    dtype: Literal["auto", "bf16", "fp32"] = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    # hf_default: sdpa where the model class supports it, else eager (GPT-OSS has no sdpa path): HF as shipped
    attention: Literal["sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3",
                       "hf_default"] = "sdpa"
    patch: bool = True  # call novatune.patch(model, **patch_options) before training
    patch_options: dict = field(default_factory=dict)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # build layer by layer straight into the final form (dtype, device; QLoRA: NF4), never the whole model in a
    # wider form first (novatune/train/load.py); false: transformers' from_config / from_pretrained
    low_memory_load: bool = True


@dataclass
class SourceConfig:
    path: str | None = None  # file, directory of files, or a `datasets` save_to_disk folder
    type: Literal["auto", "jsonl", "json", "parquet", "datasets", "synthetic"] = "auto"
    split: str = "train"  # a DatasetDict folder's split, or a data folder's files named by split (test.jsonl)
    limit: int | None = None  # keep only the first N records
    # synthetic: random token documents with log-normal lengths (the benchmark workload)
    num_docs: int = 1000
    median_length: int = 600
    sigma: float = 0.7
    min_length: int = 32
    seed: int = 1


@dataclass
class DataConfig:
    sources: list[SourceConfig] = field(default_factory=list)
    format: Literal["auto", "text", "alpaca", "messages", "prompt_completion", "tokens"] = "auto"
    chat_template: str | None = None  # jinja text or a path to a .jinja file; default: the tokenizer's
    loss_on: Literal["all", "assistant", "completion"] = "all"
    max_length: int = 2048
    packing: bool = True
    # bfd: whole documents, best fit; greedy: in order, cut at row ends
    packing_strategy: Literal["bfd", "greedy"] = "bfd"
    # longest: each micro-batch padded to its longest row; max_length: every micro-batch to max_length (one shape,
    # so CUDA graphs replay every batch; padding is its own segment, never trained or counted); auto: max_length
    # where the run's LoRA/QLoRA layers run as CUDA graphs (packed rows), else longest
    pad_rows: Literal["auto", "longest", "max_length"] = "auto"
    overlong: Literal["split", "drop", "truncate"] = "split"
    add_eos: bool = True
    shuffle: bool = True


@dataclass
class MethodConfig:
    # qlora: LoRA over bitsandbytes NF4 base weights (double quantisation, blocksize 64; novatune/train/qlora.py)
    type: Literal["full", "lora", "qlora"] = "full"
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: ["all-linear"])
    # LoRA on parameters rather than modules (PEFT's target_parameters): the routed experts' 3-D weights. "experts"
    # names every experts module's 3-D weights (gate_up_proj, down_proj); other entries go to PEFT as written
    # (e.g. mlp.experts.down_proj). novatune runs them inside the grouped GEMMs; needs method.dropout 0
    target_parameters: list[str] = field(default_factory=list)
    # qlora only (null: true for qlora): the frozen input embedding in NF4 too, rows dequantised as gathered
    # (novatune.ops.nf4.NF4Embedding; Qwen3-8B: 1.16 -> 0.30 GiB). Skipped, with a printed reason, when the
    # embedding is tied to lm_head (lm_head stays dense, so the shared table must too).
    quantize_embeddings: bool | None = None


@dataclass
class TrainConfig:
    epochs: int = 1
    max_steps: int | None = None  # optimizer steps; overrides epochs when set
    micro_batch: int = 1
    grad_accum: int = 1
    lr: float = 2e-5
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup: float = 0.0  # >= 1: steps; < 1: fraction of the total steps
    min_lr_ratio: float = 0.0  # floor of the decay, as a fraction of lr
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    max_grad_norm: float = 1.0  # 0: no clipping
    # adamw (torch) | adamw_kahan (fp32 moments, compensated bf16 weight update: bf16 updates that do not vanish)
    # | adamw_8bit | paged_adamw | paged_adamw_8bit (bitsandbytes); novatune/train/optim.py
    optimizer: Literal["adamw", "adamw_kahan", "adamw_8bit", "paged_adamw", "paged_adamw_8bit"] = "adamw"
    # adamw only; null or true: one fused pass on CUDA (novatune's kernel where adamw_kernel takes it, else torch's
    # fused); on the CPU true is torch's fused CPU AdamW and null its foreach; false: torch's foreach
    fused_adamw: bool | None = None
    # adamw only: torch (torch.optim.AdamW) | novatune (the same update through novatune's kernel, with the clipping
    # scale applied inside it: one pass over the gradients fewer) | auto (novatune for a patched model's full
    # fine-tuning on CUDA, DDP and FSDP2 included; else torch); novatune/train/optim.py
    adamw_kernel: Literal["auto", "torch", "novatune"] = "auto"
    seed: int = 42
    # a step whose loss or grad norm is NaN/inf: stop the run (default) or skip its update (train/nonfinite.py)
    on_nonfinite: Literal["stop", "skip"] = "stop"
    max_skipped_steps: int = 3  # skip mode: more consecutive skipped steps than this stop the run


@dataclass
class MemoryConfig:
    gradient_checkpointing: bool = False
    # What each decoder layer keeps for its backward (novatune/memory/): none (keep everything) | checkpoint
    # (recompute each layer) | recompute_mlp (recompute each layer's MLP, keep its attention) | selective (keep the
    # GEMM outputs, recompute the elementwise ops) | offload (checkpoint, with the layer inputs in host memory) |
    # per-layer (memory.layers) | auto (the planner picks the fastest per-layer mix that fits memory.budget_gib).
    # null: checkpoint if gradient_checkpointing, else none.
    policy: Literal["auto", "none", "checkpoint", "recompute_mlp", "selective", "offload", "per-layer"] | None = None
    # the GPU memory to plan for (auto chooses within it; other policies warn beyond it); null: the card's free
    # memory minus a margin
    budget_gib: float | None = None
    # per-layer: one of keep | lean | recompute | recompute_mlp | selective | offload per decoder layer, `name*N`
    # for N in a row
    layers: list[str] = field(default_factory=list)
    offload_min_bytes: int = 1 << 20  # offload: smaller saved tensors stay on the device (a copy costs ~10 µs)
    # the MLP on row chunks, each recomputed in the backward, so its (tokens x intermediate) activations never
    # exist whole (novatune/patch/tiled.py). auto: batches whose intermediate exceeds 1 GiB (Qwen3-4B: from 55k
    # tokens); true: every batch longer than one chunk; false: never. Part of novatune's patch (model.patch).
    tiled_mlp: Literal["auto", True, False] = "auto"
    # CUDA caching allocator with expandable segments (one growing mapping per stream instead of many fixed-size
    # segments): without it, a card that is nearly full fragments, and the allocator frees and re-reserves its
    # cache every step (cudaFree synchronises). PYTORCH_CUDA_ALLOC_CONF, when set, wins (train/memory.py).
    expandable_segments: bool = True
    # LoRA/QLoRA: the frozen base weights of this many decoder layers live in pinned host memory and are copied
    # to the GPU for each use (novatune/memory/stream.py), spread over the recomputed layers. auto: the fewest
    # that make a plan over memory.budget_gib fit (none when it fits); 0: never; N: N layers.
    stream_frozen_layers: Literal["auto"] | int = "auto"
    # LoRA/QLoRA on one CUDA device: the frozen, untied input embedding table lives in mapped pinned host memory
    # and the GPU gathers each micro-batch's rows from there (novatune/memory/host_embedding.py): vocab x hidden x
    # 2 bytes less on the GPU for tokens x hidden x 2 bytes read over the host link per forward
    embeddings_on_host: bool = False
    # a trained, untied input embedding under gradient accumulation: its gradient is kept as the rows each
    # micro-batch touched until the step's last backward builds it whole (novatune/memory/embedding_grad.py), so
    # the later micro-steps' forwards run without the vocab x hidden gradient; bit for bit stock's. auto: rows
    # where that applies (one process, grad_accum > 1), dense otherwise; dense: stock's
    embedding_grad: Literal["auto", "rows", "dense"] = "auto"
    # full fine-tuning with accumulation, one process: from a step's second micro-step on, the fused loss adds
    # lm_head's gradient into its .grad by token chunks in the forward (novatune/ops/linear_cross_entropy.py),
    # so neither a vocab x hidden gradient buffer nor the full logits exist while every gradient does. The price:
    # each chunk's GEMM reads and writes .grad and rounds into it (5-7 roundings per micro-step at 4,096 tokens
    # where the backward path rounds twice). auto: where the memory plan needs the room (or it makes a faster plan
    # fit); true: always where it applies; false: from the backward
    lm_head_grad_in_forward: Literal["auto", True, False] = "auto"


@dataclass
class ParallelConfig:
    # none: one process | ddp: DistributedDataParallel | fsdp2: torch.distributed.fsdp.fully_shard per decoder
    # layer, then the root (novatune/parallel/). ddp/fsdp2 run under torchrun (`novatune train --nproc N`), or as
    # one process without it. The global batch is micro_batch x grad_accum x the number of processes.
    strategy: Literal["none", "ddp", "fsdp2"] = "none"
    # fsdp2: free the gathered layer after its forward (gathered again in backward). Unset: yes across 2+ processes;
    # no with one process, where the gathered layers stay for the optimizer step (gathered once per step)
    reshard_after_forward: bool | None = None
    # when the gradients are reduced across the processes: once per optimizer step, after the last micro-batch
    # (`step`; the others accumulate locally), or after every micro-batch (`micro_batch`). fsdp2 with `step`
    # accumulates whole (unsharded) gradients between reductions (in parallel.reduce_dtype) on every rank;
    # with `micro_batch` the gradients stay sharded at the cost of grad_accum reduce-scatters per step. auto:
    # micro_batch for fsdp2 across 2+ processes (what sharding is for), step otherwise (ddp keeps whole
    # gradients anyway)
    gradient_sync: Literal["auto", "step", "micro_batch"] = "auto"
    # fsdp2: consecutive decoder layers per FSDP unit (gathered and reduced together). Unset: 1 where the layers
    # reshard after forward, 4 across 2+ processes where they stay gathered for the step; with one process the root
    # is the only unit (the layers stay gathered: a unit only costs host time). parallel/wrap.py unit_size
    layers_per_unit: int | None = None
    # fsdp2 across 2+ processes: the dtype gradients are accumulated and reduced in. auto: the trained parameters'
    # own, as one process accumulates them and DDP all-reduces them (bf16 weights: bf16; LoRA's fp32 adapters:
    # fp32); fp32: always fp32 (4 bytes per parameter between reductions with gradient_sync step)
    reduce_dtype: Literal["auto", "fp32"] = "auto"


@dataclass
class CheckpointConfig:
    output_dir: str = "runs/run"
    save_every: int = 0  # optimizer steps between checkpoints; 0: only the final one (saved before the export)
    keep: int = 2  # newest N checkpoints kept
    # auto: the newest intact checkpoint in output_dir (a damaged newer one is set aside, loudly) | never: a fresh
    # run (refused where output_dir holds checkpoints) | <path to a checkpoint>: that one, or an error if damaged
    resume: str = "auto"
    export: bool = True  # final weights loadable with from_pretrained (LoRA/QLoRA: adapter/ and merged/)
    export_merged: bool = True


@dataclass
class LoggingConfig:
    every: int = 1
    tensorboard: bool = True  # event files when the tensorboard package is installed
    progress: bool = True  # live rich bar on a terminal; plain lines otherwise
    peak_tflops: float | None = None  # MFU denominator; null: table by GPU name
    measure_peak: bool = False  # measure the bf16 matmul rate at start (BENCHMARKS.md's definition)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


# ---------------------------------------------------------------------------------------- building from dicts
_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "a mapping",
               list: "a list"}


def _describe(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is Union or origin is types.UnionType:
        return " or ".join("null" if a is type(None) else _describe(a) for a in typing.get_args(tp))
    if origin is list:
        return "a list of " + _describe(typing.get_args(tp)[0]).removeprefix("a ").removeprefix("an ") + "s"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return _TYPE_WORDS.get(tp, getattr(tp, "__name__", str(tp)))


def _coerce(value: Any, tp, key: str) -> Any:
    """Check (and gently convert: int -> float, "1e-4" -> float, str -> [str]) one value against a type."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if origin is Union or origin is types.UnionType:  # Optional[int] and `int | None` alike
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError as e:
                errors.append(e)
        raise errors[0] if len(errors) == 1 else _bad(value, tp, key)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value in allowed and type(value) is type(allowed[allowed.index(value)]):
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(key, f"{value!r} is not allowed", f"{hint}use one of: {', '.join(map(str, allowed))}")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool) and item_tp is str:
            value = [str(value)]
        if not isinstance(value, (list, tuple)):
            raise _bad(value, tp, key)
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _bad(value, tp, key)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):  # YAML reads "1e3" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                raise _bad(value, tp, key) from None
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise _bad(value, tp, key)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads "1e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise _bad(value, tp, key)
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise _bad(value, tp, key)
    if tp is dict:
        if isinstance(value, dict):
            return dict(value)
        raise _bad(value, tp, key)
    return value


def _bad(value, tp, key) -> ConfigError:
    return ConfigError(key, f"expected {_describe(tp)}, got {value!r} ({type(value).__name__})",
                       f"set {key} to {_describe(tp)}")


def _build(cls, data: Any, prefix: str):
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(prefix, f"expected a mapping of keys, got {data!r} ({type(data).__name__})",
                          f"write {prefix or 'the config'} as `key: value` lines")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in hints:
            close = difflib.get_close_matches(str(k), names, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(key, "unknown key", f"{hint}valid keys of {prefix or 'the config'}: {', '.join(names)}")
        kwargs[k] = _coerce(v, hints[k], key)
    return cls(**kwargs)


def from_dict(data: dict) -> Config:
    cfg = _build(Config, data, "")
    return cfg


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False, width=120)


# ------------------------------------------------------------------------------------------------- overrides
def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(text, "an override must look like key.path=value", "write e.g. --set train.lr=1e-4")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(text, "empty key in override", "write e.g. --set train.lr=1e-4")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b=c` overrides to a raw (YAML) dict; list items by index: data.sources.0.path=x."""
    for text in overrides or []:
        path, value = parse_override(text)
        node: Any = data
        for i, part in enumerate(path[:-1]):
            where = ".".join(path[: i + 1])
            if isinstance(node, list):
                node = _list_item(node, part, where)
                continue
            if node.get(part) is None:
                node[part] = [] if part == "sources" else {}
            node = node[part]
            if not isinstance(node, (dict, list)):
                raise ConfigError(where, f"is a value ({node!r}), not a section", f"set {where}=... directly")
        last = path[-1]
        if isinstance(node, list):
            idx = int(last) if last.isdigit() else -1
            if idx == len(node):
                node.append(value)
            else:
                node[_index(node, last, ".".join(path))] = value
        else:
            node[last] = value
    return data


def _index(node: list, part: str, where: str) -> int:
    if not part.isdigit() or int(part) > len(node) - 1:
        raise ConfigError(where, f"no list item {part!r} (the list has {len(node)} items)",
                          f"use an index from 0 to {len(node)} (the next index appends)")
    return int(part)


def _list_item(node: list, part: str, where: str):
    if part.isdigit() and int(part) == len(node):
        node.append({})
    return node[_index(node, part, where)]


def load(path: str | Path | None = None, overrides: list[str] | None = None, check: bool = True) -> Config:
    """Load a YAML config (None: the bundled demo), apply overrides, build the typed config and validate it."""
    if path is None:
        from novatune.train.demo import demo_config_path

        path = demo_config_path()
    p = Path(path)
    if not p.is_file():
        raise ConfigError("", f"config file not found: {p}", "pass the path of a YAML file (see examples/*.yaml)")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as e:
        line = p.read_bytes()[: e.start].count(b"\n") + 1
        raise ConfigError("", f"{p} is not UTF-8 text (byte {e.object[e.start]:#04x} on line {line})",
                          "re-save the config as UTF-8 or fix that line") from None
    except yaml.YAMLError as e:
        raise ConfigError("", f"{p} is not valid YAML: {e}", "fix the YAML syntax at the line shown") from None
    if not isinstance(data, dict):  # before the overrides, which would name a section inside the list
        raise ConfigError("", f"{p} holds a {type(data).__name__} at its top level, not a mapping of sections",
                          "write the config as sections (model:, data:, train:, ...; see examples/*.yaml)")
    data = apply_overrides(data, overrides or [])
    cfg = from_dict(data)
    if check:
        from novatune.train.config_checks import validate

        validate(cfg, base_dir=p.parent)
    return cfg


def load_with_base(path: str | Path | None, overrides: list[str] | None = None,
                   output_dir: str | None = None) -> tuple[Config, Path]:
    """The config at `path` (None: the embedded demo) with overrides applied, and the folder its relative paths
    resolve from (the config file's folder; the demo's asset folder for the demo)."""
    overrides = list(overrides or [])
    if output_dir:
        overrides.append(f"checkpoint.output_dir={output_dir}")
    cfg = load(path, overrides)
    if path is None:
        from novatune.train.demo import DEMO_DIR

        return cfg, DEMO_DIR
    return cfg, Path(path).resolve().parent


# --------------------------------------------------------------------------------------------- the run summary
def _memory_summary(mem: MemoryConfig) -> str:
    policy = memory_policy(mem)
    if policy == "none":
        return ""
    if policy == "checkpoint":
        return ", gradient checkpointing"
    return f", memory policy {policy}" + (f" (budget {mem.budget_gib:g} GiB)" if mem.budget_gib else "")


def summary(cfg: Config) -> str:
    """The resolved config in a few lines for the start of a run (the full one goes to <output_dir>/config.yaml)."""
    m, d, me, t, c = cfg.model, cfg.data, cfg.method, cfg.train, cfg.checkpoint
    model = f"name: {m.name}" if m.name else f"arch: {m.arch}"
    if m.arch_overrides:
        model += " (" + ", ".join(f"{k}={v}" for k, v in m.arch_overrides.items()) + ")"
    method = me.type if me.type == "full" else f"{me.type} r{me.r} alpha {me.alpha:g} dropout {me.dropout:g} " \
                                                 f"targets {','.join(me.targets)}" \
        + (f" + parameters {','.join(me.target_parameters)}" if me.target_parameters else "")
    sources = ", ".join(s.path or s.type for s in d.sources)
    length = f"max_steps {t.max_steps}" if t.max_steps else f"epochs {t.epochs}"
    lines = [
        ("model", f"{model}, {m.dtype}, {m.attention}, patch {'on' if m.patch else 'off'}, device {m.device}"),
        ("method", method + _memory_summary(cfg.memory)
         + (f", parallel {cfg.parallel.strategy}" if cfg.parallel.strategy != "none" else "")),
        ("data", f"{sources}; format {d.format}, loss_on {d.loss_on}, max_length {d.max_length}, packing "
                 f"{d.packing_strategy if d.packing else 'off'}"),
        ("train", f"{length}, micro_batch {t.micro_batch} x grad_accum {t.grad_accum}, {t.optimizer} lr {t.lr:g} "
                  f"{t.schedule} (warmup {t.warmup:g}), clip {t.max_grad_norm:g}, on_nonfinite {t.on_nonfinite}, "
                  f"seed {t.seed}"),
        ("output", f"{c.output_dir} (save_every {c.save_every}, keep {c.keep}, resume {c.resume}, export "
                   f"{'on' if c.export else 'off'}); full config: {Path(c.output_dir) / 'config.yaml'}"),
    ]
    return "\n".join(f"{k:<7} {v}" for k, v in lines)
