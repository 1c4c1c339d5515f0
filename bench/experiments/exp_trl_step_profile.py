"""One whole optimizer step of TRL's SFTTrainer + novatune.patch(trainer) and of `novatune train` under
torch.profiler (CPU + CUDA), from one step end to the next, on the same config: GPU busy vs wall per step, the
largest idle spans with the host ops that launched the kernel ending each, and the host syncs
(novatune.bench.diagnostics.gap_report). The bench's step_ms say how much longer TRL's steps are; this says where.

    python bench/experiments/exp_trl_step_profile.py examples/qwen3-4b-seed.yaml OUT_DIR [PROFILED_STEP]
"""
import json
import os
import sys

import torch
import transformers
from torch.profiler import ProfilerActivity, profile

from novatune.bench.diagnostics import gap_report
from novatune.bench.trl_stack import run_trl_stack
from novatune.train.config import load
from novatune.train.loop import train


def _busy_ms(prof) -> float:
    return sum(e.time_range.elapsed_us() for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3


class _StepWindow:
    """Starts the profiler at the end of step `step - 1` and stops it at the end of step `step` (synchronised)."""

    def __init__(self, step: int, path: str):
        self.step, self.path, self.prof, self.result = step, path, None, None

    def at_step_end(self, step: int) -> None:
        if step == self.step - 1:
            torch.cuda.synchronize()
            self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self.prof.__enter__()
            self.t0 = torch.cuda.Event(enable_timing=True)
            self.t0.record()
        elif step == self.step and self.prof is not None:
            t1 = torch.cuda.Event(enable_timing=True)
            t1.record()
            torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            self.prof.export_chrome_trace(self.path + ".json")
            wall = self.t0.elapsed_time(t1)
            self.result = {"wall_ms": round(wall, 1), "busy_ms": round(_busy_ms(self.prof), 1)}
            with open(self.path + ".txt", "w") as f:
                f.write(f"step {step}: wall {wall:.1f} ms, CUDA busy {self.result['busy_ms']} ms\n")
                f.write(gap_report(self.path + ".json", min_gap_us=200.0, top=40))
                f.write(self.prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))


def main(config: str, out_dir: str, step: int = 4) -> None:
    if step < 2:
        raise SystemExit("PROFILED_STEP must be >= 2: the window opens at the end of the step before it")
    os.makedirs(out_dir, exist_ok=True)
    sets = [f"train.max_steps={step + 1}", "checkpoint.output_dir=/tmp/exp_trl_step", "checkpoint.save_every=0"]
    rows = []

    window = _StepWindow(step, os.path.join(out_dir, "novatune_train"))
    train(load(config, sets), step_hook=lambda s, _mbs: window.at_step_end(s))
    rows.append({"exp": "trl_step_profile", "stack": "novatune_train", **(window.result or {})})

    window = _StepWindow(step, os.path.join(out_dir, "trl_sft"))

    class Cb(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            window.at_step_end(state.global_step)

    real_init = transformers.Trainer.__init__

    def init_with_callback(self, *a, **kw):
        real_init(self, *a, **kw)
        self.add_callback(Cb())
    transformers.Trainer.__init__ = init_with_callback
    try:
        run_trl_stack(load(config, sets), steps=step + 1, warmup=1, output_dir="/tmp/exp_trl_step/trl")
    finally:
        transformers.Trainer.__init__ = real_init
    rows.append({"exp": "trl_step_profile", "stack": "trl_sft+novatune", **(window.result or {})})
    for r in rows:
        print(json.dumps(r))
    with open(os.path.join(out_dir, "rows.jsonl"), "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *(int(a) for a in sys.argv[3:4]))
