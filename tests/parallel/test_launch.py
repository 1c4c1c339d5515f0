"""`novatune train --nproc N` returns the ranks' own exit code (2 a config or data error, 3 unhealthy training,
128 + N a signal), not torchrun's agent's 1 for any failure."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from novatune.parallel import launch

REPO = Path(__file__).resolve().parents[2]


def recorded(folder: Path, codes: dict[int, int]) -> Path:
    for rank, code in codes.items():
        (folder / f"rank{rank}").write_text(str(code))
    return folder


@pytest.mark.parametrize("codes,launcher,want", [
    ({0: 0, 1: 0}, 0, 0),
    ({0: 2, 1: 2}, 1, 2),                 # every rank refused the config
    ({0: 143, 1: 3}, 1, 3),               # rank 1 stopped on a non-finite loss, rank 0 was stopped by the agent
    ({0: 1, 1: 3}, 1, 3),                 # rank 0 lost its peer (an exception), rank 1 named the cause
    ({0: 143, 1: 143}, 1, 143),           # SIGTERM: both saved and ended at a step boundary
    ({0: 130, 1: 130}, 1, 130),
    ({0: 143}, 1, 1),                     # rank 1 recorded nothing (killed, out of memory): torchrun's code
    ({0: 2}, 1, 2),                       # ... but a rank that names its failure still wins
    ({}, 1, 1),                           # no rank recorded: torchrun's code
    ({0: 0, 1: 0}, -9, -9),
])
def test_the_most_telling_rank_code_is_returned(tmp_path, codes, launcher, want):
    assert launch.rank_exit_code(recorded(tmp_path, codes), launcher, nproc=2) == want


def test_a_rank_records_its_code_only_under_the_launcher(tmp_path, monkeypatch):
    monkeypatch.delenv(launch.EXIT_DIR_ENV, raising=False)
    monkeypatch.setenv("RANK", "1")
    launch.record_rank_exit(3)
    assert not list(tmp_path.iterdir())
    monkeypatch.setenv(launch.EXIT_DIR_ENV, str(tmp_path))
    launch.record_rank_exit(3)
    assert (tmp_path / "rank1").read_text() == "3"


@pytest.mark.slow  # one torchrun launch of 2 gloo processes that stop at the data: ~10-20 s
def test_nproc_run_with_a_data_error_exits_2_as_one_process_does(tmp_path):
    """A data error found inside the ranks (a conversation with no assistant turn, read when the run builds its
    data): both ranks exit 2, and so does the launcher."""
    data = tmp_path / "no_assistant.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    cmd = [sys.executable, "-m", "novatune", "train", "--nproc", "2", "--output-dir", str(tmp_path / "run"),
           "--set", "parallel.strategy=ddp", "--set", "model.device=cpu", "--set", f"data.sources.0.path={data}"]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240,
                       env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert p.returncode == 2, p.stderr[-3000:]
    assert "rank 0 exited with code 2" in p.stderr
