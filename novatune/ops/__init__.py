"""Registered torch.library ops (fake + autograd) with a functional and a module form per op.

    from novatune.ops import rms_norm, swiglu, apply_rope, linear_cross_entropy, varlen_attention

Imports are lazy so `import novatune.ops` stays cheap and an op's import error names that op.
"""
import importlib

_EXPORTS = {
    "rms_norm": "novatune.ops.rms_norm",
    "NovaRMSNorm": "novatune.ops.rms_norm",
    "swiglu": "novatune.ops.swiglu",
    "swiglu_mlp": "novatune.ops.swiglu",
    "apply_rope": "novatune.ops.rope",
    "linear_cross_entropy": "novatune.ops.linear_cross_entropy",
    "varlen_attention": "novatune.attention.backends",
}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'novatune.ops' has no attribute {name!r}")


__all__ = list(_EXPORTS)
