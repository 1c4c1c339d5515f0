"""memory.policy through the run builder: every policy trains like stock checkpointing; bad settings name the fix."""
from __future__ import annotations

import pytest
import torch

from novatune.memory.policy import installed
from novatune.parallel.wrap import decoder_layers
from novatune.train.config import ConfigError
from novatune.train.model import SetupError
from novatune.train.session import build


def _run(cfg, steps=2):
    s = build(cfg)
    losses = [s.step(s.next_micro_batches()).loss.item() for _ in range(steps)]
    return s, losses, {n: p.detach().clone() for n, p in s.model.named_parameters()}


@pytest.mark.parametrize("method,patch", [("full", False), ("lora", False), ("full", True)])
def test_policies_train_like_checkpointing(make_cfg, method, patch):
    """Stock modules and novatune's patched ones (selective recompute over its custom ops)."""
    model = {"patch": patch}
    ref_s, ref_losses, ref_w = _run(make_cfg("ref", method={"type": method}, model=model,
                                             memory={"gradient_checkpointing": True}))
    assert installed(decoder_layers(ref_s.model)) == ["recompute", "recompute"]
    s, losses, w = _run(make_cfg("mix", method={"type": method}, model=model,
                                 memory={"policy": "per-layer", "layers": ["offload", "selective"]}))
    assert installed(decoder_layers(s.model)) == ["offload", "selective"]
    assert s.memory_plan.engine is not None and s.memory_plan.engine.stats["unpacked_tensors"] == 0  # tiny: kept
    assert losses == ref_losses  # the same arithmetic: bit-identical on the CPU
    for n in ref_w:
        assert torch.equal(w[n], ref_w[n]), n
    keep_s, keep_losses, _ = _run(make_cfg("keep", method={"type": method}, model=model, memory={"policy": "none"}))
    assert not getattr(decoder_layers(keep_s.model)[0], "gradient_checkpointing", False)
    assert keep_losses == pytest.approx(ref_losses, rel=1e-5)
    mlp_s, mlp_losses, mlp_w = _run(make_cfg("mlp", method={"type": method}, model=model,
                                             memory={"policy": "recompute_mlp"}))
    assert installed(decoder_layers(mlp_s.model)) == ["recompute_mlp", "recompute_mlp"]
    assert mlp_losses == ref_losses  # each MLP recomputed by the stock checkpoint, the attention kept: same ops
    for n in ref_w:
        assert torch.equal(mlp_w[n], ref_w[n]), n


def test_auto_without_a_budget_keeps_everything_and_says_so(make_cfg):
    s = build(make_cfg(memory={"policy": "auto"}))
    assert s.memory_plan.plan.policies == ["keep", "keep"]
    assert any("no memory budget" in n for n in s.memory_plan.plan.notes)


def test_auto_that_cannot_fit_stops_before_the_model_is_built(make_cfg):
    with pytest.raises(SetupError, match=r"needs .* GiB .* budget is 0\.0 GiB.*lower data\.max_length"):
        build(make_cfg(memory={"policy": "auto", "budget_gib": 1e-4}))


def test_a_fixed_policy_over_its_budget_is_warned_about_and_runs(make_cfg):
    from rich.console import Console

    console = Console(record=True, width=400)
    s = build(make_cfg(memory={"policy": "checkpoint", "budget_gib": 1e-4}), console=console)
    said = console.export_text()
    assert "warning: memory.policy checkpoint: the plan (recompute x2) needs" in said
    assert "or set memory.policy: auto" in said
    assert s.memory_plan.plan.policies == ["recompute", "recompute"] and not s.memory_plan.plan.fits


@pytest.mark.parametrize("memory,key,fix", [
    ({"policy": "none", "gradient_checkpointing": True}, "memory.policy", "drop memory.gradient_checkpointing"),
    ({"policy": "per-layer"}, "memory.layers", "offload*30"),
    ({"policy": "offload", "layers": ["keep*2"]}, "memory.layers", "memory.policy: per-layer"),
    ({"policy": "per-layer", "layers": ["kep*2"]}, "memory.layers", "optionally with *N"),
    ({"policy": "auto", "budget_gib": -1}, "memory.budget_gib", "free memory"),
    ({"policy": "offload", "offload_min_bytes": -1}, "memory.offload_min_bytes", "set 0 to offload every"),
    ({"policy": "offlaod"}, "memory.policy", "did you mean 'offload'"),
])
def test_bad_memory_settings_name_the_fix(make_cfg, memory, key, fix):
    with pytest.raises(ConfigError) as e:
        make_cfg(memory=memory)
    assert key in str(e.value) and fix in str(e.value)


def test_per_layer_count_must_match_the_model(make_cfg):
    with pytest.raises(SetupError, match="names 3 layers but the model has 2"):
        build(make_cfg(memory={"policy": "per-layer", "layers": ["offload*3"]}))


def test_a_model_the_estimate_cannot_handle_trains_without_a_prediction_under_stock_policies(make_cfg,
                                                                                             monkeypatch):
    from rich.console import Console

    from novatune.train import session

    def broken(*a, **k):
        raise NotImplementedError("no meta-device init for this model")

    monkeypatch.setattr(session, "estimate", broken)
    console = Console(record=True, width=300)
    s = build(make_cfg(memory={"gradient_checkpointing": True}), console=console)
    assert s.memory_plan is None and "no predicted peak for this model" in console.export_text()
    assert installed(decoder_layers(s.model)) == ["recompute", "recompute"]
    with pytest.raises(NotImplementedError):
        build(make_cfg("off", memory={"policy": "offload"}))


def test_allocator_gets_expandable_segments_on_cuda_unless_the_user_configured_it(monkeypatch):
    from novatune.train.config import MemoryConfig
    from novatune.train.memory import configure_allocator

    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert configure_allocator(MemoryConfig(), torch.device("cpu")) is None and calls == []
    assert "expandable segments" in configure_allocator(MemoryConfig(), torch.device("cuda"))
    assert calls == ["expandable_segments:True"]
    assert configure_allocator(MemoryConfig(expandable_segments=False), torch.device("cuda")) is None
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:native")
    assert "as set" in configure_allocator(MemoryConfig(), torch.device("cuda"))
    assert calls == ["expandable_segments:True"]  # the user's setting is left alone


def test_lean_layers_train_like_kept_ones_through_the_run_builder(make_cfg):
    """memory.layers with `lean`: checkpointing goes on so the policy runs, and the patched model trains bit for
    bit as with every layer kept (the recomputed norm outputs are the same values)."""
    model = {"patch": True}
    keep_s, keep_losses, keep_w = _run(make_cfg("keep", model=model, memory={"policy": "per-layer",
                                                                          "layers": ["keep", "keep"]}))
    s, losses, w = _run(make_cfg("lean", model=model, memory={"policy": "per-layer", "layers": ["lean", "keep"]}))
    assert installed(decoder_layers(s.model)) == ["lean", "keep"]
    assert losses == keep_losses
    for n in keep_w:
        assert torch.equal(w[n], keep_w[n]), n
