"""The stacks `novatune bench` measures: a table of name -> how the run is built.

Every stack is the configured run built by novatune.train.session.build (same seed: same init and same data), with
its own config overrides and build hooks; only the kernels differ. A stack whose training is not novatune's step
at all (for example TRL's SFTTrainer on the same model and data) gives `run` instead: a function taking the worker's
spec, the resolved config and its base folder, returning the row fields (tok_s, timed_s, timed_tokens,
tokens_per_step, step_s, losses, grad_norms, peak_gib, gflop_per_tok, ...; schema in runner.py). Register it here
with the function named by its module, imported only in that stack's worker:
    register(Stack("trl-sft", "TRL SFTTrainer", STOCK, run=run_from("novatune.bench.trl_stack:run")))
(or call register() from a module listed in PLUGINS).

  stock           HF as shipped: attn_implementation=sdpa (eager where sdpa cannot compute the family's attention:
                  GPT-OSS's sinks, Gemma 2's soft-capped logits; the row's hf_attention says which), no
                  patch (QLoRA: PEFT + bitsandbytes, bf16 embeddings; LoRA on experts: PEFT's target_parameters)
  liger-peer      the best peer: Liger-Kernel's fused ops + torch varlen attention (bench/peer.py); a family whose
                  attention varlen_attn cannot compute (soft-capping, sinks) keeps HF's own attention, as stock runs
                  it, and the row's `applied` says so
  hf-varlen       Hugging Face's best without other libraries: torch varlen attention (bench/peer.py; absent, with
                  the reason, where varlen_attn cannot compute the family's attention) and, on MoE
                  models, transformers' grouped_mm experts (the MoE table's best HF row; `stock` runs grouped_mm
                  experts too, with sdpa)
  hf-flex         Hugging Face's best where varlen cannot compute the family's attention (GPT-OSS's sinks, Gemma 2's
                  soft-cap): transformers' flex_attention with per-document block masks built from position_ids
                  (bench/peer.py) and, on MoE models, grouped_mm experts; CUDA only (sinks through flex need CUDA)
  unsloth         Unsloth: its row says why it did not run (not installed; or installed but not yet built by the
                  run builder: Unsloth loads its own model through FastLanguageModel.from_pretrained from a saved
                  folder, with its own checkpointing and packed-attention setup, and a row from plain HF classes
                  after `import unsloth` would be stock's speed under Unsloth's name)
  novatune        novatune.patch(model, **model.patch_options)
  novatune_full   novatune with full fine-tuning, beside a LoRA config (refused under QLoRA)
  novatune_eager  novatune without CUDA graphs (model.patch_options.cuda_graphs=false)
  novatune_flash / novatune_fa4 / novatune_cudnn
                  novatune with every attention module on that backend (model.patch_options.attention), the A/B
                  of the attention backends in a training step
  trl-sft         TRL's SFTTrainer + novatune.patch(trainer) on the same model, rows and optimizer (bench/trl_stack.py)
  novatune-train  `novatune train`'s whole loop (bench/train_stack.py): what the CLI runs, per-step loss read and
                  metrics included; the yardstick of stacks that bring their own loop (trl-sft)
  novatune_fsdp2  novatune under FSDP2 (parallel.strategy=fsdp2): decoder layers and the root fully_shard-ed (over
                  one process the root alone: a one-member group, what FSDP2 costs beside `novatune`), or `--nproc N`
                  processes through torchrun
  novatune_ddp    novatune under DistributedDataParallel (parallel.strategy=ddp): a whole replica per process, the
                  gradients all-reduced once per optimizer step; one process, or `--nproc N` through torchrun
A stack with a `strategy` runs under torchrun with `novatune bench --nproc N` processes; every other stack then
trains the same global batch in one process (grad_accum x N), so its row is the one-process reference for the
parallel rows' scaling and per-step losses (bench/runner.py).
A stack that cannot run here gives a row with status "absent" and the reason; it is never dropped silently.
"""
from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field

# hf_default: sdpa, or eager where sdpa cannot compute the family's attention (GPT-OSS, Gemma 2)
# stock and the peers train with torch's AdamW whatever the config chose (novatune's kernel is novatune's), with
# every weight on the GPU (memory.embeddings_on_host is novatune's) and every gradient autograd's own
# (memory.embedding_grad rows is novatune's)
HOST_TABLE_OFF = "memory.embeddings_on_host=false"  # also where a stack trains the table or wraps every parameter
STOCK = ["model.patch=false", "model.attention=hf_default", "method.quantize_embeddings=false",
         "train.adamw_kernel=torch", HOST_TABLE_OFF, "memory.embedding_grad=dense"]
NOVATUNE = ["model.patch=true"]

# modules that register more stacks when imported (a stack defined outside this file)
PLUGINS: list[str] = []

# the anchor figures' stack names, accepted on the command line
ALIASES = {"hf_sdpa": "stock", "varlen_liger": "liger-peer"}


@dataclass
class Hooks:
    """What a stack adds to the build: see novatune.train.session.build."""
    before_model: Callable | None = None
    model_hook: Callable | None = None
    applied: str | None = None  # a short record of what was applied (e.g. Liger's function name), for the row


@dataclass
class Stack:
    name: str
    description: str
    overrides: list[str] = field(default_factory=list)
    hooks: Callable | None = None  # hooks(cfg, base_dir) -> Hooks
    unavailable: Callable | None = None  # unavailable(cfg) -> reason it cannot run here, or None
    run: Callable | None = None  # run(spec, cfg, base_dir) -> row fields: a stack with its own trainer
    patched: bool = False  # the stack runs novatune.patch (its row records the attention backend, CUDA graphs)
    strategy: str | None = None  # ddp | fsdp2: run with `--nproc` processes under torchrun


def _missing(module: str, pip: str) -> Callable:
    def why(cfg) -> str | None:
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (pip install {pip}): this stack did not run"
        return None
    return why


def _liger_hooks(cfg, base_dir) -> Hooks:
    from novatune.bench.peer import apply_liger, use_peer_attention

    hooks = Hooks()

    def before(model_config) -> None:
        hooks.applied = apply_liger(model_config.model_type)  # class-level: before the model exists

    def model_hook(model) -> None:
        hooks.applied = f"{hooks.applied}, {use_peer_attention(model)}"

    hooks.before_model, hooks.model_hook = before, model_hook
    return hooks


def _grouped_mm_experts(model) -> str | None:
    """MoE models: transformers' grouped_mm experts, set explicitly (it raises when this machine cannot run them,
    instead of HF's silent fall back to its per-expert loop); None for dense models. An experts module holds its
    gate_up_proj as one (experts, ., .) parameter; a dense MLP's fused gate_up_proj (Phi-3) is a Linear."""
    import torch

    if not any(isinstance(getattr(m, "gate_up_proj", None), torch.nn.Parameter) for m in model.modules()):
        return None
    setter = getattr(model, "set_experts_implementation", None)
    if setter is not None:
        setter("grouped_mm")
    else:  # older transformers 5 releases: the config attribute every experts module reads
        model.config._experts_implementation = "grouped_mm"
    return "experts=grouped_mm"


def _stock_hooks(cfg, base_dir) -> Hooks:
    hooks = Hooks()

    def model_hook(model) -> None:
        hooks.applied = _grouped_mm_experts(model)

    hooks.model_hook = model_hook
    return hooks


def _hf_attention_hooks(switch: str) -> Callable:
    """Hooks of an HF stack: the attention switch named in novatune.bench.peer (imported in the worker only), then
    grouped_mm experts on MoE models."""
    def hooks_for(cfg, base_dir) -> Hooks:
        from novatune.bench import peer

        hooks = Hooks()

        def model_hook(model) -> None:
            hooks.applied = ", ".join(filter(None, [getattr(peer, switch)(model), _grouped_mm_experts(model)]))

        hooks.model_hook = model_hook
        return hooks
    return hooks_for


def _flex_unavailable(cfg) -> str | None:
    import torch

    if cfg.model.device == "cpu" or not torch.cuda.is_available():
        return ("the flex stack runs on CUDA only (transformers adds attention sinks through flex's log-sum-exp, "
                "which it does not return on the CPU): this stack did not run")
    return None


def _hf_config(cfg):
    """The run's transformers config without building anything (None when it cannot be read here)."""
    from novatune.train.errors import SetupError
    from novatune.train.model import model_config

    try:
        return model_config(cfg.model)
    except (SetupError, ValueError):  # an unreadable model is the build's error to report, with its own message
        return None


def _varlen_unavailable(cfg) -> str | None:
    import torch

    from novatune.bench.peer import varlen_refusal

    config = _hf_config(cfg)
    why = varlen_refusal(config) if config is not None else None
    if why is not None:
        return f"{why}: HF + varlen would train another function, so this stack did not run"
    if cfg.model.device == "cpu" or not torch.cuda.is_available():
        return "torch's varlen attention runs on CUDA only: this stack did not run"
    return None


def _unsloth_unavailable(cfg) -> str | None:
    missing = _missing("unsloth", "unsloth")(cfg)
    if missing is not None:
        return missing
    return ("unsloth is installed, but the run builder does not build Unsloth's model yet (FastLanguageModel."
            "from_pretrained on a saved folder, its own checkpointing and packed attention): this stack did not run")


def _full_refused_under_qlora(cfg) -> str | None:
    if cfg.method.type == "qlora":
        return "novatune_full trains every weight in full precision: it has no meaning under method.type qlora"
    return None


def _parallel_refused_under_qlora(strategy: str) -> Callable:
    def why(cfg) -> str | None:
        if cfg.method.type == "qlora":
            return (f"novatune_{strategy}: parallel.strategy {strategy} refuses qlora (bitsandbytes' NF4 base weights "
                    f"can be neither sharded nor broadcast)")
        return None
    return why


def run_from(target: str) -> Callable:
    """`module:function` -> a run function importing its module when called (the worker process only)."""
    module, _, name = target.partition(":")

    def run(spec: dict, cfg, base_dir) -> dict:
        return getattr(importlib.import_module(module), name)(spec, cfg, base_dir)
    return run


STACKS: dict[str, Stack] = {}


def register(stack: Stack) -> Stack:
    STACKS[stack.name] = stack
    return stack


register(Stack("stock", "HF stock, attn_implementation=sdpa (MoE: grouped_mm experts)", STOCK, _stock_hooks))
register(Stack("hf-varlen", "HF + torch varlen attention (MoE: grouped_mm experts)", STOCK,
               _hf_attention_hooks("use_peer_attention"), _varlen_unavailable))
register(Stack("hf-flex", "HF + flex_attention with per-document masks (MoE: grouped_mm experts)", STOCK,
               _hf_attention_hooks("use_flex_attention"), _flex_unavailable))
register(Stack("liger-peer", "Liger kernels + torch varlen attention (the best peer)", STOCK, _liger_hooks,
               _missing("liger_kernel", "liger-kernel")))
register(Stack("unsloth", "Unsloth (FastLanguageModel)", STOCK, unavailable=_unsloth_unavailable))
register(Stack("novatune", "novatune.patch(model, **model.patch_options)", NOVATUNE, patched=True))
register(Stack("novatune_full", "novatune, full fine-tuning (beside a LoRA config)",
               NOVATUNE + ["method.type=full", HOST_TABLE_OFF], unavailable=_full_refused_under_qlora,
               patched=True))
register(Stack("trl-sft", "TRL SFTTrainer + novatune.patch(trainer) on the same model, rows and optimizer",
               NOVATUNE, unavailable=_missing("trl", "trl"), run=run_from("novatune.bench.trl_stack:run"),
               patched=True))
register(Stack("novatune-train", "novatune train: the trainer's own loop (logging, non-finite checks) timed",
               NOVATUNE, run=run_from("novatune.bench.train_stack:run"), patched=True))
register(Stack("novatune_eager", "novatune without CUDA graphs", NOVATUNE + ["model.patch_options.cuda_graphs=false"],
               patched=True))
# novatune's AdamW kernel is the default (train.adamw_kernel auto); this stack is the A/B against torch's
register(Stack("novatune_torch_adamw", "novatune with torch's fused AdamW (train.adamw_kernel torch)",
               NOVATUNE + ["train.adamw_kernel=torch"], patched=True))
# the A/B of the MoE experts' weight gradients added into .grad inside the grouped GEMM (the default): returned
register(Stack("novatune_wgrad_returned", "novatune, MoE expert weight gradients returned to autograd "
               "(model.patch_options.moe_wgrad_in_place=false)",
               NOVATUNE + ["model.patch_options.moe_wgrad_in_place=false"], patched=True))
# the same A/B for the dense projections' weight gradients (novatune.ops.linear; returned by default): in place
register(Stack("novatune_linear_wgrad_in_place", "novatune, dense projection weight gradients added into .grad "
               "inside the GEMM (model.patch_options.linear_wgrad_in_place=true)",
               NOVATUNE + ["model.patch_options.linear_wgrad_in_place=true"], patched=True))
register(Stack("novatune_linear_wgrad_returned", "novatune, dense projection weight gradients returned to autograd "
               "(model.patch_options.linear_wgrad_in_place=false)",
               NOVATUNE + ["model.patch_options.linear_wgrad_in_place=false"], patched=True))
# the attention backends' A/B: each attention module on the named backend instead of the automatic choice
for _backend, _what in (("flash", "FlashAttention-2 through aten's ops"), ("fa4", "FlashAttention-4 (flash-attn-4)"),
                        ("cudnn", "cuDNN's fused attention")):
    register(Stack(f"novatune_{_backend}", f"novatune, attention on {_what} (model.patch_options.attention="
                   f"{_backend})", NOVATUNE + [f"model.patch_options.attention={_backend}"], patched=True))
# the memory policies side by side (novatune/memory/): checkpointing alone is the `novatune` stack under a config
# with gradient checkpointing; these override memory.policy on top of the config
for _policy, _what in (("offload", "checkpointing with each layer's input offloaded to host memory"),
                       ("selective", "selective recompute (GEMM outputs kept, elementwise recomputed)"),
                       ("recompute_mlp", "each layer's MLP recomputed, its attention kept"),
                       ("keep", "no recompute (every activation kept)"),
                       ("auto", "the memory planner's choice under the card's free memory")):
    register(Stack(f"novatune_{_policy}", f"novatune, memory.policy {_policy}: {_what}",
                   NOVATUNE + ["memory.gradient_checkpointing=false",
                               f"memory.policy={'none' if _policy == 'keep' else _policy}"], patched=True))
for _strategy, _what in (("fsdp2", "FSDP2 (fully_shard per unit of decoder layers and the root; the root alone "
                                   "over one process)"),
                         ("ddp", "DistributedDataParallel (a replica per process)")):
    register(Stack(f"novatune_{_strategy}", f"novatune under {_what}",
                   NOVATUNE + [f"parallel.strategy={_strategy}", HOST_TABLE_OFF, "memory.embedding_grad=auto"],
                   unavailable=_parallel_refused_under_qlora(_strategy), patched=True, strategy=_strategy))


def load_plugins() -> None:
    for name in PLUGINS:
        importlib.import_module(name)


def parse_stacks(text: str) -> list[str]:
    load_plugins()
    names = [ALIASES.get(s.strip(), s.strip()) for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in STACKS]
    if bad or not names:
        raise ValueError(f"unknown stack(s) {bad or text!r}; choose from {', '.join(STACKS)}")
    return names
