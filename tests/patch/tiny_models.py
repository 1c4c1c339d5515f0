"""Tiny random-init models of each supported family (real HF classes, toy sizes) and packed batches for them."""
from __future__ import annotations

import torch
import transformers

from novatune.measure.numerics import assert_close, rel_err

COMMON = dict(vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, use_cache=False, tie_word_embeddings=True)
FAMILIES = {
    "qwen3": ("Qwen3Config", dict(COMMON, head_dim=16, rms_norm_eps=1e-6)),
    "qwen2": ("Qwen2Config", dict(COMMON, rms_norm_eps=1e-6)),
    "llama": ("LlamaConfig", dict(COMMON, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", dict(COMMON, rms_norm_eps=1e-5, sliding_window=None)),
}
# sparse MoE families: odd expert counts (5, 7) so some experts receive no token in a small batch; Qwen3-MoE with
# one dense layer (mlp_only_layers) between sparse ones
MOE_FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(COMMON, num_hidden_layers=3, head_dim=16, rms_norm_eps=1e-6, num_experts=5,
                                         num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                                         mlp_only_layers=[1], router_aux_loss_coef=0.01)),
    "mixtral": ("MixtralConfig", dict(COMMON, intermediate_size=48, rms_norm_eps=1e-5, num_local_experts=7,
                                      num_experts_per_tok=3, router_aux_loss_coef=0.02, tie_word_embeddings=False)),
}


def tiny_model(family: str, seed: int = 0, dtype=torch.float32, attn: str = "sdpa", **overrides):
    cls_name, kw = FAMILIES[family] if family in FAMILIES else MOE_FAMILIES[family]
    kw = {**kw, **overrides}
    cfg = getattr(transformers, cls_name)(**kw)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
    return model


def packed_batch(doc_lens_per_row, vocab=257, seed=0, device="cpu"):
    """input_ids, position_ids (restarting per document) and labels (-100 on each document's first token)."""
    g = torch.Generator().manual_seed(seed)
    ids, pos, lab = [], [], []
    for lens in doc_lens_per_row:
        r_ids, r_pos, r_lab = [], [], []
        for n in lens:
            doc = torch.randint(0, vocab, (n,), generator=g).tolist()
            r_ids += doc
            r_pos += list(range(n))
            r_lab += [-100] + doc[1:]
        ids.append(r_ids)
        pos.append(r_pos)
        lab.append(r_lab)
    t = lambda x: torch.tensor(x, device=device)  # noqa: E731
    return t(ids), t(pos), t(lab)


def tiny_gpt_oss(seed: int = 0, dtype=torch.float32, layers: int = 2, sliding_window: int = 5):
    """GPT-OSS at toy size: alternating sliding (window 5) and full layers, 3 experts (top 2), YaRN rotary tables
    (factor 4 over 64 original positions: their attention scaling is not 1), biases and sinks drawn away from
    their zero / tiny init, weights at std 0.1 (peaked attention), so that dropping any quirk shows."""
    cfg = transformers.GptOssConfig(
        vocab_size=257, hidden_size=64, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=3, num_experts_per_tok=2, sliding_window=sliding_window,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        max_position_embeddings=256, use_cache=False, tie_word_embeddings=False, initializer_range=0.1,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 64, "rope_theta": 150000.0})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(1.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
    return model.to(dtype)


def tiny_gemma(family: str = "gemma2", seed: int = 0, dtype=torch.float32, layers: int = 3, sliding_window: int = 5,
               **overrides):
    """Gemma (1, 2 or 3 text) at toy size, every quirk switched on and made to matter: sliding-window layers
    (window 5; Gemma 3's pattern cut to 2 sliding : 1 full), soft-caps small enough that most scores and logits are
    capped (attention 1.0, final 2.0, on Gemma 2 and also on Gemma 3, whose config allows them), a query scalar that
    is not head_dim, Gemma 3 rotary bases that differ per layer type (the full layers' with linear scaling), and
    norm weights drawn away from their zero init (a dropped weight or a dropped offset shows)."""
    common = dict(vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  use_cache=False, initializer_range=0.1, rms_norm_eps=1e-6)
    types = ["sliding_attention" if (i + 1) % 3 else "full_attention" for i in range(layers)]
    quirks = dict(sliding_window=sliding_window, layer_types=types, attn_logit_softcapping=1.0,
                  final_logit_softcapping=2.0, query_pre_attn_scalar=24)
    if family == "gemma":
        cfg = transformers.GemmaConfig(**{**common, **overrides})
    elif family == "gemma2":
        cfg = transformers.Gemma2Config(**{**common, **quirks, **overrides})
    else:
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0}}
        cfg = transformers.Gemma3TextConfig(**{**common, **quirks, "rope_parameters": rope, **overrides})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model.to(dtype)


def _perturb(model, seed: int, bias_std: float = 0.1, norm_std: float = 0.2) -> None:
    """Norm weights drawn around 1 and biases away from 0 (their init), so a dropped norm or bias shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(bias_std * torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.copy_(1.0 + norm_std * torch.randn(p.shape, generator=g))


def tiny_phi3(seed: int = 0, dtype=torch.float32, layers: int = 2, sliding_window: int | None = 5,
              partial_rotary_factor: float = 0.75, longrope_original: int | None = None, attn: str = "eager",
              **overrides):
    """Phi-3 / Phi-4-mini at toy size: fused qkv_proj and gate_up_proj, GQA (4 query / 2 key-value heads of 16),
    partial rotary (3/4: the first 12 features of each head rotate), a sliding window of 5 on every layer, weights
    at std 0.1 (peaked attention) and norms drawn around 1. longrope_original: LongRoPE tables with distinct short
    and long factors and that original_max_position_embeddings (the long factors apply past it)."""
    head_dim = 16
    rotary_half = int(head_dim * partial_rotary_factor) // 2
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial_rotary_factor}
    kw = dict(max_position_embeddings=256, original_max_position_embeddings=256)
    if longrope_original is not None:
        rope.update(rope_type="longrope", original_max_position_embeddings=longrope_original,
                    short_factor=[1.0 + 0.1 * i for i in range(rotary_half)],
                    long_factor=[2.0 + 3.0 * i for i in range(rotary_half)])
        kw = dict(max_position_embeddings=4 * longrope_original, original_max_position_embeddings=longrope_original)
    cfg = transformers.Phi3Config(
        vocab_size=257, hidden_size=4 * head_dim, intermediate_size=48, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=sliding_window, use_cache=False,
        tie_word_embeddings=False, initializer_range=0.1, rope_parameters=rope, pad_token_id=None, bos_token_id=1,
        eos_token_id=2, **kw, **overrides)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    _perturb(model, seed + 1)
    return model.to(dtype)


def tiny_olmo2(seed: int = 0, dtype=torch.float32, layers: int = 2, attn: str = "eager", **overrides):
    """OLMo 2 at toy size: post-norm layers, q/k norms over the whole projection (64 and 32 wide), GQA, weights at
    std 0.1 and every norm weight drawn around 1 (so a per-head q/k norm or a dropped post-norm shows)."""
    cfg = transformers.Olmo2Config(
        vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, use_cache=False, tie_word_embeddings=False,
        initializer_range=0.1, rms_norm_eps=1e-6, **overrides)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    _perturb(model, seed + 1)
    return model.to(dtype)


def train_eval_generate_warning_free(model, ids, pos, lab, new_tokens: int) -> torch.Tensor:
    """A training forward + backward, an eval forward and a greedy generation of `model`, with transformers'
    FutureWarning / DeprecationWarning turned into errors; returns the generated tokens."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        model.train()
        model(input_ids=ids, position_ids=pos, labels=lab).loss.backward()
        model.eval()
        with torch.no_grad():
            model(input_ids=ids[:1, :8])
            return model.generate(ids[:1, :5], max_new_tokens=new_tokens, do_sample=False)


def grads_of(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def stock_per_document(model, ids, pos, lab):
    """Loss and gradients of a packed batch computed by the model one document at a time: each document's summed
    loss over the packed batch's label count, so the sum equals the packed mean (the ground truth for packed rows:
    no attention across documents)."""
    model.zero_grad(set_to_none=True)
    n_items = int((lab[:, 1:] != -100).sum())
    total = torch.zeros((), device=ids.device)
    for r in range(ids.shape[0]):
        starts = [i for i in range(ids.shape[1]) if pos[r, i] == 0] + [ids.shape[1]]
        for a, b in zip(starts, starts[1:]):
            out = model(input_ids=ids[r:r + 1, a:b], labels=lab[r:r + 1, a:b], use_cache=False,
                        num_items_in_batch=torch.tensor(n_items))
            out.loss.backward()
            total += out.loss.detach()
    return total, grads_of(model)


def packed_loss_and_grads(model, ids, pos, lab):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, position_ids=pos, labels=lab)
    out.loss.backward()
    return out.loss.detach(), grads_of(model)


def assert_as_close_as_stock_bf16(loss, grads, loss_stock, grads_stock, loss_true, grads_true, names=None) -> int:
    """bf16 on CUDA against the fp32 truth, with stock bf16's own error as the yardstick: ours within 2x stock's
    error + 5e-3 for the loss and each gradient in `names` (default: all). Returns how many gradients were checked."""
    assert rel_err(loss, loss_true) <= 2 * rel_err(loss_stock, loss_true) + 5e-3
    checked = 0
    for name in (names if names is not None else grads_true):
        ours, stock = rel_err(grads[name], grads_true[name]), rel_err(grads_stock[name], grads_true[name])
        assert ours <= 2 * stock + 5e-3, f"{name}: {ours:.3g} vs stock bf16 {stock:.3g}"
        checked += 1
    return checked


def assert_checkpointing_keeps_gradients(model, ids, pos, lab) -> None:
    """The patched model's gradients with HF gradient checkpointing on equal those without it (1e-6)."""
    _, grads = packed_loss_and_grads(model, ids, pos, lab)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _, grads_ckpt = packed_loss_and_grads(model, ids, pos, lab)
    for name in grads:
        assert_close(grads_ckpt[name], grads[name], 1e-6, name)


# The four named family architectures of novatune/train/arch.py cut to toy size (`model.arch_overrides`), every
# other attribute as the real config has it (soft-caps, rotary tables, Phi-4-mini's LongRoPE with its 262k window,
# token ids moved into the toy vocabulary); sliding windows of 5 so documents exceed them, weights at std 0.1
TINY_ARCH = {
    "gemma-2-2b": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=257, sliding_window=5, initializer_range=0.1),
    "gemma-3-4b": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=257, sliding_window=5, initializer_range=0.1,
                       layer_types=["sliding_attention", "full_attention"]),
    "phi-4-mini": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=257, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                       initializer_range=0.1,
                       rope_scaling=dict(rope_type="longrope", partial_rotary_factor=0.75,
                                         original_max_position_embeddings=4096, short_factor=[1.0] * 6,
                                         long_factor=[1.0 + i for i in range(6)])),
    "olmo-2-7b": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=257, pad_token_id=0, eos_token_id=1, initializer_range=0.1),
}


def tiny_arch(arch: str, attn: str = "hf_default", seed: int = 0, dtype=torch.float32):
    """A named architecture (TINY_ARCH's cut) built as the trainer builds it, with the stock stack's attention
    (hf_default: sdpa, or eager where sdpa cannot compute the family's attention)."""
    from novatune.train.arch import arch_config
    from novatune.train.model import resolve_attention

    cfg = arch_config(arch, TINY_ARCH[arch])
    cfg._attn_implementation = resolve_attention(cfg, attn)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
