"""QLoRA plumbing for the trainer: bitsandbytes NF4 base weights, in-place quantisation, and the dense merge.

* `require_bnb()`: bitsandbytes imported, or a SetupError naming the fix (no silent fallback to bf16 weights).
* `bnb_config(dtype)`: the BitsAndBytesConfig `model.name` checkpoints load with (NF4, double quantisation,
  blocksize 64, compute dtype = the run's dtype): what PEFT/bnb QLoRA recipes use.
* `quantize_linears_(model, dtype)`: the same quantisation applied in place to a model already built (random-init
  `model.arch`: the benchmark has no downloadable weights): every nn.Linear but lm_head becomes a bnb Linear4bit,
  one layer at a time (the bf16 weight is freed as its NF4 copy appears, so the peak is the bf16 model, never
  two copies). lm_head stays in bf16 as transformers' bnb integration leaves it (llm_int8_skip_modules default).
  PEFT's prepare_model_for_kbit_training is NOT called: it casts embeddings, lm_head and norms to fp32, which
  halves QLoRA speed (docs/BENCHMARKS.md's QLoRA anchor: 2,504 vs 4,888 tok/s) for no accuracy the bf16 loss needs.
* `quantize_embeddings_(model, dtype)`: the frozen input embedding in NF4 as well (novatune.ops.nf4.NF4Embedding:
  the same layout, rows dequantised as they are gathered), unless it is tied to lm_head (which stays dense, so the
  shared table must too): Qwen3-8B's untied 152k x 4096 table is 1.16 GiB in bf16, 0.30 GiB in NF4, the step that
  brings the QLoRA workload under 7 GiB. Applied after quantize_linears_ (or the quantised load), before gradient
  checkpointing and enable_input_require_grads, whose hook goes on get_input_embeddings(): the NF4 module.
* `merged_model(peft_model, dtype)`: a plain transformers model with every LoRA delta merged into the
  *dequantised* base weight (fp32 sum, one cast to `dtype`), ready for save_pretrained / from_pretrained. PEFT's
  own merge_and_unload re-quantises the sum to NF4 (a second quantisation error, and a 4-bit checkpoint); here the
  export is dense.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from novatune.memory.host_embedding import lookup_refusal, tied_to_head
from novatune.train.errors import SetupError

BNB_FIX = "qlora needs bitsandbytes: pip install bitsandbytes"


def require_bnb():
    try:
        import bitsandbytes as bnb
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken native library
        raise SetupError(f"method.type: {BNB_FIX} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else e})"
                         ) from None
    return bnb


def bnb_config(dtype: torch.dtype):
    from transformers import BitsAndBytesConfig

    require_bnb()
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=dtype)


def quantize_linear(lin: nn.Linear, dtype: torch.dtype) -> nn.Module:
    """An NF4 bnb Linear4bit (double quantisation, blocksize 64) computing in `dtype`, on `lin`'s device, holding
    `lin`'s weight quantised (bitsandbytes quantises a Params4bit as it is moved to the device)."""
    bnb = require_bnb()
    device = lin.weight.device
    q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None, compute_dtype=dtype,
                          compress_statistics=True, quant_type="nf4", device="meta")
    q.weight = bnb.nn.Params4bit(lin.weight.data.to(dtype), requires_grad=False, compress_statistics=True,
                                 quant_type="nf4", blocksize=64, module=q).to(device)  # quantised here
    if lin.bias is not None:
        q.bias = nn.Parameter(lin.bias.data.to(dtype), requires_grad=False)
    q.compute_type_is_set = True  # compute dtype fixed above; bnb would otherwise guess it from the first input
    q.train(lin.training)
    return q


def quantize_linears_(model: nn.Module, dtype: torch.dtype, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Replace every nn.Linear under `model` (not named in `skip`) by quantize_linear's NF4 Linear4bit; returns
    the number replaced. Marks `model` `is_loaded_in_4bit` (what PEFT checks to wrap Linear4bit layers)."""
    require_bnb()
    targets = [(name, mod) for name, mod in model.named_modules()
               if type(mod) is nn.Linear and name.rsplit(".", 1)[-1] not in skip]
    for name, lin in targets:
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        setattr(parent, name.rsplit(".", 1)[-1], quantize_linear(lin, dtype))
        del lin
    model.is_loaded_in_4bit = True
    return len(targets)


def quantize_embeddings_(model: nn.Module, dtype: torch.dtype) -> str:
    """Replace the input embedding by an NF4Embedding computing in `dtype` (module docstring); returns a line
    saying what was done, or why nothing was (tied to lm_head, or not a plain nn.Embedding) for the run's log."""
    from novatune.ops.nf4 import NF4Embedding

    emb = model.get_input_embeddings()
    name = next((n for n, m in model.named_modules() if m is emb), "input embeddings")
    if isinstance(emb, NF4Embedding):
        return f"embeddings: {name} already NF4"
    why = lookup_refusal(model)
    if tied_to_head(model):
        return (f"embeddings: {name} kept in {str(emb.weight.dtype).replace('torch.', '')}: {why}, which stays "
                f"dense (quantising the shared table would change lm_head's weights too)")
    if why is not None:
        return f"embeddings: {name} kept dense: {why}, which NF4Embedding would drop"
    dense_mib = emb.weight.numel() * emb.weight.element_size() / 2**20
    q = NF4Embedding.from_embedding(emb, dtype)
    q.train(emb.training)
    model.set_input_embeddings(q)
    if model.get_input_embeddings() is not q:  # enable_input_require_grads hooks whatever this returns
        raise SetupError(f"embeddings: {type(model).__name__}.set_input_embeddings did not install the NF4 table; "
                         f"set method.quantize_embeddings: false")
    nf4_mib = sum(b.numel() * b.element_size() for b in q.buffers()) / 2**20
    return (f"embeddings: {name} {q.num_embeddings}x{q.embedding_dim} in NF4 ({nf4_mib:,.0f} MiB, was "
            f"{dense_mib:,.0f} MiB)")


def dense_weight(layer: nn.Module) -> torch.Tensor:
    """fp32 (out, in) weight of an nn.Linear or a bnb NF4 Linear4bit (dequantised: bnb's exact values)."""
    w = layer.weight
    if getattr(w, "quant_state", None) is not None:
        from novatune.ops.nf4 import from_bnb, nf4_dequantize

        return nf4_dequantize(from_bnb(w), torch.float32)
    return w.detach().float()


def _lora_delta(layer: nn.Module) -> torch.Tensor:
    """Sum over active adapters of scaling · B A (fp32), vanilla LoRA only."""
    delta = None
    for ad in layer.active_adapters:
        if ad not in layer.lora_A:
            continue
        if getattr(layer, "use_dora", {}).get(ad, False) or ad in getattr(layer, "lora_variant", {}):
            raise SetupError(f"export: adapter {ad!r} is a LoRA variant (DoRA/...); the dense merge here is "
                             f"vanilla LoRA only; set checkpoint.export_merged: false and merge with PEFT")
        a, b = layer.lora_A[ad].weight.float(), layer.lora_B[ad].weight.float()
        d = layer.scaling[ad] * (b @ a)
        if getattr(layer, "fan_in_fan_out", False):
            d = d.t()
        delta = d if delta is None else delta + d
    return delta


def merged_state_dict(peft_model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """State dict of the plain (unquantised, unwrapped) model: LoRA layers -> W + delta, NF4 layers and the NF4
    embedding dequantised."""
    from novatune.ops.nf4 import NF4Embedding

    base = peft_model.get_base_model() if hasattr(peft_model, "get_base_model") else peft_model
    out: dict[str, torch.Tensor] = {}
    done: list[str] = []  # module paths already emitted whole (their children are PEFT's / bnb's internals)
    for path, mod in base.named_modules():
        if any(path.startswith(p + ".") for p in done):
            continue
        pre = f"{path}." if path else ""
        if hasattr(mod, "lora_A") and hasattr(mod, "base_layer"):
            inner = mod.get_base_layer()
            w = dense_weight(inner)
            delta = _lora_delta(mod)
            out[pre + "weight"] = (w if delta is None else w + delta).to(dtype)
            if inner.bias is not None:
                out[pre + "bias"] = inner.bias.detach().to(dtype)
            done.append(path)
        elif isinstance(mod, NF4Embedding):
            # a normal dense embedding in the export (one fp32 -> dtype cast)
            out[pre + "weight"] = mod.dequantize(dtype)
            done.append(path)
        elif getattr(getattr(mod, "weight", None), "quant_state", None) is not None:
            out[pre + "weight"] = dense_weight(mod).to(dtype)
            if mod.bias is not None:
                out[pre + "bias"] = mod.bias.detach().to(dtype)
            done.append(path)
        else:
            for n, p in mod.named_parameters(recurse=False):
                out[pre + n] = p.detach().to(dtype) if p.is_floating_point() else p.detach()
            for n, b in mod.named_buffers(recurse=False):
                if n not in mod._non_persistent_buffers_set:
                    out[pre + n] = b.detach()
    return out


def merged_model(peft_model, dtype: torch.dtype):
    """A plain transformers model (config without quantization_config) holding merged_state_dict's weights."""
    from transformers import AutoModelForCausalLM

    base = peft_model.get_base_model() if hasattr(peft_model, "get_base_model") else peft_model
    cfg = copy.deepcopy(base.config)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config  # the export is dense: from_pretrained must not look for bitsandbytes
    state = merged_state_dict(peft_model, dtype)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    missing, unexpected = plain.load_state_dict(state, strict=False, assign=True)
    tied = set(getattr(plain, "_tied_weights_keys", None) or [])
    if unexpected or [k for k in missing if k not in tied]:
        raise SetupError(f"export: merged weights do not match {type(plain).__name__} (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")
    plain.tie_weights()
    # non-persistent buffers (rotary inv_freq) are not in any state dict: take the trained model's
    src = dict(base.named_buffers())
    for name, buf in list(plain.named_buffers()):
        if buf.is_meta:
            owner, _, leaf = name.rpartition(".")
            plain.get_submodule(owner)._buffers[leaf] = src[name].detach().clone()
    return plain.eval()
