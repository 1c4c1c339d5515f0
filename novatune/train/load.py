"""Low-memory model building: never the whole model in a wider form than the one it trains in.

The model is constructed on the meta device (shapes only, no memory), then brought to its final form one *unit* at
a time: a unit is one decoder layer, or one module outside the decoder stack (embeddings, final norm, rotary
embedding, lm_head). Each unit is allocated on the target device in its final dtype and

* `model.arch` (random init): initialised by the model's own `_init_weights`, module by module, as transformers
  does after its own meta-device load, so a random-init run draws from the same distributions as
  `from_config` (not the same values: the draws happen in another order);
* `model.name` (a folder of safetensors): filled from the checkpoint, tensor by tensor, read with safetensors'
  `safe_open` (memory-mapped on the host: one tensor at a time is read, cast and copied to the device; a MoE
  checkpoint's per-expert tensors are read and fused one layer's experts at a time, as transformers fuses them).

QLoRA: right after a unit is in place its linears (all but lm_head) become NF4 (novatune.train.qlora
.quantize_linear), before the next unit is allocated; fused MoE experts are parameters, not linears, and stay in
the compute dtype, as in transformers' bitsandbytes load. The device therefore holds the finished units plus one unit
in the compute dtype: for Qwen3-8B (computed from its shapes) 3.3 GiB of NF4 layers, the bf16 embedding and lm_head
(2 x 1.16 GiB) and one 0.36 GiB bf16 layer, where building the bf16 model first needs 15.3 GiB.

Tied parameters (lm_head sharing the embedding table) are allocated once and shared again. Non-persistent buffers
(rotary inv_freq) are not in any checkpoint: `_init_weights` computes them, as transformers does. Anything still
on the meta device afterwards is an error, never a silent placeholder.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from torch import nn

from novatune.train.errors import SetupError

OnUnit = Callable[[nn.Module, str], None]  # (the model, a unit's path) once that unit is in its final form
LOW_MEMORY_FIX = "set model.low_memory_load: false to load it with transformers' from_pretrained"


def empty_model(config, dtype: torch.dtype, attn: str):
    """The CausalLM of `config` on the meta device (no memory, no init), parameters in `dtype`."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The decoder stack: the ModuleList holding the most parameters (`model.layers` in every Llama layout)."""
    best, size = None, 0
    for m in model.modules():
        if isinstance(m, nn.ModuleList):
            n = sum(p.numel() for p in m.parameters())
            if n > size:
                best, size = m, n
    return best


def units(model: nn.Module) -> Iterator[tuple[str, nn.Module, bool]]:
    """(path, module, whole) in module order: each decoder layer whole, every other module holding parameters or
    buffers of its own on its own (whole=False: its children are units of their own)."""
    layers = decoder_layers(model)
    heads = {id(layer) for layer in (layers or [])}
    inside = {id(m) for layer in (layers or []) for m in layer.modules()}
    for path, m in model.named_modules():
        if id(m) in heads:
            yield path, m, True
        elif id(m) not in inside and (m._parameters or m._buffers):
            yield path, m, False


def _unit_modules(module: nn.Module, whole: bool) -> list[nn.Module]:
    return list(module.modules()) if whole else [module]


def materialize_(modules: list[nn.Module], device: torch.device, shared: dict) -> None:
    """Allocate the meta parameters and buffers of `modules` (uninitialised) on `device`, each in its dtype.
    `shared` maps id(meta tensor) -> (meta tensor, its replacement): a tensor met twice (tied weights) is
    allocated once, and the second owner is marked initialised so the init skips it."""
    for m in modules:
        for store, make in ((m._parameters, _new_param), (m._buffers, _new_buffer)):
            for name, t in store.items():
                if t is None or not t.is_meta:
                    continue
                if id(t) in shared:
                    store[name] = shared[id(t)][1]
                    store[name]._is_hf_initialized = True
                    continue
                store[name] = make(t, device)
                shared[id(t)] = (t, store[name])


def _new_param(p: nn.Parameter, device) -> nn.Parameter:
    return nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)


def _new_buffer(b: torch.Tensor, device) -> torch.Tensor:
    return torch.empty_like(b, device=device)


def init_(model: nn.Module, modules: list[nn.Module]) -> None:
    """transformers' random init of `modules` (children before parents, as its initialize_weights), through the
    `_init_weights` of the innermost PreTrainedModel holding each one (a family may override it)."""
    from transformers import PreTrainedModel
    from transformers import initialization as hf_init

    owners = {}
    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            for sub in m.modules():
                owners[id(sub)] = m  # inner models come later in module order: the innermost wins
    with torch.no_grad(), hf_init.guard_torch_init_functions():
        for m in reversed(modules):
            owners.get(id(m), model)._init_weights(m)


def _quantize_unit_(module: nn.Module, path: str, whole: bool, dtype: torch.dtype, model: nn.Module) -> None:
    """QLoRA: the unit's linears (lm_head excepted, as transformers' bitsandbytes integration leaves it) to NF4."""
    from novatune.train.qlora import quantize_linear, quantize_linears_

    if whole:
        quantize_linears_(module, dtype)
    elif type(module) is nn.Linear and path.rsplit(".", 1)[-1] != "lm_head":
        parent = model.get_submodule(path.rsplit(".", 1)[0]) if "." in path else model
        setattr(parent, path.rsplit(".", 1)[-1], quantize_linear(module, dtype))


def _forget_replaced(shared: dict, model: nn.Module) -> None:
    """Drop the `shared` entries whose tensor left the model (a linear quantised to NF4): the map is for tied
    tensors only, and an entry would keep that dense weight alive until the build ends (Qwen3-8B: 0.36 GiB per
    layer, 13 GiB over the build)."""
    live = {id(t) for t in [*model.parameters(), *model.buffers()]}
    for key in [k for k, (_, new) in shared.items() if id(new) not in live]:
        del shared[key]


def _unit_done(model: nn.Module, path: str, module: nn.Module, whole: bool, dtype: torch.dtype, shared: dict,
               qlora: bool, on_unit: OnUnit | None) -> None:
    """A unit is in place: QLoRA quantises its linears (and forgets their dense weights) before the next unit is
    allocated; then the caller's hook sees it."""
    if qlora:
        _quantize_unit_(module, path, whole, dtype, model)
        _forget_replaced(shared, model)
    if on_unit is not None:
        on_unit(model, path)


def _finish(model: nn.Module, shared: dict, qlora: bool) -> None:
    for _, t in shared.values():
        t.__dict__.pop("_is_hf_initialized", None)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise SetupError(f"model: {len(left)} tensors were never placed ({', '.join(left[:3])}); {LOW_MEMORY_FIX}")
    if qlora:
        model.is_loaded_in_4bit = True  # what PEFT checks to wrap the Linear4bit layers


def build_random_(model: nn.Module, device: torch.device, dtype: torch.dtype, qlora: bool = False,
                  on_unit: OnUnit | None = None) -> nn.Module:
    """Materialise a meta model unit by unit with transformers' random init (module docstring); the caller seeds
    the RNG. Returns the model."""
    shared: dict = {}
    for path, module, whole in list(units(model)):  # listed first: quantising replaces modules
        mods = _unit_modules(module, whole)
        materialize_(mods, device, shared)
        init_(model, mods)
        del mods  # it lists the unit's dense linears: each is freed once quantised
        _unit_done(model, path, module, whole, dtype, shared, qlora, on_unit)
    _finish(model, shared, qlora)
    return model


# --------------------------------------------------------------------------------------------- from a folder
def checkpoint_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of a transformers checkpoint folder (sharded with an index, or one file)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: folder / f for k, f in weight_map.items()}
    single = folder / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {k: single for k in f.keys()}
    raise SetupError(f"model.name: {folder} holds no safetensors weights (model.safetensors or an index); "
                     f"convert the checkpoint to safetensors, or {LOW_MEMORY_FIX}")


def resolve_folder(name: str, path: Path) -> Path:
    """The local folder of model.name: the path itself, or the Hugging Face cache's snapshot of an id."""
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception as e:  # noqa: BLE001 - any hub error means: not in the local cache
        raise SetupError(f"model.name: {name!r} is neither a local folder nor in the Hugging Face cache "
                         f"({type(e).__name__}); download it first, or give a local folder") from None


def _unit_keys(module: nn.Module, path: str, whole: bool) -> list[tuple[str, nn.Module, str, bool]]:
    """(checkpoint key, owning module, local name, is a parameter) of the unit's persistent tensors."""
    pre = f"{path}." if path else ""
    out = []
    for sub_path, m in (module.named_modules() if whole else [("", module)]):
        sp = f"{pre}{sub_path}." if sub_path else pre
        out += [(sp + n, m, n, True) for n, p in m._parameters.items() if p is not None]
        out += [(sp + n, m, n, False) for n, b in m._buffers.items()
                if b is not None and n not in m._non_persistent_buffers_set]
    return out


# MoE checkpoints on the Hub (and what transformers' save_pretrained writes) keep one tensor per expert; the model
# holds them fused: experts.gate_up_proj (E, 2I, H) = [gate | up] along dim 1, experts.down_proj (E, H, I), as
# transformers' own checkpoint conversion builds them. Mixtral's name the block `block_sparse_moe` and the
# projections w1 (gate), w3 (up), w2 (down), its router `block_sparse_moe.gate`.
_EXPERT_LAYOUTS = (("mlp", ("gate_proj", "up_proj", "down_proj")), ("block_sparse_moe", ("w1", "w3", "w2")))


def per_expert_tensor(key: str, files: dict, read, n_experts: int) -> tuple[torch.Tensor, list[str]] | None:
    """The fused expert tensor (or Mixtral's renamed router) `key` built from the checkpoint's per-expert tensors,
    with the names it read; None where the checkpoint has no such layout either."""
    if key.endswith(".mlp.gate.weight"):
        alt = key[: -len(".mlp.gate.weight")] + ".block_sparse_moe.gate.weight"
        return (read(alt), [alt]) if alt in files else None
    for block, (gate, up, down) in _EXPERT_LAYOUTS:
        for suffix, parts in ((".mlp.experts.gate_up_proj", (gate, up)), (".mlp.experts.down_proj", (down,))):
            if not key.endswith(suffix) or n_experts < 1:
                continue
            stem = f"{key[: -len(suffix)]}.{block}.experts."
            groups = [[f"{stem}{e}.{part}.weight" for e in range(n_experts)] for part in parts]
            if all(name in files for group in groups for name in group):
                tensors = [[read(name) for name in group] for group in groups]
                shapes = {tuple(x.shape) for group in tensors for x in group}
                if len(shapes) != 1:  # every expert's projection has one shape (gate and up alike)
                    raise SetupError(f"model.name: the per-expert tensors of {key} differ in shape ({sorted(shapes)}); "
                                     "the checkpoint does not match its config")
                # the layer's experts are on the host twice for a moment (read, then fused): one layer at a time
                fused = torch.cat([torch.stack(group) for group in tensors], dim=1)
                return fused, [name for group in groups for name in group]
    return None


def load_pretrained_(model: nn.Module, folder: Path, device: torch.device, dtype: torch.dtype, qlora: bool = False,
                     on_unit: OnUnit | None = None) -> nn.Module:
    """Fill a meta model from the safetensors checkpoint in `folder`, unit by unit (module docstring).
    A parameter the checkpoint lacks (other than a tied one) or a tensor of another shape is an error."""
    from safetensors import safe_open

    files = checkpoint_files(folder)
    # names whose tensor is another's (lm_head of a tied model): a checkpoint may hold them or not
    tied = set(getattr(model, "all_tied_weights_keys", None) or ())
    shared: dict = {}
    used: set[str] = set()
    with ExitStack() as stack:
        handles: dict[Path, object] = {}

        def read(key: str) -> torch.Tensor:
            f = files[key]
            if f not in handles:
                handles[f] = stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            return handles[f].get_tensor(key)

        for path, module, whole in list(units(model)):  # listed first: quantising replaces modules
            mods = _unit_modules(module, whole)
            materialize_(mods, device, shared)
            for key, owner, name, _ in _unit_keys(module, path, whole):
                target = owner._parameters.get(name) if name in owner._parameters else owner._buffers[name]
                if getattr(target, "_is_hf_initialized", False):
                    continue  # the second owner of a tied tensor: filled with the first
                if key in files:
                    value, sources = read(key), (key,)
                elif (found := per_expert_tensor(key, files, read, target.shape[0] if target.dim() else 0)):
                    value, sources = found
                else:
                    raise SetupError(f"model.name: the checkpoint in {folder} has no tensor {key!r} (its names "
                                     f"follow another layout); {LOW_MEMORY_FIX}")
                if tuple(value.shape) != tuple(target.shape):
                    raise SetupError(f"model.name: {key} is {tuple(value.shape)} in the checkpoint but "
                                     f"{tuple(target.shape)} in the model (config.json does not match the "
                                     f"weights); fix the folder's config or model.arch_overrides")
                with torch.no_grad():
                    target.copy_(value)  # cast to the model's dtype for this tensor on the way
                target._is_hf_initialized = True
                used.update(sources)
            # what no checkpoint holds (rotary inv_freq): computed by the model's init, as transformers does
            init_(model, mods)
            del mods  # it lists the unit's dense linears: each is freed once quantised
            _unit_done(model, path, module, whole, dtype, shared, qlora, on_unit)
    for m in model.modules():
        for t in [*m._parameters.values(), *m._buffers.values()]:
            if t is not None:
                t.__dict__.pop("_is_hf_initialized", None)
    unused = sorted(k for k in set(files) - used - tied if not k.endswith("rotary_emb.inv_freq"))
    if unused:
        raise SetupError(f"model.name: the checkpoint in {folder} has {len(unused)} tensors the model does not "
                         f"use ({', '.join(unused[:3])}); check config.json, or {LOW_MEMORY_FIX}")
    _finish(model, shared, qlora)
    return model
