"""Assembling the report: speed and memory, loss and tokens/s curves, op-time breakdown, correctness (validate and
the weight-change table), GSM8K evaluation and cost, from what load.py read. Every figure printed is a field of an
input row or computed from them here (the formulas are in cost.py and in the text); a section whose input is absent
says so instead of disappearing.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from novatune.report import cost as costmod
from novatune.report import plots
from novatune.report.load import TRACE_AFTER, TRACE_BEFORE, Inputs, headline, latest_per_workload, pick_pair, step_tok_s
from novatune.report.traces import CATEGORIES


@dataclass
class Options:
    title: str = "novatune report"
    baseline: str | None = None  # stack name; default stock / hf_sdpa
    candidate: str | None = None  # default novatune
    gpu: str | None = None  # GPU name for the default price; default: the headline rows' device
    gpu_price: float | None = None
    token_budget: float = costmod.DEFAULT_TOKEN_BUDGET
    monthly: tuple = costmod.DEFAULT_MONTHLY
    plots: bool = True


def _f(v, spec: str = ",.0f", none: str = "-") -> str:
    return none if v is None else format(v, spec)


def _ms(v: float, sign: bool = False) -> str:
    """Milliseconds with about 3-4 significant digits, from a whole step (250.3) down to one kernel (0.0123)."""
    a = abs(v)
    spec = ",.1f" if a >= 100 else ".2f" if a >= 1 else ".3f" if a >= 0.01 else ".4f"
    return format(v, ("+" if sign else "") + spec)


def _sig(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, (list, dict)):
        return f"{len(v)} item(s)"
    return str(v)


class Report:
    def __init__(self, inp: Inputs, opt: Options):
        self.inp, self.opt = inp, opt
        self.blocks: list[tuple] = []
        self.groups = latest_per_workload(inp.bench)
        self.head = headline(self.groups, opt.baseline, opt.candidate)
        self.figures: dict = {}  # the numbers the summary and tests check

    def add(self, *block) -> None:
        self.blocks.append(tuple(block))

    def img(self, name: str, png_fn, alt: str) -> None:
        if self.opt.plots:
            self.add("img", name, png_fn(), alt)

    # ------------------------------------------------------------------------------------------ sections
    def build(self) -> list[tuple]:
        self.add("h1", self.opt.title)
        self.summary()
        self.speed()
        self.curves()
        self.breakdown()
        self.correctness()
        self.evaluation()
        self.cost()
        self.inputs()
        return self.blocks

    def summary(self) -> None:
        if self.head is None:
            self.add("headline", "No side-by-side bench run with both the baseline and novatune was found: no "
                                 "speedup to report (give a `novatune bench` run folder or bench/e2e.py rows).")
            return
        base, cand = pick_pair(self.head, self.opt.baseline, self.opt.candidate)
        s = cand["tok_s"] / base["tok_s"]
        self.figures.update(speedup=s, tok_s_before=base["tok_s"], tok_s_after=cand["tok_s"],
                            baseline=base["stack"], candidate=cand["stack"])
        dev = base.get("device", "?")
        saving = "" if costmod.not_projectable(base, cand) else \
            f", {100 * costmod.cost_reduction(s):.1f}% lower cost per training token"
        self.add("headline", f"**{cand['stack']} {cand['tok_s']:,.0f} tok/s vs {base['stack']} {base['tok_s']:,.0f} "
                             f"tok/s: {s:.3f}x ({100 * (s - 1):+.1f}% throughput{saving})** on "
                             f"{self.head.workload()}, {dev}, git `{base.get('git_sha', '?')}`, "
                             f"measured {self.head.time()}.")

    def speed(self) -> None:
        self.add("h2", "Speed and memory")
        if not self.groups:
            self.add("note", "No bench rows in the inputs (bench.jsonl of `novatune bench`, or bench/e2e.py's "
                             "e2e.jsonl): no speed table.")
            return
        ordered = sorted(self.groups, key=lambda g: (g is not self.head, -g.gflop()))
        for g in ordered:
            base, cand = pick_pair(g, self.opt.baseline, self.opt.candidate)
            self.add("h3", ("Headline: " if g is self.head else "") + g.workload())
            rows = []
            peer = max((r for r in g.ok().values() if r is not base and r is not cand), key=lambda r: r["tok_s"],
                       default=None)
            for r in g.rows:
                if r.get("status", "ok") != "ok":
                    rows.append([r["stack"], r["status"], (r.get("reason") or "").splitlines()[0][:80]] + [""] * 7)
                    continue
                mfu = r.get("mfu")
                rows.append([r["stack"], "ok", _f(r["tok_s"]),
                             _f(r["tok_s"] / base["tok_s"], ".3f") if base else "-",
                             _f(r["tok_s"] / peer["tok_s"], ".3f") if peer else "-",
                             _f(100 * mfu, ".1f") + "%" if mfu is not None else "-",
                             _f(r.get("peak_gib"), ".2f") if r.get("peak_gib") else "-",
                             _f(r.get("gflop_per_tok"), ".2f"), _f((r.get("losses") or [None])[-1], ".4f"),
                             f"{r.get('warm', '?')}+{r.get('steps', '?')}"])
            head = ["stack", "status", "tok/s", f"x {base['stack'] if base else 'baseline'}",
                    f"x {peer['stack'] if peer else 'peer'}", "MFU", "peak GiB", "GFLOP/token", "last loss",
                    "warm+timed steps"]
            self.add("table", head, rows)
            r0 = g.rows[0]
            self.add("note", f"From {g.source} ({g.kind} rows), device {r0.get('device', '?')}, torch "
                             f"{r0.get('torch', '?')}, transformers {r0.get('transformers', '?')}, git "
                             f"`{r0.get('git_sha', '?')}`. tok/s = trained tokens / wall time of the timed steps; "
                             f"peak GiB = torch.cuda.max_memory_allocated over them (with CUDA graphs' pools "
                             f"from session 21 on); ratios are tok/s over tok/s of the same run "
                             f"(docs/BENCHMARKS.md).")
            if g is self.head:
                bench_x = cand.get("x_stock")
                if bench_x is not None:
                    self.add("p", f"Speedup {cand['stack']}/{base['stack']} = {self.figures['speedup']:.4f} "
                                  f"(the bench's own x_stock field: {bench_x}).")
                bars = {r["stack"]: r["tok_s"] for r in g.ok().values()}
                self.img("tok_s.png", lambda b=bars: plots.bar_plot(b, "Training throughput", "tokens/s"),
                         "tokens/s per stack")

    def curves(self) -> None:
        self.add("h2", "Loss curves")
        g = self.head or (self.groups[0] if self.groups else None)
        loss = {}
        warm = None
        if g is not None:
            for r in g.ok().values():
                if r.get("losses"):
                    loss[r["stack"]] = (list(range(1, len(r["losses"]) + 1)), r["losses"])
                    warm = int(r.get("warm") or 0)
        if loss:
            self.img("loss.png", lambda: plots.line_plot(loss, f"Loss per optimizer step: {g.workload()[:60]}",
                                                         "loss", marker_warm=warm), "loss curves")
            base, cand = pick_pair(g, self.opt.baseline, self.opt.candidate)
            if base and cand:
                n = min(len(base["losses"]), len(cand["losses"]))
                worst = max(abs(cand["losses"][i] - base["losses"][i]) / max(abs(base["losses"][i]), 1e-12)
                            for i in range(n))
                self.figures["loss_max_rel_diff"] = worst
                self.add("p", f"Largest per-step loss difference {cand['stack']} vs {base['stack']}: "
                              f"{worst:.2e} relative over {n} steps (same init, same data).")
        for t in self.inp.train_runs:
            loss[f"train: {t.label}"] = (t.steps, t.loss)
        if self.inp.train_runs:
            tr = {k: v for k, v in loss.items() if k.startswith("train: ")}
            self.img("loss_train.png", lambda: plots.line_plot(tr, "Training runs (metrics.jsonl)", "loss"),
                     "training-run loss curves")
        if not loss:
            self.add("note", "No per-step losses in the inputs.")
        self.add("h2", "Tokens/s over steps")
        tps = {}
        if g is not None:
            for r in g.ok().values():
                x, y = step_tok_s(r)
                if x:
                    tps[r["stack"]] = (x, y)
        if tps:
            self.img("tok_s_steps.png", lambda: plots.line_plot(tps, "Throughput of each timed step", "tokens/s"),
                     "tokens/s per step")
        else:
            self.add("note", "The bench rows carry no per-step timings (bench/runner.py's step_s/tokens_per_step or "
                             "bench/e2e.py's step_ms).")
        tr = {f"train: {t.label}": (t.steps, t.tok_s) for t in self.inp.train_runs if any(t.tok_s)}
        if tr:
            self.img("tok_s_train.png", lambda: plots.line_plot(tr, "Training runs (metrics.jsonl)", "tokens/s"),
                     "training-run tokens/s")

    def breakdown(self) -> None:
        self.add("h2", "Op-time breakdown (torch.profiler)")
        traces = [t for t in self.inp.traces if t.result]
        if not traces:
            self.add("note", "No Chrome traces in the inputs (torch.profiler `export_chrome_trace`, e.g. "
                             "<run>/traces/<stack>.json, or bench/e2e.py --profile PREFIX).")
            return
        # baseline first, candidate second, others after
        def rank(t):
            n = t.name.lower()
            return (0 if any(n == b or n.endswith(("_" + b, "-" + b)) for b in TRACE_BEFORE) else
                    1 if any(n == a or n.endswith(("_" + a, "-" + a)) for a in TRACE_AFTER) else 2, n)
        traces.sort(key=rank)
        kinds = {t.result["kind"] for t in traces}
        unit = "GPU" if kinds == {"gpu"} else "CPU" if kinds == {"cpu"} else "GPU/CPU"
        pair = len(traces) >= 2  # the first two are before/after: show the change
        head = (["category"] + [f"{t.name} ms" for t in traces] + [f"{t.name} %" for t in traces] +
                ([f"change {traces[0].name} -> {traces[1].name}"] if pair else []))

        def change(a: float, b: float) -> str:
            return f"{_ms(b - a, sign=True)} ms" + (f" ({100 * (b - a) / a:+.0f}%)" if a else "")
        rows = []
        for c in CATEGORIES:
            vals = [t.result["categories_ms"].get(c, 0.0) for t in traces]
            if any(vals):
                rows.append([c] + [_ms(v) for v in vals] +
                            [f"{100 * v / t.result['total_ms']:.1f}" for v, t in zip(vals, traces)] +
                            ([change(vals[0], vals[1])] if pair else []))
        tot = [t.result["total_ms"] for t in traces]
        rows.append(["**total**"] + [f"**{_ms(v)}**" for v in tot] + ["100.0"] * len(traces) +
                    ([change(tot[0], tot[1])] if pair else []))
        rows.append(["wall span"] + [_ms(t.result["span_ms"]) for t in traces] + [""] * len(traces) +
                    ([""] if pair else []))
        self.add("table", head, rows)
        if len(traces) >= 2:
            a, b = traces[0].result["total_ms"], traces[1].result["total_ms"]
            self.add("p", f"{unit} time {traces[0].name} -> {traces[1].name}: {_ms(a)} -> {_ms(b)} ms "
                          f"({a / b:.2f}x).")
        self.img("breakdown.png", lambda: plots.stacked_breakdown(
            {t.name: t.result["categories_ms"] for t in traces}, f"{unit} time by category", CATEGORIES,
            f"{unit} time (ms)"), "op-time breakdown")
        for t in traces:
            r = t.result
            self.add("h3", f"Top {'kernels' if r['kind'] == 'gpu' else 'CPU ops'}: {t.name}")
            self.add("table", ["name", "ms", "category"], [[n[:110], _ms(ms), c] for n, ms, c in r["top"]])
            events = "GPU events" if r["kind"] == "gpu" else "top-level CPU ops"
            self.add("note", f"{t.path.name}: {r['kernels']} {events}"
                             f", {r['attributed']} attributed to a category through what launched them (module / "
                             f"Python frame / forward op)." + ("" if r["kind"] == "gpu" else
                             " CPU-only trace: times are CPU op times."))
        self.add("p", "Trace files (open in Perfetto, ui.perfetto.dev, or chrome://tracing): " +
                 ", ".join(f"`traces/{t.path.name}`" for t in traces) + ".")
        self.figures["trace_files"] = [t.path for t in traces]

    def correctness(self) -> None:
        self.add("h2", "Correctness")
        if not self.inp.validate:
            self.add("note", "No validate.json (`novatune validate CONFIG`) in the inputs: no parity checks.")
        for src, v in self.inp.validate:
            self.add("p", f"`novatune validate` ({src}): **{'passed' if v.get('passed') else 'FAILED'}**, "
                          f"{v.get('steps', '?')} steps, {v.get('dtype', '?')} on {v.get('device', '?')}, noise floor "
                          f"{(v.get('noise_floor') or {}).get('reference', '?')} vs "
                          f"{(v.get('noise_floor') or {}).get('alternative', '?')}, tolerance factor "
                          f"{v.get('factor', '?')}.")
            rows = [[c.get("name", "?"), "pass" if c.get("passed") else "FAIL", _sig(c.get("floor")),
                     _sig(c.get("tolerance")), _sig(c.get("max_rel_diff", c.get("max_update_rel_diff"))),
                     (c.get("message") or "")[:160]] for c in v["checks"]]
            self.add("table", ["check", "result", "floor", "tolerance", "measured", "message"], rows)
        wc = [(src, c["rows"]) for src, v in self.inp.validate for c in v["checks"]
              if c.get("name") == "weight_change" and c.get("rows")] + list(self.inp.weight_change)
        self.add("h3", "Weight change")
        if not wc:
            self.add("note", "No weight-change table (validate.json or weight_change.json) in the inputs.")
        for src, rows in wc:
            self.weight_table(src, rows)

    def weight_table(self, src: str, rows: list[dict]) -> None:
        known = [("layer", "layer"), ("param", "parameter"), ("stock_vs_base", "stock vs base"),
                 ("novatune_vs_base", "novatune vs base"), ("verdict", "stock vs novatune"),
                 ("stock_update_rel", "stock update (rel)"), ("novatune_update_rel", "novatune update (rel)"),
                 ("stock_vs_novatune_update_rel", "stock-novatune / update"),
                 ("floor_update_rel", "floor (eager) / update")]
        keys = [k for k, _ in known if any(k in r for r in rows)]
        if not keys:  # an unfamiliar layout: show it as it is
            keys = list(dict.fromkeys(k for r in rows for k in r))
            names = keys
        else:
            names = [n for k, n in known if k in keys]
        self.add("table", names, [[_sig(r.get(k)) for k in keys] for r in rows])
        self.add("note", f"From {src}. CHANGED: the weight moved from its initial value; the last columns compare "
                         f"the stock and novatune updates with the eager-vs-sdpa noise floor (validate's definitions).")

    def evaluation(self) -> None:
        from novatune.eval.exact_match import render_table

        self.add("h2", "GSM8K evaluation")
        if not self.inp.evals:
            self.add("note", "No eval results (`novatune eval --output FILE.json`, passed with --eval or found in a "
                             "run folder).")
            return
        res = [r for _, r in self.inp.evals]
        md = render_table(res).splitlines()
        cells = [ln.strip("|").split(" | ") for ln in md]
        self.add("table", [c.strip() for c in cells[0]], [[c.strip() for c in row] for row in cells[2:]])
        r0 = res[0]
        self.add("note", f"{r0['n']} problems, {r0['k_shot']}-shot chain of thought, greedy decoding (batch "
                         f"{r0['batch_size']}, max {r0['max_new_tokens']} new tokens), exact match on the final "
                         f"number. Latency per request = wall time of the batched generate call that served it; "
                         f"throughput per request = its output tokens / that latency; generated tok/s = all output "
                         f"tokens / all generate time.")
        if len(res) >= 2:
            a, b = res[0], res[1]
            overlap = a["ci95"][0] <= b["ci95"][1] and b["ci95"][0] <= a["ci95"][1]
            self.add("p", f"Accuracy {a.get('label')} {a['accuracy']:.3f} vs {b.get('label')} {b['accuracy']:.3f} "
                          f"({100 * (b['accuracy'] - a['accuracy']):+.1f} points): the 95% intervals "
                          + ("overlap, so the difference is within sampling noise at this sample size." if overlap
                             else "do not overlap."))
        notes = sorted({n for r in res for n in r.get("notes", [])})
        if notes:
            self.add("list", notes)

    def cost(self) -> None:
        self.add("h2", "Cost")
        if "speedup" not in self.figures:
            self.add("note", "No headline speedup (needs a bench run with both sides): no cost analysis.")
            return
        base, cand = pick_pair(self.head, self.opt.baseline, self.opt.candidate)
        toy = costmod.not_projectable(base, cand)
        if toy:
            self.add("note", f"No cost projection: {toy}. Speed ratios from such runs do not carry over to GPU "
                             f"training at scale; bench the real model on the GPU you pay for.")
            return
        gpu = self.opt.gpu or base.get("device")
        price, source = costmod.resolve_price(gpu, self.opt.gpu_price)
        c = costmod.analysis(base["tok_s"], cand["tok_s"], price, self.opt.token_budget, self.opt.monthly)
        self.figures["cost"] = c
        self.add("p", f"Throughput {base['tok_s']:,.0f} -> {cand['tok_s']:,.0f} tok/s ({c['speedup']:.3f}x) on "
                      f"{gpu}. Same GPU, same $/GPU-hour, utilisation and workload shape: cost per training token "
                      f"falls by 1 - 1/{c['speedup']:.3f} = **{100 * c['cost_reduction']:.1f}%**.")
        budget = self.opt.token_budget
        rows = [["tokens/s", _f(base["tok_s"]), _f(cand["tok_s"])],
                [f"GPU-hours for {budget:,.0f} tokens", _f(c["gpu_hours_before"], ",.1f"),
                 _f(c["gpu_hours_after"], ",.1f")]]
        if price is not None:
            rows += [["$ per 1M training tokens", _f(c["cost_per_m_before"], ",.4f"),
                      _f(c["cost_per_m_after"], ",.4f")],
                     [f"$ for {budget:,.0f} tokens", _f(c["budget_cost_before"], ",.2f"),
                      _f(c["budget_cost_after"], ",.2f")]]
        self.add("table", ["", base["stack"], cand["stack"]], rows)
        self.add("note", (f"GPU price ${price:.2f}/GPU-hour: {source}." if price is not None else source) +
                 f" GPU-hours saved for the budget: {c['gpu_hours_saved']:,.1f}.")
        self.add("h3", "Monthly fine-tuning spend at the measured speedup")
        self.add("table", ["baseline monthly spend", "equivalent spend with novatune", "estimated monthly savings"],
                 [[f"${s:,.0f}", f"${a:,.0f}", f"${d:,.0f}"] for s, a, d in c["monthly"]])
        self.add("note", "Equivalent spend = spend / speedup: the same tokens trained in proportionally fewer "
                         "GPU-hours (no price needed). Savings depend on utilisation, configuration and workload mix.")

    def inputs(self) -> None:
        self.add("h2", "Inputs")
        self.add("list", self.inp.read or ["nothing readable"])
        if self.inp.ignored:
            self.add("p", "Not used:")
            self.add("list", self.inp.ignored)


def write_report(inp: Inputs, opt: Options, out_dir: str | Path) -> dict:
    """report.md (+ plots/*.png), report.html (self-contained) and traces/ (copies of the traces) in out_dir;
    returns {paths..., figures}."""
    from novatune.report.html import render_html, render_markdown

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rep = Report(inp, opt)
    blocks = rep.build()
    (out / "report.md").write_text(render_markdown(blocks, out))
    (out / "report.html").write_text(render_html(opt.title, blocks))
    copied = []
    for p in rep.figures.get("trace_files", []):
        dst = out / "traces" / p.name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if p.resolve() != dst.resolve():
            shutil.copyfile(p, dst)
        copied.append(dst)
    return {"markdown": out / "report.md", "html": out / "report.html", "traces": copied, "figures": rep.figures}
