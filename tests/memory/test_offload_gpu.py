"""Activation offload on a GPU: the checkpointed layer inputs leave the device, the copies overlap the compute
(events only), and the gradients are those of plain checkpointing. Also through the run builder, with
novatune.patch and LoRA (its CUDA graphs step aside for offloaded layers, saying why).

Gradients are compared bit for bit: offload moves the same saved tensors, and the compute stream runs the same
kernels on the same values in the same order (eager attention and deterministic algorithms, so no kernel with
atomics can reorder a sum between the two runs)."""
from __future__ import annotations

import pytest
import torch

from novatune.memory.offload import OffloadEngine
from novatune.memory.policy import install, uninstall

pytestmark = pytest.mark.gpu

ARCH = dict(vocab_size=1024, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=2, head_dim=128, use_cache=False, max_position_embeddings=8192)
TOKENS = 4096


def _model():
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    cfg = Qwen3Config(**ARCH)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="eager").cuda()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ARCH["vocab_size"], (1, TOKENS), generator=g).cuda()
    return ids, torch.arange(TOKENS, device="cuda")[None]


def _step(model, seed):
    """Forward; the memory held between forward and backward; backward. Returns (held bytes, loss, grads)."""
    ids, pos = _batch(seed)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    out.loss.backward()
    return held, out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_offload_moves_the_checkpoint_memory_to_the_host_and_keeps_the_gradients():
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        model = _model()
        layers = list(model.model.layers)
        _step(model, 0)  # warm-up: cuBLAS handles and workspaces exist before anything is measured
        model.zero_grad(set_to_none=True)
        held_ckpt, loss_ckpt, grads_ckpt = _step(model, 1)
        model.zero_grad(set_to_none=True)
        engine = OffloadEngine("cuda")
        install(layers, ["offload"] * len(layers), engine)
        _step(model, 0)  # the pinned host buffers and the two device slots are allocated here
        model.zero_grad(set_to_none=True)
        held_off, loss_off, grads_off = _step(model, 1)
        uninstall(layers)
    finally:
        torch.use_deterministic_algorithms(False)
    per_layer = TOKENS * ARCH["hidden_size"] * 2  # one bf16 layer input
    n = ARCH["num_hidden_layers"]
    # the layer inputs left the device: what checkpointing holds minus what offload holds is n inputs (the two
    # slots are allocated once, before the measured step), less the last one or two, whose memory the allocator
    # hands back only once it sees their copy's event (record_stream) at a later allocation
    assert held_ckpt - held_off >= (n - 2) * per_layer, (held_ckpt, held_off)
    print(f"held between forward and backward: checkpoint {held_ckpt / 2**20:.1f} MiB, offload "
          f"{held_off / 2**20:.1f} MiB ({n} layer inputs = {n * per_layer / 2**20:.1f} MiB)")
    assert engine.stats["offloaded_tensors"] == 2 * n and engine.stats["host_buffers"] == n
    assert engine.stats["device_slots"] == 2 and engine.stats["fetched_on_demand"] == 2  # the last layer only
    assert engine.stats["prefetched_groups"] == 2 * (n - 1)
    assert torch.equal(loss_off, loss_ckpt)
    for name, g in grads_ckpt.items():
        assert torch.equal(grads_off[name], g), name


def _builder_cfg(tmp_path, name, method="lora", packing_strategy="bfd", **memory):
    from novatune.train.config import from_dict

    return from_dict({
        "model": {"arch": "qwen3-tiny", "tokenizer": "demo", "device": "cuda", "dtype": "bf16", "patch": True,
                  "arch_overrides": {k: v for k, v in ARCH.items() if k not in ("use_cache", "vocab_size")}},
        "data": {"sources": [{"type": "synthetic", "num_docs": 64, "median_length": 300}], "max_length": 2048,
                 "packing_strategy": packing_strategy},
        "method": {"type": method, "r": 8},
        "train": {"max_steps": 3, "grad_accum": 2, "lr": 1e-4 if method == "lora" else 1e-5, "seed": 0},
        "memory": memory,
        "checkpoint": {"output_dir": str(tmp_path / name)},
    })


def _losses(cfg):
    from novatune.train.session import build

    s = build(cfg)
    return s, [s.step(s.next_micro_batches()).loss.item() for _ in range(3)]


def test_every_policy_with_novatune_patch_trains_like_checkpointing(tmp_path):
    """Full fine-tuning through the fused kernels and packed varlen attention: selective recompute (torch's
    selective checkpoint over novatune's custom ops), offload and keep in one model give the checkpointed run's
    losses within bf16 noise (FlashAttention's backward sums in a varying order)."""
    _, ref = _losses(_builder_cfg(tmp_path, "ref", "full", policy="checkpoint"))
    s, got = _losses(_builder_cfg(tmp_path, "mix", "full", policy="per-layer",
                                  layers=["selective*3", "offload*3", "keep*2"]))
    assert got == pytest.approx(ref, rel=1e-2)
    assert s.memory_plan.engine.stats["offloaded_tensors"] == 3 * 2 * 3


def test_offload_through_the_builder_with_patch_and_lora(tmp_path):
    """novatune.patch + LoRA + offload: the CUDA graphs step aside (a reason in the report), losses match the
    checkpointed run within bf16 noise (graphs vs eager attention kernels differ: tests/patch/test_cuda_graphs.py),
    and the engine moved every layer's input."""
    def losses(policy):
        return _losses(_builder_cfg(tmp_path, policy, "lora", policy=policy))

    _, ref = losses("checkpoint")
    s, got = losses("offload")
    assert got == pytest.approx(ref, rel=2e-2)
    assert s.memory_plan.engine.stats["offloaded_tensors"] == 3 * 2 * ARCH["num_hidden_layers"]
    assert "memory policy" in str(s.patch_report)
