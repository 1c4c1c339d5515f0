"""Reading what `novatune report` is given: run folders and result files (the contract is in README.md).

Each input is a file or a folder. A folder is read at its top level (bench.jsonl, *.jsonl of bench/e2e.py rows,
validate.json, weight_change.json, eval JSONs, metrics.jsonl, Chrome traces) and in its traces/ subfolder; nothing
deeper, so a run folder's per-stack training outputs are not mistaken for separate runs. Anything unreadable or of
an unknown kind is listed in `ignored` with the reason (the report prints that list): nothing is dropped silently.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from novatune.report.traces import breakdown, is_trace_file

BENCH_KINDS = ("novatune_bench", "e2e")  # bench/runner.py rows and bench/e2e.py rows
BASELINES = ("stock", "hf_sdpa")  # in order of preference
CANDIDATE = "novatune"
TRACE_BEFORE = ("stock", "hf_sdpa", "baseline", "before")
TRACE_AFTER = ("novatune", "after", "optimized")


@dataclass
class BenchGroup:
    """The rows of one side-by-side run (one row per stack), as the bench wrote them."""
    source: str
    kind: str
    rows: list[dict]

    def workload(self) -> str:
        r = self.rows[0]
        if self.kind == "e2e":
            return (f"{r.get('arch')} x{r.get('layers')} layers, seq {r.get('seq')}, GA {r.get('ga')}, "
                    f"checkpointing {'on' if r.get('ckpt') else 'off'}")
        ov = " ".join(r.get("overrides") or [])
        return f"{r.get('config', '?')}" + (f" ({ov})" if ov else "")

    def ok(self) -> dict[str, dict]:
        return {r["stack"]: r for r in self.rows if r.get("status", "ok") == "ok" and r.get("tok_s")}

    def time(self) -> str:
        return max(str(r.get("time", "")) for r in self.rows)

    def gflop(self) -> float:
        return max(float(r.get("gflop_per_tok") or 0) for r in self.rows)


@dataclass
class TrainRun:
    label: str
    steps: list[int]
    loss: list[float]
    tok_s: list[float | None]


@dataclass
class TraceInfo:
    path: Path
    name: str  # the stack it belongs to (file stem, matched against stack names)
    result: dict | None = None
    error: str | None = None


@dataclass
class Inputs:
    bench: list[BenchGroup] = field(default_factory=list)
    train_runs: list[TrainRun] = field(default_factory=list)
    validate: list[tuple[str, dict]] = field(default_factory=list)
    weight_change: list[tuple[str, list]] = field(default_factory=list)
    evals: list[tuple[str, dict]] = field(default_factory=list)
    traces: list[TraceInfo] = field(default_factory=list)
    read: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    # the ignored lines about files named on --eval / --trace themselves (the command refuses to run without them)
    named_unusable: list[str] = field(default_factory=list)


def _workload_key(r: dict) -> tuple:
    if r.get("bench") == "e2e":
        return ("e2e", r.get("arch"), r.get("layers"), r.get("seq"), r.get("ga"), r.get("ckpt"))
    return ("bench", r.get("config"), tuple(r.get("overrides") or ()))


def _same_workload(a: dict, b: dict) -> bool:
    """A bench row of a stack that did not run (absent, interrupted) carries no config or overrides: it matches any
    row of its run on the fields it has, so it never splits the run it belongs to."""
    if a.get("bench") == "e2e" or b.get("bench") == "e2e":
        return _workload_key(a) == _workload_key(b)
    return all(a[k] == b[k] for k in ("config", "overrides") if k in a and k in b)


def group_key(g: BenchGroup) -> tuple:
    """The workload of a run, from a row that records it fully (a stack that ran)."""
    return _workload_key(next((r for r in g.rows if "overrides" in r or r.get("bench") == "e2e"), g.rows[0]))


def group_rows(rows: list[dict], source: str) -> list[BenchGroup]:
    """Consecutive rows of one workload form a run; a stack seen again starts the next run (files are appended)."""
    groups: list[BenchGroup] = []
    cur: list[dict] = []
    for r in rows:
        if cur and (not all(_same_workload(r, c) for c in cur) or any(c["stack"] == r["stack"] for c in cur)):
            groups.append(BenchGroup(source, cur[0]["bench"], cur))
            cur = []
        cur.append(r)
    if cur:
        groups.append(BenchGroup(source, cur[0]["bench"], cur))
    return groups


def _read_jsonl(p: Path, inp: Inputs) -> None:
    rows, other = [], {}
    for i, line in enumerate(p.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            inp.ignored.append(f"{p}:{i + 1}: not JSON ({e})")
            continue
        if r.get("bench") in BENCH_KINDS and "stack" in r or p.name == "metrics.jsonl" and "step" in r:
            rows.append(r)
        else:
            kind = r.get("bench", "no 'bench' field")
            other[kind] = other.get(kind, 0) + 1
    if p.name == "metrics.jsonl":
        if rows:
            label = p.parent.name or str(p.parent)
            inp.train_runs.append(TrainRun(label, [int(r["step"]) for r in rows], [r.get("loss") for r in rows],
                                           [r.get("tokens_per_s") for r in rows]))
            inp.read.append(f"{p}: training metrics, {len(rows)} steps")
        return
    if rows:
        groups = group_rows(rows, str(p))
        inp.bench.extend(groups)
        inp.read.append(f"{p}: {len(rows)} bench rows in {len(groups)} run(s)")
    for kind, n in other.items():
        inp.ignored.append(f"{p}: {n} row(s) of kind {kind!r} (not a bench/e2e row)")


def _read_json(p: Path, inp: Inputs) -> None:
    if is_trace_file(p):
        inp.traces.append(TraceInfo(p, _trace_name(p)))
        return
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        inp.ignored.append(f"{p}: not JSON ({e})")
        return
    if isinstance(data, dict) and data.get("task") == "gsm8k" and "accuracy" in data:
        inp.evals.append((str(p), data))
        inp.read.append(f"{p}: eval result ({data.get('label')})")
    elif isinstance(data, dict) and isinstance(data.get("checks"), list) and "runs" in data:
        inp.validate.append((str(p), data))
        inp.read.append(f"{p}: validate result ({len(data['checks'])} checks)")
    elif p.name == "weight_change.json" and isinstance(data, list):
        inp.weight_change.append((str(p), data))
        inp.read.append(f"{p}: weight-change table ({len(data)} rows)")
    elif p.name in ("summary.json", "result.json", "config.json"):
        pass  # bench's summary repeats bench.jsonl's rows; read those instead
    else:
        inp.ignored.append(f"{p}: JSON of an unknown kind (keys: {list(data)[:6] if isinstance(data, dict) else '-'})")


def _trace_name(p: Path) -> str:
    stem = p.name
    for suf in (".json.gz", ".pt.trace.json", ".json"):
        if stem.endswith(suf):
            stem = stem[: -len(suf)]
            break
    return stem


def _read_path(p: Path, inp: Inputs) -> None:
    if p.suffix == ".jsonl":
        _read_jsonl(p, inp)
    elif p.name.endswith(".json") or p.name.endswith(".json.gz"):
        _read_json(p, inp)


def load_inputs(paths: list[str | Path], evals: list[str | Path] = (), traces: list[str | Path] = ()) -> Inputs:
    inp = Inputs()
    for raw in paths:
        p = Path(raw)
        if p.is_file():
            before = len(inp.read) + len(inp.traces)
            _read_path(p, inp)
            if len(inp.read) + len(inp.traces) == before:  # a file named on its own must be a result
                inp.named_unusable.append(f"{p}: not a result file (bench rows, validate/eval results, "
                                          "metrics.jsonl or a trace)")
        elif p.is_dir():
            files = sorted(f for f in p.iterdir() if f.is_file())
            if (p / "traces").is_dir():
                files += sorted(f for f in (p / "traces").iterdir() if f.is_file())
            before = len(inp.read) + len(inp.ignored) + len(inp.traces)
            for f in files:
                _read_path(f, inp)
            if validate_in_dir := [v for v in inp.validate if Path(v[0]).parent == p]:
                # validate.json embeds weight_change.json's rows: keep one copy
                inp.weight_change = [w for w in inp.weight_change if Path(w[0]).parent != p or not validate_in_dir]
            if len(inp.read) + len(inp.ignored) + len(inp.traces) == before:
                inp.ignored.append(f"{p}: no bench rows, validate/eval results, metrics.jsonl or traces found")
        else:
            inp.ignored.append(f"{p}: does not exist")
    for e in evals:
        p = Path(e)
        n = len(inp.evals)
        if p.is_file():
            _read_json(p, inp)
        if len(inp.evals) == n:
            inp.named_unusable.append(f"--eval {p}: not a `novatune eval --output` JSON")
    named: set[Path] = set()
    for t in traces:
        p = Path(t)
        if p.is_file():
            inp.traces.append(TraceInfo(p, _trace_name(p)))
            named.add(p)
        else:
            inp.named_unusable.append(f"--trace {p}: does not exist")
    for t in inp.traces:
        try:
            t.result = breakdown(t.path)
            events = "GPU events" if t.result["kind"] == "gpu" else "top-level CPU ops"
            inp.read.append(f"{t.path}: trace ({t.result['kernels']} {events})")
        except (ValueError, OSError, KeyError, TypeError) as e:
            t.error = f"{type(e).__name__}: {e}"
            if t.path in named:  # a file named on --trace, not one found in a run folder
                inp.named_unusable.append(f"--trace {t.path}: unreadable trace ({t.error})")
            else:
                inp.ignored.append(f"{t.path}: unreadable trace ({t.error})")
    inp.ignored.extend(inp.named_unusable)
    return inp


def pick_pair(group: BenchGroup, baseline: str | None = None, candidate: str | None = None):
    """(baseline row, candidate row) of a run, either None where that stack did not run."""
    ok = group.ok()
    base = ok.get(baseline) if baseline else next((ok[b] for b in BASELINES if b in ok), None)
    return base, ok.get(candidate or CANDIDATE)


def latest_per_workload(groups: list[BenchGroup]) -> list[BenchGroup]:
    """The newest run of each workload (files accumulate history; the report shows the current state)."""
    best: dict[tuple, BenchGroup] = {}
    for g in groups:
        k = group_key(g)
        if k not in best or g.time() >= best[k].time():
            best[k] = g
    return list(best.values())


def headline(groups: list[BenchGroup], baseline: str | None = None, candidate: str | None = None):
    """The run the headline figures come from: among runs where both sides ran, the largest model (FLOPs/token),
    then the newest."""
    both = [g for g in groups if all(pick_pair(g, baseline, candidate))]
    if not both:
        return None
    return max(both, key=lambda g: (g.gflop(), g.time()))


def step_tok_s(row: dict) -> tuple[list[int], list[float]]:
    """Tokens/s of each timed step: bench/runner.py rows (tokens_per_step / step_s, or / step_ms for the stacks
    with their own loop) or bench/e2e.py rows (step_ms, steps 2.. of the timed ones, each seq x ga tokens).
    ([], []) when the row has neither."""
    warm = int(row.get("warm") or 0)
    if row.get("tokens_per_step") and row.get("step_s"):
        secs = row["step_s"][warm:warm + len(row["tokens_per_step"])]
        return ([warm + 1 + i for i in range(len(secs))],
                [t / s for t, s in zip(row["tokens_per_step"], secs) if s > 0])
    if row.get("tokens_per_step") and row.get("step_ms"):  # the stacks with their own loop (trl-sft, novatune-train)
        pairs = list(zip(row["tokens_per_step"], row["step_ms"]))
        return ([warm + 1 + i for i in range(len(pairs))], [t * 1e3 / ms for t, ms in pairs if ms > 0])
    if row.get("step_ms"):
        tokens = int(row["seq"]) * int(row["ga"])
        return ([warm + 2 + i for i in range(len(row["step_ms"]))], [tokens * 1e3 / ms for ms in row["step_ms"]])
    return [], []
