"""Benchmark rows: one JSON line per measurement, appended to bench/results/<name>.jsonl.

Every row carries the device, the torch/triton/transformers versions and the git sha, so a figure quoted in a
note or the README can be traced to the run that produced it.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
from pathlib import Path


def git_sha() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5)
        sha = out.stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=5).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("NOVATUNE_GIT_SHA", "unknown")


def environment() -> dict:
    import torch

    env: dict[str, str | None] = {"torch": torch.__version__, "device": "cpu"}
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        env["cuda"] = torch.version.cuda
    for mod in ("triton", "transformers", "liger_kernel", "peft"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - absent or broken package: record that it is absent
            pass
    env["git_sha"] = os.environ.get("NOVATUNE_GIT_SHA") or git_sha()
    return env


def write_row(path: str | os.PathLike, row: dict) -> dict:
    """Append one row (with environment and UTC time) to a .jsonl file; returns the full row."""
    full = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **environment(), **row}
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "a") as f:
        f.write(json.dumps(full) + "\n")
    return full
