"""`novatune train CONFIG --nproc N`: the same command line, re-run under torchrun with N processes.

The child command is `python -m torch.distributed.run --nproc-per-node N --standalone -m novatune train ...`
(what `torchrun` runs), with every argument but `--nproc` passed through unchanged. The exit code is torchrun's:
the first failing rank's, or 0.
"""
from __future__ import annotations

import signal
import subprocess
import sys


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

    This process only waits. Ctrl-C reaches torchrun and the workers from the terminal (one process group), so it
    is not sent again (a second SIGINT aborts a worker mid-step); a SIGTERM sent to this process alone is passed
    to torchrun, which passes it to the workers: they finish the step, save and exit."""
    proc = subprocess.Popen(torchrun_command(nproc, argv))

    def on_signal(signum, frame) -> None:
        if signum != signal.SIGINT:
            proc.send_signal(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
