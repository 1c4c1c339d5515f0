"""`novatune train` stopped by SIGTERM / Ctrl-C as a user's scheduler or terminal does it: the step in progress
finishes, a checkpoint is saved, the exit code is 143 / 130, and the same command resumes from it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from novatune.train import checkpoint as ckpt

REPO = Path(__file__).resolve().parents[2]
TINY = ["--set", "model.arch_overrides={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, "
                 "num_attention_heads: 2, num_key_value_heads: 1, head_dim: 16}",
        "--set", "model.patch=false", "--set", "logging.every=1", "--set", "logging.progress=false",
        "--set", "logging.tensorboard=false", "--set", "data.max_length=128", "--set", "train.max_steps=400"]


def start(out: Path) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("TRITON_INTERPRET", None)
    return subprocess.Popen([sys.executable, "-m", "novatune", "train", "--output-dir", str(out), *TINY], cwd=REPO,
                            env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["sigterm", "sigint"])
def test_signal_saves_a_checkpoint_and_exits_with_the_signal_code(tmp_path, signum, code):
    out = tmp_path / "run"
    proc = start(out)
    deadline = time.monotonic() + 240
    for line in proc.stdout:  # wait until training runs (the handler is installed by then)
        if line.startswith("step 3/") or time.monotonic() > deadline:
            break
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code, stderr[-3000:]
    assert "Traceback" not in stderr and f"stopped by {signal.Signals(signum).name}" in stdout + stderr
    cp = ckpt.latest(out)
    assert cp is not None and ckpt.verify(cp) == []
    state = json.loads((cp / "state.json").read_text())
    assert state["data"]["index"] == state["step"] * 4  # demo: micro_batch 4, grad_accum 1; nothing skipped
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == state["step"]
