"""`novatune bench CONFIG`: the configured workload trained by each stack in its own process, side by side.

Stacks (bench/stacks.py; same config, same seed -> same init and same data; only the kernels differ): stock,
liger-peer, hf-varlen, hf-flex, unsloth, novatune, novatune_full, novatune_eager. A stack that cannot run here (Liger or
Unsloth not installed, novatune_full under QLoRA) gets a row with status "absent" and the reason; it is never
dropped.

Each stack runs `python -m novatune.bench.worker SPEC.json` (bench/worker.py): the run is built by the trainer's
own builder (novatune.train.session.build) and stepped with the session's step, `warm` warm-up steps then `steps`
timed ones. Separate processes keep memory peaks, caches and Liger's process-wide class patching from leaking
between stacks (docs/BENCHMARKS.md rule).

Several GPUs (`--nproc N`): a stack with a parallel strategy (novatune_ddp, novatune_fsdp2) runs its worker under
torchrun with N processes, `grad_accum` micro-batches per rank; every other stack trains the same global batch in
one process (grad_accum x N): the same rows in the same order per optimizer step, so the per-step losses compare
directly and the `novatune` row is the one-process reference of the parallel rows (x_one_process, scaling,
loss_max_rel_diff_vs_one_process). One process at grad_accum x N amortises its optimizer step over more tokens
than one rank does, so the scaling it gives is, if anything, low.

Figures (docs/BENCHMARKS.md): tokens/s = real (non-padding) tokens of the timed steps / their wall time; peak GiB =
torch.cuda.max_memory_allocated() over the timed steps (reset after warm-up) plus what CUDA graphs' private pools
hold beyond it (novatune/measure/gpu_memory.py: a graph's temporaries are not counted as allocated after capture);
FLOPs/token = 6 x matmul params
+ attention causal within documents (novatune.train.metrics.flops_per_token, from the timed batches' own
document lengths); MFU = tokens/s x FLOPs/token / the bf16 rate: on a GPU the driver measures an 8192^3 bf16
matmul once and hands the same figure to every stack (logging.peak_tflops in the config overrides it).

Run directory (schema, for `novatune report` and anyone reading the files):

  <run_dir>/config.yaml        the resolved config (user overrides applied, before the per-stack changes)
  <run_dir>/bench.jsonl        one JSON row per stack, written by measure/results.write_row (time, device,
                               capability, cuda, torch, triton, transformers, liger_kernel, peft, git_sha), also
                               appended to --results where given (e.g. bench/results/bench.jsonl). The worker's fields:
      bench: "novatune_bench", stack: str, status: "ok" | "absent" | "failed", reason: str | null,
      description: str, config: str, overrides: [str], stack_overrides: [str], warm: int, steps: int,
      tok_s: float, timed_s: float, timed_tokens: int, tokens_per_step: [int] (timed steps),
      step_ms: [float] (GPU time of each timed step, CUDA events; empty on the CPU),
      step_s: [float] (every step: warm-up ones by the host clock, synchronised; timed ones from step_ms on a
      GPU, by the host clock on a CPU),
      gflop_per_tok: float, model_tflops: float, mfu: float | null (fraction), peak_tflops: float | null,
      peak_tflops_source: str | null, peak_gib: float | null (max_memory_allocated over the timed steps; null on
      the CPU), peak_reserved_gib: float | null (CUDA graphs replay in a private pool only reserved sees),
      weights_gib: float | null (allocated once the model is built, quantised, wrapped and patched),
      losses: [float] (every optimizer step, warm-up included), grad_norms: [float] (pre-clip), gc_freeze: bool,
      method: str, model_class: str, model_type: str, params: int, trainable_params: int,
      hf_attention: str | null (the model's transformers attention implementation: sdpa, eager, peer_varlen, ...;
      under novatune.patch the patched attention replaces it, attention_backend names what ran), dtype: str,
      device_type: str, seq: int, grad_accum: int, micro_batch: int, gradient_checkpointing: bool,
      memory_policy: str, memory_layers: str ("offload x30, keep x6"), predicted_peak_gib: float (the memory
      planner's, beside peak_gib), predicted_layers_s: float, planner_hardware: str,
      predicted_tokens_per_s: float | null (auto on a GPU: at the measured rates), offloaded_gib: float | null
      (bytes the offload engine moved to the host over the whole process), offload_stats: dict | null,
      nf4_embedding: bool, patch: PatchReport.to_dict() | null, applied: str | null (a peer's patch),
      attention_backend: str | null, cuda_graphs: dict (patched stacks), liger_version: str | null,
      pack: PackStats.to_dict(), memory: dict | str (--memory), profile: dict, trace: str (--profile),
      process_wall_s: float, x_stock: float | null, x_peer: float | null, best_peer: str | null,
      loss_max_rel_diff_vs_stock: float | null   (max over steps of |loss - stock| / |stock|),
      nproc: int (processes that trained the stack; tok_s, timed_tokens and tokens_per_step are their total, mfu
      and peak_gib per process: peak_gib the largest rank's), tok_s_per_proc: float, peak_gib_per_rank: [float],
      x_one_process: float | null (tok_s / the one-process novatune row's, same global batch), scaling: float |
      null (x_one_process / nproc), loss_max_rel_diff_vs_one_process: float | null,
      with --rounds N > 1 (combine_rounds: the row is the median round's, the ratios are between medians; a stack
      with fewer finished rounds than the others, in an interrupted bench, is failed):
      rounds: int, round_tok_s: [float] (each round, in run order), round_spread: float (max / min - 1),
      peak_gib: the largest of any round, loss_max_rel_diff_across_rounds: float | null
  <run_dir>/summary.json       {"config", "overrides", "stacks": [names as given], "warm", "steps", "nproc", "rounds",
                               "peak_tflops", "peak_tflops_source", "rows": [the bench.jsonl rows],
                               "speedup": {"novatune_vs_stock", "novatune_vs_peer", "peer_vs_stock"} (null when a
                               side did not run), "env": results.environment(), "exit_code": int}
  <run_dir>/traces/<stack>.json|.txt   with --profile: one micro-step under torch.profiler after the timed steps
  <run_dir>/memory/<stack>.txt  with --memory: the allocation replay to the peak of one micro-step
  <run_dir>/<stack>/           spec.json (what the worker was asked), result.json (its row, without the
                               environment) and worker.log (its stdout and stderr); with --rounds N > 1 each
                               round's under <run_dir>/round<k>/<stack>/ (--profile and --memory: the last
                               round's, in <run_dir>/traces/ and memory/)

Rounds (--rounds N): a host that drifts during a call (seen: 30% between machines, +20% step time within one
call) skews a ratio of stacks run once each in a fixed order. N rounds run the stacks in alternating order (A B,
B A, ...) and every stack's row is its median round's (of an even count, the slower middle one), with each
round's figure beside it.
"""
from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from novatune.bench.stacks import STACKS, load_plugins
from novatune.parallel.launch import torchrun_command

PEERS = ("liger-peer", "unsloth", "hf-varlen", "hf-flex")  # the stacks x_peer compares with (the fastest that ran)
DIAGNOSTICS = ("profile", "trace", "memory")  # a worker row's --profile / --memory fields (bench/worker.py)


def default_run_dir(kind: str) -> Path:
    return Path("runs") / f"{kind}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"


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
    return {"stack": stack, "status": "absent", "reason": reason, "description": STACKS[stack].description}


def worker_command(spec_path: Path, nproc: int) -> list[str]:
    """One stack's worker: this Python, or torchrun with `nproc` processes for a parallel stack."""
    if nproc > 1:
        return torchrun_command(nproc, [str(spec_path)], module="novatune.bench.worker")
    return [sys.executable, "-m", "novatune.bench.worker", str(spec_path)]


def _wait(proc: subprocess.Popen, timeout: float | None) -> int | None:
    """The worker's exit code; None after a timeout. On a timeout, or when this driver is stopped (SIGTERM,
    Ctrl-C), the worker's whole process group goes (torchrun and its ranks too), so nothing stays on the GPU."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop_group(proc)
        return None
    except BaseException:
        _stop_group(proc)
        raise


def _stop_group(proc: subprocess.Popen) -> None:
    for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=grace)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def run_worker(spec: dict, timeout: float | None) -> dict:
    """One stack in a fresh Python process (or `spec["nproc"]` of them under torchrun); returns its result row
    (status failed, with the log's tail, if the process died or wrote no result)."""
    stack, stack_dir = spec["stack"], Path(spec["stack_dir"])
    stack_dir.mkdir(parents=True, exist_ok=True)
    result_path = stack_dir / "result.json"
    result_path.unlink(missing_ok=True)
    (stack_dir / "spec.json").write_text(json.dumps(spec, indent=1))
    cmd = worker_command(stack_dir / "spec.json", spec.get("nproc", 1))
    env = dict(os.environ)
    # the worker must import this same novatune (a source checkout is not necessarily installed)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # a bench started under torchrun: its workers make their own groups
    log = stack_dir / "worker.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        code = _wait(proc, timeout)
    wall = time.perf_counter() - t0
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
    if result_path.exists():
        row = json.loads(result_path.read_text())
        if code not in (0, None) and row.get("status") == "ok":
            row.update(status="failed",
                       reason=f"worker exited with code {code} after writing its result; log tail:\n{tail}")
    else:
        why = f"timed out after {timeout:.0f} s" if code is None else f"worker exited with code {code}"
        row = {"stack": stack, "status": "failed", "reason": f"{why}, no result.json; log tail:\n{tail}",
               "description": STACKS[stack].description}
    row["process_wall_s"] = round(wall, 2)
    return row


def _max_rel_diff(a: list[float], b: list[float]) -> float | None:
    n = min(len(a), len(b))
    if n == 0:
        return None
    return max(abs(a[i] - b[i]) / max(abs(b[i]), 1e-12) for i in range(n))


def add_ratios(rows: list[dict]) -> dict:
    """x_stock, x_peer (against the fastest peer that ran) and loss_max_rel_diff_vs_stock on every row (null where
    a side did not run)."""
    ok = {r["stack"]: r for r in rows if r.get("status") == "ok"}
    stock = ok.get("stock")
    peers = [ok[p] for p in PEERS if p in ok]
    peer = max(peers, key=lambda r: r["tok_s"]) if peers else None
    for r in rows:
        ran = r.get("status") == "ok"
        r["x_stock"] = round(r["tok_s"] / stock["tok_s"], 4) if stock and ran else None
        r["x_peer"] = round(r["tok_s"] / peer["tok_s"], 4) if peer and ran else None
        r["best_peer"] = peer["stack"] if peer else None
        r["loss_max_rel_diff_vs_stock"] = _max_rel_diff(r["losses"], stock["losses"]) if stock and ran else None
    nova = ok.get("novatune")
    one = nova if nova is not None and nova.get("nproc", 1) == 1 else None
    for r in rows:  # the parallel rows against one process training the same global batch
        parallel = r.get("status") == "ok" and r.get("nproc", 1) > 1 and one is not None
        r["x_one_process"] = round(r["tok_s"] / one["tok_s"], 4) if parallel else None
        r["scaling"] = round(r["tok_s"] / (one["tok_s"] * r["nproc"]), 4) if parallel else None
        r["loss_max_rel_diff_vs_one_process"] = _max_rel_diff(r["losses"], one["losses"]) if parallel else None

    def ratio(a, b):
        return round(a["tok_s"] / b["tok_s"], 4) if a and b else None

    return {"novatune_vs_stock": ratio(nova, stock), "novatune_vs_peer": ratio(nova, peer),
            "peer_vs_stock": ratio(peer, stock)}


def stack_procs(stack: str, nproc: int) -> tuple[int, int]:
    """(processes, grad_accum multiplier) of one stack in a bench with `nproc` processes: a parallel stack runs on
    nproc ranks as configured; any other stack in one process at grad_accum x nproc (the same global batch)."""
    if nproc <= 1:
        return 1, 1
    if STACKS[stack].strategy is not None:
        return nproc, 1
    return 1, nproc


def round_order(stacks: list[str], round_index: int) -> list[str]:
    """The stacks' order in round `round_index` (0-based) of --rounds: as given, then reversed, and so on (A B, B A,
    A B, ...), so every stack runs as often early as late in the call while the host drifts."""
    return list(stacks) if round_index % 2 == 0 else list(reversed(stacks))


def combine_rounds(runs: list[dict], rounds: int | None = None) -> dict:
    """One stack's row from its rounds (run order): the median round's row (the slower middle one for an even count,
    so tok_s, timed_s and step_ms stay one run's figures), with every round's tokens/s (round_tok_s), their spread
    (max / min - 1), the largest peak of any round, and how far the rounds' losses are apart. A round that did not
    run ok makes the stack's row that round's; fewer runs than `rounds` (an interrupted bench) make it failed: a
    median of fewer rounds than the other stacks had is not the comparison asked for."""
    if len(runs) == 1 and (rounds or 1) == 1:
        return runs[0]
    bad = next((r for r in runs if r.get("status") != "ok"), None)
    ok = [r for r in runs if r.get("status") == "ok"]
    tok = [r["tok_s"] for r in ok]
    if bad is not None:
        return {**bad, "rounds": len(runs), "round_tok_s": tok}
    if rounds is not None and len(runs) < rounds:
        return {**runs[-1], "status": "failed", "rounds": len(runs), "round_tok_s": tok,
                "reason": f"bench interrupted after {len(runs)} of {rounds} rounds (tok/s per round: {tok})"}
    median = sorted(ok, key=lambda r: r["tok_s"])[(len(ok) - 1) // 2]
    peaks = [r["peak_gib"] for r in ok if r.get("peak_gib") is not None]
    diffs = [_max_rel_diff(r["losses"], median["losses"]) for r in ok if r is not median]
    diagnosed = {k: runs[-1][k] for k in DIAGNOSTICS if k in runs[-1]}  # --profile / --memory ran in the last round
    return {**median, **diagnosed, "rounds": len(runs), "round_tok_s": tok,
            "round_spread": round(max(tok) / min(tok) - 1, 4),
            "peak_gib": max(peaks) if peaks else median.get("peak_gib"),
            "loss_max_rel_diff_across_rounds": max((d for d in diffs if d is not None), default=None)}


def _run_stacks(runs: dict[str, list[dict]], cfg, spec: dict, stacks: list[str], run_dir: Path, timeout, log,
                rounds: int = 1) -> None:
    """Each stack once per round, in round_order; each run's row is appended to runs[stack]. An absent or failed
    stack is not run again (its row is that run's). --profile and --memory run in the last round only, into
    run_dir's traces/ and memory/ (where `novatune report` reads them)."""
    for index in range(rounds):
        last = index == rounds - 1
        round_spec = spec if rounds == 1 else {**spec, "diag_dir": str(run_dir),
                                               "profile": spec.get("profile") and last,
                                               "memory": spec.get("memory") and last}
        for stack in round_order(stacks, index):
            if runs[stack] and runs[stack][-1]["status"] != "ok":
                continue  # what made it absent (a package, the config) or fail does not change between rounds
            runs[stack].append(_run_one(stack, cfg, round_spec,
                                        run_dir if rounds == 1 else run_dir / f"round{index + 1}", timeout, log,
                                        f" (round {index + 1} of {rounds})" if rounds > 1 else ""))


def _run_one(stack: str, cfg, spec: dict, stack_root: Path, timeout, log, what: str) -> dict:
    why = STACKS[stack].unavailable(cfg) if STACKS[stack].unavailable is not None else None
    procs, times = stack_procs(stack, spec.get("nproc", 1))
    if why is not None:
        row = _absent_row(stack, why)
    else:
        on = f" on {procs} processes" if procs > 1 else (f" in one process, grad_accum x {times} (the same "
                                                          f"global batch)" if times > 1 else "")
        log(f"[{stack}] running {spec['warm']} warm-up + {spec['steps']} timed steps{on}{what} (log: "
            f"{stack_root / stack / 'worker.log'})")
        row = run_worker({**spec, "stack": stack, "stack_dir": str(stack_root / stack), "nproc": procs,
                          "grad_accum_times": times}, timeout)
    row.setdefault("config", spec["config"] or "<demo>")
    row.setdefault("nproc", procs)
    log(f"[{stack}] {row['status']}" + (f": {row['tok_s']:,.0f} tok/s, peak {row.get('peak_gib')} GiB, step ms "
                                         f"{row.get('step_ms')}" if row["status"] == "ok" else
                                         f": {row.get('reason', '')[:400]}"))
    return row


def run_bench(config: str | None, overrides: list[str], stacks: list[str], run_dir: Path, warm: int, steps: int,
              timeout: float | None = None, profile: bool = False, log=print, results: str | None = None,
              memory: bool = False, gc_freeze: bool = True, diag: bool = False, nproc: int = 1,
              rounds: int = 1) -> dict:
    """Run every stack (one process each; a parallel stack on `nproc` under torchrun) `rounds` times, in
    round_order, and write the run directory described above; returns the summary. `results`: a .jsonl file the
    rows are appended to as well (the repository's bench/results/)."""
    from novatune.train.config import load_with_base, to_yaml

    load_plugins()
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
    spec = {"config": str(config) if config else None, "overrides": list(overrides), "warm": warm, "steps": steps,
            "peak_tflops": peak, "peak_source": source, "profile": profile, "memory": memory,
            "gc_freeze": gc_freeze, "diag": diag, "nproc": nproc}
    # SIGTERM (e.g. `timeout` around the bench) becomes SystemExit while the stacks run, so the running worker is
    # stopped instead of left on the GPU behind the dead driver; once they are done it waits until the rows are
    # written (measured: a `timeout` that fired after the last round had finished lost every round's rows), then
    # ends the bench as it would have
    writing, late = [False], []

    def on_sigterm(*_):
        if writing[0]:
            late.append(143)
        else:
            sys.exit(143)

    prev = signal.signal(signal.SIGTERM, on_sigterm)
    runs: dict[str, list[dict]] = {s: [] for s in stacks}
    stopped: BaseException | None = None
    try:
        try:
            _run_stacks(runs, cfg, spec, stacks, run_dir, timeout, log, rounds)
        except (SystemExit, KeyboardInterrupt) as e:  # keep what ran; a stack that has no finished run says so
            stopped = e
        finally:
            writing[0] = True
        summary = _write_rows(runs, stacks, rounds, stopped, run_dir, results, config, overrides, warm, steps, nproc,
                              peak, source)
    finally:
        signal.signal(signal.SIGTERM, prev)
    if stopped is not None:
        raise stopped
    if late:
        raise SystemExit(late[0])
    return summary


def _write_rows(runs: dict[str, list[dict]], stacks: list[str], rounds: int, stopped: BaseException | None,
                run_dir: Path, results: str | None, config, overrides, warm: int, steps: int, nproc: int, peak,
                source) -> dict:
    """Each stack's row (combine_rounds), written to the run directory's bench.jsonl and to `results`, and the
    summary.json beside them; returns the summary."""
    from novatune.measure.results import environment, write_row

    rows = [combine_rounds(runs[s], rounds if stopped is not None else None) if runs[s] else
            {"stack": s, "status": "failed", "reason": "bench interrupted (SIGTERM / Ctrl-C) before this stack "
             "finished", "description": STACKS[s].description} for s in stacks]
    speedup = add_ratios(rows)
    written = [write_row(run_dir / "bench.jsonl", {"bench": "novatune_bench", **r}) for r in rows]
    if results:
        for r in written:
            write_row(results, {k: v for k, v in r.items() if k != "time"})
    failed = [r["stack"] for r in rows if r["status"] == "failed"]
    summary = {"config": str(config) if config else "<demo>", "overrides": list(overrides), "stacks": stacks,
               "warm": warm, "steps": steps, "nproc": nproc, "rounds": rounds, "peak_tflops": peak,
               "peak_tflops_source": source,
               "rows": written,
               "speedup": speedup, "env": environment(), "exit_code": 1 if failed else 0}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def render_table(summary: dict) -> str:
    """The side-by-side table: one line per stack, then the per-step losses."""
    lines = [(f"{'stack':14s} {'status':7s} {'tok/s':>9s} {'x stock':>8s} {'x peer':>7s} {'MFU':>6s} "
              f"{'peak GiB':>9s} {'GFLOP/tok':>9s} {'loss vs stock':>13s} {'plan GiB':>9s}")]
    for r in summary["rows"]:
        if r["status"] != "ok":
            lines.append(f"{r['stack']:14s} {r['status']:7s} {r.get('reason', '').splitlines()[0][:90]}")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        lines.append(f"{r['stack']:14s} {'ok':7s} {r['tok_s']:9,.0f} {_fmt(r['x_stock'], '8.3f', '       -')} "
                     f"{_fmt(r['x_peer'], '7.3f', '      -')} {mfu:>6s} {_fmt(r.get('peak_gib'), '9.2f', '        -')} "
                     f"{_fmt(r.get('gflop_per_tok'), '9.3g', '        -')} "
                     f"{_fmt(r.get('loss_max_rel_diff_vs_stock'), '13.2e', '            -')} "
                     f"{_fmt(r.get('predicted_peak_gib'), '9.2f', '        -')}")
    ok = [r for r in summary["rows"] if r["status"] == "ok"]
    if ok:
        lines.append(f"per-step loss (steps 1..{len(ok[0]['losses'])}: the first {summary['warm']} warm-up):")
        for r in ok:
            lines.append(f"  {r['stack']:14s} " + " ".join(f"{x:.4f}" for x in r["losses"]))
    for r in ok:
        if r.get("nproc", 1) > 1:
            lines.append(f"{r['stack']} on {r['nproc']} processes: {r['tok_s_per_proc']:,.0f} tok/s per process, "
                         f"{_fmt(r.get('x_one_process'), '.3f')}x one process at the same global batch (scaling "
                         f"{_fmt(r.get('scaling'), '.3f')}), losses within "
                         f"{_fmt(r.get('loss_max_rel_diff_vs_one_process'), '.2e')} of one process's, peak GiB "
                         f"per rank {r.get('peak_gib_per_rank')}")
    if summary.get("rounds", 1) > 1:
        even = " (of an even count, the slower middle one)" if summary["rounds"] % 2 == 0 else ""
        lines.append(f"{summary['rounds']} rounds in alternating order; each row is its stack's median round{even}. "
                     "tok/s per round (run order):")
        for r in ok:
            lines.append(f"  {r['stack']:14s} " + " ".join(f"{x:,.0f}" for x in r.get("round_tok_s", [])) +
                         f"  (spread {100 * r.get('round_spread', 0.0):.1f}%)")
    sp = summary["speedup"]
    lines.append("speedup: novatune/stock " + _fmt(sp["novatune_vs_stock"], ".3f") + ", novatune/peer "
                 + _fmt(sp["novatune_vs_peer"], ".3f") + ", peer/stock " + _fmt(sp["peer_vs_stock"], ".3f"))
    return "\n".join(lines)
