"""Where an op's work runs: the one rule every op in novatune.ops follows.

* CUDA tensors -> the Triton kernels in novatune.kernels (later: whatever `novatune tune` selected).
* CPU tensors  -> the plain-PyTorch fp32 references, so a patched model on the CPU computes the same
  numbers as the stock one.
* CPU tensors with TRITON_INTERPRET=1 -> the Triton kernels through Triton's interpreter. This is how CI
  (no GPU) executes the real kernel code; it is slow, so tests use small odd shapes.

`NOVATUNE_BACKEND=reference` forces the references everywhere (debugging, bisecting a numerics issue).

Tuned implementations (novatune.tune): `OVERRIDE` is None unless the tune engine installed a hook
(novatune.tune.select.install / record_shapes). Public functionals that support tuning check it first:

    hook = _backend.OVERRIDE
    if hook is not None:
        out = hook("rms_norm", x, weight, eps)      # the selected implementation's result, or None
        if out is not None:
            return out

so the default path pays one module-global read (no dict lookup, no call) when nothing is tuned; the hook
itself looks the call's shape signature up and returns None for shapes nothing was selected for.
"""
from __future__ import annotations

import os

import torch


# hook(op_name, *args) -> result or None; see the module docstring. Set only by novatune.tune.select.
OVERRIDE = None


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
