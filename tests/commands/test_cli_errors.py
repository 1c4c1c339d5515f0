"""CLI arguments that make no sense end with exit 2 and a message naming the fix, not a traceback."""
from __future__ import annotations

from pathlib import Path

import pytest

from novatune.commands.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("value", ["nan", "-3", "0"])
def test_plan_gpu_mem_must_be_positive(value, capsys):
    assert main(["plan", str(REPO / "examples" / "demo.yaml"), "--gpu-mem", value]) == 2
    assert "--gpu-mem: must be a positive number of GiB" in capsys.readouterr().err
