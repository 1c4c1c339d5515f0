"""What a run tells its user: a compact summary at start (the full config in the run folder), the lr each step
really used, a warning before a model too big for the CPU, a progress bar whose times fit a narrow terminal."""
from __future__ import annotations

import io
import json
from pathlib import Path

import torch
from rich.console import Console

from novatune.train import preflight
from novatune.train.arch import arch_config
from novatune.train.config import load
from novatune.train.loop import train
from novatune.train.metrics import Progress

REPO = Path(__file__).resolve().parents[2]


def recorder(width=200):
    buf = io.StringIO()
    return Console(file=buf, soft_wrap=True, width=width), buf


def test_logged_lr_is_the_one_the_step_used(make_cfg):
    cfg = make_cfg("lr", train={"max_steps": 4, "warmup": 3, "schedule": "constant", "lr": 3e-3})
    train(cfg, console=recorder()[0])
    rows = [json.loads(x) for x in (Path(cfg.checkpoint.output_dir) / "metrics.jsonl").read_text().splitlines()]
    # linear warmup over 3 steps: the first update uses lr/3, the second 2lr/3, then lr
    assert [r["lr"] for r in rows] == [3e-3 / 3, 3e-3 * 2 / 3, 3e-3, 3e-3]


def test_start_prints_a_compact_summary_and_saves_the_full_config(make_cfg):
    cfg = make_cfg("sum", train={"max_steps": 1})
    console, buf = recorder()
    train(cfg, console=console)
    head = buf.getvalue().split("data:")[0]  # what is printed before the data is read
    assert len(head.strip().splitlines()) <= 8, head
    assert "arch: qwen3-tiny" in head and "lr 0.003" in head and "config.yaml" in head
    full = load(Path(cfg.checkpoint.output_dir) / "config.yaml", check=False)
    assert full == cfg


def test_big_model_on_the_cpu_is_warned_about_before_it_is_built():
    big = arch_config("qwen3-4b")
    msg = preflight.cpu_step_warning(big, torch.device("cpu"), 4 * 4096)
    assert msg and "4.0B-parameter model on the CPU" in msg and "minutes" in msg and "GPU" in msg
    assert preflight.cpu_step_warning(big, torch.device("cuda"), 4 * 4096) is None
    tiny = arch_config("qwen3-tiny", vocab_size=501)
    assert preflight.cpu_step_warning(tiny, torch.device("cpu"), 4 * 2048) is None


def test_lora_example_on_cpu_warns_first(make_cfg, monkeypatch):
    # the run itself: the warning is printed before the model is built (build_model stopped here)
    import novatune.train.session as session

    class Built(Exception):
        pass

    def stop(*a, **k):
        raise Built

    monkeypatch.setattr(session, "build_model", stop)
    monkeypatch.setattr(preflight, "SLOW_STEP_S", 0.0)
    console, buf = recorder()
    try:
        train(make_cfg("warn"), console=console)
    except Built:
        pass
    assert "WARNING: training a" in buf.getvalue()


def test_progress_bar_times_fit_80_columns():
    buf = io.StringIO()
    console = Console(file=buf, width=80, force_terminal=True, color_system=None)
    bar = Progress(12, 0, True, console)
    bar.update(3, {"step": 3, "total_steps": 12, "loss": 11.9321, "lr": 2e-4, "grad_norm": 1.2,
                   "tokens_per_s": 12345.6, "mfu": 0.41, "mem_gib": 23.4})
    bar.bar.refresh()
    bar.close()
    last = [ln for ln in buf.getvalue().replace("\r", "\n").splitlines() if "3/12" in ln][-1]
    assert "3/12" in last and "0:00:00" in last and "-:--:--" in last, last
