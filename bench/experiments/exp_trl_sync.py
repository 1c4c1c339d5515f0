"""Where TRL's SFTTrainer + novatune.patch(trainer) waits for the GPU (issue 13's last 3%): the headline config's
TRL stack with CUDA's sync-debug mode on during two optimizer steps after the warm-up. Prints every synchronising
call site (the innermost frames outside torch) with its count, and the host milliseconds of each phase of a step
(on_step_begin -> compute_loss -> training_step -> on_step_end), and what is live at the peak of step 4 (the
allocation trace replayed to its peak, as `novatune bench --memory` does for one micro-step). Then the stack timed
without and with the Trainer's logging NaN/inf filter. Rows: none (stdout; quoted in LOG.md).

    python bench/experiments/exp_trl_sync.py examples/qwen3-4b-seed.yaml
"""
import collections
import sys
import time
import traceback
import warnings

import torch
import transformers

from novatune.bench.diagnostics import largest_live, replay_to_peak
from novatune.bench.trl_stack import run_trl_stack
from novatune.train.config import load

SITES: collections.Counter = collections.Counter()
PHASES: list[tuple[str, float]] = []


def _site() -> str:
    frames = [f for f in traceback.extract_stack()[:-3] if "/torch/" not in f.filename and "warnings" not in f.filename]
    return " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in frames[-3:][::-1])


class Watch(transformers.TrainerCallback):
    def on_step_begin(self, args, state, control, **kw):
        PHASES.append((f"step {state.global_step + 1} begin", time.perf_counter()))
        if state.global_step == 3 and torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")
            torch.cuda.memory._record_memory_history(max_entries=1000000, stacks="python")

    def on_step_end(self, args, state, control, **kw):
        PHASES.append((f"step {state.global_step} end", time.perf_counter()))
        if state.global_step == 4 and torch.cuda.is_available():
            torch.cuda.synchronize()
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            peak, live, _, _ = replay_to_peak(snap)
            print(f"step 4 peak allocated {peak / 2**30:.2f} GiB; live at the peak:")
            for where, (size, n) in largest_live(live, 15):
                print(f"  {size / 2**30:8.3f} GiB {n:5d} blocks  {where[:240]}")
        if state.global_step == 5 and torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(0)


def main(config):
    real_warn = warnings.showwarning

    def show(message, category, *a, **kw):
        if "synchroniz" in str(message).lower():
            SITES[_site()] += 1
        else:
            real_warn(message, category, *a, **kw)
    warnings.showwarning = show
    warnings.simplefilter("always")
    real_add = transformers.Trainer.add_callback

    def add(self, cb):
        real_add(self, cb)
        if not any(isinstance(c, Watch) for c in self.callback_handler.callbacks):
            real_add(self, Watch())
            for name in ("compute_loss", "training_step"):
                inner = getattr(self, name)

                def timed(*a, _inner=inner, _name=name, **k):
                    PHASES.append((f"  {_name} start", time.perf_counter()))
                    out = _inner(*a, **k)
                    PHASES.append((f"  {_name} end", time.perf_counter()))
                    return out
                setattr(self, name, timed)
    transformers.Trainer.add_callback = add
    res = run_trl_stack(load(config, ["train.max_steps=6", "checkpoint.output_dir=/tmp/exp_trl_sync"]), steps=6,
                        warmup=2, output_dir="/tmp/exp_trl_sync/trl")
    print(f"tok/s {res['tokens_per_s']:.0f} (sync-debug mode on in steps 4-5: slower)")
    transformers.Trainer.add_callback = real_add  # the timed runs below without the watch
    for filt in (False, True, False):  # without the Trainer's per-micro-batch NaN check of the loss, and with it
        other = run_trl_stack(load(config, ["train.max_steps=6", "checkpoint.output_dir=/tmp/exp_trl_sync"]), steps=6,
                              warmup=2, output_dir="/tmp/exp_trl_sync/trl", sft_args={"logging_nan_inf_filter": filt})
        print(f"logging_nan_inf_filter={filt}: tok/s {other['tokens_per_s']:.0f}")
    print("synchronising sites during steps 4-5 (count, site):")
    for site, n in SITES.most_common(30):
        print(f"  {n:4d}  {site}")
    t0 = next(t for name, t in PHASES if name == "step 4 begin")
    for name, t in PHASES:
        if t >= t0 and not name.startswith("step 6"):
            print(f"  {1e3 * (t - t0):9.1f} ms  {name}")


if __name__ == "__main__":
    main(sys.argv[1])
