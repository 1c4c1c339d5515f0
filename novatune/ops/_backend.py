"""Where an op's work runs: the one device rule every op in novatune.ops follows.

* CUDA tensors -> the Triton kernels in novatune.kernels.
* CPU tensors  -> the plain-PyTorch fp32 references (novatune.reference), so a patched model on the CPU computes
  the same numbers as the stock one.
* CPU tensors with TRITON_INTERPRET=1 -> the Triton kernels through Triton's interpreter. This is how CI
  (no GPU) executes the real kernel code; it is slow, so tests use small odd shapes.

`NOVATUNE_BACKEND=reference` forces the references everywhere (debugging, bisecting a numerics issue).
Tuned implementations are chosen per call by novatune.ops.dispatch, before this rule applies.
"""
from __future__ import annotations

import os

import torch


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(x: torch.Tensor) -> bool:
    """True when the Triton kernel should run for a tensor on x's device."""
    forced = os.environ.get("NOVATUNE_BACKEND", "").lower()
    if forced == "reference":
        return False
    if x.is_cuda:
        return True
    return interpreter_on() and x.device.type == "cpu"
