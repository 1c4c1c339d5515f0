"""The planner's FSDP2 terms (train/memory.py: fsdp2_held_bytes) against the peaks measured on 2 and 4 H100s
(bench/results/bench.jsonl, call session10-1: `novatune bench --nproc N`, max_memory_allocated of the largest rank),
and the choice FSDP2 makes when its two settings are left unset (fsdp2_fastest_that_fits)."""
import pytest

from novatune.train.config import load
from novatune.train.memory import ASSUMED, GiB, fsdp2_fastest_that_fits, fsdp2_held_bytes, resolve
from novatune.train.model import model_config
from novatune.train.plan import plan as estimate

FAST = ["parallel.reshard_after_forward=false", "parallel.gradient_sync=step"]
LEAN = ["parallel.reshard_after_forward=true", "parallel.gradient_sync=micro_batch"]


def planned(sets: list[str], shards: int, budget_gib: float | None = 76.0):
    cfg = load("examples/qwen3-4b-seed.yaml", ["parallel.strategy=fsdp2", *sets])
    mconf = model_config(cfg.model, None, None)
    est = estimate(cfg, None, mconf=mconf, hw=ASSUMED)
    budget = int(budget_gib * GiB) if budget_gib else None
    return cfg, est, mconf, resolve(cfg, est, mconf, ASSUMED, budget, shards)


FP32 = "parallel.reduce_dtype=fp32"  # the session-10 runs reduced in fp32, one layer per unit
UNITS_OF_1 = "parallel.layers_per_unit=1"


@pytest.mark.parametrize("sets, shards, measured_gib", [
    ([*LEAN, FP32], 2, 18.48),  # seed, 2 GPUs: every layer resharded, gradients reduced after each micro-batch
    ([*LEAN, FP32], 4, 10.99),  # the same on 4 GPUs
    ([*FAST, FP32, UNITS_OF_1], 2, 35.75),  # gathered layers kept for the step, fp32 gradients reduced once per step
    ([*LEAN, FP32, "model.arch=qwen3-8b", "data.max_length=8192"], 2, 39.85),  # Qwen3-8B on 8192-token rows
    ([*FAST, FP32], 2, 36.26),  # the same as the third on 2 H200s with units of 4 layers (session19-3)
    (FAST, 2, 28.25),  # and with the gradients accumulated and reduced in bf16 (session19-4)
])
def test_the_fsdp2_plan_stands_at_or_just_above_the_measured_peak(sets, shards, measured_gib):
    """Never under the measurement (a plan under the peak runs out of memory), at most 5% above it."""
    *_, p = planned(sets, shards)
    got = p.peak_bytes / GiB
    assert measured_gib <= got <= 1.05 * measured_gib, got


def test_fsdp2_holds_nothing_extra_for_other_strategies_and_the_gathered_copy_over_one_rank():
    cfg, est, mconf, _ = planned(FAST, 1)
    assert fsdp2_held_bytes(cfg, est, mconf, 1) == est["weights"]  # one rank: the gathered copy is a second copy
    ddp = load("examples/qwen3-4b-seed.yaml", ["parallel.strategy=ddp"])
    assert fsdp2_held_bytes(ddp, est, mconf, 2) == 0


def test_unset_fsdp2_settings_keep_the_layers_gathered_where_that_fits_else_reshard():
    cfg, est, mconf, _ = planned([], 2)
    assert cfg.parallel.reshard_after_forward is None and cfg.parallel.gradient_sync == "auto"
    fast, why = fsdp2_fastest_that_fits(cfg, est, mconf, ASSUMED, int(76 * GiB), 2)
    assert (fast.parallel.reshard_after_forward, fast.parallel.gradient_sync) == (False, "step")
    assert "keeps the gathered layers" in why
    lean, why = fsdp2_fastest_that_fits(cfg, est, mconf, ASSUMED, int(24 * GiB), 2)  # 29.2 GiB would not fit
    assert (lean.parallel.reshard_after_forward, lean.parallel.gradient_sync) == (True, "micro_batch")
    assert "would not fit" in why
    unknown, why = fsdp2_fastest_that_fits(cfg, est, mconf, ASSUMED, None, 2)
    assert unknown.parallel.reshard_after_forward is True and "no memory budget known" in why


def test_a_set_fsdp2_setting_or_one_rank_is_left_as_it_is():
    for sets, shards in ((["parallel.gradient_sync=step"], 2), (["parallel.reshard_after_forward=true"], 2),
                         ([], 1)):
        cfg, est, mconf, _ = planned(sets, shards)
        same, why = fsdp2_fastest_that_fits(cfg, est, mconf, ASSUMED, int(76 * GiB), shards)
        assert same is cfg and why is None


def test_novatune_plan_with_nproc_plans_one_rank_and_names_the_choice(capsys):
    from novatune.commands.cli import main

    seed = ["plan", "examples/qwen3-4b-seed.yaml", "--gpu-mem", "80", "--set", "parallel.strategy=fsdp2"]
    assert main([*seed, "--nproc", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 processes, fsdp2: each rank holds 1/2" in out and "keeps the gathered layers" in out
    per_rank = float(out.split("predicted peak")[1].split("GiB")[0])
    assert per_rank == pytest.approx(planned([*FAST], 2, 80 * 0.92)[3].peak_bytes / GiB, rel=1e-3)
    assert main([*seed, "--nproc", "2", "--set", "model.arch=qwen3-8b", "--set", "data.max_length=8192",
                 "--set", FP32]) == 0
    assert "reshards each layer" in capsys.readouterr().out  # the 8B run's choice (session10-3)
    assert main(["plan", "examples/qwen3-4b-seed.yaml", "--gpu-mem", "80", "--nproc", "2"]) == 0
    assert "parallel.strategy is none: planned as one process" in capsys.readouterr().out
    assert main([*seed, "--nproc", "0"]) == 2


def test_units_of_several_layers_count_the_extra_gathered_layers():
    """Resharding units of 3 layers: a unit and its prefetched neighbour hold 2 x 2 layers more than units of one
    (their other ranks' part), and a unit's whole gradients with their fp32 reduce-scatter input 2 layers more;
    kept-gathered plans hold the whole model either way."""
    cfg, est, mconf, _ = planned([*LEAN, FP32], 2)
    grouped, *_ = planned([*LEAN, FP32, "parallel.layers_per_unit=3"], 2)
    one, three = fsdp2_held_bytes(cfg, est, mconf, 2), fsdp2_held_bytes(grouped, est, mconf, 2)
    root = mconf.vocab_size * mconf.hidden_size * (1 if mconf.tie_word_embeddings else 2)
    layer = (est["weights"] - root * est["weights"] / est["params"]) / mconf.num_hidden_layers
    per_param = est["weights"] / est["params"]  # bf16 weights, full fine-tuning: every layer parameter trained
    assert three - one == pytest.approx(4 * layer / 2 + 2 * layer / per_param * (2 + 4), rel=1e-6)
    # kept gathered: the whole model either way, and at a unit's reduction its reduce-scatter input (fp32 here)
    kept, *_ = planned([*FAST, FP32, "parallel.layers_per_unit=3"], 2)
    single, *_ = planned([*FAST, FP32, UNITS_OF_1], 2)
    assert fsdp2_held_bytes(kept, est, mconf, 2) - fsdp2_held_bytes(single, est, mconf, 2) == \
        pytest.approx(2 * layer / per_param * 4, rel=1e-6)


def test_gradients_reduced_in_their_own_dtype_hold_half_of_what_fp32_holds():
    """Kept-gathered plans with one reduction per step hold every gradient whole until its reduce-scatter, with
    the root's reduce-scatter output beside it: 2 bytes per trained element in bf16 (auto, bf16 weights) where
    fp32 holds 4; one rank reduces nothing either way."""
    auto_cfg, est, mconf, _ = planned([*FAST, UNITS_OF_1], 2)
    fp32_cfg, *_ = planned([*FAST, UNITS_OF_1, FP32], 2)
    root = mconf.vocab_size * mconf.hidden_size * (1 if mconf.tie_word_embeddings else 2)
    saved = fsdp2_held_bytes(fp32_cfg, est, mconf, 2) - fsdp2_held_bytes(auto_cfg, est, mconf, 2)
    assert saved == pytest.approx((4 - 2) * (est["trainable"] + root / 2), rel=1e-6)
    assert fsdp2_held_bytes(auto_cfg, est, mconf, 1) == fsdp2_held_bytes(fp32_cfg, est, mconf, 1)


def test_auto_reduces_lora_adapters_in_fp32_and_full_weights_in_bf16():
    """parallel.reduce_dtype auto follows the trained parameters: bf16 weights reduce in bf16, fp32 adapters in
    fp32 (FSDP2's bf16 compute would otherwise hand them bf16 gradients); the planner counts the same bytes."""
    import torch

    from novatune.parallel import wrap as pwrap

    assert pwrap.fsdp2_reduce_dtype("auto", 2, frozenset({torch.bfloat16})) is None
    assert pwrap.fsdp2_reduce_dtype("auto", 2, frozenset({torch.float32})) is torch.float32
    lora = ["method.type=lora", "method.r=16"]
    auto_cfg, est, mconf, _ = planned([*FAST, *lora], 2)
    fp32_cfg, *_ = planned([*FAST, *lora, FP32], 2)
    assert est["gradients"] == 4 * est["trainable"]  # fp32 adapters
    assert fsdp2_held_bytes(auto_cfg, est, mconf, 2) == fsdp2_held_bytes(fp32_cfg, est, mconf, 2)
