"""Issue 3's GPU check: the trainer's tokens/s on the seed config vs bench/e2e.py's novatune row in the same run.

    python scripts/train_speed.py RUN_DIR E2E_JSONL RESULTS_JSONL [--warm 2]
Reads RUN_DIR/metrics.jsonl (tokens/s per logged step), skips the warm-up steps, compares with the newest
novatune qwen3-4b row of E2E_JSONL, appends one row to RESULTS_JSONL and prints it.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from novatune.measure.results import write_row  # noqa: E402

run_dir, e2e_path, out_path = sys.argv[1:4]
warm = int(sys.argv[sys.argv.index("--warm") + 1]) if "--warm" in sys.argv else 2
rows = [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]
timed = [r for r in rows if r["step"] > warm]
tps = len(timed) / sum(1.0 / r["tokens_per_s"] for r in timed)  # harmonic mean = total tokens / total time
e2e = [json.loads(line) for line in open(e2e_path)]
ref = [r for r in e2e if r.get("stack") == "novatune" and r.get("arch") == "qwen3-4b"][-1]
row = {"bench": "train_vs_e2e", "config": "examples/qwen3-4b-seed.yaml", "timed_steps": len(timed),
       "train_tok_s": round(tps, 1), "e2e_novatune_tok_s": ref["tok_s"], "ratio": round(tps / ref["tok_s"], 4),
       "train_mfu": timed[-1].get("mfu"), "train_mem_gib": timed[-1].get("mem_gib"),
       "losses": [round(r["loss"], 4) for r in rows]}
print(json.dumps(write_row(out_path, row)))
