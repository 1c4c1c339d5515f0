"""Where an op's work runs: the one device rule every op in novatune.ops follows.

* CUDA tensors -> the Triton kernels in novatune.kernels.
* CPU tensors  -> the plain-PyTorch fp32 references (novatune.reference), so a patched model on the CPU computes
  the same numbers as the stock one.
* CPU tensors with TRITON_INTERPRET=1 -> the Triton kernels through Triton's interpreter. This is how CI
  (no GPU) executes the real kernel code; it is slow, so tests use small odd shapes.

`NOVATUNE_BACKEND=reference` forces the references everywhere (debugging, bisecting a numerics issue).
Both variables are read once (use_triton runs on every op call, and an environment read costs about as much as the
rest of the decision); `reset()` reads them again (tests that set them mid-process call it).
Tuned implementations are chosen per call by novatune.ops.dispatch, before this rule applies.
"""
from __future__ import annotations

import os

import torch


def _read() -> tuple[bool, bool]:
    """(references forced, Triton interpreter on) from the environment."""
    forced = os.environ.get("NOVATUNE_BACKEND", "").lower() == "reference"
    return forced, os.environ.get("TRITON_INTERPRET", "0") == "1"


_FORCED_REFERENCE, _INTERPRET = _read()


def reset() -> None:
    """Read NOVATUNE_BACKEND and TRITON_INTERPRET again."""
    global _FORCED_REFERENCE, _INTERPRET
    _FORCED_REFERENCE, _INTERPRET = _read()


def interpreter_on() -> bool:
    return _INTERPRET


def use_triton(x: torch.Tensor) -> bool:
    """True when the Triton kernel should run for a tensor on x's device."""
    if _FORCED_REFERENCE:
        return False
    if x.is_cuda:
        return True
    return _INTERPRET and x.device.type == "cpu"
