"""GSM8K-style exact match by generation: k-shot chain-of-thought prompts, batched greedy decoding with a KV cache.

Prints the results table (accuracy with its 95% Wilson interval, per-request throughput and latency, average output
tokens) plus the aggregate generated tokens/s, and one JSON summary line last. --output writes the full result
(every request's output and extracted answer) for `novatune report --eval`.
"""
from __future__ import annotations

HELP = "GSM8K-style accuracy and generation speed of a local model, a novatune export/checkpoint or a random arch"

EPILOG = """examples:
  novatune eval --model runs/seed/final --output eval_after.json --label "finetuned novatune"
  novatune eval --model /models/Qwen3-4B-Instruct-2507 --data gsm8k_test.jsonl --limit 50 --chat
  novatune eval --arch qwen2.5-0.5b --max-new-tokens 256 --batch-size 64 --repeat 3   # speed test, random weights
  novatune eval --arch qwen3-tiny --limit 4 --k-shot 2 --max-new-tokens 16 --device cpu

--data defaults to the bundled sample (novatune/assets/gsm8k_sample.jsonl, 22 problems); the real GSM8K test set is
a JSONL with the same fields. --arch builds random weights (use --tokenizer, default: the bundled demo tokenizer):
accuracy is then meaningless but the decoding speed is real. Exit codes: 0 ok, 2 bad input.
"""


def add_arguments(p) -> None:
    src = p.add_argument_group("model")
    src.add_argument("--model", help="local from_pretrained folder, novatune run/export folder, or checkpoint folder")
    src.add_argument("--arch", help="random-init named architecture (novatune.train.arch.ARCHS), for speed tests")
    src.add_argument("--arch-set", action="append", default=[], metavar="KEY=VALUE",
                     help="override an --arch config field, e.g. num_hidden_layers=2 (repeatable)")
    src.add_argument("--tokenizer", help="local tokenizer folder or 'demo' (default: the model's; --arch: demo)")
    src.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    src.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                     help="auto: bf16 on CUDA, fp32 on CPU")
    src.add_argument("--attn", default="sdpa", help="attn_implementation (sdpa, eager, flash_attention_2, ...)")
    src.add_argument("--seed", type=int, default=0, help="random-init seed for --arch")
    d = p.add_argument_group("data and decoding")
    d.add_argument("--data", help="GSM8K-format JSONL (question, answer ending '#### N'); default: bundled sample")
    d.add_argument("--shots-file", help="solved problems for the k-shot prompt (default: --data; the evaluated "
                                        "problem is never its own shot)")
    d.add_argument("--limit", type=int, help="evaluate the first N problems")
    d.add_argument("--k-shot", type=int, default=4)
    d.add_argument("--chat", action="store_true", help="shots as chat turns through the tokenizer's chat template")
    d.add_argument("--batch-size", type=int, default=32)
    d.add_argument("--max-new-tokens", type=int, default=256)
    d.add_argument("--stop", action="append", help="stop string (repeatable; default: 'Question:')")
    d.add_argument("--repeat", type=int, default=1, help="run each problem N times (throughput tests; accuracy "
                                                         "counts the first copy)")
    d.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up generate call")
    o = p.add_argument_group("output")
    o.add_argument("--label", help="column name in tables and reports (default: the model)")
    o.add_argument("--output", help="write the full result JSON here (input of novatune report --eval)")
    o.add_argument("--results", help="append a summary row to this .jsonl (e.g. bench/results/eval.jsonl)")


def _parse_sets(items: list[str]) -> dict:
    import yaml

    from novatune.eval.exact_match import EvalError

    out = {}
    for it in items:
        if "=" not in it:
            raise EvalError(f"--arch-set {it!r}: expected KEY=VALUE, e.g. num_hidden_layers=2")
        k, v = it.split("=", 1)
        out[k.strip()] = yaml.safe_load(v)
    return out


def run(args) -> int:
    import json
    import sys
    from pathlib import Path

    from novatune.eval.exact_match import (
        SAMPLE,
        EvalError,
        EvalSettings,
        evaluate,
        load_model,
        load_problems,
        render_table,
    )

    try:
        for name in ("k_shot", "batch_size", "max_new_tokens", "repeat"):
            if getattr(args, name) < (0 if name == "k_shot" else 1):
                raise EvalError(f"--{name.replace('_', '-')} must be {'>= 0' if name == 'k_shot' else '>= 1'}")
        data = args.data or str(SAMPLE)
        problems = load_problems(data, args.limit)
        shots = load_problems(args.shots_file) if args.shots_file else load_problems(data)
        model, tok, desc = load_model(args.model, args.arch, args.tokenizer, args.device, args.dtype, args.attn,
                                      _parse_sets(args.arch_set), args.seed)
        settings = EvalSettings(k_shot=args.k_shot, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                                chat=args.chat, stops=tuple(args.stop) if args.stop else ("Question:",),
                                warmup=not args.no_warmup, repeat=args.repeat)
        print(f"eval: {desc['model']} on {desc['device']} ({desc['dtype']}, {desc['params'] / 1e6:.1f}M params), "
              f"{len(problems)} problems x{args.repeat} from {data}, {args.k_shot}-shot, batch {args.batch_size}, "
              f"max {args.max_new_tokens} new tokens", flush=True)

        def progress(done, total, dt):
            print(f"  {done}/{total} requests  (batch {dt:.2f} s)", flush=True)

        res = evaluate(model, tok, problems, shots, settings, progress)
    except EvalError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from novatune.measure.results import environment

    res = {"task": "gsm8k", "label": args.label or desc["model"], **desc, "data": data,
           "shots_file": args.shots_file or data, "env": environment(), **res}
    if desc["kind"] == "random":
        res["notes"].append("random weights: accuracy is meaningless, decoding speed is real")
    print()
    print(render_table([res]))
    print(f"\ngenerated {res['gen_tokens']:,} tokens in {res['gen_time_s']:.2f} s of generate: "
          f"{res['gen_tokens_per_s']:,.1f} tok/s; {res['hit_max_new_tokens']}/{res['requests']} requests hit "
          f"max_new_tokens")
    for n in res["notes"]:
        print(f"note: {n}")
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(res, indent=1))
    summary = {k: res[k] for k in ("task", "label", "model", "device", "dtype", "n", "correct", "accuracy", "ci95",
                                   "avg_output_tokens", "avg_latency_s", "avg_request_tokens_per_s",
                                   "gen_tokens_per_s", "gen_tokens", "batch_size", "max_new_tokens", "k_shot",
                                   "requests")}
    if args.results:
        from novatune.measure.results import write_row

        write_row(args.results, {"bench": "eval", **summary})
    print(json.dumps(summary))
    return 0
