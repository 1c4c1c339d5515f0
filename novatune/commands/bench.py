"""Train the configured workload with stock HF, the peers (Liger + torch varlen attention, Unsloth; when installed)
and novatune (and its variants: full fine-tuning beside a LoRA config, without CUDA graphs), each in its own
process from the same init and data, every one built by the trainer's builder; print tokens/s, MFU, peak memory and
per-step losses side by side, and write a run directory (bench.jsonl rows, summary.json) and --results rows.

tokens/s counts the timed optimizer steps after the warm-up steps (synchronised); peak GiB is the allocator's
peak over the timed steps; MFU divides by a bf16 matmul rate measured once in this run. Rows carry the device,
versions and git sha. Exit 1 when a stack failed (its row holds the error); a stack that cannot run here (Liger
not installed) gets a row saying so.
"""
from __future__ import annotations

HELP = "stock vs peers vs novatune on the configured workload: tok/s, MFU, memory, losses"
EPILOG = """examples:
  novatune bench examples/qwen3-4b-seed.yaml                       # all stacks, writes runs/bench-<time>/
  novatune bench examples/qwen3-4b-seed.yaml --warm 2 --steps 5 --run-dir /tmp/bench
  novatune bench examples/qwen3-4b-seed.yaml --stacks stock,novatune --set model.arch_overrides.num_hidden_layers=8
  novatune bench examples/lora.yaml --stacks stock,liger-peer,novatune,novatune_full
  novatune bench examples/qlora.yaml --stacks stock,novatune,novatune_eager --profile --memory
  novatune bench examples/qwen3-4b-seed.yaml --nproc 2 --stacks novatune,novatune_ddp,novatune_fsdp2
                                      # the parallel stacks on 2 GPUs beside one GPU at the same global batch
  novatune bench examples/qwen3-4b-seed.yaml --stacks trl-sft,novatune-train --rounds 3
                                      # A B, B A, A B: each row its stack's median round (a drifting host)
  novatune report /tmp/bench                                       # the report from the run directory
"""


def add_arguments(p) -> None:
    from novatune.commands.cli import add_config_args

    add_config_args(p, optional=False)
    p.add_argument("--stacks", default="stock,liger-peer,unsloth,novatune",
                   help="comma list of stock, liger-peer, unsloth, novatune, novatune_full, novatune_eager "
                        "(the anchors' names hf_sdpa and varlen_liger are accepted); default: "
                        "stock,liger-peer,unsloth,novatune")
    p.add_argument("--nproc", type=int, default=1, metavar="N",
                   help="processes (GPUs) for the parallel stacks novatune_ddp and novatune_fsdp2, under torchrun, "
                        "grad_accum micro-batches per rank; the other stacks then train the same global batch in "
                        "one process (grad_accum x N), the reference of the parallel rows' scaling and losses")
    p.add_argument("--warm", type=int, default=2, help="warm-up optimizer steps, not timed (default 2, min 1)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed optimizer steps (default: train.max_steps minus the warm-up)")
    p.add_argument("--run-dir", help="where the run's files go (default: runs/bench-<date-time>)")
    p.add_argument("--results", default="",
                   help="a .jsonl file the rows are appended to as well, e.g. bench/results/bench.jsonl (the rows "
                        "are always in the run directory's bench.jsonl)")
    p.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="run the stacks N times in alternating order (A B, B A, ...); each row is its stack's "
                        "median round, with every round's tokens/s (ratios robust to a host that drifts)")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="seconds allowed per stack")
    p.add_argument("--profile", action="store_true",
                   help="one micro-step per stack under torch.profiler, after the timed steps (CUDA): "
                        "<run-dir>/traces/<stack>.json + .txt (op table, idle gaps, host syncs)")
    p.add_argument("--memory", action="store_true",
                   help="replay one micro-step's allocations to the peak (CUDA): <run-dir>/memory/<stack>.txt")
    p.add_argument("--no-gc-freeze", action="store_true",
                   help="leave Python's GC as is (by default gc.freeze() after the warm-up: full collections "
                        "walk every long-lived object, ~0.2 s each, inside timed steps)")
    p.add_argument("--diag", action="store_true", help="print Triton compiles, long GCs and warm-up step times")


def run(args) -> int:
    import json
    from pathlib import Path

    from novatune.bench.runner import default_run_dir, render_table, run_bench
    from novatune.bench.stacks import parse_stacks
    from novatune.commands.cli import load_config
    from novatune.train.config import ConfigError

    try:
        stacks = parse_stacks(args.stacks)
    except ValueError as e:
        raise ConfigError("--stacks", str(e)) from None
    if args.warm < 1:
        raise ConfigError("--warm", f"must be >= 1, got {args.warm}", "docs/BENCHMARKS.md asks for >= 2 warm-up steps")
    if args.rounds < 1:
        raise ConfigError("--rounds", f"must be >= 1, got {args.rounds}", "pass --rounds 1 (once) or more")
    cfg, _ = load_config(args)  # config errors surface here, before any process starts
    check_nproc(args.nproc, cfg, stacks)
    steps = args.steps if args.steps is not None else (cfg.train.max_steps or 0) - args.warm
    if steps < 1:
        raise ConfigError("--steps", f"{steps} timed steps (train.max_steps={cfg.train.max_steps}, --warm "
                          f"{args.warm})", "pass --steps N (N >= 1)")
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir("bench")
    summary = run_bench(args.config, list(args.overrides), stacks, run_dir, args.warm, steps, args.timeout,
                        args.profile, results=args.results or None, memory=args.memory,
                        gc_freeze=not args.no_gc_freeze, diag=args.diag, nproc=args.nproc,
                        rounds=args.rounds)
    print()
    print(render_table(summary))
    print(f"run directory: {run_dir}")
    sp = summary["speedup"]
    print(json.dumps({"bench": str(run_dir), "exit_code": summary["exit_code"],
                      **{r["stack"]: (r["tok_s"] if r["status"] == "ok" else r["status"]) for r in summary["rows"]},
                      **sp}))
    return summary["exit_code"]


def check_nproc(nproc: int, cfg, stacks: list[str]) -> None:
    """--nproc: at least 1, a parallel stack to run with it, and as many GPUs as processes on a CUDA run."""
    from novatune.bench.stacks import STACKS
    from novatune.commands.cli import check_nproc_positive
    from novatune.train.config import ConfigError

    check_nproc_positive(nproc)
    if nproc == 1:
        return
    if not any(STACKS[s].strategy for s in stacks):
        parallel = ", ".join(s for s in STACKS if STACKS[s].strategy)
        raise ConfigError("--nproc", f"{nproc} processes, but none of the stacks {', '.join(stacks)} runs on several",
                          f"add a parallel stack to --stacks ({parallel})")
    if cfg.model.device != "cpu":
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have and have < nproc:
            raise ConfigError("--nproc", f"{nproc} processes, one GPU each, but this machine shows {have} GPU(s)",
                              f"pass --nproc {have} or less (or set CUDA_VISIBLE_DEVICES)")
