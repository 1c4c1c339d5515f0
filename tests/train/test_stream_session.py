"""memory.stream_frozen_layers through the run builder and the trainer: same losses and weights as without it,
the export reads every layer's own weights, full fine-tuning is refused with the fix."""
from __future__ import annotations

import pytest
import torch

from novatune.parallel.wrap import decoder_layers
from novatune.train.config import ConfigError
from novatune.train.session import build

ARCH = {"num_hidden_layers": 4}


def _run(cfg, steps=2):
    s = build(cfg)
    losses = [s.step(s.next_micro_batches()).loss.item() for _ in range(steps)]
    return s, losses, {n: p.detach().clone() for n, p in s.model.named_parameters() if p.requires_grad}


def test_streamed_lora_trains_like_unstreamed(make_cfg):
    from tests.train.conftest import TINY_ARCH

    model = {"arch_overrides": {**TINY_ARCH, **ARCH}}
    ref_s, ref_losses, ref_w = _run(make_cfg("ref", method={"type": "lora"}, model=model,
                                             memory={"gradient_checkpointing": True, "stream_frozen_layers": 0}))
    assert ref_s.memory_plan.streamer is None
    s, losses, w = _run(make_cfg("stream", method={"type": "lora"}, model=model,
                                 memory={"gradient_checkpointing": True, "stream_frozen_layers": 4}))
    assert s.memory_plan.plan.streamed == [0, 1, 2, 3] and s.memory_plan.streamer is not None
    assert s.memory_plan.streamer.stats["acquires"] > 0
    assert losses == ref_losses
    for n in ref_w:
        assert torch.equal(w[n], ref_w[n]), n
    # the export path puts every frozen weight back in its own storage
    s.stop_streaming()
    frozen = {n: p for n, p in s.model.named_parameters() if not p.requires_grad}
    ref_frozen = dict(ref_s.model.named_parameters())
    for n, p in frozen.items():
        assert torch.equal(p, ref_frozen[n]), n
    ptrs = [p.data_ptr() for p in decoder_layers(s.model)[0].parameters()]
    assert len(set(ptrs)) == len(ptrs)


def test_full_fine_tuning_refuses_streaming(make_cfg):
    with pytest.raises(ConfigError, match="memory.stream_frozen_layers: 0"):
        make_cfg(memory={"gradient_checkpointing": True, "stream_frozen_layers": 2})


def test_the_trainer_exports_the_streamed_run_like_the_unstreamed_one(make_cfg):
    """The whole trainer: metrics rows say what was copied, and the merged export (which reads every base
    weight) equals the unstreamed run's."""
    from rich.console import Console
    from transformers import AutoModelForCausalLM

    from novatune.train.loop import train
    from tests.train.conftest import TINY_ARCH

    def run(name, stream):
        cfg = make_cfg(name, model={"arch_overrides": {**TINY_ARCH, **ARCH}},
                       method={"type": "lora", "r": 4, "alpha": 8}, train={"max_steps": 2, "lr": 2e-2},
                       memory={"gradient_checkpointing": True, "stream_frozen_layers": stream})
        res = train(cfg, console=Console(file=open("/dev/null", "w")))
        return res, AutoModelForCausalLM.from_pretrained(res.exported[1]).eval()

    ref, ref_merged = run("ref", 0)
    got, merged = run("stream", 4)
    assert got.session.memory_plan.streamer is None  # stopped before the export
    assert [got.losses[k] for k in sorted(got.losses)] == [ref.losses[k] for k in sorted(ref.losses)]
    ref_sd = ref_merged.state_dict()
    for n, t in merged.state_dict().items():
        assert torch.equal(t, ref_sd[n]), n


def test_streamed_qlora_trains_like_unstreamed(make_cfg):
    """NF4 base weights (bitsandbytes' Params4bit) stream as their packed bytes; the quantisation state stays."""
    pytest.importorskip("bitsandbytes", reason="qlora needs bitsandbytes: pip install bitsandbytes")
    arch = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32)

    def cfg(name, stream):
        return make_cfg(name, model={"arch_overrides": arch}, method={"type": "qlora", "r": 4, "alpha": 8},
                        memory={"gradient_checkpointing": True, "stream_frozen_layers": stream})

    _, ref_losses, ref_w = _run(cfg("ref", 0))
    s, losses, w = _run(cfg("stream", 4))
    layer = decoder_layers(s.model)[0]
    assert type(layer.mlp.up_proj.base_layer.weight).__name__ == "Params4bit"
    # layers 0 and 2 share slot 0: a use without acquire would read the other's weights
    assert layer.mlp.up_proj.base_layer.weight.data_ptr() == \
        decoder_layers(s.model)[2].mlp.up_proj.base_layer.weight.data_ptr()
    assert s.memory_plan.streamer.stats["copies"] > 0
    assert losses == ref_losses
    for n in ref_w:
        assert torch.equal(w[n], ref_w[n]), n
