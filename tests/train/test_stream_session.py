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
