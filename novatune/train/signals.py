"""Ctrl-C and SIGTERM end a run at a step boundary, with a checkpoint, instead of in the middle of a step.

While `StopSignals` is active (the main thread only: Python delivers signals there), SIGINT and SIGTERM only set a
flag. The loop finishes the optimizer step in progress, saves a checkpoint whose data position is exactly the next
unread micro-batch, and raises `RunInterrupted`; the CLI exits with 128 + the signal number (130 for SIGINT, 143 for
SIGTERM), the shell convention for "ended by a signal". A second Ctrl-C aborts at once without saving (the last
checkpoint is kept). The previous handlers come back when the block ends.
"""
from __future__ import annotations

import signal
import sys
import threading


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class RunInterrupted(KeyboardInterrupt):
    """The run stopped on a signal after saving; exit_code is 128 + the signal number."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum, self.exit_code = signum, 128 + signum


class StopSignals:
    """Context manager: SIGINT/SIGTERM request a stop at the next step boundary (`requested` holds the signal)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.requested: int | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: abort now
        self.requested = signum
        sys.stderr.write(f"\n{signal_name(signum)}: finishing this step, then saving a checkpoint "
                         f"(Ctrl-C again aborts without saving)\n")

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
