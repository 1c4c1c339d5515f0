"""The results page: markdown tables rendered from the rows in bench/results/*.jsonl.

The page is generated, never hand-edited: every figure on it is a field of a row a benchmark wrote, and every
table line names the git sha, device and date of its row. It measures nothing and imports nothing heavy.

Row kinds (recognised by file name and by `bench`):
- `e2e.jsonl` / `bench.jsonl`: one row per training stack in a side-by-side call (`tok_s`, `mfu`, `peak_gib`,
  `losses`); rows of `novatune bench --nproc N` (a row with `nproc` > 1 and the one-process rows of its bench)
  go to a table of their own, with the scaling the bench computed against one process at the same global batch.
  A call is a run of consecutive rows: `run_index` restarting (or not increasing), another git sha, or more than
  CALL_GAP_S between two rows without `run_index` starts the next one. "x stock" and the loss difference
  are computed inside one call against the stock row of the same workload, because only ratios from one call
  compare (machines of one kind differ in host speed from day to day).
- `ops.jsonl`: one row per (op, shape, candidate); launch-config sweeps (`phase` rows) are counted, not tabulated.
- `attention.jsonl`, `tune.jsonl` (`tune_summary` rows), `train.jsonl`, `validate.jsonl`, `eval.jsonl`.
Any other file is listed with its row count, so nothing in the folder goes unmentioned.
"""
from __future__ import annotations

import datetime
import json
from pathlib import Path

CALL_GAP_S = 180.0
STOCK_STACKS = ("hf_sdpa", "stock")
PEER_STACKS = ("varlen_liger", "liger-peer")
STACK_NAMES = {
    "hf_sdpa": "stock HF (sdpa)", "stock": "stock HF (sdpa)",
    "varlen_liger": "Liger + varlen (peer)", "liger-peer": "Liger + varlen (peer)",
    "novatune": "novatune", "novatune_eager": "novatune, no CUDA graphs", "novatune_full": "novatune, full FT",
    "novatune_offload": "novatune, offload", "novatune_selective": "novatune, selective recompute",
    "novatune_recompute_mlp": "novatune, MLP recomputed",
    "novatune_keep": "novatune, no recompute", "novatune_auto": "novatune, memory planner",
    "novatune_ddp": "novatune, DDP", "novatune_fsdp2": "novatune, FSDP2",
}
RENDERED = ("e2e", "bench", "ops", "attention", "tune", "train", "validate", "eval")


def load_rows(path: Path) -> list[dict]:
    """Rows of one .jsonl file; a line that is not a JSON object raises, naming the file and line."""
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not a JSON line ({e.msg}); repair or remove that line") from e
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{number}: a result row must be a JSON object")
        rows.append(row)
    return rows


def fmt(value, digits: int = 2) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value).replace("|", "/")


def table(header: list[str], lines: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(cell if isinstance(cell, str) else fmt(cell) for cell in line) + " |" for line in lines]
    return out + [""]


def when(row: dict) -> str:
    return str(row.get("time", ""))[:16].replace("T", " ") or "-"


def provenance(row: dict) -> list[str]:
    return [f"`{row.get('git_sha', 'unknown')}`", fmt(row.get("device")), when(row)]


def _seconds(row: dict) -> float | None:
    try:
        return datetime.datetime.fromisoformat(str(row["time"])).timestamp()
    except (KeyError, ValueError):
        return None


def _starts_call(prev: dict, row: dict) -> bool:
    if "call" in row or "call" in prev:  # rows that name their call (an A/B of two trees shares one)
        return row.get("call") != prev.get("call")
    if row.get("git_sha") != prev.get("git_sha"):
        return True
    if "run_index" in row and "run_index" in prev:
        return row["run_index"] <= prev["run_index"]
    t0, t1 = _seconds(prev), _seconds(row)
    return t0 is None or t1 is None or t1 - t0 > CALL_GAP_S


def split_calls(rows: list[dict]) -> list[list[dict]]:
    """Consecutive rows of one side-by-side call (see the module docstring for the rule)."""
    calls: list[list[dict]] = []
    for row in rows:
        if calls and not _starts_call(calls[-1][-1], row):
            calls[-1].append(row)
        else:
            calls.append([row])
    return calls


def workload(row: dict) -> str:
    """The training workload a stack row measured, e.g. `qwen3-4b 4096 full` or `qwen3-8b 2048 QLoRA r16`."""
    if row.get("bench") == "novatune_bench":
        return " ".join([str(row.get("config", "?"))] + list(row.get("overrides") or []))
    rank = row.get("lora") or 0
    method = "full" if rank == 0 else (f"QLoRA r{rank}" if row.get("qlora") else f"LoRA r{rank}")
    if row.get("stack") == "novatune_full":
        method = "full"
    extra = "" if row.get("ckpt", True) else " no-ckpt"
    return f"{row.get('arch', '?')} {row.get('seq', '?')} {method}{extra}"


def _loss_diff(losses: list | None, stock: list | None) -> float | None:
    """Largest relative per-step loss difference over the steps both rows logged."""
    if not losses or not stock:
        return None
    number = (int, float)
    pairs = [(a, b) for a, b in zip(losses, stock, strict=False)
             if isinstance(a, number) and isinstance(b, number) and b]
    return max(abs(a - b) / abs(b) for a, b in pairs) if pairs else None


def stack_lines(call: list[dict]) -> list[tuple[dict, list]]:
    """(row, table line) per row of a call: ratios and loss difference against the same workload's stock row."""
    stock: dict[str, dict] = {}
    peer: dict[str, dict] = {}
    for r in call:  # the first stock / peer row of a workload is the one the others are compared with
        if r.get("tok_s") and r.get("stack") in STOCK_STACKS:
            stock.setdefault(workload(r), r)
        if r.get("tok_s") and r.get("stack") in PEER_STACKS:
            peer.setdefault(workload(r), r)
    lines = []
    for row in call:
        base, best = stock.get(workload(row)), peer.get(workload(row))
        tok_s = row.get("tok_s")
        ok = row.get("status", "ok") == "ok" and tok_s
        x_stock = tok_s / base["tok_s"] if ok and base else None
        x_peer = tok_s / best["tok_s"] if ok and best else None
        diff = _loss_diff(row.get("losses"), base.get("losses")) if base and base is not row else None
        stack = STACK_NAMES.get(str(row.get("stack")), fmt(row.get("stack")))
        if not ok:
            stack += f" ({row.get('status')}: {fmt(row.get('reason'))})"
        diff_text = "-" if diff is None else f"{diff:.1e}"
        lines.append((row, [stack, workload(row), _tok_s_cell(row), fmt(x_stock, 3), fmt(x_peer, 3),
                            fmt(row.get("mfu"), 3), fmt(row.get("peak_gib")), diff_text, *provenance(row)]))
    return lines


def _tok_s_cell(row: dict) -> str:
    """tok/s, and for a row of `novatune bench --rounds N` the N rounds' figures it is the median of."""
    text = fmt(row.get("tok_s"), 0)
    if (row.get("rounds") or 1) > 1 and row.get("round_tok_s") and row.get("status", "ok") == "ok":
        text += " (median of " + " / ".join(fmt(x, 0) for x in row["round_tok_s"]) + ")"
    return text


STACK_HEADER = ["stack", "workload", "tok/s", "x stock", "x peer", "MFU", "peak GiB", "loss diff vs stock",
                "git sha", "device", "date (UTC)"]


def section_of(row: dict) -> str:
    if row.get("bench") == "novatune_bench":
        return "novatune bench"
    if row.get("qlora"):
        return "QLoRA"
    if (row.get("lora") or 0) > 0 and row.get("stack") != "novatune_full":
        return "LoRA"
    if row.get("arch") == "qwen3-4b" and row.get("seq") == 4096:
        return "Headline: Qwen3-4B full fine-tuning"
    return "Other architectures"


SECTION_ORDER = ["Headline: Qwen3-4B full fine-tuning", "LoRA", "QLoRA", "novatune bench", "Other architectures"]


def several_processes(row: dict, parallel_runs: set) -> bool:
    """A row of a `novatune bench --nproc N` run: trained on N processes, or the one-process reference beside
    them (the same bench run: its rows share their time and config)."""
    return (row.get("nproc") or 1) > 1 or (row.get("time"), row.get("config")) in parallel_runs


PARALLEL_HEADER = ["stack", "workload", "processes", "grad_accum", "tok/s", "tok/s per process",
                   "x one process", "scaling", "peak GiB per rank", "loss diff vs one process", "git sha", "device",
                   "date (UTC)"]


def render_parallel(rows: list[dict]) -> list[str]:
    """`novatune bench --nproc N` rows, newest first: the parallel stacks beside one process training the same
    global batch (the bench's own x_one_process, scaling and loss difference)."""
    if not rows:
        return []
    lines = []
    for r in newest_first(rows):
        ok = r.get("status", "ok") == "ok"
        stack = STACK_NAMES.get(str(r.get("stack")), fmt(r.get("stack")))
        if not ok:
            stack += f" ({r.get('status')}: {fmt(r.get('reason'))})"
        diff = r.get("loss_max_rel_diff_vs_one_process")
        lines.append([stack, workload(r), fmt(r.get("nproc") or 1), fmt(r.get("grad_accum")), fmt(r.get("tok_s"), 0),
                      fmt(r.get("tok_s_per_proc"), 0), fmt(r.get("x_one_process"), 3), fmt(r.get("scaling"), 3),
                      fmt(r.get("peak_gib")), "-" if diff is None else f"{diff:.1e}", *provenance(r)])
    return ["## Several GPUs (`novatune bench --nproc N`)", "",
            "The parallel stacks on N processes (grad_accum micro-batches per rank) beside one process training the "
            "same global batch (grad_accum x N) in the same bench: `x one process` is their tok/s ratio, `scaling` "
            "that ratio per process; the peak is the largest rank's.", ""] + table(PARALLEL_HEADER, lines)


def render_stacks(rows: list[dict]) -> list[str]:
    """Training-speed tables by workload kind, newest call first, rows of a call in the order they ran; the rows
    of several processes in their own table."""
    # a bench writes all its rows at its end: one (time, config) per bench run
    parallel_runs = {(r.get("time"), r.get("config")) for r in rows if (r.get("nproc") or 1) > 1}
    parallel = [r for r in rows if several_processes(r, parallel_runs)]
    rows = [r for r in rows if not several_processes(r, parallel_runs)]
    by_section: dict[str, list[list]] = {}
    for call in reversed(split_calls(rows)):
        for row, line in stack_lines(call):
            by_section.setdefault(section_of(row), []).append(line)
    out = ["## Training speed, side by side", "",
           "Each stack runs in its own process inside one call; `x stock`, `x peer` and the loss difference are "
           "taken against rows of the same call and workload. Peak is `torch.cuda.max_memory_allocated()`, plus the "
           "CUDA graphs' pools from the rows of session 21 on.", ""]
    for name in SECTION_ORDER:
        if name in by_section:
            out += [f"### {name}", ""] + table(STACK_HEADER, by_section[name])
    return out + render_parallel(parallel)


def shape_label(row: dict) -> str:
    shape = row.get("shape")
    if isinstance(shape, dict):
        return "x".join(str(v) for v in shape.values())
    if isinstance(shape, list):
        return "x".join(str(v) for v in shape)
    if "rows" in row and "n" in row:
        return f"{row['rows']}x{row['n']}"
    return fmt(shape)


def _ops_call(row: dict) -> tuple:
    """The call an ops row belongs to: the `call` it names (an A/B of two trees shares one, across hours), else
    its git sha and hour."""
    if "call" in row:
        return ("call", row["call"])
    return (row.get("git_sha"), row.get("time", "")[:13])


def render_ops(rows: list[dict]) -> list[str]:
    """Per (op, shape): the candidates of its newest call (the `call` field, else sha and hour), fwd+bwd
    together."""
    sweeps = [r for r in rows if "phase" in r]
    latest: dict[tuple, list[dict]] = {}
    for row in rows:
        if "phase" in row or not row.get("candidate"):
            continue
        key = (row.get("op") or row.get("bench"), shape_label(row))
        group = latest.setdefault(key, [])
        if group and _ops_call(group[0]) != _ops_call(row):
            group.clear()  # a newer call of this op and shape replaces the older one
        group.append(row)
    lines = []
    for (op, shape), group in sorted(latest.items()):
        for row in group:
            floor = row.get("frac_of_floor", row.get("frac_floor"))
            candidate = row["candidate"] + (f" ({row['mode']})" if row.get("mode") else "")
            if row.get("absent"):
                candidate += f" - absent: {row['absent']}"
            lines.append([op, shape, candidate, fmt(row.get("kernel_us"), 1), fmt(row.get("wall_us"), 1),
                          fmt(floor, 3), fmt(row.get("peak_mib"), 0), *provenance(row)])
    return ["## Operators (fwd+bwd at the model's shapes)", "",
            "Kernel µs: the GPU kernels' own time; wall µs: median time of the call including launch overhead; "
            "floor fraction: the HBM floor (bytes that must move / copy bandwidth measured in the same call) over "
            f"kernel time. Newest call per op and shape. {len(sweeps)} launch-config sweep rows are not tabulated.",
            ""] + table(["op", "shape", "candidate", "kernel µs", "wall µs", "floor fraction", "peak MiB",
                         "git sha", "device", "date (UTC)"], lines)


def newest_first(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: str(r.get("time", "")), reverse=True)


def render_attention(rows: list[dict]) -> list[str]:
    lines = [[fmt(r.get("candidate")), f"{r.get('batch')}x{r.get('seq')} Hq{r.get('hq')}/Hkv{r.get('hkv')} "
              f"d{r.get('head_dim')}", fmt(r.get("fwd_tflops"), 1), fmt(r.get("fwd_bwd_tflops"), 1),
              fmt(r.get("fwd_bwd_ms"), 3), *provenance(r)] for r in newest_first(rows)]
    return ["## Attention on packed rows", "", f"Useful causal TFLOP/s ({fmt(rows[0].get('flops_convention'))}).",
            ""] + table(["candidate", "shape", "fwd TFLOP/s", "fwd+bwd TFLOP/s", "fwd+bwd ms", "git sha",
                         "device", "date (UTC)"], lines)


def render_tune(rows: list[dict]) -> list[str]:
    lines = []
    for row in newest_first(rows):
        if row.get("bench") != "tune_summary":
            continue
        for op in row.get("ops", []):
            lines.append([fmt(op.get("op")), fmt(op.get("shape")), fmt(op.get("choice")), fmt(op.get("chosen_us"), 1),
                          fmt(op.get("stock_us"), 1), fmt(op.get("x_hf_eager")), fmt(op.get("floor_frac"), 3),
                          fmt(row.get("tune_s"), 0), *provenance(row)])
    return ["## novatune tune", "", "One line per op of each tuning run (CUDA-graph replay time).", ""] + table(
        ["op", "shape", "choice", "chosen µs", "HF eager µs", "x HF eager", "floor fraction", "tune s", "git sha",
         "device", "date (UTC)"], lines)


def render_train(rows: list[dict]) -> list[str]:
    lines = [[fmt(r.get("config")), fmt(r.get("train_tok_s"), 0), fmt(r.get("e2e_novatune_tok_s"), 0),
              fmt(r.get("ratio"), 3), fmt(r.get("train_mem_gib")), *provenance(r)] for r in newest_first(rows)]
    return ["## `novatune train` against the benchmark's novatune stack", ""] + table(
        ["config", "train tok/s", "bench tok/s", "ratio", "peak GiB", "git sha", "device", "date (UTC)"], lines)


def render_validate(rows: list[dict]) -> list[str]:
    lines = []
    for row in newest_first(rows):
        checks = row.get("checks") or []
        failed = [c.get("name", "?") for c in checks if isinstance(c, dict) and not c.get("passed", True)]
        lines.append([fmt(row.get("config")), fmt(row.get("passed")), str(len(checks)), ", ".join(failed) or "-",
                      *provenance(row)])
    return ["## `novatune validate`", ""] + table(["config", "passed", "checks", "failed", "git sha", "device",
                                                    "date (UTC)"], lines)


def render_eval(rows: list[dict]) -> list[str]:
    lines = [[fmt(r.get("task")), fmt(r.get("label") or r.get("model")), f"{r.get('correct')}/{r.get('n')}",
              fmt(r.get("accuracy"), 3), fmt(r.get("gen_tokens_per_s"), 0), *provenance(r)] for r in newest_first(rows)]
    return ["## `novatune eval`", ""] + table(["task", "model", "correct", "accuracy", "generated tok/s", "git sha",
                                                "device", "date (UTC)"], lines)


COMMAND = "novatune report --results-page bench/results -o docs/RESULTS.md"


def render_results_page(results_dir: Path, command: str = COMMAND) -> str:
    """The markdown results page for every .jsonl file in results_dir (see the module docstring)."""
    results_dir = Path(results_dir)
    files = {p.stem: load_rows(p) for p in sorted(results_dir.glob("*.jsonl"))}
    if not files:
        raise FileNotFoundError(f"no .jsonl result rows in {results_dir}; run a benchmark or pass the results folder")
    # the page names the folder as the repository does, not as one machine's absolute path
    source = "/".join(results_dir.parts[-2:]) if results_dir.is_absolute() else results_dir.as_posix()
    out = ["# Results", "",
           f"Generated by `{command}` from the rows in `{source}/`; do not edit by hand (edits are lost the next "
           "time it runs). Every line names the git sha, device and date of the row it comes from.", ""]
    stacks = files.get("e2e", []) + files.get("bench", [])
    if stacks:
        out += render_stacks(stacks)
    renderers = {"ops": render_ops, "attention": render_attention, "tune": render_tune, "train": render_train,
                 "validate": render_validate, "eval": render_eval}
    for stem, render in renderers.items():
        if files.get(stem):
            out += render(files[stem])
    others = [f"`{stem}.jsonl` ({len(rows)} rows)" for stem, rows in files.items() if stem not in RENDERED]
    if others:
        out += ["## Other rows", "", "Not tabulated here (one-off experiments and estimates, quoted where they are "
                "used): " + ", ".join(others) + ".", ""]
    return "\n".join(out).rstrip() + "\n"
