"""Experiment (issue 12): the pre-redesign bench/e2e.py loop on exactly the rows `novatune bench` trains on.

bench/e2e.py generated its own rows (documents cut to fill each 4096-token row), so its novatune figure and the
run builder's differ by the data as well as by the loop. This script removes the data from the comparison:

    # 1. in the current tree: the rows `novatune bench CONFIG` consumes, in its order (warm-up rows first)
    python bench/experiments/exp_ab_same_rows.py dump --config examples/qwen3-4b-seed.yaml --rows 24 --out rows.pt
    # 2. in the old tree (PYTHONPATH pointing at it): bench/e2e.py's own loop with make_rows replaced by those rows
    cd OLD_TREE && PYTHONPATH=$PWD python NEW_TREE/bench/experiments/exp_ab_same_rows.py old --rows rows.pt \
        -- --stack novatune --warm 2 --steps 4

The old loop counts steps x GA x --seq tokens; the rows here are shorter (whole documents, no cut), so the real
tok/s is printed beside it: its tok/s scaled by the real tokens of the timed rows over steps x GA x seq.
"""
from __future__ import annotations

import argparse
import os
import sys


def dump(args) -> None:
    import torch
    import yaml

    from novatune.data.dataset import BatchStream
    from novatune.train.config import apply_overrides, from_dict
    from novatune.train.session import build_data, load_tokenizer, model_config, pad_id_of

    data = apply_overrides(yaml.safe_load(open(args.config)), args.set or [])
    cfg = from_dict(data)
    tok = load_tokenizer(cfg.model, None)
    mconf = model_config(cfg.model, tok, None)
    built = build_data(cfg.data, tok, mconf.vocab_size, None)
    stream = BatchStream(built.rows, cfg.train.micro_batch, cfg.train.seed, cfg.data.shuffle, pad_id=pad_id_of(tok))
    rows = []
    for _ in range(args.rows):
        b = stream.next()
        assert b["input_ids"].shape[0] == 1, "one row per micro-batch (micro_batch 1)"
        rows.append((b["input_ids"][0].tolist(), b["position_ids"][0].tolist(), b["labels"][0].tolist()))
    torch.save(rows, args.out)
    print(f"{len(rows)} rows, {sum(len(r[0]) for r in rows)} tokens -> {args.out}")


def old(args, e2e_args: list[str]) -> None:
    import torch

    sys.path.insert(0, os.getcwd())  # the old tree: its bench/e2e.py and its novatune package
    from bench import e2e

    rows = torch.load(args.rows)
    e2e.make_rows = lambda n, seq, vocab, seed=1: rows[:n]
    p = argparse.ArgumentParser()
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--ga", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    known, _ = p.parse_known_args(e2e_args)
    timed = rows[known.ga * known.warm: known.ga * (known.warm + known.steps)]
    scale = sum(len(r[0]) for r in timed) / (len(timed) * known.seq)
    print(f"AB real tokens / counted tokens of the timed rows: {scale:.4f}", flush=True)
    sys.argv = ["e2e.py", *e2e_args]
    e2e.main()


def main() -> None:
    argv = sys.argv[1:]
    e2e_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("--config", required=True)
    d.add_argument("--set", action="append")
    d.add_argument("--rows", type=int, default=24)
    d.add_argument("--out", required=True)
    o = sub.add_parser("old")
    o.add_argument("--rows", required=True)
    args = p.parse_args(argv)
    dump(args) if args.cmd == "dump" else old(args, e2e_args)


if __name__ == "__main__":
    main()
