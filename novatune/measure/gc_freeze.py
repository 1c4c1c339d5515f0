"""Python's garbage collector kept out of the timed steps: the objects that live for the whole run are frozen.

A full collection walks every Python object of transformers, the model and autograd: 170-195 ms on the GPU machine
(`novatune bench --diag`, LOG.md), landing at random inside training steps. What exists once the first step has
run (the model, the optimizer state, the data pipeline) lives for the whole run, so `freeze()` collects once and
moves it out of the collector's walks (`gc.freeze`); later collections walk only newer objects. Freezing frees
nothing less: an object still goes when its last reference does; only a reference cycle among the frozen objects
waits for `release()`. (torchtitan disables the collector instead.)

Where something else had frozen objects before (`gc.get_freeze_count() > 0`), `release()` leaves them frozen: that
freeze is its owner's to undo, and what this one added stays frozen with it until then.
"""
from __future__ import annotations

import gc


class LongLivedFreeze:
    """One owner's freeze: `freeze()` once the long-lived objects exist, `release()` when the run is over."""

    def __init__(self):
        self.ours = False  # this object froze, and unfreezes

    def freeze(self) -> None:
        self.ours = self.ours or gc.get_freeze_count() == 0
        gc.collect()
        gc.freeze()

    def release(self) -> None:
        if self.ours:
            self.ours = False
            gc.unfreeze()
