"""Check that training with novatune is the same training as stock, from the same init and data:
(a) per-step loss parity within a measured noise floor (stock sdpa vs stock eager attention: two valid kernels),
(b) the weight-change table (every projection of the chosen layers: stock vs base, novatune vs base,
stock vs novatune), (c) gradient norms, (d) packing contamination (changing one document of a packed row must not
move any other document's logits), (e) gradient-accumulation invariance (one micro-batch of rows vs one per row).

Exit 0 when every check passes, 1 when one fails (the table says which and why). Writes validate.json and
weight_change.json (schema: novatune/proof/parity.py) and each run's metrics under the run directory.
"""
from __future__ import annotations

HELP = "loss/weight/grad parity vs stock within a measured noise floor, packing and grad-accum checks"
EPILOG = """examples:
  novatune validate examples/qwen3-4b-seed.yaml                    # 4 steps per run, writes runs/validate-<time>/
  novatune validate examples/qwen3-4b-seed.yaml --steps 6 --layers 0,13,35 --run-dir /tmp/val
  novatune validate examples/demo.yaml --set model.device=cpu      # tiny model, CPU
"""


def add_arguments(p) -> None:
    from novatune.commands.cli import add_config_args

    add_config_args(p, optional=False)
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per run (default 4)")
    p.add_argument("--layers", help="decoder layers for the weight table, e.g. 0,13,35 (default: first, middle, last)")
    p.add_argument("--run-dir", help="where the results go (default: runs/validate-<date-time>)")


def run(args) -> int:
    import json
    from pathlib import Path

    from novatune.bench.runner import default_run_dir
    from novatune.commands.cli import load_config
    from novatune.proof.validate import render, run_validate
    from novatune.train.config import ConfigError

    if args.steps < 1:
        raise ConfigError("--steps", f"must be >= 1, got {args.steps}")
    layers = None
    if args.layers:
        try:
            layers = sorted({int(x) for x in args.layers.split(",") if x.strip()})
        except ValueError:
            raise ConfigError("--layers", f"{args.layers!r} is not a comma list of layer indices",
                              "e.g. --layers 0,13,35") from None
    cfg, base = load_config(args)
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir("validate")
    result = run_validate(cfg, base, run_dir, steps=args.steps, layers=layers, overrides=list(args.overrides),
                          config_name=args.config)
    print()
    print(render(result))
    print(f"run directory: {run_dir}")
    print(json.dumps({"validate": str(run_dir), "passed": result["passed"],
                      **{c["name"]: c["passed"] for c in result["checks"]}}))
    return 0 if result["passed"] else 1
