"""The tune report: markdown (tune_report.md), the short summary table, and benchmark rows (tune.jsonl)."""
from __future__ import annotations

from novatune.measure.results import write_row
from novatune.tune.calls import shape_str


def _us(v) -> str:
    return f"{v:.1f}" if isinstance(v, (int, float)) else "-"


def summary_rows(entries: list[dict]) -> list[dict]:
    """Per tuned (op, shape): default, chosen and stock times, floor fraction, speed-up over HF eager."""
    out = []
    for e in entries:
        chosen, dflt, stock, floor = e["chosen_us"], e.get("default_us"), e.get("stock_us"), e.get("floor_us")
        out.append({"op": e["op"], "shape": shape_str(e["shape"]), "dtype": e["dtype"], "choice": e["choice"],
                    "default_us": dflt, "chosen_us": chosen, "stock_us": stock,
                    "floor_us": floor, "floor_frac": round(floor / chosen, 3) if floor else None,
                    "x_hf_eager": round(stock / chosen, 2) if stock else None,
                    "kernel_us": e.get("kernel_us", {}), "kept": e.get("kept", True),
                    "calls_per_step": e.get("calls_per_step")})
    return out


def summary_table(entries: list[dict], check: dict | None, tune_s: float) -> str:
    lines = [f"{'op':9s} {'shape':>12s} {'default µs':>11s} {'chosen':>18s} {'chosen µs':>10s} {'floor frac':>10s} "
             f"{'x HF eager':>10s}  kept"]
    for r in summary_rows(entries):
        lines.append(f"{r['op']:9s} {r['shape']:>12s} {_us(r['default_us']):>11s} {r['choice'][:18]:>18s} "
                     f"{_us(r['chosen_us']):>10s} {(r['floor_frac'] or 0):10.3f} {(r['x_hf_eager'] or 0):10.2f}  "
                     f"{'yes' if r['kept'] else 'no'}")
    if check:
        lines.append(f"step: default {check['default_s'] * 1e3:.1f} ms, tuned {check['tuned_s'] * 1e3:.1f} ms -> "
                     f"{'kept' if check['kept'] else 'dropped'}")
    lines.append(f"tune wall time: {tune_s:.1f} s")
    return "\n".join(lines)


def write_rows(path, entries: list[dict], extra: dict) -> None:
    for e in entries:
        for c in e["candidates"]:
            write_row(path, {"bench": "tune", "op": e["op"], "shape": shape_str(e["shape"]), "dtype": e["dtype"],
                             "candidate": c["name"], "family": c["family"], "params": c.get("params"),
                             "status": c["status"], "check": c.get("check"), "reason": c.get("reason"),
                             "median_us": c.get("median_us"), "spread_us": c.get("spread_us"),
                             "wall_us": (c.get("timing") or {}).get("wall_us"),
                             "timing_mode": (c.get("timing") or {}).get("mode"),
                             "kernel_us": c.get("kernel_us"), "floor_us": e.get("floor_us"),
                             "floor_frac": c.get("floor_frac"), "errors": c.get("errors"),
                             "peak_bytes": c.get("peak_bytes"), "excluded": c.get("excluded"),
                             "memory_rule": e.get("memory_rule"),
                             "chosen": c["status"] == "chosen", "kept": e.get("kept"), **extra})
    write_row(path, {"bench": "tune_summary", "ops": summary_rows(entries), **extra})


def markdown(*, config: str, device: str, before, after, targets: list[dict], entries: list[dict], check,
             tune_s: float, patch_report: str, cache_path: str, build: dict, notes: list[str]) -> str:
    md = [f"# novatune tune: {config}", "", f"device: {device} · tune wall time {tune_s:.1f} s · cache "
          f"`{cache_path}`", ""]
    if build:
        md += [f"CUDA extension: {build}", ""]
    for n in notes:
        md.append(f"- note: {n}")
    md += ["", "## Profile (per profiled step)", "", "| kind | before ms | after ms |", "|---|---|---|"]
    kinds = sorted(set(before.by_kind) | set(after.by_kind if after else {}), key=lambda k: -before.by_kind.get(k, 0))
    for k in kinds:
        a = after.by_kind.get(k) if after else None
        md.append(f"| {k} | {before.by_kind.get(k, 0) / 1e3:.2f} | {(a or 0) / 1e3:.2f} |")
    md.append(f"| launch gaps (wall - busy) | {before.gaps_us / 1e3:.2f} | "
              f"{(after.gaps_us / 1e3) if after else 0:.2f} |")
    md.append(f"| wall | {before.wall_us / 1e3:.2f} | {(after.wall_us / 1e3) if after else 0:.2f} |")
    md += ["", f"traces: before `{before.trace}`, after `{after.trace if after else '-'}` (open in "
               f"ui.perfetto.dev or chrome://tracing)", "", "Top modules (before):", ""]
    for m, v in sorted(before.by_module.items(), key=lambda kv: -kv[1])[:12]:
        md.append(f"- {m}: {v / 1e3:.2f} ms")
    md += ["", "## Targets ranked by possible gain", "", "| target | time ms | floor ms | possible gain ms | how |",
           "|---|---|---|---|---|"]
    for t in targets:
        fl = f"{t['floor_us'] / 1e3:.2f}" if t.get("floor_us") is not None else "-"
        md.append(f"| {t['target']} | {t['time_us'] / 1e3:.2f} | {fl} | {t['possible_gain_us'] / 1e3:.2f} | "
                  f"{t['how']} |")
    md += ["", "## Choices", "", "```", summary_table(entries, check, tune_s), "```", ""]
    for e in entries:
        md += [f"### {e['op']} {shape_str(e['shape'])} {e['dtype']} -> {e['choice']}", "",
               f"{e['reason']}" + ("" if e.get("kept", True) else f" - dropped: {e.get('kept_reason')}")
               + (f" ({e['memory_rule']})" if e.get("memory_rule") else ""), "",
               "| candidate | family | status | µs (median ± IQR) | wall µs | kernel µs | floor frac | max rel err |"
               " peak MiB | reason |", "|---|---|---|---|---|---|---|---|---|---|"]
        for c in e["candidates"]:
            t = f"{c['median_us']:.2f} ± {c['spread_us']:.2f}" if c.get("median_us") is not None else "-"
            err = max(c["errors"].values()) if c.get("errors") else None
            md.append(f"| {c['name']} | {c['family']} | {c['status']} | {t} | "
                      f"{_us((c.get('timing') or {}).get('wall_us'))} | {_us(c.get('kernel_us'))} | "
                      f"{c.get('floor_frac', '-')} | {f'{err:.1e}' if err is not None else '-'} | "
                      f"{_us(c['peak_bytes'] / 2**20) if c.get('peak_bytes') is not None else '-'} | "
                      f"{(('[' + c['check'] + '] ') if c.get('check') else '') + (c.get('reason') or '')}"
                      f"{c.get('excluded') or c.get('note') or ''} |")
        md.append("")
    if check:
        md += ["## Whole-step check", "", f"{check['reason']} (default {check['default_all']} s, tuned "
               f"{check['tuned_all']} s, alternated)", ""]
    md += ["## PatchReport", "", "```", patch_report, "```", ""]
    return "\n".join(md)
