"""Markdown + one self-contained HTML page from bench / validate / eval results and profiler traces.

Reads each RUN (a folder or a file; see novatune/report/README.md for what is read) and writes OUTPUT/report.md
(with plots/*.png beside it), OUTPUT/report.html (images embedded, no external links) and OUTPUT/traces/ (copies
of the Chrome traces, for Perfetto). Sections whose inputs are absent say so.
"""
from __future__ import annotations

HELP = "write a markdown + self-contained HTML report from bench/validate/eval results and profiler traces"

EPILOG = """examples:
  novatune report runs/bench-20261121 runs/validate-20261121 --eval eval_before.json --eval eval_after.json
  novatune report bench/results/e2e.jsonl --gpu-price 3.2 --token-budget 5e9 -o /tmp/report
  novatune report runs/bench-x --monthly-spend 10000,100000,1000000 --gpu "NVIDIA H100 80GB HBM3"
  novatune report --results-page bench/results -o docs/RESULTS.md     # the generated results page

Cost figures use --gpu-price ($ per GPU-hour) when given, else an assumed default for the GPU name (stated in the
report; see novatune/report/cost.py); runs measured on the CPU or on a toy model (< 100M parameters) get no cost
projection. Exit codes: 0 report written, 2 bad option or a RUN path that does not exist.
"""


def add_arguments(p) -> None:
    p.add_argument("runs", nargs="*", metavar="RUN", help="run folder or result file (bench.jsonl, e2e.jsonl, "
                                                          "validate.json, eval JSON, Chrome trace)")
    p.add_argument("-o", "--output", help="output folder (default: <first RUN folder>/report)")
    p.add_argument("--eval", action="append", default=[], metavar="FILE", help="`novatune eval --output` JSON "
                                                                               "(repeatable: before, after, ...)")
    p.add_argument("--trace", action="append", default=[], metavar="FILE",
                   help="Chrome trace (torch.profiler export_chrome_trace), named by its file stem (repeatable)")
    p.add_argument("--title", default="novatune report")
    p.add_argument("--baseline", help="baseline stack (default: stock, or hf_sdpa for bench/e2e.py rows)")
    p.add_argument("--candidate", help="candidate stack (default: novatune)")
    p.add_argument("--gpu", help="GPU name for the default price (default: the headline rows' device)")
    p.add_argument("--gpu-price", type=float, metavar="USD_PER_HOUR", help="$ per GPU-hour for the cost figures")
    p.add_argument("--token-budget", type=float, default=1e9, help="training tokens for the GPU-hours/cost line "
                                                                    "(default 1e9)")
    p.add_argument("--monthly-spend", default="10000,50000,100000,250000,500000,1000000",
                   help="comma-separated monthly spends ($) for the savings table")
    p.add_argument("--no-plots", action="store_true", help="tables only (faster)")
    p.add_argument("--results-page", metavar="DIR", help="instead: render the results page (markdown) from the "
                   "rows in DIR (bench/results) to -o FILE (default: stdout); docs/RESULTS.md is made this way")


def write_results_page(results_dir: str, output: str | None) -> int:
    import sys
    from pathlib import Path

    from novatune.report.results_page import render_results_page

    if not Path(results_dir).is_dir():
        print(f"error: --results-page {results_dir}: no such folder of result rows", file=sys.stderr)
        return 2
    page = render_results_page(Path(results_dir))
    if output:
        Path(output).write_text(page)
        print(f"wrote {output}")
    else:
        print(page)
    return 0


def run(args) -> int:
    import json
    import sys
    from pathlib import Path

    if args.results_page:
        return write_results_page(args.results_page, args.output)
    if not args.runs:
        print("error: name at least one RUN folder or result file (or --results-page DIR)", file=sys.stderr)
        return 2

    from novatune.report.build import Options, write_report
    from novatune.report.load import load_inputs

    try:
        spends = tuple(float(x) for x in args.monthly_spend.split(",") if x.strip())
    except ValueError:
        print(f"error: --monthly-spend {args.monthly_spend!r}: give comma-separated numbers", file=sys.stderr)
        return 2
    if args.gpu_price is not None and args.gpu_price <= 0:
        print("error: --gpu-price must be > 0 ($ per GPU-hour)", file=sys.stderr)
        return 2
    if args.token_budget <= 0 or not spends:
        print("error: --token-budget and --monthly-spend must be positive", file=sys.stderr)
        return 2
    missing = [r for r in args.runs if not Path(r).exists()]
    if missing:
        print(f"error: no such run folder or result file: {', '.join(missing)}; check the path(s)", file=sys.stderr)
        return 2
    if args.output:
        out = Path(args.output)
    else:
        first = Path(args.runs[0])
        out = (first if first.is_dir() else first.parent) / "report"
    inp = load_inputs(args.runs, args.eval, args.trace)
    # a file named on its own flag and not usable fails the command (a file inside a run folder that is not a
    # result stays a "not used" line: folders hold other files too)
    if inp.named_unusable:
        print("error: " + "; ".join(inp.named_unusable) + "; check the path(s)", file=sys.stderr)
        return 2
    opt = Options(title=args.title, baseline=args.baseline, candidate=args.candidate, gpu=args.gpu,
                  gpu_price=args.gpu_price, token_budget=args.token_budget, monthly=spends, plots=not args.no_plots)
    res = write_report(inp, opt, out)
    print(f"wrote {res['markdown']} and {res['html']}" + (f" and {len(res['traces'])} trace(s) in {out / 'traces'}"
                                                          if res["traces"] else ""))
    for line in inp.ignored:
        print(f"not used: {line}")
    fig = res["figures"]
    print(json.dumps({"markdown": str(res["markdown"]), "html": str(res["html"]), "speedup": fig.get("speedup"),
                      "baseline": fig.get("baseline"), "candidate": fig.get("candidate"),
                      "tok_s_before": fig.get("tok_s_before"), "tok_s_after": fig.get("tok_s_after")}))
    return 0
