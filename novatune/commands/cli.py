"""The `novatune` command line (also `python -m novatune`).

    novatune train [CONFIG] [--set key=value ...] [--output-dir DIR]   train (no CONFIG: the embedded demo)
    novatune plan CONFIG [--set ...] [--gpu-mem GiB]                    memory plan (policy per layer) before a run
    novatune env                                                        versions, GPU, kernels, attention backends

More subcommands live beside their implementation (see PLUGGED_COMMANDS): each such module defines
`add_arguments(parser)`, `HELP` (one line) and `run(args) -> int`, and imports nothing heavy at module level, so
`novatune --help` stays fast.

Exit codes: 0 ok; 1 `plan` predicts an out-of-memory; 2 a config/data/setup/checkpoint error (the message names
the key and the fix); 3 training went non-finite (train.on_nonfinite; the last good checkpoint is kept); 130
(SIGINT, Ctrl-C) or 143 (SIGTERM) stopped by a signal after finishing the step and saving a checkpoint: run the same
command to resume.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import math
import sys

EPILOG_MAIN = """examples:
  novatune train                                  # the embedded demo: tiny Qwen3, arithmetic chat data, CPU ok
  novatune train examples/lora.yaml --set train.lr=1e-4 --set method.r=8
  novatune train examples/qwen3-4b-seed.yaml --set train.max_steps=20
  novatune plan examples/qwen3-4b-seed.yaml --gpu-mem 40
  novatune env
"""

EPILOG_TRAIN = """examples:
  novatune train                                      # the embedded demo (writes ./runs/demo)
  novatune train --output-dir /tmp/demo               # the demo, elsewhere
  novatune train my.yaml --set train.max_steps=100 --set data.max_length=4096
  novatune train my.yaml --set data.sources.0.path=other.jsonl --set model.patch=false
  novatune train my.yaml --nproc 8 --set parallel.strategy=fsdp2    # = torchrun --nproc-per-node 8 -m novatune ...

Overrides are YAML values: --set train.betas=[0.9,0.95]  --set model.arch_overrides.num_hidden_layers=2.
A run resumes from the newest checkpoint in checkpoint.output_dir (checkpoint.resume: auto); --set
checkpoint.resume=never starts over. See examples/*.yaml for complete configs.
"""

EPILOG_PLAN = """examples:
  novatune plan examples/qwen3-4b-seed.yaml               # compares with this machine's GPU, if any
  novatune plan examples/qwen3-4b-seed.yaml --gpu-mem 24 --set memory.gradient_checkpointing=false
  novatune plan examples/qwen3-4b-seed.yaml --gpu-mem 40 --set memory.policy=auto    # the planner's per-layer mix
"""


# subcommand -> module holding add_arguments(parser), HELP and run(args); imported when the parser is built
PLUGGED_COMMANDS: dict[str, str] = {
    "eval": "novatune.commands.eval",
    "report": "novatune.commands.report",
    "bench": "novatune.commands.bench",
    "validate": "novatune.commands.validate",
    "tune": "novatune.commands.tune",
}


def add_config_args(p: argparse.ArgumentParser, optional: bool) -> None:
    if optional:
        p.add_argument("config", nargs="?", help="YAML config (default: the embedded demo)")
    else:
        p.add_argument("config", help="YAML config (see examples/*.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.lr=1e-4 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    from novatune.version import __version__

    fmt = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(prog="novatune", formatter_class=fmt, epilog=EPILOG_MAIN,
                                 description="Faster, leaner LLM fine-tuning: fused kernels, packed attention, "
                                             "a readable trainer.")
    ap.add_argument("--version", action="version", version=f"novatune {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    t = sub.add_parser("train", help="fine-tune a model (no config: the embedded demo)", formatter_class=fmt,
                       epilog=EPILOG_TRAIN, description="Train as configured: prints the resolved config, "
                       "a live progress bar, writes metrics.jsonl, checkpoints and the final export.")
    add_config_args(t, optional=True)
    t.add_argument("--output-dir", help="same as --set checkpoint.output_dir=DIR")
    t.add_argument("--nproc", type=int, metavar="N", help="run N processes on this host through torchrun "
                   "(needs parallel.strategy fsdp2 or ddp); plain `torchrun -m novatune train` works too")
    p = sub.add_parser("plan", help="estimate GPU memory for a config before running it", formatter_class=fmt,
                       epilog=EPILOG_PLAN, description="Memory plan: weights, gradients, optimizer states, "
                       "logits, each decoder layer's bytes and time under keep / lean / recompute_mlp / selective / "
                       "recompute / offload, the memory.policy's assignment with its predicted peak and speed; warns "
                       "before an OOM.")
    add_config_args(p, optional=False)
    p.add_argument("--gpu-mem", type=float, metavar="GiB",
                   help="GPU memory to plan for (default: this GPU's free memory; memory.budget_gib wins)")
    p.add_argument("--nproc", type=int, default=1, metavar="N",
                   help="plan one of N processes (parallel.strategy fsdp2: each rank holds 1/N of the weights, "
                        "gradients and optimizer states)")
    sub.add_parser("env", help="versions, GPU, available kernels and attention backends", formatter_class=fmt,
                   description="Print the environment novatune sees (paste it into bug reports).")
    for name, module in PLUGGED_COMMANDS.items():
        mod = importlib.import_module(module)
        sp = sub.add_parser(name, help=mod.HELP, formatter_class=fmt, description=mod.__doc__,
                            epilog=getattr(mod, "EPILOG", None))
        mod.add_arguments(sp)
    return ap


def load_config(args):
    """The config named by args.config with args.overrides (and --output-dir) applied, and its base folder."""
    from novatune.train.config import load_with_base

    return load_with_base(args.config, args.overrides, getattr(args, "output_dir", None))


def check_nproc_positive(nproc: int) -> None:
    """--nproc (train, plan, bench): a number of processes, at least 1."""
    from novatune.train.config import ConfigError

    if nproc < 1:
        raise ConfigError("--nproc", f"must be >= 1, got {nproc}", "pass the number of processes, e.g. 2")


def cmd_train(args) -> int:
    from novatune.parallel import dist as pdist
    from novatune.train.config import ConfigError

    cfg, base = load_config(args)
    if args.nproc is not None and not pdist.launched_by_torchrun():
        check_nproc_positive(args.nproc)
        if cfg.parallel.strategy == "none" and args.nproc > 1:
            raise ConfigError("parallel.strategy", f"--nproc {args.nproc} needs a multi-process strategy",
                              "add --set parallel.strategy=fsdp2 (or ddp)")
        from novatune.parallel.launch import relaunch

        return relaunch(args.nproc, args.argv)
    from novatune.train.loop import train
    from novatune.tune.patching import selection_for

    result = train(cfg, base_dir=base, select=selection_for)
    d = result.session.dist
    # The wrapped model goes before the process group: DDP's reducer holds the group and its last gloo work, and
    # a group destroyed from the reducer's destructor joins a worker thread that waits for the GIL (a hang at exit).
    del result
    gc.collect()
    pdist.teardown(d)
    return 0


def cmd_plan(args) -> int:
    from novatune.train.config import ConfigError
    from novatune.train.plan import plan, render

    cfg, base = load_config(args)
    check_nproc_positive(args.nproc)
    if args.gpu_mem is not None and not (math.isfinite(args.gpu_mem) and args.gpu_mem > 0):
        raise ConfigError("--gpu-mem", f"must be a positive number of GiB, got {args.gpu_mem}", "e.g. --gpu-mem 80")
    est = plan(cfg, base_dir=base, gpu_mem_gib=args.gpu_mem, nproc=args.nproc)
    print(render(est))
    return 1 if est.get("oom") else 0


def cmd_env(args) -> int:
    from novatune.commands.env import render_env

    print(render_env())
    return 0


def _user_errors() -> tuple:
    from novatune.data.sources import DataError
    from novatune.train.checkpoint import CheckpointError
    from novatune.train.config import ConfigError
    from novatune.train.model import SetupError

    return ConfigError, DataError, SetupError, CheckpointError


def main(argv: list[str] | None = None) -> int:
    """The CLI's exit code: 0, 2 a config or data error, 3 unhealthy training, 128 + N a signal; under `--nproc`
    each rank also records its code for the launcher (parallel/launch.py)."""
    from novatune.parallel.launch import record_rank_exit

    code = 1  # an exception that escapes: Python exits 1
    try:
        code = _main(argv)
        return code
    except SystemExit as e:
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        raise
    finally:
        record_rank_exit(code)


def _main(argv: list[str] | None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.command is None:
        ap.print_help()
        return 0
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what --nproc re-runs under torchrun
    handlers = {"train": cmd_train, "plan": cmd_plan, "env": cmd_env}
    try:
        if args.command in PLUGGED_COMMANDS:
            return importlib.import_module(PLUGGED_COMMANDS[args.command]).run(args)
        return handlers[args.command](args)
    except _user_errors() as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # train's RunInterrupted carries 128 + the signal number
        print(f"interrupted: {e}" if str(e) else "interrupted", file=sys.stderr)
        return getattr(e, "exit_code", 130)
    except RuntimeError as e:
        from novatune.train.nonfinite import UnhealthyTraining

        if not isinstance(e, UnhealthyTraining):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
