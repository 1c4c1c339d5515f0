"""proof/parity.py: tolerances derived from the noise floor, the per-step series check, the weight-change table,
the same-init guard. Pure functions on small made-up numbers and tensors (no training here; the trainer-driven
runs are in tests/integration/test_cli_validate_bench.py)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from novatune.proof import parity

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "patch"))
from tiny_models import tiny_model  # noqa: E402


def test_tolerance_is_factor_times_floor_with_a_minimum():
    assert parity.tolerance(1e-4, "loss", "bfloat16") == pytest.approx(parity.FACTOR * 1e-4)
    assert parity.tolerance(0.0, "loss", "float32") == parity.MIN_TOL["loss"]["float32"]
    assert parity.tolerance(0.0, "loss", "float16") == parity.MIN_TOL["loss"]["bfloat16"]  # low precision: bf16's


def test_series_check_passes_within_and_fails_beyond_the_floor():
    ref = [12.0, 11.9, 11.8]
    alt = [12.0 * (1 + 2e-5), 11.9, 11.8 * (1 - 1e-5)]  # floor 2e-5 -> tolerance max(2e-4, 5e-4) = 5e-4
    ok = parity.series_check("loss_parity", "loss", "loss", ref, alt, [x * (1 + 3e-4) for x in ref], "bfloat16")
    assert ok["passed"] and ok["floor"] == pytest.approx(2e-5) and ok["tolerance"] == pytest.approx(5e-4)
    bad = parity.series_check("loss_parity", "loss", "loss", ref, alt, [12.0, 11.9, 11.8 * 1.01], "bfloat16")
    assert not bad["passed"] and "steps [3]" in bad["message"] and bad["max_rel_diff"] == pytest.approx(0.01)
    nan = parity.series_check("loss_parity", "loss", "loss", ref, alt, [12.0, float("nan"), 11.8], "bfloat16")
    assert not nan["passed"]
    assert [r["step"] for r in ok["per_step"]] == [1, 2, 3]


def test_series_check_refuses_runs_of_different_lengths():
    with pytest.raises(ValueError, match="different step counts"):
        parity.series_check("grad_norm", "grad_norm", "g", [1.0, 2.0], [1.0, 2.0], [1.0], "float32")


def _weights(seed, n=3):
    g = torch.Generator().manual_seed(seed)
    return {(0, f"p{i}.weight"): torch.randn(16, 8, generator=g) for i in range(n)}


def test_weight_table_changed_match_and_differ():
    base = _weights(0)
    g = torch.Generator().manual_seed(1)
    upd = {k: 1e-2 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    stock = {k: base[k] + upd[k] for k in base}
    alt = {k: stock[k] + 1e-6 * torch.randn(stock[k].shape, generator=g) for k in base}  # floor ~ 1e-4 of update
    nova = {k: stock[k] + 2e-6 * torch.randn(stock[k].shape, generator=g) for k in base}
    res = parity.weight_change_check(base, stock, alt, nova, "float32")
    assert res["passed"], res["message"]
    assert {r["stock_vs_base"] for r in res["rows"]} == {"CHANGED"} and {r["verdict"] for r in res["rows"]} == {"MATCH"}
    r0 = res["rows"][0]
    assert r0["stock_changed_frac"] == 1.0 and 0 < r0["stock_vs_novatune_update_rel"] < 1e-3
    # an unchanged matrix in the candidate run, and one whose update went elsewhere
    k0, k1 = sorted(base)[:2]
    nova_bad = {**nova, k0: base[k0].clone(), k1: base[k1] - upd[k1]}
    bad = parity.weight_change_check(base, stock, alt, nova_bad, "float32")
    assert not bad["passed"]
    assert any("p0.weight (novatune)" in u for u in bad["unchanged"])
    assert "not updated by training" in bad["message"] and "differ by up to" in bad["message"]
    verdicts = {r["param"]: (r["novatune_vs_base"], r["verdict"]) for r in bad["rows"]}
    assert verdicts["p0.weight"] == ("UNCHANGED", "DIFFER") and verdicts["p1.weight"] == ("CHANGED", "DIFFER")
    assert "p1.weight" in parity.render_weight_table(bad["rows"])


def test_same_init_check_names_the_mismatch():
    a, b = _weights(0), _weights(0)
    assert parity.same_init_check({"stock": a, "novatune": b})["passed"]
    b[(0, "p2.weight")][3, 3] += 1e-3
    res = parity.same_init_check({"stock": a, "novatune": b})
    assert not res["passed"] and res["mismatched"] == ["0:p2.weight (novatune)"]


def test_layer_params_are_every_projection_of_the_chosen_layers():
    model = tiny_model("qwen3")  # 2 layers
    keys = parity.layer_params(model, [1])
    assert {k[0] for k in keys} == {1}
    assert sorted(k[1] for k in keys) == sorted(f"{m}.weight" for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj"))
    snap = parity.snapshot(model, [1])
    p = keys[(1, "mlp.up_proj.weight")]
    assert snap[(1, "mlp.up_proj.weight")].device.type == "cpu"
    with torch.no_grad():
        p.add_(1.0)  # a copy, not a view
    assert not torch.equal(snap[(1, "mlp.up_proj.weight")], p.detach())
