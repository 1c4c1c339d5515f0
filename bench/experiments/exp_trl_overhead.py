"""Where TRL's SFTTrainer + novatune.patch(trainer) loses time against the novatune session on the same model, rows
and optimizer (headline config): one profiled optimizer step of each, after warm-up; prints wall time, CUDA busy
time and the top CUDA kernels and CPU ops. Rows: none (stdout; quoted in LOG.md).

    python bench/experiments/exp_trl_overhead.py examples/qwen3-4b-seed.yaml
"""
import sys
import time

import torch
import transformers
from torch.profiler import ProfilerActivity, profile

from novatune.bench import trl_stack
from novatune.train.config import load_with_base
from novatune.train.session import build


def table(prof, title):
    ev = prof.key_averages()
    cuda = sum(e.self_device_time_total for e in ev) / 1e3
    print(f"== {title}: CUDA busy {cuda:.1f} ms")
    print(ev.table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=60))
    print(ev.table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=60))


def main(config):
    cfg, base = load_with_base(config, ["train.max_steps=5"])
    s = build(cfg, base)
    plan = s.batches(4)
    for mbs in plan[:3]:
        s.step(mbs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        s.step(plan[3])
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    print(f"novatune session step wall {1e3 * wall:.1f} ms")
    table(prof, "novatune session")
    del s, plan
    torch.cuda.empty_cache()

    class Prof(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 3:
                torch.cuda.synchronize()
                self.p = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                self.p.__enter__()
                self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 4:
                torch.cuda.synchronize()
                print(f"trl step wall {1e3 * (time.perf_counter() - self.t):.1f} ms")
                self.p.__exit__(None, None, None)
                table(self.p, "trl-sft")

    real_add = transformers.Trainer.add_callback
    transformers.Trainer.add_callback = lambda self, cb: (real_add(self, cb), real_add(self, Prof()))[0]
    trl_stack.run_trl_stack(cfg, 5, 2, base)


if __name__ == "__main__":
    main(sys.argv[1])
