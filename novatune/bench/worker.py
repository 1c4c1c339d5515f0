"""One `novatune bench` stack in this process: `python -m novatune.bench.worker SPEC.json`.

The spec (written by bench/runner.py) names the stack, the config and overrides, the step counts and the options:
  {"stack", "stack_dir", "config", "overrides", "warm", "steps", "peak_tflops", "peak_source",
   "profile", "memory", "gc_freeze", "diag", "gpu_cap_gib" (optional: a GPU memory cap for the whole process),
   "nproc" (optional: the processes torchrun started for a parallel stack), "grad_accum_times" (optional: a
   one-process stack in a bench of several processes trains grad_accum x this, the same global batch)}
Under torchrun every rank builds and steps its part of the run; the totals (tokens, the slowest rank's wall time)
and each rank's peak memory are gathered to rank 0, which alone writes the row.
The run is built by novatune.train.session.build with the stack's overrides and hooks and stepped with the
session's own step. The measurement (docs/BENCHMARKS.md's rules):
  * every optimizer step's micro-batches are collated before the first step and pinned on CUDA (a trainer's
    prefetch): the timed steps copy them to the GPU without blocking the host;
  * `warm` warm-up steps, then Python's GC is frozen (gc.freeze: later collections skip the objects that live for
    the whole run; a full collection took 170-195 ms and landed inside a timed step) unless gc_freeze is false;
  * the allocator's peak is reset, then `steps` timed steps with no host sync inside them (one CUDA event per
    step gives step_ms), synchronised at both ends; tokens/s = trained tokens / that wall time;
  * --memory and --profile run after the timed steps, on the next micro-batch.
Writes <stack_dir>/result.json (the row; schema in bench/runner.py). Exit 0 when the stack ran or is absent (the
row says why), 1 when it failed (the row holds the error, worker.log the traceback).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from novatune.measure.gc_freeze import LongLivedFreeze
from novatune.measure.gpu_memory import graph_pool_idle_bytes, peak_bytes

RUN_OVERRIDES = ["checkpoint.resume=never", "checkpoint.save_every=0", "checkpoint.export=false",
                 "logging.progress=false", "logging.tensorboard=false"]


def _sig(x: float, digits: int = 5) -> float:
    """Rounded to significant digits (a tiny CPU test model has 1e-4 GFLOP/token)."""
    return float(f"{x:.{digits}g}")


def load_stack_config(spec: dict):
    from novatune.bench.stacks import STACKS
    from novatune.train.config import load_with_base

    stack = STACKS[spec["stack"]]
    total = spec["warm"] + spec["steps"]
    run = RUN_OVERRIDES + [f"checkpoint.output_dir={spec['stack_dir']}", f"train.max_steps={total}"]
    cfg, base = load_with_base(spec.get("config"), list(spec.get("overrides", [])) + stack.overrides + run)
    times = spec.get("grad_accum_times", 1)  # one process at the global batch of a several-process bench
    if times > 1:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_accum=cfg.train.grad_accum * times))
    return cfg, base


class WarmClock:
    """For a stack with its own training loop (TRL's, the trainer's): the wall time from the end of the warm-up
    step `warm` to the end of step `last`, synchronised at both ends only (no sync inside the timed steps, as in
    the worker's own loop), and the allocator's peak over them. Call `step_end(step)` after every step. On CUDA
    each timed step's time also comes from events recorded at the step ends (`step_ms`, read after the run, as
    the worker's own loop reads its steps): a step the host held up (a garbage collection, a sync) stands out."""

    def __init__(self, device: torch.device, warm: int, last: int):
        self.cuda = device.type == "cuda"
        self.device, self.warm, self.last = device, warm, last
        self.t0 = self.t1 = self.peak_gib = None
        self.events: list = []

    def step_end(self, step: int) -> None:
        if self.cuda and self.warm <= step <= self.last:
            self.events.append(torch.cuda.Event(enable_timing=True))
            self.events[-1].record()
        if step not in (self.warm, self.last):
            return
        if self.cuda:
            torch.cuda.synchronize(self.device)
        if step == self.warm:
            self.t0 = time.perf_counter()
            if self.cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
        elif step > self.warm:
            self.t1 = time.perf_counter()
            if self.cuda:
                self.peak_gib = peak_bytes(self.device) / 2**30

    @property
    def timed_s(self) -> float | None:
        return self.t1 - self.t0 if self.t0 is not None and self.t1 is not None else None

    def step_ms(self) -> list[float]:
        """Each timed step's milliseconds between the events at its ends (empty without CUDA)."""
        return Clock.between(self.events)


class Clock:
    """Wall time of the timed steps (synchronised at both ends) and each step's GPU time from CUDA events."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.events: list = []

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def mark(self) -> None:
        if self.cuda:
            self.events.append(torch.cuda.Event(enable_timing=True))
            self.events[-1].record()

    def step_ms(self) -> list[float]:
        return self.between(self.events)

    @staticmethod
    def between(events: list) -> list[float]:
        """Milliseconds between consecutive recorded CUDA events (call once the last one has completed)."""
        return [round(a.elapsed_time(b), 1) for a, b in zip(events, events[1:])]


def micro_batch_kwargs(session, mb: dict) -> dict:
    """A micro-batch as the session's forward receives it (for the diagnostics' single micro-steps)."""
    from novatune.train.session import call_inputs

    n_items = max(1, mb["num_target_tokens"])
    wrapped = session.strategy != "none"
    return {**call_inputs(mb, session.device, session.packed_kwargs, wrapped), "num_items_in_batch": n_items,
            "use_cache": False}


def timed_steps(session, spec: dict, log=print) -> dict:
    """Warm-up, GC freeze, timed steps (module docstring); returns the measured fields."""
    warm, steps = spec["warm"], spec["steps"]
    plan = session.batches(warm + steps)
    clock = Clock(session.device)
    losses, norms, step_s = [], [], []
    for k in range(warm):
        t = time.perf_counter()
        out = session.step(plan[k])
        losses.append(float(out.loss))  # a sync per warm-up step: warm-up step times are exact
        norms.append(out.grad_norm)
        step_s.append(time.perf_counter() - t)
        if spec.get("diag"):
            log(f"DIAG warm step {k}: {1e3 * step_s[-1]:.1f} ms")
    clock.sync()
    if spec.get("gc_freeze", True):
        LongLivedFreeze().freeze()  # the worker process ends with the run: nothing to release
    if clock.cuda:
        torch.cuda.reset_peak_memory_stats()
    timed, ends = [], []
    t0 = time.perf_counter()
    clock.mark()
    for k in range(warm, warm + steps):
        timed.append(session.step(plan[k]))
        clock.mark()
        ends.append(time.perf_counter())  # host time: the step itself on a CPU, only its queueing on a GPU
    clock.sync()
    wall = time.perf_counter() - t0
    if clock.cuda:
        step_s += [ms / 1e3 for ms in clock.step_ms()]
    else:
        step_s += [b - a for a, b in zip([t0, *ends], ends)]
    losses += [float(o.loss) for o in timed]
    norms += [o.grad_norm for o in timed]
    tokens = [sum(mb["num_tokens"] for mb in mbs) for mbs in plan[warm:]]
    keys = sum(mb["attn_keys"] for mbs in plan[warm:] for mb in mbs)
    return {"timed_s": wall, "tokens_per_step": tokens, "keys": keys, "losses": losses,
            "grad_norms": [float(g) for g in norms], "step_ms": clock.step_ms(),
            "step_s": [round(x, 4) for x in step_s],
            "peak_bytes": peak_bytes() if clock.cuda else None,
            "graph_pool_bytes": graph_pool_idle_bytes() if clock.cuda else None,
            "reserved_bytes": torch.cuda.max_memory_reserved() if clock.cuda else None}


def over_ranks(session, m: dict) -> dict:
    """The timed steps' figures of the whole run: under several processes the tokens and attended keys are summed
    over the ranks, the wall time is the slowest rank's, and the peaks are each rank's (peak_bytes the largest);
    the losses are already the global batch's (the session sums them)."""
    d = session.dist
    per = d.gather({k: m[k] for k in ("timed_s", "tokens_per_step", "keys", "peak_bytes", "reserved_bytes")})
    out = {**m, "nproc": len(per), "peak_bytes_per_rank": [p["peak_bytes"] for p in per]}
    if len(per) > 1:
        out.update(timed_s=max(p["timed_s"] for p in per), keys=sum(p["keys"] for p in per),
                   tokens_per_step=[sum(col) for col in zip(*(p["tokens_per_step"] for p in per))])
        if m["peak_bytes"] is not None:
            out.update(peak_bytes=max(p["peak_bytes"] for p in per),
                       reserved_bytes=max(p["reserved_bytes"] for p in per))
    return out


def diagnostics(session, spec: dict, stack: str) -> dict:
    """--memory (CUDA) and --profile, on the next micro-batch, after the timed steps (never inside them)."""
    from novatune.bench import diagnostics as diag

    extra = {}
    if not (spec.get("memory") or spec.get("profile")):
        return extra
    batch = micro_batch_kwargs(session, session.stream.next())
    out = Path(spec.get("diag_dir") or Path(spec["stack_dir"]).parent)  # diag_dir: the bench's, under --rounds
    name = stack if session.dist.main else f"{stack}.rank{session.dist.rank}"  # every rank runs the micro-step
    if spec.get("memory") and session.device.type == "cuda":
        try:
            extra["memory"] = diag.memory_peak_report(session.model, batch, str(out / "memory" / name),
                                                       session.finish_backward, session.optimizer,
                                                       promise=session.lm_head_grad_in_forward)
        except Exception as e:  # noqa: BLE001 - a diagnostic: the timing row is kept whatever happens here
            extra["memory"] = f"failed: {type(e).__name__}: {e}"
    if spec.get("profile"):
        try:
            extra["profile"] = diag.profile_micro_step(session.model, batch, str(out / "traces" / name),
                                                        session.finish_backward,
                                                        accumulating=session.cfg.train.grad_accum > 1,
                                                        promise=session.lm_head_grad_in_forward)
            extra["trace"] = str(out / "traces" / f"{name}.json")
        except Exception as e:  # noqa: BLE001 - a diagnostic: the timing row is kept whatever happens here
            extra["profile"] = f"failed: {type(e).__name__}: {e}"
    return extra


def patch_facts(session) -> dict:
    """The attention backend novatune chose and the CUDA-graph counters (patched stacks)."""
    from novatune.attention.backends import last_choice
    from novatune.patch.apply import _find_state

    choice = last_choice()
    facts = {"attention_backend": choice.backend if choice else None}
    model = session.inner_model
    found = _find_state(model.get_base_model() if hasattr(model, "get_base_model") else model)
    if found is not None and found[1].graphs is not None:
        facts["cuda_graphs"] = found[1].graphs.stats()
    return facts


def cap_gpu_memory(gib: float | None) -> float | None:
    """spec "gpu_cap_gib": the process may allocate at most this much on the GPU from the start, model build
    included (torch.cuda.set_per_process_memory_fraction), as on a card of that size."""
    if not gib:
        return None
    if not torch.cuda.is_available():
        raise RuntimeError("gpu_cap_gib needs a CUDA GPU")
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total))
    return gib


def run_stack(spec: dict, log=print) -> dict:
    from rich.console import Console

    from novatune.bench.peer import liger_version
    from novatune.bench.stacks import STACKS, Hooks
    from novatune.train.session import build
    from novatune.tune.patching import selection_for

    stack = STACKS[spec["stack"]]
    cfg, base = load_stack_config(spec)
    if stack.run is not None:  # a stack with its own trainer (e.g. TRL)
        return {"status": "ok", "reason": None, **stack.run(spec, cfg, base)}
    hooks = stack.hooks(cfg, base) if stack.hooks is not None else Hooks()
    cap = cap_gpu_memory(spec.get("gpu_cap_gib"))
    if spec.get("diag"):
        from novatune.bench.diagnostics import install_diagnostics

        install_diagnostics()
    session = build(cfg, base, Console(soft_wrap=True), hooks.before_model, hooks.model_hook,
                    select=selection_for)
    m = over_ranks(session, timed_steps(session, spec, log))
    extra = diagnostics(session, spec, stack.name)
    if stack.patched:
        extra.update(patch_facts(session))
    tokens = sum(m["tokens_per_step"])
    tps = tokens / m["timed_s"]
    nproc = m["nproc"]
    fpt = session.flops_per_token(m["keys"] / max(1, tokens))
    peak, source = spec.get("peak_tflops"), spec.get("peak_source")
    if not peak:
        from novatune.train.metrics import peak_tflops

        peak = peak_tflops(session.device, cfg.logging.peak_tflops, cfg.logging.measure_peak)
        source = "GPU datasheet table (novatune.train.metrics)" if peak else None
    n_total, n_train = session.param_counts()

    def gib(n_bytes):
        return round(n_bytes / 2**30, 3) if n_bytes is not None else None

    report = session.patch_report
    return {
        "status": "ok", "reason": None, "warm": spec["warm"], "steps": spec["steps"],
        "tok_s": round(tps, 1), "timed_s": round(m["timed_s"], 6), "timed_tokens": tokens,
        "tokens_per_step": m["tokens_per_step"], "step_ms": m["step_ms"], "step_s": m["step_s"],
        "gflop_per_tok": _sig(fpt / 1e9),
        "model_tflops": _sig(tps * fpt / 1e12),
        "mfu": round(tps * fpt / (nproc * peak * 1e12), 4) if peak else None,
        "nproc": nproc, "tok_s_per_proc": round(tps / nproc, 1),
        "peak_gib_per_rank": [gib(b) for b in m["peak_bytes_per_rank"]] if m["peak_bytes"] is not None else None,
        "peak_tflops": peak, "peak_tflops_source": source, "peak_gib": gib(m["peak_bytes"]),
        "peak_reserved_gib": gib(m["reserved_bytes"]),
        "graph_pool_gib": gib(m["graph_pool_bytes"]) if m.get("graph_pool_bytes") is not None else None,
        "weights_gib": gib(session.weights_bytes),
        "losses": m["losses"], "grad_norms": m["grad_norms"], "gc_freeze": spec.get("gc_freeze", True),
        "method": cfg.method.type, "model_class": type(session.inner_model).__name__,
        "model_type": session.base_config.model_type, "params": n_total, "trainable_params": n_train,
        "hf_attention": getattr(session.inner_model.config, "_attn_implementation", None),
        "dtype": str(session.dtype).replace("torch.", ""), "device_type": session.device.type,
        "seq": cfg.data.max_length, "grad_accum": cfg.train.grad_accum, "micro_batch": cfg.train.micro_batch,
        "gradient_checkpointing": cfg.memory.gradient_checkpointing, **memory_facts(session),
        "nf4_embedding": type(session.inner_model.get_input_embeddings()).__name__ == "NF4Embedding",
        "patch": report.to_dict() if report is not None else None, "applied": hooks.applied,
        "liger_version": liger_version(), "pack": session.data.stats.to_dict(), "gpu_cap_gib": cap, **extra,
    }


def memory_facts(session) -> dict:
    """The memory policy the stack ran, the planner's prediction beside the measured peak_gib, and what the
    offload engine and the frozen-weight streamer moved."""
    mp = session.memory_plan
    if mp is None:
        return {}
    engine = mp.engine
    return {"memory_policy": mp.policy, "memory_layers": mp.plan.describe(),
            "predicted_peak_gib": round(mp.predicted_peak_gib, 3),
            "predicted_layers_s": mp.plan.seconds, "planner_hardware": mp.hardware.source,
            "predicted_tokens_per_s": mp.predicted_tokens_per_s,
            "offloaded_gib": round(engine.stats["offloaded_bytes"] / 2**30, 3) if engine else None,
            "offload_stats": dict(engine.stats) if engine else None,
            "streamed_layers": len(mp.plan.streamed),
            "stream_stats": dict(mp.streamer.stats) if mp.streamer is not None else None}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m novatune.bench.worker SPEC.json (written by `novatune bench`)", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    from novatune.bench.stacks import STACKS, load_plugins

    load_plugins()
    out = Path(spec["stack_dir"])
    out.mkdir(parents=True, exist_ok=True)
    name, code = spec["stack"], 0
    base = {"stack": name, "description": STACKS[name].description if name in STACKS else None,
            "config": spec.get("config") or "<demo>", "overrides": spec.get("overrides", []),
            "stack_overrides": STACKS[name].overrides if name in STACKS else []}
    if name not in STACKS:
        row = {"status": "failed", "reason": f"unknown stack; choose from {', '.join(STACKS)}"}
        code = 1
    else:
        from novatune.bench.peer import PeerUnavailable

        try:
            row = run_stack(spec, lambda s: print(s, flush=True))
        except PeerUnavailable as e:
            row = {"status": "absent", "reason": str(e)}
        except Exception as e:  # noqa: BLE001 - recorded in the row (the traceback in worker.log), exit 1
            traceback.print_exc()
            row = {"status": "failed", "reason": f"{type(e).__name__}: {e}"}
            code = 1
    row = {**base, **row}
    if os.environ.get("RANK", "0") == "0":  # under torchrun rank 0 writes the row of the whole run
        (out / "result.json").write_text(json.dumps(row, indent=1))
        print("RESULT " + json.dumps({k: row.get(k) for k in ("stack", "status", "tok_s", "peak_gib", "reason")}),
              flush=True)
    if torch.distributed.is_initialized():
        # every rank waits for the others before leaving, as the trainer's teardown does: a rank that leaves while
        # a slower one still finishes its last collective can take that rank down with it (exit code 1 after the
        # row was written, once, on a busy 2-core CI machine)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
