"""Append a peer harness's RESULT lines (the Unsloth harness prints `RESULT {json}`) to a results file as bench rows,
so a peer's figure quoted beside novatune's sits in bench/results with its device, versions and call.

    python bench/experiments/record_peer_result.py LOG --call NAME --config examples/X.yaml [--results PATH]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

KEEP = ("tok_s", "peak_gib", "peak_reserved_gib", "weights_gib", "losses", "step_ms", "steps", "warm", "ga", "seq",
        "layers", "lora", "params", "gc", "torch", "transformers", "triton", "peft", "trl", "gpu", "unsloth",
        "unsloth_zoo", "moe_backend", "model_tflops", "gflop_per_tok")


def rows(log: Path, call: str, config: str) -> list[dict]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            row = {k: r[k] for k in KEEP if k in r}
            row.update({"bench": "peer_harness", "stack": r.get("config", "peer"), "status": "ok", "call": call,
                        "config": config, "device": r.get("gpu"), "source": log.name})
            out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log", type=Path)
    p.add_argument("--call", required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--results", type=Path, default=Path("bench/results/bench.jsonl"))
    a = p.parse_args()
    new = rows(a.log, a.call, a.config)
    with a.results.open("a") as f:
        for row in new:
            f.write(json.dumps(row) + "\n")
    print(f"{len(new)} row(s) appended to {a.results}")


if __name__ == "__main__":
    main()
