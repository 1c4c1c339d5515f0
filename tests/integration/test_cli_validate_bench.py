"""`novatune validate` and `novatune bench` end to end on a tiny Qwen3 (CPU, fp32, synthetic packed rows):
validate passes for the real patch and fails - naming the check - for each planted fault (tests/proof/faults.py);
bench runs two stacks in their own processes, reports the absent peer, and writes its rows."""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

from novatune.commands.cli import main

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "proof"))
from faults import FAULTS  # noqa: E402

TINY = """
model:
  arch: qwen3-tiny
  arch_overrides: {hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4,
                   num_key_value_heads: 2, head_dim: 16, vocab_size: 256}
  device: cpu
  dtype: fp32
data:
  sources: [{type: synthetic, num_docs: 48, median_length: 40, sigma: 0.7, min_length: 8, seed: 1}]
  max_length: 128
  shuffle: false
train: {max_steps: 3, micro_batch: 2, grad_accum: 2, lr: 1.0e-3, schedule: constant, seed: 0}
checkpoint: {output_dir: runs/unused, export: false}
logging: {every: 1, tensorboard: false, progress: false}
"""


@pytest.fixture
def tiny_cfg(tmp_path, monkeypatch, reference_backend):
    # the patched ops run their PyTorch references (the Triton interpreter takes minutes even at these sizes);
    # the environment variable reaches bench's worker processes too
    reference_backend()
    p = tmp_path / "tiny.yaml"
    p.write_text(TINY)
    return p


def _validate(cfg, out, capsys):
    code = main(["validate", str(cfg), "--steps", "3", "--run-dir", str(out)])
    text = capsys.readouterr().out
    result = json.loads((out / "validate.json").read_text())
    return code, text, result, {c["name"]: c for c in result["checks"]}


def test_validate_passes_for_novatune(tiny_cfg, tmp_path, capsys):
    code, text, result, checks = _validate(tiny_cfg, tmp_path / "val", capsys)
    assert code == 0 and result["passed"], text
    assert list(checks) == ["same_init", "loss_parity", "weight_change", "grad_norm", "packing_contamination",
                            "grad_accum_invariance"]
    assert result["dtype"] == "float32" and result["layers"] == [0, 1] and result["git_sha"]
    assert set(result["runs"]) == {"stock", "stock_eager", "novatune"}
    assert all(len(r["losses"]) == len(r["grad_norms"]) == 3 for r in result["runs"].values())
    assert result["runs"]["novatune"]["patch"]["replaced"]["attention"] == 2
    loss = checks["loss_parity"]
    assert loss["tolerance"] >= 10 * loss["floor"] and loss["max_rel_diff"] <= loss["tolerance"]
    table = json.loads((tmp_path / "val" / "weight_change.json").read_text())
    assert len(table) == 14  # 7 projections x 2 layers
    assert {(r["stock_vs_base"], r["novatune_vs_base"], r["verdict"]) for r in table} == {("CHANGED", "CHANGED",
                                                                                           "MATCH")}
    for run in ("stock", "stock_eager", "novatune"):
        assert (tmp_path / "val" / run / "metrics.jsonl").exists()
    assert "validate: PASSED" in text and "self_attn.q_proj.weight" in text
    assert json.loads(text.strip().splitlines()[-1])["passed"] is True


# each planted fault and the checks that must catch it (others may fail too: a wrong eps changes every figure)
CAUGHT_BY = {"wrong_eps": ["loss_parity", "grad_norm", "weight_change"],
             "cross_documents": ["packing_contamination", "loss_parity"],
             "per_microbatch_loss": ["grad_accum_invariance", "loss_parity"]}


@pytest.mark.slow
@pytest.mark.parametrize("fault", list(FAULTS))
def test_validate_catches_planted_fault(fault, tiny_cfg, tmp_path, capsys, monkeypatch):
    FAULTS[fault](monkeypatch)
    code, text, result, checks = _validate(tiny_cfg, tmp_path / "val", capsys)
    assert code == 1 and not result["passed"]
    for name in CAUGHT_BY[fault]:
        assert not checks[name]["passed"], f"{name} missed {fault}: {checks[name]['message']}"
    assert checks["same_init"]["passed"]  # the fault is in the kernels, not in the setup
    if fault == "cross_documents":
        assert "attention crosses document boundaries" in checks["packing_contamination"]["message"]
    if fault == "per_microbatch_loss":
        assert "num_items_in_batch" in checks["grad_accum_invariance"]["message"]
    assert "validate: FAILED" in text


@pytest.mark.slow
def test_bench_two_stacks_and_absent_peers(tiny_cfg, tmp_path, capsys):
    # Liger's Triton kernels need a GPU: where liger_kernel is installed the peer would run (and fail on a CPU),
    # so the absent rows are checked only where a peer is not installed (CI)
    absent = [s for s, mod in (("liger-peer", "liger_kernel"), ("unsloth", "unsloth"))
              if importlib.util.find_spec(mod) is None]
    stacks = ["stock", *absent, "novatune"]
    out, results = tmp_path / "bench", tmp_path / "results" / "bench.jsonl"
    code = main(["bench", str(tiny_cfg), "--stacks", ",".join(stacks), "--warm", "1", "--steps", "2",
                 "--profile", "--run-dir", str(out), "--results", str(results)])
    text = capsys.readouterr().out
    assert code == 0, text
    rows = [json.loads(ln) for ln in (out / "bench.jsonl").read_text().splitlines()]
    assert [r["stack"] for r in rows] == stacks
    assert [json.loads(ln)["stack"] for ln in results.read_text().splitlines()] == stacks  # the one row writer
    stock, nova = rows[0], rows[-1]
    for r in rows[1:-1]:
        assert r["status"] == "absent" and "is not installed" in r["reason"]
        assert f"{r['stack']:14s} absent" in text
    for r in (stock, nova):
        assert r["status"] == "ok", r.get("reason")
        assert r["device"] == "cpu" and r["torch"] and r["git_sha"] and r["time"]
        # 1 warm-up + 2 timed optimizer steps; the profiled micro-step after them is no optimizer step
        assert r["warm"] == 1 and r["steps"] == 2 and len(r["losses"]) == len(r["grad_norms"]) == 3
        assert len(r["tokens_per_step"]) == 2 and r["step_ms"] == []  # CUDA events only on a GPU
        assert len(r["step_s"]) == 3 and sum(r["step_s"][1:]) == pytest.approx(r["timed_s"], rel=0.05, abs=2e-3)
        assert r["tok_s"] == pytest.approx(r["timed_tokens"] / r["timed_s"], rel=1e-3)
        assert r["timed_tokens"] == sum(r["tokens_per_step"]) > 0 and r["gflop_per_tok"] > 0
        trace = json.loads((out / "traces" / f"{r['stack']}.json").read_text())
        assert r["trace"].endswith(f"{r['stack']}.json") and trace["traceEvents"] and r["profile"]["busy_ms"] > 0
        assert r["peak_gib"] is None and r["mfu"] is None  # CPU: no allocator peak, no bf16 peak rate
        assert r["gc_freeze"] is True and r["method"] == "full"
        spec = json.loads((out / r["stack"] / "spec.json").read_text())
        assert spec["stack"] == r["stack"] and (out / r["stack"] / "result.json").exists()
    assert stock["patch"] is None and nova["patch"]["replaced"]["cross_entropy"] == 1
    assert stock["x_stock"] == 1.0 and nova["x_stock"] == pytest.approx(nova["tok_s"] / stock["tok_s"], rel=1e-3)
    assert nova["loss_max_rel_diff_vs_stock"] < 1e-5  # fp32: same training
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stacks"] == stacks and summary["exit_code"] == 0
    assert summary["speedup"]["novatune_vs_stock"] == nova["x_stock"]
    assert f"{'stock':14s} ok" in text and f"{'novatune':14s} ok" in text and "per-step loss" in text
    assert json.loads(text.strip().splitlines()[-1])["novatune_vs_stock"] == nova["x_stock"]


def test_bench_and_validate_reject_bad_arguments(tiny_cfg, capsys):
    assert main(["bench", str(tiny_cfg), "--stacks", "stock,liger"]) == 2
    assert "unknown stack" in capsys.readouterr().err
    assert main(["validate", str(tiny_cfg), "--layers", "0,x"]) == 2
    assert "--layers" in capsys.readouterr().err
