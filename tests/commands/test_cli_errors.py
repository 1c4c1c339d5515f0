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


@pytest.mark.parametrize("flag", ["--eval", "--trace"])
@pytest.mark.parametrize("kind", ["missing", "unreadable"])
def test_report_refuses_a_named_input_it_cannot_use(flag, kind, tmp_path, capsys):
    """A file named on --eval / --trace that is missing or not that kind of file ends with exit 2 and its name,
    instead of a report written without it."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "bench.jsonl").write_text('{"bench": "novatune_bench", "stack": "stock", "status": "ok", "tok_s": 1.0}\n')
    named = tmp_path / "named.json"
    if kind == "unreadable":
        named.write_text("{ not json")
    assert main(["report", str(run), flag, str(named), "-o", str(tmp_path / "out"), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert f"{flag} {named}" in err and "check the path" in err
    assert not (tmp_path / "out").exists()
