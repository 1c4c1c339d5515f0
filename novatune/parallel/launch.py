"""`novatune train CONFIG --nproc N`: the same command line, re-run under torchrun with N processes.

The child command is `python -m torch.distributed.run --nproc-per-node N --standalone -m novatune train ...`
(what `torchrun` runs), with every argument but `--nproc` passed through unchanged. The exit code is the ranks'
own, as one process would have returned it (2 a config or data error, 3 unhealthy training, 128 + N a signal):
torchrun's agent exits 1 whatever failed, so each rank records its code in a folder the launcher names
(record_rank_exit) and the launcher returns the most telling one (rank_exit_code).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

EXIT_DIR_ENV = "NOVATUNE_RANK_EXIT_DIR"


def strip_nproc(argv: list[str]) -> list[str]:
    """argv without `--nproc N` / `--nproc=N`."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = True
            continue
        if a.startswith("--nproc="):
            continue
        out.append(a)
    return out


def torchrun_command(nproc: int, argv: list[str], module: str = "novatune") -> list[str]:
    """The torchrun command line for `python -m <module> <argv>` on `nproc` local processes."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", module, *strip_nproc(argv)]


def relaunch(nproc: int, argv: list[str]) -> int:
    """Run `novatune <argv>` under torchrun with `nproc` processes on this host; returns its exit code.

    This process only waits. Ctrl-C in a terminal reaches torchrun and the workers from the terminal (the
    foreground process group), so a SIGINT that finds this process in its terminal's foreground group is not sent
    again (a second SIGINT aborts a worker mid-step); one sent while it has no terminal or runs in the background
    (a job manager, an IDE, `nohup ... &`), and a SIGTERM, are passed to torchrun, which passes them to the
    workers: they finish the step, save and exit. (A `kill -INT` from another shell to a launcher in the
    foreground reaches it alone and is not passed on: send SIGTERM there.)"""
    with tempfile.TemporaryDirectory(prefix="novatune-exit-") as exit_dir:
        proc = subprocess.Popen(torchrun_command(nproc, argv), env={**os.environ, EXIT_DIR_ENV: exit_dir})

        def on_signal(signum, frame) -> None:
            if signum != signal.SIGINT or not _in_terminal_foreground():
                proc.send_signal(signum)

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            launcher_code = proc.wait()
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
        return rank_exit_code(Path(exit_dir), launcher_code, nproc)


def _in_terminal_foreground() -> bool:
    """Whether this process is in its terminal's foreground process group: where Ctrl-C signals every process of
    the group, torchrun and the workers included."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY)
    except OSError:  # no controlling terminal
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


def record_rank_exit(code: int) -> None:
    """Under `--nproc`, this rank's exit code for the launcher (nothing otherwise)."""
    folder, rank = os.environ.get(EXIT_DIR_ENV), os.environ.get("RANK")
    if folder and rank is not None and Path(folder).is_dir():
        (Path(folder) / f"rank{int(rank)}").write_text(str(int(code)))


def rank_exit_code(folder: Path, launcher_code: int, nproc: int) -> int:
    """The code `novatune train --nproc N` returns: a failing rank's own code, the most telling first: one that
    names the failure (2 config or data, 3 unhealthy training), then 1 (an exception; often a rank that lost its
    peer), then 128 + N (a signal: a rank the launcher stopped because another failed ends that way too), the
    lowest rank first. torchrun's own code where no rank recorded a failure, or where a rank recorded nothing (it
    crashed: killed, out of memory) and the others only say they were stopped."""
    codes = {}
    for f in folder.glob("rank*"):
        try:
            codes[int(f.name[4:])] = int(f.read_text())
        except ValueError:
            continue
    failed = sorted((2 if code >= 128 else 1 if code == 1 else 0, rank, code)
                    for rank, code in codes.items() if code != 0)
    if not failed or (len(codes) < nproc and failed[0][0] == 2):
        return launcher_code
    _, rank, code = failed[0]
    if code != launcher_code:
        print(f"novatune: rank {rank} exited with code {code} (torchrun's agent reports {launcher_code} for any "
              "failure); returning the rank's", file=sys.stderr)
    return code
