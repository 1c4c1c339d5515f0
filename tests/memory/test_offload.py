"""The offload engine and the per-layer policies on a tiny Qwen3 (CPU: host = device, no streams).

Every policy changes which tensors are kept, never the arithmetic, so the gradients are compared bit for bit with
stock non-reentrant checkpointing (same ops, same order, fp32 on the CPU)."""
from __future__ import annotations

import pytest
import torch

from novatune.memory.offload import OffloadEngine
from novatune.memory.policy import expand_layers, install, installed, uninstall
from tests.patch.tiny_models import packed_batch, tiny_model


def _model(layers=4, lora=False):
    from tests.patch import tiny_models

    kw = dict(tiny_models.FAMILIES["qwen3"][1], num_hidden_layers=layers)
    old = tiny_models.FAMILIES["qwen3"]
    tiny_models.FAMILIES["qwen3"] = (old[0], kw)
    try:
        model = tiny_model("qwen3", seed=3)
    finally:
        tiny_models.FAMILIES["qwen3"] = old
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        for n, p in model.named_parameters():  # random B: the adapters' gradients are not trivially zero
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.02)
    model.train()
    return model


def _layers(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return list(base.model.layers)


def _grads(model, steps=2):
    """Per-parameter gradients of `steps` micro-batches accumulated (fresh batches each), and the losses."""
    model.zero_grad(set_to_none=True)
    losses = []
    for s in range(steps):
        ids, pos, lab = packed_batch([[7, 12, 4], [23]], seed=10 + s)
        out = model(input_ids=ids, position_ids=pos, labels=lab, use_cache=False)
        out.loss.backward()
        losses.append(out.loss.detach())
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, losses


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("policies", [["offload"] * 4, ["keep", "offload", "selective", "recompute"],
                                      ["recompute_mlp"] * 4, ["recompute_mlp", "offload", "lean", "recompute_mlp"],
                                      ["selective"] * 4, ["offload", "keep", "keep", "offload"]])
def test_policies_give_the_gradients_of_plain_checkpointing(policies, lora):
    model = _model(lora=lora)
    ref, ref_losses = _grads(model)
    engine = OffloadEngine("cpu", min_bytes=0)
    install(_layers(model), policies, engine)
    assert installed(_layers(model)) == policies
    got, losses = _grads(model)
    assert set(got) == set(ref)
    for n in ref:
        assert torch.equal(got[n], ref[n]), n
    assert torch.equal(torch.stack(losses), torch.stack(ref_losses))
    offloaded = policies.count("offload")
    # each offloaded layer's one checkpoint input (the hidden states), per micro-batch, went out and came back
    assert engine.stats["offloaded_tensors"] == 2 * offloaded
    assert engine.stats["unpacked_tensors"] == 2 * offloaded
    uninstall(_layers(model))
    assert installed(_layers(model)) == ["recompute"] * 4


def test_offloaded_tensors_round_trip_through_host_buffers_and_two_slots():
    """Every saved tensor comes back equal, from one of two device slots; host buffers are pooled across
    micro-batches; the previous layer's input is prefetched when a layer's backward starts."""
    model = _model(layers=4)
    engine = OffloadEngine("cpu", min_bytes=0)
    packed, unpacked = {}, []
    pack, unpack = engine._pack, engine._unpack

    def spy_pack(t):
        h = pack(t)
        packed[id(h)] = t.detach().clone()
        return h

    def spy_unpack(h):
        t = unpack(h)
        unpacked.append((id(h), t))
        assert torch.equal(t, packed[id(h)])  # the value saved, not a stale slot
        return t

    engine._pack, engine._unpack = spy_pack, spy_unpack
    install(_layers(model), ["offload"] * 4, engine)
    _grads(model, steps=3)
    assert len(unpacked) == 12
    assert engine.stats["device_slots"] == 2  # two buffers of the hidden-state shape serve every layer
    assert engine.stats["host_buffers"] == 4  # one per offloaded layer, reused by the next micro-batches
    assert engine.stats["prefetched_groups"] == 3 * 3  # layers 2, 1, 0 of each micro-batch came early
    assert engine.stats["fetched_on_demand"] == 3  # the last layer of each micro-batch: nothing before it


def test_small_tensors_stay_put():
    model = _model(layers=2)
    engine = OffloadEngine("cpu")  # default threshold: 1 MiB, far above the tiny model's hidden states
    install(_layers(model), ["offload"] * 2, engine)
    _grads(model, steps=1)
    assert engine.stats["offloaded_tensors"] == 0 and engine.stats["kept_tensors"] == 2


def test_install_needs_checkpointing_and_one_policy_per_layer():
    model = _model(layers=2)
    with pytest.raises(ValueError, match="2 decoder layers"):
        install(_layers(model), ["keep"])
    with pytest.raises(ValueError, match="needs an OffloadEngine"):
        install(_layers(model), ["offload", "keep"])
    model.gradient_checkpointing_disable()
    with pytest.raises(ValueError, match="gradient_checkpointing_enable"):
        install(_layers(model), ["keep", "keep"])


def test_expand_layers():
    assert expand_layers(["offload*2", "keep"], 3) == ["offload", "offload", "keep"]
    with pytest.raises(ValueError, match="unknown layer policy 'kep'"):
        expand_layers(["kep*3"], 3)
    with pytest.raises(ValueError, match="names 2 layers but the model has 3"):
        expand_layers(["offload*2"], 3)


def test_a_second_backward_through_offloaded_layers_fetches_again():
    """retain_graph=True: the host copies outlive the first backward, and a slot that another layer's input has
    overwritten since is filled again, so the second backward sees the saved values too."""
    model = _model(layers=4)
    ids, pos, lab = packed_batch([[7, 12, 4], [23]], seed=5)

    def twice():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, position_ids=pos, labels=lab, use_cache=False).loss
        loss.backward(retain_graph=True)
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    ref = twice()
    engine = OffloadEngine("cpu", min_bytes=0)
    install(_layers(model), ["offload"] * 4, engine)
    got = twice()
    for n in ref:
        assert torch.equal(got[n], ref[n]), n
    assert engine.stats["unpacked_tensors"] == 8 and engine.stats["fetched_on_demand"] >= 2


def test_an_index_less_cuda_device_is_the_current_one(monkeypatch):
    """Tensors report `cuda:0`; an engine built for `cuda` (the run builder's device name) must compare equal,
    or it offloads nothing."""
    from novatune.memory.offload import indexed

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert indexed("cuda") == torch.device("cuda", 3)
    assert indexed("cuda:1") == torch.device("cuda", 1)
    assert indexed("cpu") == torch.device("cpu")


def test_recompute_mlp_survives_a_deep_copy_and_puts_the_forward_back_after_an_error():
    """The policy points at its own layer: a deep copy's (or an unpickled model's) layers checkpoint their own MLPs,
    and an MLP that raises gets back the forward it had."""
    import copy
    import pickle

    model = _model(layers=2)
    install(_layers(model), ["recompute_mlp"] * 2)
    twin = copy.deepcopy(model)
    for layer, twin_layer in zip(_layers(model), _layers(twin)):
        assert twin_layer._gradient_checkpointing_func.layer is twin_layer is not layer
    layer = pickle.loads(pickle.dumps(_layers(twin)[0]))
    assert layer._gradient_checkpointing_func.layer is layer
    want, _ = _grads(model)
    got, _ = _grads(twin)
    for n in want:
        assert torch.equal(got[n], want[n]), n

    mlp = _layers(model)[0].mlp
    assert "forward" not in mlp.__dict__

    def broken(*a, **k):
        raise RuntimeError("boom")
    mlp.__dict__["forward"] = broken
    with pytest.raises(RuntimeError, match="boom"):
        _grads(model)
    assert "_novatune_mlp_own_checkpoint" not in mlp.__dict__
    assert mlp.__dict__["forward"] is broken
