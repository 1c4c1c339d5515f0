"""One run per output folder: a new run never mixes with or overwrites another run's results, and a folder that
cannot be written is refused at start with the way out (novatune/train/run_dir.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from novatune.train import checkpoint as ckpt
from novatune.train import run_dir
from novatune.train.loop import train
from novatune.train.model import SetupError


def quiet():
    return Console(file=open("/dev/null", "w"), soft_wrap=True)


def test_resume_never_over_an_older_runs_checkpoints_is_refused(make_cfg):
    cfg = make_cfg("mix", train={"max_steps": 6}, checkpoint={"save_every": 2})
    train(cfg, console=quiet(), stop_after=4)
    before = sorted(p.name for p in ckpt.list_checkpoints(cfg.checkpoint.output_dir))
    fresh = make_cfg("mix", train={"max_steps": 6}, checkpoint={"save_every": 2, "resume": "never"})
    with pytest.raises(SetupError, match=r"resume=never.*checkpoint.resume=auto.*--output-dir"):
        train(fresh, console=quiet())
    assert sorted(p.name for p in ckpt.list_checkpoints(cfg.checkpoint.output_dir)) == before


def test_rerun_into_a_finished_run_is_refused_and_changes_nothing(make_cfg):
    cfg = make_cfg("done", train={"max_steps": 2})
    train(cfg, console=quiet())
    out = Path(cfg.checkpoint.output_dir)
    snapshot = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    again = make_cfg("done", train={"max_steps": 3, "lr": 1e-2})
    with pytest.raises(SetupError, match=r"finished run \(exported to .*final.*--output-dir"):
        train(again, console=quiet())
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == snapshot
    assert json.loads((out / "summary.json").read_text())["first_loss"] is not None
    assert run_dir.read_run(out)["status"] == "finished"


def test_a_run_that_kept_nothing_may_be_rerun(make_cfg):
    # benchmark/validate runs: no export, no checkpoint; rerunning into their folder is fine
    cfg = make_cfg("bench", train={"max_steps": 2}, checkpoint={"export": False, "resume": "never"})
    train(cfg, console=quiet())
    res = train(cfg, console=quiet())
    rows = (Path(cfg.checkpoint.output_dir) / "metrics.jsonl").read_text().splitlines()
    assert res.steps == 2 and [json.loads(r)["step"] for r in rows] == [1, 2]


def test_output_dir_that_is_a_file_is_refused(make_cfg, tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SetupError, match="is a file"):
        train(make_cfg("afile"), console=quiet())


def test_unwritable_checkpoints_folder_fails_at_start(make_cfg, monkeypatch):
    cfg = make_cfg("ro", checkpoint={"save_every": 1})
    out = Path(cfg.checkpoint.output_dir)
    (out / "checkpoints").mkdir(parents=True)
    real = Path.write_text

    def read_only(self, *a, **k):  # chmod does not stop root: refuse writes under checkpoints/ instead
        if self.parent == out / "checkpoints":
            raise PermissionError(13, "Permission denied")
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "write_text", read_only)
    steps = []
    with pytest.raises(SetupError, match="cannot write to .*checkpoints.*writable"):
        train(cfg, console=quiet(), step_hook=lambda s, m: steps.append(s))
    assert steps == []  # before any training


def test_leftovers_of_killed_saves_are_removed_at_start(make_cfg):
    cfg = make_cfg("left", train={"max_steps": 1})
    root = ckpt.checkpoints_dir(cfg.checkpoint.output_dir)
    for name in (".tmp-step_00000004-123", ".trash-step_00000002-9-9"):
        (root / name).mkdir(parents=True)
        (root / name / "weights.safetensors").write_bytes(b"half")
    train(cfg, console=quiet())
    assert [p.name for p in root.iterdir()] == ["step_00000001"]  # only the final checkpoint (saved before export)
