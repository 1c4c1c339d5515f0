"""The choice among validated, timed candidates (the one place that chooses implementations).

choose(): the fastest validated candidate wins only if it beats the runner-up by more than the measured spread
(the larger of the two interquartile ranges); otherwise every candidate within that margin of the fastest is a
tie and the simplest of them (lowest family complexity: eager < native < default < triton < compile < cuda) wins,
so a change of implementation always has a measured reason. For ops with a memory rule (linear cross-entropy),
`memory_filter` first drops the candidates whose peak memory exceeds the default's.
The chosen functionals reach the ops as a plain value: novatune.ops.dispatch.Selection.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Measured:
    name: str
    complexity: int
    median_us: float
    spread_us: float
    peak_bytes: int | None = None   # peak extra memory of one fwd+bwd (CUDA only; None when not measured)


def memory_filter(measured: list[Measured], default: str, allow_more: bool = False
                  ) -> tuple[list[Measured], dict[str, str], str]:
    """(allowed, {excluded name: why}, note) under the memory rule: a candidate whose peak memory exceeds the
    default's is not eligible ("peak memory <= the peer's" is part of the promise) unless `allow_more`. The rule
    is not applied (note says why) when the default's peak was not measured (off CUDA, or the default failed)."""
    ref = next((m for m in measured if m.name == default), None)
    if allow_more:
        return list(measured), {}, "memory rule off (--allow-more-memory)"
    if ref is None or ref.peak_bytes is None:
        return list(measured), {}, (f"memory rule not applied: no peak-memory figure for {default}"
                                    + (" (not measured off CUDA)" if ref is not None else " (not validated/timed)"))
    allowed, excluded = [], {}
    for m in measured:
        if m.peak_bytes is not None and m.peak_bytes > ref.peak_bytes:
            excluded[m.name] = (f"peak memory {m.peak_bytes / 2**20:.1f} MiB > {default}'s "
                                f"{ref.peak_bytes / 2**20:.1f} MiB (memory rule; --allow-more-memory lifts it)")
        else:
            allowed.append(m)
    return allowed, excluded, f"memory rule: peak <= {default}'s {ref.peak_bytes / 2**20:.1f} MiB"


@dataclass
class Choice:
    name: str
    reason: str
    runner_up: str | None
    margin_us: float          # the noise margin used
    gain_us: float            # runner-up median - chosen median (>= 0 when the fastest won outright)


def choose(measured: list[Measured]) -> Choice:
    """Pick among validated, timed candidates (see the module docstring). Raises ValueError when empty."""
    if not measured:
        raise ValueError("no validated candidate to choose from")
    ranked = sorted(measured, key=lambda m: m.median_us)
    best = ranked[0]
    if len(ranked) == 1:
        return Choice(best.name, "the only validated candidate", None, 0.0, 0.0)
    second = ranked[1]
    margin = max(best.spread_us, second.spread_us)
    lead = second.median_us - best.median_us
    if lead > margin:
        return Choice(best.name, f"fastest: {best.median_us:.2f} µs, {lead:.2f} µs ahead of {second.name} "
                                 f"(> noise {margin:.2f} µs)", second.name, margin, lead)
    tied = [m for m in ranked if m.median_us - best.median_us <= margin]
    simplest = min(tied, key=lambda m: (m.complexity, m.median_us))
    others = ", ".join(m.name for m in tied if m is not simplest)
    if simplest is best:
        return Choice(best.name, f"fastest and simplest of those within noise {margin:.2f} µs ({others})",
                      second.name, margin, lead)
    return Choice(simplest.name, f"within noise ({margin:.2f} µs) of the fastest {best.name} "
                                 f"({best.median_us:.2f} vs {simplest.median_us:.2f} µs): the simpler one is kept",
                  best.name, margin, best.median_us - simplest.median_us)
