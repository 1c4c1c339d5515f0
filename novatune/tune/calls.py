"""Helpers shared by the tuner's stages for calling any registered op (novatune.ops.registry): incoming gradients,
shape strings. They read the op's SPEC; none names an op."""
from __future__ import annotations

from collections.abc import Callable

import torch

from novatune.ops.contract import OpSpec
from novatune.ops.registry import OPS


def make_dy(spec: OpSpec, shape, dtype, device, gen):
    """A random incoming gradient for one fwd+bwd at `shape`: a tensor, or a tuple of one per output."""
    if len(spec.outputs) == 1:
        return torch.randn(spec.grad_shape(shape), generator=gen).to(device=device, dtype=dtype)
    return tuple(torch.randn(tuple(s), generator=gen).to(device=device, dtype=dtype) for s in spec.dy_shape(shape))


def map_dy(f: Callable, dy):
    """f applied to a gradient that may be a tuple (multi-output ops)."""
    return tuple(f(t) for t in dy) if isinstance(dy, tuple) else f(dy)


def shape_str(shape) -> str:
    return "x".join(str(s) for s in shape)


def candidates(op: str, shape, dtype: torch.dtype, device: str, families=None) -> list:
    """All candidates the op's SPEC declares at `shape`/`dtype` on `device` ("cuda" or "cpu"), optionally only
    some families."""
    if op not in OPS:
        raise KeyError(f"no op {op!r} in the registry (registered: {', '.join(OPS)})")
    return [c for c in OPS[op].candidates(tuple(shape), dtype, device) if families is None or c.family in families]


def model_level(op: str) -> bool:
    """True for ops applied as a setting on the patched model (not per call through the dispatch table)."""
    return op in OPS and OPS[op].setting is not None
