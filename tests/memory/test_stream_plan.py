"""Frozen-weight streaming in the planner: the bytes it saves, the copies it exposes, the fewest layers that fit."""
from __future__ import annotations

import pytest

from novatune.memory import planner
from novatune.memory.planner import FrozenStream, LayerCost, choose, evaluate, fewest_streamed, with_streaming

# 6 identical layers; a layer's forward takes 1 s, its recompute + backward 3 s
COST = LayerCost(bytes={"keep": 10, "selective": 6, "recompute": 1, "offload": 0},
                 seconds={"keep": 3.0, "selective": 3.1, "recompute": 4.0, "offload": 4.1}, transient=2,
                 input_bytes=1, forward=1.0)


def _plan(budget=None, policies=None, saved=0):
    return evaluate(policies or ["recompute"] * 6, [COST] * 6, 1000 - saved, budget)


def test_streaming_saves_the_streamed_weights_minus_two_slots():
    base = _plan()
    fs = FrozenStream(layer_bytes=50, link_gbps=1e-9 * 50 / 0.5)  # one layer's copy: 0.5 s
    plan = with_streaming(base, [COST] * 6, 4, fs)
    assert plan.streamed == [0, 1, 3, 4]  # spread over the six layers
    assert plan.stream_saved_bytes == (4 - 2) * 50
    assert plan.peak_bytes == base.peak_bytes - 100 and plan.static_bytes == base.static_bytes - 100
    assert plan.stream_h2d_bytes == (2 * 4 - 4) * 50  # layers 0 and 1 stay in their slots across micro-batches
    # every copy hides behind at least one forward (1 s) or backward (3 s): only the fixed cost per copy remains
    assert plan.seconds == pytest.approx(base.seconds + 4 * planner.COPY_OVERHEAD_S)
    assert with_streaming(base, [COST] * 6, 2, fs).peak_bytes == base.peak_bytes  # two layers: the slots alone


def test_copies_longer_than_the_layers_between_are_exposed():
    base = _plan()
    fs = FrozenStream(layer_bytes=50, link_gbps=1e-9 * 50 / 2.5)  # one copy: 2.5 s
    plan = with_streaming(base, [COST] * 6, 6, fs)
    # forward: copies of streamed layers 2..5, each behind one forward (1 s): 1.5 s exposed each; backward: copies
    # of layers 3..0 behind one backward (3 s): hidden
    assert plan.seconds - base.seconds == pytest.approx(4 * 1.5 + 8 * planner.COPY_OVERHEAD_S)
    spaced = with_streaming(base, [COST] * 6, 3, fs)  # layers 0, 2, 4: two forwards between them
    assert spaced.streamed == [0, 2, 4]
    assert spaced.seconds - base.seconds == pytest.approx(0.5 + 2 * planner.COPY_OVERHEAD_S)


def test_keep_layers_are_never_streamed():
    base = _plan(policies=["keep", "recompute", "keep", "recompute", "recompute", "keep"])
    fs = FrozenStream(50, 1.0)
    assert with_streaming(base, [COST] * 6, 3, fs).streamed == [1, 3, 4]
    with pytest.raises(ValueError, match="only 3 are recomputed"):
        with_streaming(base, [COST] * 6, 4, fs)


def test_the_fewest_streamed_layers_that_fit():
    fs = FrozenStream(50, 1.0)
    full = _plan().peak_bytes  # 1000 + 6 kept + 2 transient
    for k in (3, 4, 5, 6):
        budget = full - (k - 2) * 50
        plan = fewest_streamed(lambda saved, b=budget: _plan(b, saved=saved), [COST] * 6, 6, fs)
        assert plan is not None and len(plan.streamed) == k and plan.fits and plan.peak_bytes <= budget, k
    # six layers save 200
    assert fewest_streamed(lambda saved: _plan(full - 201, saved=saved), [COST] * 6, 6, fs) is None


def test_auto_rechooses_policies_in_the_room_streaming_makes():
    fs = FrozenStream(50, 1.0)
    allowed = ("selective", "recompute")
    budget = 1000 - 100 + 6 * 6 + 6  # every layer selective fits only once streaming saves 100 (4 layers)
    plan = fewest_streamed(lambda saved: choose([COST] * 6, 1000 - saved, budget, allowed=allowed),
                           [COST] * 6, 6, fs)
    assert plan is not None and plan.fits and plan.peak_bytes <= budget
    assert plan.policies == ["selective"] * 6 and len(plan.streamed) == 4
    # the fastest plan without streaming recomputes some layers instead
    assert choose([COST] * 6, 1000, budget, allowed=allowed).policies != ["selective"] * 6


def test_the_run_streams_only_lora_over_its_budget(make_tiny_cfg):
    from types import SimpleNamespace

    from novatune.train.memory import ASSUMED, resolve
    from novatune.train.model import SetupError

    mconf = SimpleNamespace(hidden_size=2560, head_dim=128, num_attention_heads=32, num_key_value_heads=8,
                            intermediate_size=9728, num_hidden_layers=36, vocab_size=151936)
    est = {"weights": 7.55 * 2**30, "gradients": 0.06 * 2**30, "optimizer": 0.12 * 2**30, "dequant": 0,
           "patch": True, "fused_loss": True, "logits_stock": 0}
    lora = make_tiny_cfg(method="lora", budget=8.0)
    plan = resolve(lora, est, mconf, ASSUMED, int(8.0 * 2**30))
    assert plan.fits and 3 <= len(plan.streamed) <= 12 and plan.peak_bytes <= 8 * 2**30
    assert resolve(lora, est, mconf, ASSUMED, int(20 * 2**30)).streamed == []  # fits: nothing streamed
    full = make_tiny_cfg(method="full", budget=8.0)
    assert resolve(full, est, mconf, ASSUMED, int(8.0 * 2**30)).streamed == []
    assert any("full fine-tuning" in n for n in resolve(full, est, mconf, ASSUMED, int(8.0 * 2**30)).notes)
    fixed = make_tiny_cfg(method="lora", stream=5)
    assert len(resolve(fixed, est, mconf, ASSUMED, None).streamed) == 5
    with pytest.raises(SetupError, match="only 0 are recomputed"):
        resolve(make_tiny_cfg(method="lora", stream=5, policy="none"), est, mconf, ASSUMED, None)


def test_graphed_lora_layers_count_the_pool_instead_of_the_eager_transient(make_tiny_cfg):
    """Graphed LoRA layers run their recompute and backward inside the graphs' pool: the peak counts the pool (and
    the graphs' buffers) in place of the eager layer's transient, beside the loss's working memory (a private pool
    is never lent to it), and only where the graphs run."""
    import dataclasses
    from types import SimpleNamespace

    from novatune.train.memory import ASSUMED, layer_costs, loss_transient_bytes, resolve

    mconf = SimpleNamespace(hidden_size=2560, head_dim=128, num_attention_heads=32, num_key_value_heads=8,
                            intermediate_size=9728, num_hidden_layers=36, vocab_size=151936)
    est = {"weights": 7.55 * 2**30, "gradients": 0.06 * 2**30, "optimizer": 0.12 * 2**30, "dequant": 0,
           "patch": True, "fused_loss": True, "logits_stock": 0}
    lora = make_tiny_cfg(method="lora")
    no_graphs = dataclasses.replace(lora, model=dataclasses.replace(lora.model, patch_options={"cuda_graphs": False}))
    cost = layer_costs(lora, mconf, ASSUMED)[0]
    tokens, h, i = 4096, 2560, 9728
    assert cost.graph_pool == cost.transient + (tokens * i + 2 * tokens * h) * 2  # the MLP backward's gradients
    loss = loss_transient_bytes(lora, mconf)
    assert 0 < loss < cost.graph_pool  # one (chunk x vocab) logits block: the pool is the larger
    graphed, eager = resolve(lora, est, mconf, ASSUMED, None), resolve(no_graphs, est, mconf, ASSUMED, None)
    buffers = 3 * tokens * h * 2
    assert graphed.graph_pool_bytes == cost.graph_pool and eager.graph_pool_bytes == 0
    assert graphed.static_bytes == eager.static_bytes + buffers + cost.graph_pool
    assert graphed.peak_bytes == eager.static_bytes + buffers + cost.graph_pool + graphed.activation_bytes + loss
    assert eager.peak_bytes == eager.static_bytes + eager.activation_bytes + cost.transient
    # a layer that keeps its activations sends every layer down the eager path: no pool
    mixed = make_tiny_cfg(method="lora", policy="per-layer", layers=["recompute*35", "keep"])
    assert resolve(mixed, est, mconf, ASSUMED, None).graph_pool_bytes == 0
    on_cpu = dataclasses.replace(lora, model=dataclasses.replace(lora.model, device="cpu"))
    assert resolve(on_cpu, est, mconf, ASSUMED, None).graph_pool_bytes == 0  # graphs need a GPU
    # full fine-tuning: "auto" captures nothing; "forward" the forward only: its pool (bounded by the keep set) and
    # one input buffer stand beside the eager recompute's transient
    full = make_tiny_cfg(method="full")
    full_est = {**est, "gradients": 7.5 * 2**30, "optimizer": 15 * 2**30}
    full_eager = resolve(full, full_est, mconf, ASSUMED, None)
    full_cost = layer_costs(full, mconf, ASSUMED)[0]
    forward = dataclasses.replace(full, model=dataclasses.replace(full.model, patch_options={"cuda_graphs": "forward"}))
    fwd = resolve(forward, full_est, mconf, ASSUMED, None)
    assert fwd.graph_pool_bytes == full_cost.bytes["keep"] and full_eager.graph_pool_bytes == 0
    assert fwd.static_bytes == full_eager.static_bytes + tokens * h * 2 + full_cost.bytes["keep"]
    assert fwd.peak_bytes - full_eager.peak_bytes == tokens * h * 2 + full_cost.bytes["keep"]


def test_the_seed_lora_plan_stands_at_or_above_its_measured_peak():
    """The seed workload with LoRA r16 and 16 streamed layers under an 8 GiB cap measured 6.74 GiB (H200,
    max_memory_allocated over the timed steps), and its graphs' pool 548 MiB besides (this plan counts 544 MiB):
    7.27 GiB in all. The plan stands 3% under it, closer than the graphed plans of test_metrics_plan.py (the
    constants' comment there says where they fall short)."""
    from novatune.train.config import load
    from novatune.train.plan import plan, render

    cfg = load("examples/qwen3-4b-seed.yaml", ["method.type=lora", "method.r=16", "method.alpha=32",
                                               "memory.stream_frozen_layers=16"])
    est = plan(cfg, hw=planner.Hardware(700.0, 3000.0, 50.0))
    measured = 6.735 * 2**30 + 548 * 2**20
    assert 0.95 * measured <= est["peak"] <= measured, est["peak"] / 2**30
    assert est["memory_plan"].graph_pool_bytes / 2**20 == pytest.approx(548, rel=0.02)
    assert "CUDA-graph pool" in render(est)


@pytest.fixture
def make_tiny_cfg():
    from novatune.train.config import from_dict

    def make(method="lora", budget=None, stream="auto", policy="checkpoint", layers=None):
        memory = {"policy": policy, "budget_gib": budget, "stream_frozen_layers": stream}
        return from_dict({"model": {"arch": "qwen3-4b"}, "method": {"type": method},
                          "data": {"sources": [{"type": "synthetic"}], "max_length": 4096},
                          "train": {"grad_accum": 4},
                          "memory": {**memory, **({"layers": layers} if layers else {})}})
    return make


def test_config_refuses_streaming_for_full_fine_tuning_and_negative_counts():
    from novatune.train.config import ConfigError, from_dict
    from novatune.train.config_checks import validate

    base = {"model": {"arch": "qwen3-4b"}, "data": {"sources": [{"type": "synthetic"}]}}
    with pytest.raises(ConfigError, match="full fine-tuning trains every weight"):
        validate(from_dict({**base, "memory": {"stream_frozen_layers": 4}}))
    with pytest.raises(ConfigError, match="must be auto or >= 0"):
        validate(from_dict({**base, "method": {"type": "lora"}, "memory": {"stream_frozen_layers": -1}}))


def test_novatune_plan_shows_the_streamed_layers():
    """The seed workload with LoRA r16 under an 8 GiB budget: streaming fills the gap, and `novatune plan` says
    which layers, the GiB saved and the host-to-device traffic."""
    from novatune.train.config import load
    from novatune.train.plan import plan, render

    cfg = load("examples/qwen3-4b-seed.yaml", ["method.type=lora", "method.r=16", "method.alpha=32",
                                               "memory.budget_gib=8"])
    est = plan(cfg, hw=planner.Hardware(700.0, 3000.0, 50.0))
    mp = est["memory_plan"]
    assert mp.fits and mp.peak_bytes <= 8 * 2**30 and len(mp.streamed) >= 3
    assert mp.stream_h2d_bytes == (2 * len(mp.streamed) - 4) * (mp.stream_saved_bytes // (len(mp.streamed) - 2))
    text = render(est)
    assert f"frozen weights streamed      {len(mp.streamed)} layers" in text
    assert "GiB saved (two slots kept)" in text and "GB per optimizer step" in text
    unstreamed = plan(load("examples/qwen3-4b-seed.yaml", ["method.type=lora", "memory.budget_gib=8",
                                                           "memory.stream_frozen_layers=0"]),
                      hw=planner.Hardware(700.0, 3000.0, 50.0))
    assert not unstreamed["memory_plan"].fits and "WARNING" in render(unstreamed)


def test_a_lora_run_that_streaming_cannot_save_says_so(make_tiny_cfg):
    from types import SimpleNamespace

    from novatune.train.memory import ASSUMED, no_fit_message, resolve

    mconf = SimpleNamespace(hidden_size=2560, head_dim=128, num_attention_heads=32, num_key_value_heads=8,
                            intermediate_size=9728, num_hidden_layers=36, vocab_size=151936)
    est = {"weights": 7.55 * 2**30, "gradients": 0.06 * 2**30, "optimizer": 0.12 * 2**30, "dequant": 0,
           "patch": True, "fused_loss": True, "logits_stock": 0}
    plan = resolve(make_tiny_cfg(method="lora", budget=1.0), est, mconf, ASSUMED, 2**30)
    assert not plan.fits and plan.streamed == []
    assert "streaming the frozen weights of all 36 recomputed layers would not fit either" in \
        no_fit_message(plan, "checkpoint", "memory.budget_gib")
