"""One run per output folder: a new run never mixes with, or overwrites, another run's results.

`claim(cfg)` runs before anything is built. It refuses, with the way out in the message:
  - an output_dir that is a file or not writable (checked by writing, including `checkpoints/`, so a read-only
    folder fails at start rather than at the first save);
  - a folder holding a finished run's results (its export in `final/`, or checkpoints of a run marked finished in
    run.json): rerunning would overwrite them, and resuming has nothing left to do;
  - `checkpoint.resume: never` in a folder holding checkpoints: the new run's checkpoints would be pruned against
    the old ones, and a later `resume: auto` would pick up the wrong run. This is the HF Trainer convention (an
    existing, non-empty output directory is an error unless you resume from it).
It also removes the leftovers of killed saves and prunes. A folder whose earlier run left nothing worth keeping
(no export, no checkpoint: a benchmark or validate run) is reused.

`run.json` records the run's state: `running` while it trains, `finished` (with the time) once it reaches its last
step, so the next claim knows.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from novatune.train import checkpoint as ckpt
from novatune.train.model import SetupError

RUN_FILE = "run.json"


def _writable(folder: Path) -> None:
    probe = folder / f".tmp-write-probe-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise SetupError(f"checkpoint.output_dir: cannot write to {folder} ({e.strerror or e}); make it writable "
                         f"or choose another folder (--output-dir / --set checkpoint.output_dir=...)") from None


def read_run(out: Path) -> dict:
    try:
        return json.loads((out / RUN_FILE).read_text())
    except (OSError, ValueError):
        return {}


def finished_results(out: Path) -> str | None:
    """What a finished run left in `out` (None: nothing a rerun could overwrite)."""
    final = out / "final"
    if final.exists():
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(final.stat().st_mtime))
        return f"a finished run (exported to {final} at {when})"
    run = read_run(out)
    if run.get("status") == "finished" and ckpt.list_checkpoints(out):
        return f"a finished run (step {run.get('steps')}, finished at {run.get('finished_at')}) and its checkpoints"
    return None


def claim(out_dir: str | Path, resume: str) -> list[str]:
    """Check and take `out_dir` for a new or resumed run; returns notes for the console."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise SetupError(f"checkpoint.output_dir: {out} is a file, not a folder; choose another --output-dir")
    _writable(out)
    if (ckpt.checkpoints_dir(out)).exists():
        _writable(ckpt.checkpoints_dir(out))
    done = finished_results(out)
    if done:
        raise SetupError(f"checkpoint.output_dir: {out} holds {done}; choose another --output-dir (or --set "
                         f"checkpoint.output_dir=...), or delete {out} to train it again")
    old = ckpt.list_checkpoints(out)
    if resume == "never" and old:
        raise SetupError(f"checkpoint.resume=never, but {out} holds checkpoints of an earlier run (step "
                         f"{ckpt.step_of(old[-1])}); continue it with checkpoint.resume=auto, choose another "
                         f"--output-dir, or delete {ckpt.checkpoints_dir(out)}")
    removed = ckpt.clean_leftovers(out)
    return [f"removed leftovers of an interrupted save: {', '.join(removed)}"] if removed else []


def mark(out_dir: str | Path, status: str, **info) -> None:
    """Record the run's status in run.json (written atomically)."""
    out = Path(out_dir)
    row = {**read_run(out), "status": status, **info}
    if status == "finished":
        row["finished_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
    tmp = out / f".tmp-{RUN_FILE}-{os.getpid()}"
    tmp.write_text(json.dumps(row, indent=1))
    os.replace(tmp, out / RUN_FILE)
