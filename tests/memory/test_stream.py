"""Frozen-weight streaming on a tiny Qwen3 with LoRA (CPU: host = device, synchronous copies).

Streamed layers of the same slot share one device buffer, so a use of a layer's weights that skipped `acquire`
would compute with another layer's weights: equal losses and gradients (bit for bit, fp32) show that every use,
the forward and the recompute inside the backward, found its own."""
from __future__ import annotations

import pytest
import torch

from novatune.memory.offload import OffloadEngine
from novatune.memory.planner import spread
from novatune.memory.policy import install as install_policies
from novatune.memory.policy import installed
from novatune.memory.stream import (
    StreamingRefused,
    frozen_bytes,
    install_streaming,
    uninstall_streaming,
)
from tests.memory.test_offload import _grads, _layers, _model


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("streamed", [[0, 1, 2, 3], [1, 3], [0, 2, 3]])
def test_streamed_layers_train_like_unstreamed_ones(streamed):
    model = _model(layers=4, lora=True)
    before = _params(model)
    ref, ref_losses = _grads(model)
    streamer = install_streaming(_layers(model), streamed, "cpu")
    streamer.trace = True
    got, losses = _grads(model)
    assert torch.equal(torch.stack(losses), torch.stack(ref_losses))
    assert set(got) == set(ref)
    for n in ref:
        assert torch.equal(got[n], ref[n]), n
    # two slots, no more: a slot's layers read another's values unless acquired (the check has teeth)
    assert len(streamer.slots) == 2 and len(streamed) > 2 or len(streamed) <= 2
    # each micro-batch: a forward and a recompute per streamed layer
    assert streamer.stats["acquires"] >= 2 * 2 * len(streamed)
    uninstall_streaming(_layers(model), streamer)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n  # restored: every weight is its own again
    assert installed(_layers(model)) == ["recompute"] * 4


def test_a_missed_acquire_changes_the_loss():
    """The slots really are shared: with the streamer's acquire turned off the loss differs."""
    model = _model(layers=4, lora=True)
    _, ref_losses = _grads(model, steps=1)
    streamer = install_streaming(_layers(model), [0, 1, 2, 3], "cpu")
    streamer.acquire = lambda index: None
    _, losses = _grads(model, steps=1)
    assert not torch.equal(torch.stack(losses), torch.stack(ref_losses))


def test_acquire_order_prefetches_one_layer_ahead_in_each_direction():
    model = _model(layers=4, lora=True)
    streamer = install_streaming(_layers(model), [0, 1, 2, 3], "cpu")
    streamer.trace = True
    _grads(model, steps=1)
    acquires = [i for what, i in streamer.log if what == "acquire"]
    # forward 0..3 (the hook, then the checkpointed forward), backward 3..0 (each recompute)
    firsts = [i for j, i in enumerate(acquires) if j == 0 or acquires[j - 1] != i]
    assert firsts == [0, 1, 2, 3, 2, 1, 0] or firsts == [0, 1, 2, 3, 3, 2, 1, 0]
    copies = [i for what, i in streamer.log if what == "copy"]
    # forward: 0 on demand, then each next one ahead; backward: 3 and 2 are still in their slots, 1 and 0 come back
    assert copies == [0, 1, 2, 3, 1, 0]
    assert streamer.stats["fetched_on_demand"] == 1
    # the next micro-batch's forward finds 0 and 1 in their slots
    streamer.log.clear()
    _grads(model, steps=1)
    assert [i for what, i in streamer.log if what == "copy"] == [2, 3, 1, 0]
    assert streamer.stats["fetched_on_demand"] == 1


def test_streaming_with_offloaded_and_selective_layers():
    model = _model(layers=4, lora=True)
    ref, ref_losses = _grads(model)
    install_policies(_layers(model), ["offload", "selective", "recompute", "offload"], OffloadEngine("cpu", 0))
    install_streaming(_layers(model), [0, 1, 3], "cpu")
    got, losses = _grads(model)
    assert torch.equal(torch.stack(losses), torch.stack(ref_losses))
    for n in ref:
        assert torch.equal(got[n], ref[n]), n


def test_memory_moves_to_host():
    model = _model(layers=4, lora=True)
    per_layer = frozen_bytes(_layers(model)[0])
    streamer = install_streaming(_layers(model), [0, 1, 2, 3], "cpu")
    assert streamer.stats["host_bytes"] == 4 * per_layer
    assert streamer.slot_bytes() == 2 * per_layer
    # the streamed layers' frozen weights are views into the two slots
    slot_ptrs = {b.data_ptr() for s in streamer.slots for b in s.values()}
    for i, layer in enumerate(_layers(model)):
        q = layer.self_attn.q_proj.base_layer.weight
        base = q.untyped_storage().data_ptr()
        assert base in slot_ptrs, i


def test_full_fine_tuning_is_refused():
    model = _model(layers=2, lora=False)
    with pytest.raises(StreamingRefused, match="memory.stream_frozen_layers: 0"):
        install_streaming(_layers(model), [0], "cpu")


def test_keep_layers_are_refused():
    model = _model(layers=2, lora=True)
    install_policies(_layers(model), ["keep", "recompute"])
    with pytest.raises(StreamingRefused, match="keep"):
        install_streaming(_layers(model), [0, 1], "cpu")
    # nothing moved
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_a_backward_without_recompute_is_refused():
    model = _model(layers=2, lora=True)
    install_streaming(_layers(model), [1], "cpu")
    model.base_model.model.model.gradient_checkpointing_disable()
    ids = torch.tensor([[3, 4, 5, 6]])
    with pytest.raises(StreamingRefused, match="without gradient checkpointing"):
        model(input_ids=ids, use_cache=False)
    with torch.no_grad():  # evaluation reads the right weights through the hook
        model.eval()
        model(input_ids=ids, use_cache=False)


def test_eval_forward_without_checkpointing_matches():
    model = _model(layers=4, lora=True)
    model.eval()
    ids = torch.tensor([[3, 4, 5, 6, 9, 11]])
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
        install_streaming(_layers(model), [0, 1, 2, 3], "cpu")
        got = model(input_ids=ids, use_cache=False).logits
    assert torch.equal(got, ref)


def test_spread_places_streamed_layers_apart():
    assert spread(list(range(36)), 12) == list(range(0, 36, 3))
    assert spread(list(range(4)), 0) == []
    assert spread(list(range(4)), 9) == [0, 1, 2, 3]
    assert len(set(spread(list(range(36)), 13))) == 13
