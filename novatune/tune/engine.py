"""The engine's loop for one op at one shape, and the whole-step check.

tune_op: candidates -> validation (every rejection recorded) -> measurement of the validated ones -> choice
(select.choose) -> a cache entry holding every candidate's verdict, errors, timings and the reason of the choice.
step_check: the tuned selection is kept only if a full training step is not slower than with the defaults
(default and tuned steps alternated, medians compared).
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from novatune.ops import dispatch
from novatune.ops.contract import Candidate
from novatune.ops.registry import OPS
from novatune.tune import select
from novatune.tune.calls import candidates, shape_str
from novatune.tune.measure import input_sets, kernel_us, peak_extra_bytes, time_fwd_bwd
from novatune.tune.validate import validate

# cheapest to try first; torch.compile last (its compile time is the largest, and the budget may cut it)
_ORDER = {"eager": 0, "default": 1, "native": 2, "triton": 3, "cuda": 4, "compile": 5}


def odd_shapes(shape, device_type: str, spec=None) -> list:
    """The real shape first, then odd row counts at the same width (1 row; 37 rows; more on a GPU); ops with
    their own rule (spec.odd_shapes: cross-entropy, attention) use it."""
    if spec is not None and spec.odd_shapes is not None:
        return spec.odd_shapes(tuple(shape), device_type)
    rows, n = shape
    extra = [(1, n), (37, n)] + ([(4097, n)] if device_type == "cuda" and rows > 4097 else [])
    return [tuple(shape)] + [s for s in extra if s != tuple(shape)]


def tune_op(op: str, shape, dtype: torch.dtype, device, *, families=None, iters: int = 100, warmup: int = 10,
            bandwidth_gbps: float | None = None, deadline: float | None = None, env: dict | None = None,
            allow_more_memory: bool = False, log: Callable = print, calls=None) -> tuple[dict, dict[str, Candidate]]:
    """(cache entry, {name: candidate}) for `op` at `shape`. The entry's "choice" is the selected candidate.
    Every timed candidate's peak extra memory is recorded (`peak_bytes`, CUDA); for ops with a memory rule a
    candidate above the default's peak is not chosen unless `allow_more_memory`. Baselines (`selectable=False`:
    what patch cannot apply) are validated and timed for the report but never chosen. calls: the CallRecords
    recorded from the model at this signature (novatune.ops.dispatch.recording): every candidate is checked on
    them too."""
    device = torch.device(device)
    spec = OPS[op]
    allc = candidates(op, shape, dtype, device.type)
    stock = next(c for c in allc if c.family == "eager")
    cands = sorted((c for c in allc if families is None or c.family in families or c is stock),
                   key=lambda c: _ORDER[c.family])
    shapes = odd_shapes(shape, device.type, spec)
    floor_us = spec.floor_bytes(shape, dtype) / (bandwidth_gbps * 1e3) if bandwidth_gbps else None
    sets = input_sets(spec, shape, dtype, device)
    records, measured = [], []
    for c in cands:
        rec = {"name": c.name, "family": c.family, "params": c.params}
        # past the budget only the stock baseline (for the report) and novatune's default (the fallback choice:
        # a tune that runs out of time keeps the defaults, it does not fail) are still validated and timed
        if deadline is not None and time.perf_counter() > deadline and c is not stock and c.family != "default":
            rec.update(status="skipped", check="budget", reason="tune time budget spent before this candidate")
            records.append(rec)
            continue
        t0 = time.perf_counter()
        v = validate(spec, c, stock, shapes, dtype, device, calls=calls)
        rec.update(errors={k: float(f"{e:.3e}") for k, e in v.errors.items()},
                   validate_s=round(time.perf_counter() - t0, 2))
        if not v.ok:
            status = "skipped" if v.check == "available" else "rejected"
            rec.update(status=status, check=v.check, reason=v.reason)
            log(f"  {op} {shape_str(shape)} {c.name:18s} {status}: [{v.check}] {v.reason[:150]}")
            records.append(rec)
            continue
        t = time_fwd_bwd(spec, c.functional(), sets, iters=iters, warmup=warmup)
        peak = peak_extra_bytes(spec, c.functional(), sets)
        rec.update(status="timed", checks=v.checks, timing=t.to_dict(), median_us=round(t.median_us, 3),
                   spread_us=round(t.spread_us, 3), peak_bytes=peak)
        if not c.selectable:
            rec["note"] = "baseline (patch cannot apply it): timed for comparison, never chosen"
        if floor_us:
            rec["floor_frac"] = round(floor_us / t.median_us, 3)
        log(f"  {op} {shape_str(shape)} {c.name:18s} {t.median_us:9.2f} µs ± {t.spread_us:.2f}  [{t.mode}]"
            + (f"  {floor_us / t.median_us:.2f} of floor" if floor_us else ""))
        records.append(rec)
        if c.selectable:
            measured.append(select.Measured(c.name, c.complexity, t.median_us, t.spread_us, peak))
    memory_note = None
    if spec.memory_rule and measured:
        measured, excluded, memory_note = select.memory_filter(measured, "novatune_default", allow_more_memory)
        for rec in records:
            if rec["name"] in excluded:
                rec["excluded"] = excluded[rec["name"]]
                log(f"  {op} {shape_str(shape)} {rec['name']:18s} not eligible: {excluded[rec['name']]}")
    if not measured:
        raise RuntimeError(f"tune {op} {shape_str(shape)}: no candidate passed validation, not even the stock one: "
                           + "; ".join(f"{r['name']}: {r.get('reason')}" for r in records))
    choice = select.choose(measured)
    by_name = {c.name: c for c in cands}
    for rec in records:
        if rec["name"] == choice.name:
            rec["status"] = "chosen"
    # kernel µs (sum of kernel durations, torch.profiler) for the stock, default and chosen: BENCHMARKS' figure
    kus = {}
    for name in dict.fromkeys(["hf_eager", "novatune_default", choice.name]):
        rec = next((r for r in records if r["name"] == name and r["status"] in ("timed", "chosen")), None)
        if rec is not None:
            k = kernel_us(spec, by_name[name].functional(), sets)
            if k is not None:
                rec["kernel_us"] = round(k, 2)
                kus[name] = k
    timed = {r["name"]: r for r in records if r["status"] in ("timed", "chosen")}
    entry = {
        "op": op, "shape": list(shape), "dtype": spec.dtype_of(*sets[0][0].values()), "layout": spec.layout,
        "env": env, "choice": choice.name, "family": by_name[choice.name].family,
        "params": by_name[choice.name].params, "reason": choice.reason, "noise_margin_us": round(choice.margin_us, 3),
        "chosen_us": timed[choice.name]["median_us"], "default_us": timed.get("novatune_default", {}).get("median_us"),
        "stock_us": timed.get("hf_eager", {}).get("median_us"), "floor_us": round(floor_us, 3) if floor_us else None,
        "kernel_us": {k: round(v, 2) for k, v in kus.items()}, "candidates": records, "kept": True,
        "applied_by": spec.applied_by, "memory_rule": memory_note,
        "chosen_peak_bytes": timed[choice.name].get("peak_bytes"),
        "default_peak_bytes": timed.get("novatune_default", {}).get("peak_bytes"),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    return entry, by_name


def step_check(step: Callable[[], object], table: dict, reps: int = 3, sync: bool = True,
               settings: Callable[[bool], None] | None = None) -> dict:
    """Time `step` with the defaults and with `table` installed, alternated (default, tuned, default, ...) after
    one warm-up of each; the selection is kept when the tuned median is not slower than the default median.
    `settings(on)` switches the model-level choices (cross-entropy mode, attention backend) with the table."""
    def timed() -> float:
        if sync and torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if sync and torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    prev = dispatch.ACTIVE
    times = {"default": [], "tuned": []}
    try:
        for r in range(reps + 1):
            for name, tbl in (("default", {}), ("tuned", table)):
                dispatch.install(tbl)
                if settings is not None:
                    settings(name == "tuned")
                t = timed()
                if r > 0:  # r == 0 is the warm-up of each
                    times[name].append(t)
    finally:
        dispatch.install(prev)
        if settings is not None:
            settings(False)
    d, t = statistics.median(times["default"]), statistics.median(times["tuned"])
    keep = t <= d
    return {"default_s": round(d, 4), "tuned_s": round(t, 4), "default_all": [round(x, 4) for x in times["default"]],
            "tuned_all": [round(x, 4) for x in times["tuned"]], "kept": keep,
            "reason": (f"tuned step {t * 1e3:.1f} ms <= default {d * 1e3:.1f} ms: selection kept" if keep else
                       f"tuned step {t * 1e3:.1f} ms > default {d * 1e3:.1f} ms: selection dropped, defaults kept")}


def choice_line(entry: dict) -> str:
    """One line per choice for the PatchReport and the tune report."""
    dflt = f"default {entry['default_us']:.1f} µs" if entry.get("default_us") else "default n/a"
    errs = [v for k, v in next(r for r in entry["candidates"] if r["name"] == entry["choice"]).get("errors",
                                                                                                    {}).items()]
    err = f", max rel err {max(errs):.1e}" if errs else ""
    kept = "" if entry.get("kept", True) else f" [dropped: {entry.get('kept_reason', '')}]"
    return (f"{entry['op']} {shape_str(entry['shape'])} {entry['dtype']}: {entry['choice']} "
            f"{entry['chosen_us']:.1f} µs ({dflt}{err}) - {entry['reason']}{kept}")
