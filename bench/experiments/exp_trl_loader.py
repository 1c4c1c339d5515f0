"""Whether TRL's data loader slows the host that queues the GPU work: SFTTrainer + novatune.patch(trainer) with
its DataLoader in four settings (worker processes 2 / 0, pin_memory on / off) beside `novatune train`, on the same
config, each 8 steps with the first 2 warm-up, in this order: train, the four, train again.

Hypothesis (exp_trl_step_profile.py, session 14): TRL's steps are host-bound in the forward of micro-batches 3-4
(host 111 ms vs `novatune train`'s 80 ms for the same ops, 11 vs 9 us between ops) while the worker processes
deliver the next step's batches to the pin-memory thread, which unpickles and pins them holding the GIL.

    python bench/experiments/exp_trl_loader.py examples/qwen3-4b-seed.yaml OUT.jsonl
"""
import json
import os
import sys

import torch
import transformers

from novatune.bench.trl_stack import run_trl_stack
from novatune.bench.worker import WarmClock
from novatune.train.config import load
from novatune.train.loop import train

STEPS, WARM = 8, 2


def _train_row(config: str, sets: list[str]) -> dict:
    clock, tokens = WarmClock(torch.device("cuda"), WARM, STEPS), {}

    def hook(step, micro_batches):
        clock.step_end(step)
        tokens[step] = sum(mb["num_tokens"] for mb in micro_batches)

    train(load(config, sets), step_hook=hook)
    timed = sum(tokens[s] for s in range(WARM + 1, STEPS + 1))
    return {"stack": "novatune_train", "tok_s": round(timed / clock.timed_s, 1), "step_ms": clock.step_ms()}


def main(config: str, out: str) -> None:
    sets = [f"train.max_steps={STEPS}", "checkpoint.output_dir=/tmp/exp_trl_loader", "checkpoint.save_every=0"]
    rows = [_train_row(config, sets)]
    for workers, pin in ((2, True), (2, False), (0, True), (0, False)):
        res = run_trl_stack(load(config, sets), steps=STEPS, warmup=WARM, dataloader_workers=workers,
                            output_dir=f"/tmp/exp_trl_loader/trl{workers}{pin}",
                            sft_args={"dataloader_pin_memory": pin})
        rows.append({"stack": f"trl_sft+novatune workers={workers} pin_memory={pin}",
                     "tok_s": round(res["tokens_per_s"], 1), "step_ms": res["step_ms"], "losses": res["losses"]})
    rows.append(_train_row(config, sets))
    base = (rows[0]["tok_s"] + rows[-1]["tok_s"]) / 2
    with open(out, "a") as f:
        for r in rows:
            r.update(exp="trl_loader", vs_novatune_train_mean=round(r["tok_s"] / base, 4), config=config,
                     steps=STEPS, warm=WARM, torch=torch.__version__, transformers=transformers.__version__,
                     gpu=torch.cuda.get_device_name(), git_sha=os.environ.get("NOVATUNE_GIT_SHA"))
            print(json.dumps({k: r[k] for k in ("stack", "tok_s", "vs_novatune_train_mean", "step_ms")}))
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
