"""Numerical checks shared by tests, benchmarks and the tune validator.

Error metric: ||out - ref|| / ||ref|| over the whole tensor, with the reference in fp32 (or fp64). Typical
levels (docs/BENCHMARKS.md): fp32 arithmetic < 1e-5; bf16 operands 1e-3 .. 1e-2; NaN never passes.
"""
from __future__ import annotations

import torch

# Relative-norm tolerances per output dtype. bf16 has an 8-bit mantissa (unit roundoff 2^-8 = 3.9e-3); one
# rounding of the output alone gives ~2e-3 relative-norm error, a few chained roundings stay under 1e-2.
# fp16: 2^-11 = 4.9e-4. fp32: reductions in a different order give ~1e-6.
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| computed in fp64; inf if out has a NaN/Inf that ref does not."""
    o = out.detach().to(torch.float64)
    r = ref.detach().to(torch.float64)
    if o.shape != r.shape:
        raise AssertionError(f"shape mismatch: {tuple(o.shape)} vs reference {tuple(r.shape)}")
    bad_out = ~torch.isfinite(o)
    if bool((bad_out & torch.isfinite(r)).any()):
        return float("inf")
    o = torch.where(bad_out, torch.zeros_like(o), o)
    r = torch.where(torch.isfinite(r), r, torch.zeros_like(r))
    denom = r.norm().item()
    num = (o - r).norm().item()
    return num / denom if denom > 0 else num


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float | None = None, name: str = "output") -> float:
    """Assert rel_err(out, ref) <= tol (default: REL_TOL of out's dtype). Returns the error."""
    tol = REL_TOL.get(out.dtype, 1e-2) if tol is None else tol
    err = rel_err(out, ref)
    assert err <= tol, f"{name}: relative error {err:.3e} > tolerance {tol:.1e} ({out.dtype})"
    return err


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with NaN (or the max int) so an element a kernel forgot to write is caught."""
    if t.is_floating_point():
        return t.fill_(float("nan"))
    return t.fill_(torch.iinfo(t.dtype).max)
