"""One `novatune bench` stack in this process: train the config with the stack's changes for warm + steps optimizer
steps through the real trainer, time the last `steps`, write <stack-dir>/result.json (schema: bench/runner.py).

    python -m novatune.bench.worker --stack novatune --stack-dir runs/b/novatune --warm 2 --steps 3 \\
        --config examples/qwen3-4b-seed.yaml [--set key=value ...] [--peak-tflops 760 --peak-source measured]
        [--profile]   # one more step under torch.profiler -> <run_dir>/traces/<stack>.json

Exit 0 when the stack ran (or is absent: the result says why), 1 when it failed (the result holds the error).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path


class StepMeter:
    """The trainer's hooks: marks the end of warm-up (synchronised; the memory peak is reset there), counts the
    timed steps' tokens and attended keys, and the wall time of every step."""

    def __init__(self, warm: int, steps: int, device_type: str, then=None, trace: Path | None = None):
        self.warm, self.steps, self.cuda = warm, steps, device_type == "cuda"
        self.trace, self.prof = trace, None  # trace: profile one extra step after the timed ones, to this file
        self.then = then  # another model hook to chain (the peer's attention switch)
        self.model = None
        self.t_last = self.t0 = self.t1 = None
        self.step_s: list[float] = []
        self.tokens: list[int] = []
        self.keys = 0.0
        self.peak_bytes: int | None = None  # allocator peak over the timed steps (CUDA)

    def _sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def model_hook(self, model) -> None:
        if self.then is not None:
            self.then(model)
        self.model = model
        self._sync()
        self.t_last = time.perf_counter()

    def step_hook(self, step: int, mbs: list[dict]) -> None:
        self._sync()
        now = time.perf_counter()
        self.step_s.append(now - self.t_last)
        self.t_last = now
        if step == self.warm:
            if self.cuda:
                import torch

                torch.cuda.reset_peak_memory_stats()
            self.t0 = now
        elif self.warm < step <= self.warm + self.steps:  # steps 1..warm are warm-up: neither timed nor counted
            self.tokens.append(sum(mb["num_tokens"] for mb in mbs))
            self.keys += sum(mb["attn_keys"] for mb in mbs)
            if step == self.warm + self.steps:
                self.t1 = now
                if self.cuda:
                    import torch

                    self.peak_bytes = torch.cuda.max_memory_allocated()
                if self.trace is not None:
                    self._start_profile()
        elif self.prof is not None:  # the extra, profiled step: neither timed nor metered
            self._stop_profile()

    def _start_profile(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.prof = profile(activities=acts)
        self.prof.__enter__()

    def _stop_profile(self) -> None:
        self.prof.__exit__(None, None, None)
        self.trace.parent.mkdir(parents=True, exist_ok=True)
        self.prof.export_chrome_trace(str(self.trace))
        self.prof = None


def _sig(x: float, digits: int = 5) -> float:
    """Rounded to significant digits (a tiny CPU test model has 1e-4 GFLOP/token)."""
    return float(f"{x:.{digits}g}")


def _model_type(cfg, base_dir) -> str:
    from novatune.train.model import load_tokenizer, model_config

    return model_config(cfg.model, load_tokenizer(cfg.model, base_dir), base_dir).model_type


def run_stack(args) -> dict:
    from rich.console import Console

    from novatune.train.config import load_with_base
    from novatune.bench.runner import STACKS
    from novatune.bench.peer import apply_liger, liger_version, register_peer_varlen, use_peer_attention
    from novatune.train.loop import train
    from novatune.train.metrics import flops_per_token
    from novatune.train.model import param_counts, pick_device

    stack, out = args.stack, Path(args.stack_dir)
    total = args.warm + args.steps + (1 if args.profile else 0)  # the profiled step comes after the timed ones
    run_overrides = [f"checkpoint.output_dir={out}", "checkpoint.resume=never", "checkpoint.save_every=0",
                     "checkpoint.export=false", f"train.max_steps={total}", "logging.every=1",
                     "logging.progress=false", "logging.tensorboard=false"]
    if args.peak_tflops:
        run_overrides.append(f"logging.peak_tflops={args.peak_tflops}")
    overrides = list(args.overrides) + STACKS[stack]["overrides"] + run_overrides
    cfg, base = load_with_base(args.config, overrides)
    then, liger_applied = None, None
    if stack == "liger-peer":
        liger_applied = apply_liger(_model_type(cfg, base))  # before the model exists (class-level patch)
        register_peer_varlen()
        then = use_peer_attention
    device = pick_device(cfg.model.device)
    trace = out.parent / "traces" / f"{stack}.json" if args.profile else None
    meter = StepMeter(args.warm, args.steps, device.type, then, trace)
    res = train(cfg, base_dir=base, console=Console(soft_wrap=True), model_hook=meter.model_hook,
                step_hook=meter.step_hook)
    if meter.t1 is None:
        raise RuntimeError(f"the trainer stopped after {res.steps} steps; {total} were needed")
    timed_s = meter.t1 - meter.t0
    tokens = sum(meter.tokens)
    tps = tokens / timed_s
    model = meter.model
    flops_cfg = getattr(model, "get_base_model", lambda: model)().config
    fpt = flops_per_token(flops_cfg, meter.keys / max(1, tokens), 0.0 if cfg.method.type in ("lora", "qlora") else 1.0)
    peak, source = args.peak_tflops, args.peak_source
    if not peak:
        from novatune.train.metrics import peak_tflops

        peak = peak_tflops(device, cfg.logging.peak_tflops, cfg.logging.measure_peak)
        source = "GPU datasheet table (novatune.train.metrics)" if peak else None
    metrics = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    n_total, n_train = param_counts(model)
    backend = None
    if res.patch_report is not None:
        from novatune.attention.backends import last_choice

        choice = last_choice()
        backend = choice.backend if choice else None
    return {
        "stack": stack, "status": "ok", "reason": None, "description": STACKS[stack]["description"],
        "config": args.config or "<demo>", "overrides": list(args.overrides), "stack_overrides": STACKS[stack][
            "overrides"], "warm": args.warm, "steps": args.steps,
        "tok_s": round(tps, 1), "timed_s": round(timed_s, 6), "timed_tokens": tokens, "tokens_per_step": meter.tokens,
        "step_s": [round(x, 4) for x in meter.step_s], "gflop_per_tok": _sig(fpt / 1e9),
        "model_tflops": _sig(tps * fpt / 1e12), "mfu": round(tps * fpt / (peak * 1e12), 4) if peak else None,
        "peak_tflops": peak, "peak_tflops_source": source,
        "peak_gib": round(meter.peak_bytes / 2**30, 3) if meter.peak_bytes is not None else None,
        "losses": [res.losses[s] for s in sorted(res.losses)], "grad_norms": [r["grad_norm"] for r in metrics],
        "model_class": type(model).__name__, "model_type": flops_cfg.model_type, "params": n_total,
        "trainable_params": n_train, "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "device_type": device.type, "patch": res.patch_report.to_dict() if res.patch_report is not None else None,
        "attention_backend": backend, "liger_applied": liger_applied, "liger_version": liger_version(),
        "pack": res.pack_stats.to_dict(), "trace": str(trace) if trace is not None and trace.exists() else None,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stack", required=True)
    p.add_argument("--stack-dir", required=True)
    p.add_argument("--config")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--peak-tflops", type=float)
    p.add_argument("--peak-source")
    p.add_argument("--profile", action="store_true", help="profile one extra step after the timed ones")
    args = p.parse_args(argv)
    from novatune.bench.runner import STACKS
    from novatune.bench.peer import PeerUnavailable

    out = Path(args.stack_dir)
    out.mkdir(parents=True, exist_ok=True)
    code = 0
    if args.stack not in STACKS:
        row = {"stack": args.stack, "status": "failed", "reason": f"unknown stack; choose from {', '.join(STACKS)}"}
        code = 1
    else:
        try:
            row = run_stack(args)
        except PeerUnavailable as e:
            row = {"stack": args.stack, "status": "absent", "reason": str(e),
                   "description": STACKS[args.stack]["description"]}
        except Exception as e:  # noqa: BLE001 - recorded in the row (with the traceback in worker.log), exit 1
            traceback.print_exc()
            row = {"stack": args.stack, "status": "failed", "reason": f"{type(e).__name__}: {e}",
                   "description": STACKS[args.stack]["description"]}
            code = 1
    (out / "result.json").write_text(json.dumps(row, indent=1))
    print("RESULT " + json.dumps({k: row.get(k) for k in ("stack", "status", "tok_s", "peak_gib", "reason")}),
          flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
