"""Every op's contract, by name: OPS = {name: SPEC} (see novatune.ops.contract).

Consumers (the tuner, the implementation checker, tests, benchmarks) iterate this table; none of them names an op.
The op modules are imported by module path: `novatune.ops.rms_norm` etc. are bound to the functionals.
"""
from __future__ import annotations

import importlib

from novatune.ops.contract import OpSpec

_MODULES = ("rms_norm", "offset_rms_norm", "swiglu", "geglu", "clamped_swiglu", "linear_cross_entropy", "attention",
            "rope", "qk_norm_rope", "moe")

OPS: dict[str, OpSpec] = {}
for _name in _MODULES:
    _spec = importlib.import_module(f"novatune.ops.{_name}").SPEC
    OPS[_spec.name] = _spec
