"""Where TRL's SFTTrainer + novatune.patch(trainer) loses tokens/s against `novatune train` on the headline config:
both measured as the GPU acceptance test measures them (8 steps, the first 2 warm-up), TRL with its data collated
in the main process (dataloader_num_workers=0) and in worker processes; the host milliseconds TRL spends per step
fetching and collating its micro-batches (Trainer.get_batch_samples) with no GPU work queued behind them.

    python bench/experiments/exp_trl_gap.py examples/qwen3-4b-seed.yaml OUT.jsonl
"""
import json
import os
import sys
import time

import torch
import transformers

from novatune.bench.trl_stack import run_trl_stack
from novatune.train.config import load
from novatune.train.loop import train


def main(config, out):
    sets = ["train.max_steps=8", "checkpoint.output_dir=/tmp/exp_trl_gap", "checkpoint.save_every=0"]
    times, tokens = {}, {}

    def meter(step, micro_batches):
        torch.cuda.synchronize()
        times[step], tokens[step] = time.perf_counter(), sum(mb["num_tokens"] for mb in micro_batches)

    train(load(config, sets), step_hook=meter)
    rows = [{"exp": "trl_gap", "stack": "novatune_train",
             "tok_s": sum(tokens[s] for s in range(3, 9)) / (times[8] - times[2])}]
    fetch_ms = []
    real = transformers.Trainer.get_batch_samples

    def timed(self, *a, **kw):
        t = time.perf_counter()
        out = real(self, *a, **kw)
        fetch_ms.append(1e3 * (time.perf_counter() - t))
        return out
    transformers.Trainer.get_batch_samples = timed
    for workers in (0, 2, 0, 2):
        fetch_ms.clear()
        res = run_trl_stack(load(config, sets), steps=8, warmup=2, dataloader_workers=workers,
                            output_dir=f"/tmp/exp_trl_gap/trl{workers}")
        rows.append({"exp": "trl_gap", "stack": f"trl_sft+novatune_workers{workers}", "tok_s": res["tokens_per_s"],
                     "losses": res["losses"], "get_batch_samples_ms": [round(x, 1) for x in fetch_ms]})
    base = rows[0]["tok_s"]
    with open(out, "a") as f:
        for r in rows:
            r["vs_novatune_train"] = round(r["tok_s"] / base, 4)
            r.update(torch=torch.__version__, transformers=transformers.__version__, gpu=torch.cuda.get_device_name(),
                     git_sha=os.environ.get("NOVATUNE_GIT_SHA"), config=config, steps=8, warm=2)
            print(json.dumps(r))
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
