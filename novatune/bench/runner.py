"""`novatune bench CONFIG`: the configured workload trained by each stack in its own process, side by side.

Stacks (same config, same seed -> same init and same data; only the kernels differ):
  stock       HF as shipped: model.patch=false, model.attention=sdpa (documents found from position_ids)
  liger-peer  the best peer of BENCHMARKS.md: Liger kernels + torch varlen attention (bench/peer.py); needs
              liger_kernel: where it is not installed the row says so (status "absent"), it is never dropped
  novatune    novatune.patch(model, **model.patch_options)

Each stack runs `python -m novatune.bench.worker`, which trains with the real trainer
(novatune.train.loop.train) for `warm + steps` optimizer steps and times the last `steps` through the loop's
step_hook (synchronised at both ends). Separate processes keep memory peaks, caches and Liger's process-wide class
patching from leaking between stacks (BENCHMARKS.md rule).

Figures (BENCHMARKS.md): tokens/s = real (non-padding) tokens of the timed steps / their wall time; peak GiB =
torch.cuda.max_memory_allocated() over the timed steps (reset after warm-up); FLOPs/token = 6 x matmul params
+ attention causal within documents (novatune.train.metrics.flops_per_token, from the timed batches' own
document lengths); MFU = tokens/s x FLOPs/token / the bf16 rate: on a GPU the driver measures an 8192^3 bf16
matmul once and hands the same figure to every stack (logging.peak_tflops in the config overrides it).

Run directory (schema, for `novatune report` and anyone reading the files):

  <run_dir>/config.yaml        the resolved config (user overrides applied, before the per-stack changes)
  <run_dir>/bench.jsonl        one JSON row per stack (measure/results.write_row: time, device, capability, cuda,
                               torch, triton, transformers, liger_kernel, peft, git_sha), with the worker's fields:
      bench: "novatune_bench", stack: str, status: "ok" | "absent" | "failed", reason: str | null,
      description: str, config: str, overrides: [str], stack_overrides: [str], warm: int, steps: int,
      tok_s: float, timed_s: float, timed_tokens: int, tokens_per_step: [int] (timed steps),
      step_s: [float] (every step, warm-up included; step 1 includes optimizer creation),
      gflop_per_tok: float, model_tflops: float | null, mfu: float | null (fraction), peak_tflops: float | null,
      peak_tflops_source: str | null, peak_gib: float | null (null on the CPU),
      losses: [float] (every step: warm-up, timed, and with --profile the profiled step after them),
      grad_norms: [float] (pre-clip, every step),
      model_class: str, model_type: str, params: int, trainable_params: int, dtype: str, device_type: str,
      patch: PatchReport.to_dict() | null, attention_backend: str | null, liger_applied: str | null,
      pack: PackStats.to_dict(), trace: str | null (with --profile), x_stock: float | null, x_peer: float | null,
      loss_max_rel_diff_vs_stock: float | null   (max over steps of |loss - stock| / |stock|)
  <run_dir>/summary.json       {"config", "overrides", "stacks": [names in run order], "warm", "steps",
                               "peak_tflops", "peak_tflops_source", "rows": [the bench.jsonl rows],
                               "speedup": {"novatune_vs_stock", "novatune_vs_peer", "peer_vs_stock"} (null when a
                               side did not run), "env": results.environment(), "exit_code": int}
  <run_dir>/traces/<stack>.json   with --profile: torch.profiler Chrome trace of one optimizer step, run after
                               the timed steps (so profiling never slows the timed ones)
  <run_dir>/<stack>/           the trainer's own output: config.yaml (with the stack's changes), metrics.jsonl
                               (one row per step: loss, lr, grad_norm, tokens, tokens_per_s, mfu, mem_gib),
                               summary.json; plus the worker's result.json (the row above, without the
                               environment) and worker.log (its stdout and stderr)
"""
from __future__ import annotations

import datetime
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

STACKS: dict[str, dict] = {
    "stock": {"overrides": ["model.patch=false", "model.attention=sdpa"],
              "description": "HF stock, attn_implementation=sdpa"},
    "liger-peer": {"overrides": ["model.patch=false", "model.attention=sdpa"],
                   "description": "Liger kernels + torch varlen attention (the best peer)"},
    "novatune": {"overrides": ["model.patch=true"], "description": "novatune.patch(model, **model.patch_options)"},
}


def default_run_dir(kind: str) -> Path:
    return Path("runs") / f"{kind}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"


def parse_stacks(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in STACKS]
    if bad or not names:
        raise ValueError(f"unknown stack(s) {bad or text!r}; choose from {', '.join(STACKS)}")
    return names


def measure_peak_tflops() -> tuple[float | None, str | None]:
    """The MFU denominator for every stack: one 8192^3 bf16 matmul timing on this GPU (None on the CPU)."""
    import torch

    if not torch.cuda.is_available():
        return None, None
    from novatune.measure.timing import matmul_tflops

    rate = matmul_tflops()
    torch.cuda.empty_cache()  # the workers need the memory; only the CUDA context stays in this process
    return rate, "measured: 8192^3 bf16 matmul in the bench driver"


def _absent_row(stack: str, reason: str) -> dict:
    return {"stack": stack, "status": "absent", "reason": reason, "description": STACKS[stack]["description"]}


def run_worker(stack: str, config: str | None, overrides: list[str], stack_dir: Path, warm: int, steps: int,
               peak: float | None, peak_source: str | None, timeout: float | None, profile: bool = False) -> dict:
    """One stack in a fresh Python process; returns its result row (status failed, with the log's tail, if the
    process died or wrote no result)."""
    stack_dir.mkdir(parents=True, exist_ok=True)
    result_path = stack_dir / "result.json"
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "novatune.bench.worker", "--stack", stack, "--stack-dir", str(stack_dir),
           "--warm", str(warm), "--steps", str(steps)]
    if config is not None:
        cmd += ["--config", str(config)]
    for o in overrides:
        cmd += ["--set", o]
    if peak is not None:
        cmd += ["--peak-tflops", repr(peak), "--peak-source", peak_source or "given"]
    if profile:
        cmd.append("--profile")
    env = dict(os.environ)
    # the worker must import this same novatune (a source checkout is not necessarily installed)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    log = stack_dir / "worker.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
    wall = time.perf_counter() - t0
    if result_path.exists():
        row = json.loads(result_path.read_text())
        if code not in (0, None) and row.get("status") == "ok":
            row.update(status="failed", reason=f"worker exited with code {code} after writing its result")
    else:
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        why = f"timed out after {timeout:.0f} s" if code is None else f"worker exited with code {code}"
        row = {"stack": stack, "status": "failed", "reason": f"{why}, no result.json; log tail:\n{tail}",
               "description": STACKS[stack]["description"]}
    row["process_wall_s"] = round(wall, 2)
    return row


def _max_rel_diff(a: list[float], b: list[float]) -> float | None:
    n = min(len(a), len(b))
    if n == 0:
        return None
    return max(abs(a[i] - b[i]) / max(abs(b[i]), 1e-12) for i in range(n))


def add_ratios(rows: list[dict]) -> dict:
    """x_stock, x_peer and loss_max_rel_diff_vs_stock on every row (null where a side did not run)."""
    ok = {r["stack"]: r for r in rows if r.get("status") == "ok"}
    stock, peer = ok.get("stock"), ok.get("liger-peer")
    for r in rows:
        ran = r.get("status") == "ok"
        r["x_stock"] = round(r["tok_s"] / stock["tok_s"], 4) if stock and ran else None
        r["x_peer"] = round(r["tok_s"] / peer["tok_s"], 4) if peer and ran else None
        r["loss_max_rel_diff_vs_stock"] = _max_rel_diff(r["losses"], stock["losses"]) if stock and ran else None
    nova = ok.get("novatune")
    ratio = lambda a, b: round(a["tok_s"] / b["tok_s"], 4) if a and b else None  # noqa: E731
    return {"novatune_vs_stock": ratio(nova, stock), "novatune_vs_peer": ratio(nova, peer),
            "peer_vs_stock": ratio(peer, stock)}


def _run_stacks(rows: list, config, overrides, stacks, run_dir, warm, steps, peak, source, timeout, profile,
                log) -> None:
    for stack in stacks:
        if stack == "liger-peer" and importlib.util.find_spec("liger_kernel") is None:
            row = _absent_row(stack, "liger_kernel is not installed (pip install liger-kernel): the peer stack "
                                     "did not run")
        else:
            log(f"[{stack}] running {warm} warm-up + {steps} timed steps (log: {run_dir / stack / 'worker.log'})")
            row = run_worker(stack, config, overrides, run_dir / stack, warm, steps, peak, source, timeout,
                             profile)
        row.setdefault("config", str(config) if config else "<demo>")
        log(f"[{stack}] {row['status']}" + (f": {row['tok_s']:,.0f} tok/s" if row["status"] == "ok" else
                                             f": {row.get('reason', '')[:400]}"))
        rows.append(row)


def run_bench(config: str | None, overrides: list[str], stacks: list[str], run_dir: Path, warm: int, steps: int,
              timeout: float | None = None, profile: bool = False, log=print) -> dict:
    """Run every stack (one process each) and write the run directory described above; returns the summary."""

    from novatune.train.config import load_with_base
    from novatune.measure.results import environment, write_row
    from novatune.train.config import to_yaml

    cfg, _ = load_with_base(config, list(overrides))
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    if cfg.logging.peak_tflops:
        peak, source = cfg.logging.peak_tflops, "config: logging.peak_tflops"
    else:
        peak, source = measure_peak_tflops()
    if peak:
        log(f"MFU denominator: {peak:.1f} TFLOP/s ({source})")
    # SIGTERM (e.g. `timeout` around the bench) becomes SystemExit, so subprocess.run kills the running worker
    # instead of leaving it on the GPU behind the dead driver
    prev = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows: list[dict] = []
    stopped = None
    try:
        _run_stacks(rows, config, overrides, stacks, run_dir, warm, steps, peak, source, timeout, profile, log)
    except (SystemExit, KeyboardInterrupt) as e:  # keep what ran; the stacks that did not say so
        stopped = e
        rows += [{"stack": s, "status": "failed", "reason": "bench interrupted (SIGTERM / Ctrl-C) before this stack "
                  "finished", "description": STACKS[s]["description"]} for s in stacks[len(rows):]]
    finally:
        signal.signal(signal.SIGTERM, prev)
    speedup = add_ratios(rows)
    written = [write_row(run_dir / "bench.jsonl", {"bench": "novatune_bench", **r}) for r in rows]
    failed = [r["stack"] for r in rows if r["status"] == "failed"]
    summary = {"config": str(config) if config else "<demo>", "overrides": list(overrides), "stacks": stacks,
               "warm": warm, "steps": steps, "peak_tflops": peak, "peak_tflops_source": source, "rows": written,
               "speedup": speedup, "env": environment(), "exit_code": 1 if failed else 0}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    if stopped is not None:
        raise stopped
    return summary


def _fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def render_table(summary: dict) -> str:
    """The side-by-side table: one line per stack, then the per-step losses."""
    lines = [f"{'stack':11s} {'status':7s} {'tok/s':>9s} {'x stock':>8s} {'x peer':>7s} {'MFU':>6s} "
             f"{'peak GiB':>9s} {'GFLOP/tok':>9s} {'loss vs stock':>13s}"]
    for r in summary["rows"]:
        if r["status"] != "ok":
            lines.append(f"{r['stack']:11s} {r['status']:7s} {r.get('reason', '').splitlines()[0][:90]}")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        lines.append(f"{r['stack']:11s} {'ok':7s} {r['tok_s']:9,.0f} {_fmt(r['x_stock'], '8.3f', '       -')} "
                     f"{_fmt(r['x_peer'], '7.3f', '      -')} {mfu:>6s} {_fmt(r.get('peak_gib'), '9.2f', '        -')} "
                     f"{r['gflop_per_tok']:9.3g} {_fmt(r['loss_max_rel_diff_vs_stock'], '13.2e', '            -')}")
    ok = [r for r in summary["rows"] if r["status"] == "ok"]
    if ok:
        prof = "; the last, profiled" if ok[0].get("trace") else ""
        lines.append(f"per-step loss (steps 1..{len(ok[0]['losses'])}: the first {summary['warm']} warm-up{prof}):")
        for r in ok:
            lines.append(f"  {r['stack']:11s} " + " ".join(f"{x:.4f}" for x in r["losses"]))
    sp = summary["speedup"]
    lines.append("speedup: novatune/stock " + _fmt(sp["novatune_vs_stock"], ".3f") + ", novatune/peer "
                 + _fmt(sp["novatune_vs_peer"], ".3f") + ", peer/stock " + _fmt(sp["peer_vs_stock"], ".3f"))
    return "\n".join(lines)
