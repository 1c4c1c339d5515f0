"""bench/runner.py's pure parts: stack names, ratios, the table (an absent stack keeps its row)."""
from __future__ import annotations

import pytest

from novatune.bench.runner import add_ratios, parse_stacks, render_table


def test_parse_stacks():
    assert parse_stacks("stock, novatune") == ["stock", "novatune"]
    with pytest.raises(ValueError, match="unknown stack"):
        parse_stacks("stock,liger")


def test_ratios_and_table_with_an_absent_peer():
    rows = [{"stack": "stock", "status": "ok", "tok_s": 8000.0, "losses": [12.0, 11.0], "mfu": 0.3,
             "peak_gib": 39.0, "gflop_per_tok": 25.1},
            {"stack": "liger-peer", "status": "absent", "reason": "liger_kernel is not installed"},
            {"stack": "novatune", "status": "ok", "tok_s": 16000.0, "losses": [12.0, 11.0011], "mfu": 0.6,
             "peak_gib": 30.0, "gflop_per_tok": 25.1}]
    sp = add_ratios(rows)
    assert sp == {"novatune_vs_stock": 2.0, "novatune_vs_peer": None, "peer_vs_stock": None}
    assert rows[2]["x_stock"] == 2.0 and rows[2]["x_peer"] is None
    assert rows[2]["loss_max_rel_diff_vs_stock"] == pytest.approx(1e-4)
    assert rows[1]["x_stock"] is None
    table = render_table({"rows": rows, "warm": 1, "speedup": sp})
    assert "liger-peer  absent  liger_kernel is not installed" in table
    assert "16,000" in table and "2.000" in table and "60.0%" in table


def test_step_meter_counts_only_the_timed_steps():
    """Warm-up steps (1..warm) are neither timed nor counted: tokens / time must cover the same `steps` steps."""
    from novatune.bench.worker import StepMeter

    meter = StepMeter(warm=2, steps=3, device_type="cpu")
    meter.model_hook(object())
    mb = {"num_tokens": 100, "attn_keys": 10.0}
    for step in range(1, 6):
        meter.step_hook(step, [mb, mb])
    assert meter.tokens == [200, 200, 200]
    assert meter.t0 is not None and meter.t1 is not None and meter.t1 >= meter.t0
    assert len(meter.step_s) == 5
