"""Building what the loop trains: tokenizer, model (pretrained or random-init arch), LoRA, checkpointing, patch.

Order matters and is fixed here: model -> gradient checkpointing -> LoRA (PEFT) -> novatune.patch -> optimizer.
The patch goes last so it sees the final module tree (it patches instances, and unwraps PEFT itself); it keeps
every parameter, so the optimizer and checkpoints are unaffected by it.

The model is built layer by layer straight into its final form (novatune/train/load.py: meta-device
construction, then each decoder layer allocated on the device in the run's dtype, initialised or read from the
checkpoint's safetensors, and for QLoRA quantised, before the next); `model.low_memory_load: false` keeps
transformers' own from_config / from_pretrained.

QLoRA (method.type qlora) differs in two places: the model's linears are bitsandbytes NF4 (quantised as each
layer is placed; without the low-memory build, `model.name` loads with novatune.train.qlora.bnb_config and
`model.arch` is built, then quantised in place), and PEFT's
prepare_model_for_kbit_training is deliberately NOT called (its fp32 casts of embeddings, norms and lm_head halve
the speed: docs/BENCHMARKS.md's QLoRA anchor); only the one piece of it training needs is done here (input grads under
gradient checkpointing, `prepare`).
"""
from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import torch

from novatune.data.sources import resolve_path
from novatune.train.errors import SetupError  # noqa: F401 - re-exported: callers import it from here

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise SetupError("model.device: cuda was asked for but torch sees no CUDA GPU; set model.device: auto "
                         "(or cpu), or install a CUDA build of torch")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def load_tokenizer(mcfg, base_dir: Path | None = None):
    """model.tokenizer (or model.name): a local folder; "demo": the bundled one. None when neither is set."""
    name = mcfg.tokenizer or mcfg.name
    if name is None:
        return None
    if name == "demo":
        from novatune.train.demo import load_demo_tokenizer

        return load_demo_tokenizer()
    from transformers import AutoTokenizer

    path = resolve_path(name, base_dir)
    try:
        tok = AutoTokenizer.from_pretrained(str(path) if path.exists() else name)
    except (OSError, ValueError) as e:
        raise SetupError(f"model.tokenizer: cannot load a tokenizer from {name!r} ({str(e).splitlines()[0]}); set "
                         f"model.tokenizer to a local tokenizer folder or 'demo'") from None
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    return tok


def model_config(mcfg, tokenizer=None, base_dir: Path | None = None):
    """The transformers config the run will use (no weights): from model.arch or model.name."""
    if mcfg.arch:
        from novatune.train.arch import arch_config

        try:
            return arch_config(mcfg.arch, mcfg.arch_overrides, len(tokenizer) if tokenizer is not None else None)
        except (TypeError, ValueError) as e:
            raise SetupError(f"model.arch: {e}; fix model.arch / model.arch_overrides") from None
    from transformers import AutoConfig

    path = resolve_path(mcfg.name, base_dir)
    try:
        cfg = AutoConfig.from_pretrained(str(path) if path.exists() else mcfg.name)
    except (OSError, ValueError) as e:
        raise SetupError(f"model.name: cannot load {mcfg.name!r} ({str(e).splitlines()[0]}); give a local model "
                         f"folder, an HF id that is cached, or use model.arch for random init") from None
    from novatune.train.arch import check_heads, check_overrides

    try:
        check_overrides(mcfg.arch_overrides, type(cfg), built=cfg)
        for k, v in (mcfg.arch_overrides or {}).items():
            setattr(cfg, k, v)
        check_heads(cfg)
    except ValueError as e:
        raise SetupError(f"model.arch_overrides: {e}") from None
    return cfg


def _causal_lm_class(config):
    """transformers' CausalLM class for this config (its config -> class table), or None."""
    from transformers import AutoModelForCausalLM

    mapping = getattr(AutoModelForCausalLM, "_model_mapping", None)
    return mapping.get(type(config), None) if mapping is not None else None


def _sdpa_refusal(config) -> str | None:
    """Why transformers' sdpa attention cannot run this config's model (None when it can): a class without an sdpa
    path (GPT-OSS's sinks, Gemma 2), or soft-capped attention logits, which transformers' sdpa raises for whatever
    the class declares (a Gemma 3 config may set attn_logit_softcapping too)."""
    cls = _causal_lm_class(config)
    if cls is not None and getattr(cls, "_supports_sdpa", True) is False:
        return f"{cls.__name__} has no sdpa attention"
    cap = getattr(config, "attn_logit_softcapping", None)
    if cap is not None:
        return f"{config.model_type} soft-caps its attention logits at {cap:g}, which transformers' sdpa cannot"
    return None


def resolve_attention(config, name: str) -> str:
    """model.attention for this config: "hf_default" -> sdpa where transformers' sdpa computes the model's attention
    (the class supports it and the logits are not soft-capped), else eager (HF's own advice for both)."""
    if name != "hf_default":
        return name
    if not getattr(_causal_lm_class(config), "_supports_sdpa", False) or _sdpa_refusal(config) is not None:
        return "eager"
    return "sdpa"


def build_model(mcfg, device: torch.device, dtype: torch.dtype, tokenizer=None, base_dir: Path | None = None,
                seed: int = 0, qlora: bool = False, on_unit=None):
    """A CausalLM on `device` in `dtype`, in train mode, use_cache off. Random init is seeded by `seed`.
    qlora: every linear but lm_head is a bitsandbytes NF4 Linear4bit computing in `dtype`.
    model.low_memory_load (default): built layer by layer straight into that form (novatune/train/load.py;
    `on_unit(model, path)` after each unit); otherwise transformers builds or loads the whole model first."""
    config = model_config(mcfg, tokenizer, base_dir)
    config.use_cache = False
    mcfg = dataclasses.replace(mcfg, attention=resolve_attention(config, mcfg.attention))
    _check_attention_supported(config, mcfg.attention)
    if mcfg.low_memory_load:
        model = _build_low_memory(mcfg, config, device, dtype, base_dir, seed, qlora, on_unit)
    else:
        model = _build_with_transformers(mcfg, config, device, dtype, base_dir, seed, qlora)
    if tokenizer is not None and len(tokenizer) > model.config.vocab_size:
        raise SetupError(f"model: the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
                         f"{model.config.vocab_size}; use the model's tokenizer or set "
                         f"model.arch_overrides.vocab_size: {len(tokenizer)}")
    model.config.use_cache = False
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.use_cache = False
    model.train()
    return model


def _check_attention_supported(config, attn: str) -> None:
    """model.attention=sdpa where transformers' sdpa cannot compute the model's attention (Gemma 2, GPT-OSS: their
    soft-capping or sinks) raises deep inside transformers; say which setting to change instead."""
    why = _sdpa_refusal(config) if attn == "sdpa" else None
    if why is not None:
        raise SetupError(f"model.attention: {why}; set model.attention=eager (its stock attention; with "
                         "model.patch the patched model's attention replaces it anyway), hf_default or flex_attention")
    check_attention_installed(attn, "model.attention")


# transformers' attention implementations that need a package of their own: (its availability check, the package)
_ATTENTION_PACKAGES = {"flash_attention_2": ("is_flash_attn_2_available", "flash-attn (2.x)"),
                       "flash_attention_3": ("is_flash_attn_3_available", "flash-attn 3 (flash_attn_interface)")}


def check_attention_installed(attn: str, setting: str) -> None:
    """SetupError naming `setting` when `attn` needs a package that is not installed (or usable on this machine):
    transformers raises an ImportError from deep inside the model build otherwise."""
    need = _ATTENTION_PACKAGES.get(attn)
    if need is None:
        return
    import transformers.utils as tu

    available = getattr(tu, need[0], None)
    if available is not None and not available():
        raise SetupError(f"{setting}={attn}: {need[1]} is not installed or cannot run here (it needs a CUDA GPU); "
                         "use sdpa (with model.patch, novatune's own packed-row attention replaces it anyway), "
                         "or install the package")


def _build_low_memory(mcfg, config, device, dtype, base_dir, seed, qlora, on_unit):
    from novatune.train import load

    model = load.empty_model(config, dtype, mcfg.attention)
    if mcfg.arch:
        torch.manual_seed(seed)
        return load.build_random_(model, device, dtype, qlora, on_unit)
    if getattr(config, "quantization_config", None):
        raise SetupError(f"model.name: {mcfg.name} holds pre-quantised weights (its config has a "
                         f"quantization_config); the low-memory build reads dense checkpoints: "
                         f"{load.LOW_MEMORY_FIX}")
    if qlora:
        from novatune.train.qlora import require_bnb

        require_bnb()
    folder = load.resolve_folder(mcfg.name, resolve_path(mcfg.name, base_dir))
    model = load.load_pretrained_(model, folder, device, dtype, qlora, on_unit)
    model.config._name_or_path = str(folder)  # what PEFT records as the adapter's base model
    if (folder / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(folder))
    return model


def _build_with_transformers(mcfg, config, device, dtype, base_dir, seed, qlora):
    """transformers' own build (model.low_memory_load: false): the whole model in `dtype` on the device first."""
    from transformers import AutoModelForCausalLM

    attn = mcfg.attention
    if mcfg.arch:
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
        if qlora:
            from novatune.train.qlora import quantize_linears_

            quantize_linears_(model, dtype)  # layer by layer: the peak is the model in `dtype`, once
        return model
    path = resolve_path(mcfg.name, base_dir)
    where = str(path) if path.exists() else mcfg.name
    if qlora:
        from novatune.train.qlora import bnb_config

        # transformers quantises while loading; a 4-bit model cannot be .to()-moved afterwards, so it is placed
        # by device_map (one device: the whole model there)
        return AutoModelForCausalLM.from_pretrained(where, config=config, dtype=dtype, attn_implementation=attn,
                                                    quantization_config=bnb_config(dtype), device_map={"": device})
    return AutoModelForCausalLM.from_pretrained(where, config=config, dtype=dtype,
                                                attn_implementation=attn).to(device)


def expert_parameters(model) -> dict[str, tuple[int, ...]]:
    """`<module attribute>.<parameter>` -> shape for the 3-D weights of every routed-experts module (class name
    ending in Experts: Qwen3-MoE, Mixtral, GPT-OSS), e.g. "experts.gate_up_proj" (what PEFT's target_parameters
    matches as a suffix)."""
    found = {}
    for name, module in model.named_modules():
        if type(module).__name__.endswith("Experts"):
            leaf = name.rsplit(".", 1)[-1]
            for pname, p in module.named_parameters(recurse=False):
                if p.dim() == 3:
                    found[f"{leaf}.{pname}"] = tuple(p.shape)
    return found


def target_parameters(model, names: list[str]) -> list[str]:
    """method.target_parameters for PEFT: "experts" expanded to expert_parameters' names, the rest as written."""
    out = set()
    for n in names:
        if n == "experts":
            experts = expert_parameters(model)
            if not experts:
                raise SetupError(f"method.target_parameters: [experts] but {type(model).__name__} has no routed-"
                                 f"experts module with 3-D weights; drop it (dense model) or name parameters")
            out.update(experts)
        else:
            out.add(n)
    return sorted(out)


def add_lora(model, meth):
    from peft import LoraConfig, get_peft_model

    targets = meth.targets
    target_modules = "all-linear" if targets == ["all-linear"] else list(targets)
    params = target_parameters(model, meth.target_parameters)
    lcfg = LoraConfig(r=meth.r, lora_alpha=meth.alpha, lora_dropout=meth.dropout, target_modules=target_modules,
                      target_parameters=params or None, task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, lcfg)
    except ValueError as e:
        raise SetupError(f"method.targets / method.target_parameters: {e}; use all-linear or names like "
                         f"[q_proj, v_proj], and [experts] for the routed experts' weights") from None


def prepare(model, cfg, checkpointing: bool | None = None):
    """Gradient checkpointing and LoRA, in that order (PEFT wraps the checkpointed model). `checkpointing`: whether
    any decoder layer recomputes (default: memory.policy is not none); the memory plan's per-layer policies go on
    top (train/memory.py)."""
    if checkpointing is None:
        from novatune.train.config import memory_policy

        checkpointing = memory_policy(cfg.memory) != "none"
    if checkpointing:
        # non-reentrant: works with frozen inputs (LoRA) and passes kwargs (position_ids, cu_seqlens) through
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if cfg.method.type == "qlora":
            # The one step of PEFT's prepare_model_for_kbit_training kept (its fp32 casts are not: module
            # docstring): the frozen embedding's output requires grad, so each checkpointed layer has a
            # differentiable input, as with reentrant checkpointing it must. Non-reentrant checkpointing would
            # cope without it; it is kept so the trainer runs the graph of the stock PEFT + bitsandbytes recipe
            # that `novatune bench examples/qlora.yaml` compares against (cost: one (tokens, hidden) gradient per
            # micro-batch).
            model.enable_input_require_grads()
    if cfg.method.type in ("lora", "qlora"):
        model = add_lora(model, cfg.method)
    return model


def apply_patch(model, mcfg, select=None, tiled_mlp="auto"):
    """novatune.patch(model, **model.patch_options, tiled_mlp=memory.tiled_mlp) -> PatchReport, or None when
    model.patch is false.

    The tuned implementations (patch_options `tune` / `tune_tokens`, as `novatune.patch` takes them) come from
    `select(model, tune, tune_tokens) -> Selection`, which the layer above hands down (the tune engine sits above
    the trainer); without it the built-in defaults run and the report says so."""
    if not mcfg.patch:
        return None
    try:
        from novatune.patch.apply import patch as applier  # the applier the public novatune.patch wraps
    except ImportError as e:
        raise SetupError(f"model.patch: novatune's patch cannot be imported ({e}); reinstall novatune, or set "
                         f"model.patch=false to train stock HF") from None

    opts = dict(mcfg.patch_options or {})
    opts["tiled_mlp"] = tiled_mlp
    tune, tune_tokens = opts.pop("tune", "cache"), opts.pop("tune_tokens", 4096)
    try:
        inspect.signature(applier).bind(model, **opts)  # a typo in patch_options: say so, before any work
    except TypeError as e:
        raise SetupError(f"model.patch_options: {e}; see help(novatune.patch) for the options") from None
    report = applier(model, **opts)
    if tune and select is not None:
        select(model, tune, tune_tokens).apply(model, report)
    elif tune is True:
        raise SetupError("model.patch_options.tune=true: tuning runs through the novatune CLI (novatune train / "
                         "bench / tune), which hands the tune engine to the builder")
    elif tune:
        report.add("", "tune", "note", "tune cache not consulted (this run was built without the tune engine): "
                   "built-in defaults")
    return report


def param_numel(p) -> int:
    """Elements of the weight a parameter stands for: a bitsandbytes 4-bit Params4bit holds two per byte
    (its own numel is the packed bytes), its quant_state keeps the real shape."""
    qs = getattr(p, "quant_state", None)
    return qs.shape.numel() if qs is not None else p.numel()


def param_counts(model) -> tuple[int, int]:
    total = sum(param_numel(p) for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return total, trainable
