"""The `novatune` command line, run as a user runs it (a subprocess: `python -m novatune ...`).

The demo test is `slow` (about a minute on two CPU cores) and runs in CI: `novatune train` with no config must
train the bundled model to a visibly lower loss (>= 30% below its first logged value) and export it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run(*args, cwd=None, timeout=300, env_extra=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    # a user's CPU run computes with the ops' PyTorch references; the Triton interpreter (set by tests/conftest.py
    # for the kernel tests) would make a training run take many minutes
    env.pop("TRITON_INTERPRET", None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "novatune", *args], cwd=cwd or REPO, env=env, text=True,
                          capture_output=True, timeout=timeout)


def test_help_lists_every_command():
    r = run("--help")
    assert r.returncode == 0 and "examples:" in r.stdout
    for cmd in ("train", "plan", "env", "bench", "validate", "eval", "report", "tune"):
        assert f"    {cmd} " in r.stdout, cmd
    for cmd in ("train", "plan"):
        h = run(cmd, "--help")
        assert h.returncode == 0 and "examples:" in h.stdout and "--set" in h.stdout


def test_env_reports_versions_and_backends():
    r = run("env")
    assert r.returncode == 0, r.stderr
    for word in ("torch", "transformers", "GPUs", "kernels", "attention backends"):
        assert word in r.stdout


def test_plan_warns_before_oom():
    r = run("plan", "examples/qwen3-4b-seed.yaml", "--gpu-mem", "24")
    assert r.returncode == 1 and "WARNING" in r.stdout and "predicted peak" in r.stdout
    r = run("plan", "examples/qwen3-4b-seed.yaml", "--gpu-mem", "80")
    assert r.returncode == 0 and "fits" in r.stdout


def test_plan_counts_the_weights_in_the_dtype_the_run_would_pick():
    """model.dtype auto is bf16 on a GPU (what a plan is for) and fp32 where the config puts the model on the CPU."""
    r = run("plan", "examples/qwen3-4b-seed.yaml", "--gpu-mem", "80", "--set", "model.dtype=auto")
    assert "2-byte weights" in r.stdout, r.stdout
    r = run("plan", "examples/qwen3-4b-seed.yaml", "--gpu-mem", "80", "--set", "model.dtype=auto",
            "--set", "model.device=cpu")
    assert "4-byte weights" in r.stdout, r.stdout


def test_plan_prints_the_memory_policy_it_chooses():
    r = run("plan", "examples/qwen3-4b-seed.yaml", "--gpu-mem", "40", "--set", "memory.policy=auto")
    assert r.returncode == 0, r.stdout + r.stderr
    chosen = next(x for x in r.stdout.splitlines() if "memory policy auto:" in x)
    # 40 GiB cannot keep every layer's activations: some layers recompute (all or their MLP) or offload
    assert "keep x36" not in chosen and ("offload" in chosen or "recompute" in chosen), chosen
    for words in ("predicted peak", "predicted speed", "tok/s", "fits, with"):
        assert words in r.stdout
    r = run("plan", "examples/qwen3-4b-seed.yaml", "--gpu-mem", "30", "--set", "memory.policy=auto")
    assert r.returncode == 1 and "WARNING" in r.stdout and "method.type=lora" in r.stdout


@pytest.mark.parametrize("args,key", [
    (["train", "--set", "train.lrr=1"], "train.lrr"),
    (["train", "--set", "train.schedule=cosin"], "train.schedule"),
    (["train", "--set", "data.sources.0.path=/nope.jsonl"], "data.sources[0].path"),
    (["train", "--set", "data.max_length=8"], "data.max_length"),
    (["plan", "missing.yaml"], "config file not found"),
])
def test_bad_config_exits_2_naming_the_key(args, key):
    r = run(*args)
    assert r.returncode == 2 and key in r.stderr and "fix:" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_demo_trains_and_the_loss_falls(tmp_path):
    out = tmp_path / "demo"
    r = run("train", "--output-dir", str(out), cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "model:" in r.stdout and "packing efficiency" in r.stdout and "arch: qwen3-tiny" in r.stdout
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    first, last = rows[0]["loss"], rows[-1]["loss"]
    assert last <= 0.7 * first, f"loss fell only from {first:.3f} to {last:.3f}"
    summary = json.loads(r.stdout.strip().splitlines()[-1])  # the last line is one JSON summary
    assert summary["steps"] == summary["total_steps"] == rows[-1]["step"]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    tok = AutoTokenizer.from_pretrained(out / "final")
    assert model.config.model_type == "qwen3" and tok.chat_template
    print(f"demo: loss {first:.3f} -> {last:.3f}, wall {summary['wall_s']} s")
