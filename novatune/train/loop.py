"""The training loop: logging, checkpoints and exports around the session's step (train/session.py builds the
model, data, optimizer and scheduler, and owns the forward/backward and the update; see its docstring for the loss
normalisation under gradient accumulation).
"""
from __future__ import annotations

import gc
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from novatune.train import checkpoint as ckpt
from novatune.train.config import Config, to_yaml
from novatune.train.metrics import MetricsLog, Progress, gpu_mem_gib, peak_tflops
from novatune.train.model import SetupError
from novatune.train.session import (
    build,
    cpu_threads_for_load,
    forward_backward,
    packed_kwargs_mode,
)

__all__ = ["RunResult", "cpu_threads_for_load", "forward_backward", "resolve_resume", "train"]
_packed_kwargs_mode = packed_kwargs_mode  # the name other commands import


@dataclass
class RunResult:
    output_dir: Path
    steps: int  # optimizer steps done (total, including those before a resume)
    total_steps: int
    losses: dict[int, float] = field(default_factory=dict)  # step -> loss, for the steps this process ran
    wall_s: float = 0.0
    tokens: int = 0
    exported: list[Path] = field(default_factory=list)
    resumed_from: Path | None = None
    patch_report: object = None
    pack_stats: object = None
    model: object = None  # the trained model (patch reverted after an export; LoRA: merged after export_merged,
    # QLoRA: still the PEFT model on NF4 weights: its merged export is a separate dense copy)
    session: object = None  # the train.session.Session that ran


def resolve_resume(cfg: Config) -> Path | None:
    r = cfg.checkpoint.resume
    if r == "never":
        return None
    if r == "auto":
        return ckpt.latest(cfg.checkpoint.output_dir)
    p = Path(r)
    if p.is_dir() and not (p / "state.json").exists():  # an output_dir: its latest checkpoint
        p = ckpt.latest(p) or p
    if not (p / "state.json").exists():
        raise SetupError(f"checkpoint.resume: {r} is not a checkpoint (no state.json); give a "
                         f"<output_dir>/checkpoints/step_N folder, or resume: auto / never")
    return p


def train(cfg: Config, base_dir: Path | None = None, console=None, stop_after: int | None = None,
          model_hook=None, step_hook=None) -> RunResult:
    """Run training as configured. `stop_after` ends the process's loop after that many optimizer steps without
    exporting, like a killed run (tests use it to check that a resume continues the same loss curve).

    Hooks for the harness (`novatune bench` / `validate` measure this loop rather than a copy of it):
    `model_hook(model)` runs once the model is built, prepared and patched, before the optimizer exists (snapshot
    weights, switch a peer stack's attention); `step_hook(step, micro_batches)` runs after each optimizer step and
    its metrics row (time and meter the steps)."""
    from rich.console import Console

    console = console or Console(soft_wrap=True)
    t_start = time.perf_counter()
    out_dir = Path(cfg.checkpoint.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    console.rule("[bold]novatune train")
    console.print(to_yaml(cfg), highlight=False, markup=False)
    (out_dir / "config.yaml").write_text(to_yaml(cfg))

    session = build(cfg, base_dir, console, model_hook=model_hook)
    model, tokenizer, opt, sched, stream = (session.model, session.tokenizer, session.optimizer, session.scheduler,
                                            session.stream)
    device, dtype, report, total = session.device, session.dtype, session.patch_report, session.total_steps

    step, tokens_seen = 0, 0
    resume_from = resolve_resume(cfg)
    if resume_from is not None:
        state = ckpt.load(resume_from, model, opt, sched, device)
        stream.load_state_dict(state["data"])
        step, tokens_seen = state["step"], state.get("tokens", 0)
        console.print(f"resumed from {resume_from} at step {step}", highlight=False)
    elif ckpt.list_checkpoints(out_dir):
        console.print(f"[yellow]checkpoint.resume=never: starting at step 0; older checkpoints in {out_dir} are "
                      f"replaced as new ones are saved[/]")

    result = RunResult(out_dir, step, total, resumed_from=resume_from, patch_report=report,
                       pack_stats=session.data.stats)
    lora, qlora = session.lora, cfg.method.type == "qlora"
    peak = peak_tflops(device, cfg.logging.peak_tflops, cfg.logging.measure_peak)
    metrics = MetricsLog(out_dir, cfg.logging.tensorboard, console, resume_step=step)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def save(at: int) -> Path:
        return ckpt.save(out_dir, at, model, opt, sched, {"data": stream.state_dict(), "tokens": tokens_seen,
                                                           "total_steps": total, "config": to_yaml(cfg)},
                         keep=cfg.checkpoint.keep)

    progress = Progress(total, step, cfg.logging.progress, console)
    win_t, win_tokens, win_keys = time.perf_counter(), 0, 0.0
    pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    start_step, interrupted = step, False
    try:
        while step < total:
            mbs = session.next_micro_batches()
            out = session.forward_backward(mbs)
            # the weights change only in apply_update(): a check of out.loss / out.grad_norm goes between the two
            session.apply_update()
            loss, gnorm = out.loss, out.grad_norm
            step += 1
            n_tok = sum(mb["num_tokens"] for mb in mbs)
            tokens_seen += n_tok
            win_tokens += n_tok
            win_keys += sum(mb["attn_keys"] for mb in mbs)
            pending.append((step, loss, gnorm))
            if step % cfg.logging.every == 0 or step == total:
                vals = [(s, float(l_), float(g)) for s, l_, g in pending]  # the one sync per logged step
                pending.clear()
                result.losses.update({s: v for s, v, _ in vals})
                now = time.perf_counter()
                tps = win_tokens / max(now - win_t, 1e-9)
                mfu = None
                if peak:
                    mfu = tps * session.flops_per_token(win_keys / max(1, win_tokens)) / (peak * 1e12)
                mem = gpu_mem_gib(device)
                row = {"step": step, "total_steps": total, "loss": vals[-1][1], "lr": sched.get_last_lr()[0],
                       "grad_norm": vals[-1][2], "tokens": tokens_seen, "tokens_per_s": tps, "mfu": mfu,
                       "mem_gib": mem[1] if mem else None, "elapsed_s": now - t_start}
                metrics.write(row)
                progress.update(step, row)
                win_t, win_tokens, win_keys = now, 0, 0.0
            else:
                progress.update(step)
            if cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0:
                save(step)
            if step == start_step + 1:
                # A full garbage collection walks every Python object of transformers, the model and autograd:
                # 170-195 ms on the GPU machine, landing at random inside training steps (`novatune bench --diag`,
                # LOG.md run 15). What exists after the first step lives for the whole run: freeze it, so later
                # collections only walk new objects. (torchtitan disables the GC instead.)
                gc.collect()
                gc.freeze()
            if step_hook is not None:
                step_hook(step, mbs)
            if stop_after is not None and step - start_step >= stop_after:
                break
    except KeyboardInterrupt:
        interrupted = True
    finally:
        gc.unfreeze()  # frozen objects are never collected: hand them back once training is over
        progress.close()
        metrics.close()
    for s, l_, _ in pending:
        result.losses[s] = float(l_)
    result.steps, result.tokens = step, tokens_seen
    if interrupted:
        where = save(step) if step > start_step else None
        console.print(f"[yellow]interrupted at step {step}" + (f"; saved {where}; run the same command to resume"
                                                                 if where else "") + "[/]")
        raise KeyboardInterrupt
    if step >= total:
        if cfg.checkpoint.save_every and step % cfg.checkpoint.save_every:
            save(step)  # the end state, so `resume: auto` on a finished run knows it is finished
        if cfg.checkpoint.export:
            if report is not None:
                report.revert()  # export a plain transformers model
            # QLoRA: merged/ is dense (NF4 dequantised + delta) in the run's compute dtype
            result.exported = ckpt.export(model, tokenizer, out_dir, lora, cfg.checkpoint.export_merged,
                                          qlora=qlora, merged_dtype=dtype)
            console.print("exported: " + ", ".join(str(p) for p in result.exported), highlight=False)
    session.release_optimizer_state()  # the caller keeps the model (and the session), not the AdamW moments
    result.model, result.session = model, session
    result.wall_s = time.perf_counter() - t_start
    losses = [result.losses[k] for k in sorted(result.losses)]
    summary = {"steps": step, "total_steps": total, "first_loss": losses[0] if losses else None,
               "last_loss": losses[-1] if losses else None, "tokens": tokens_seen,
               "wall_s": round(result.wall_s, 2), "output_dir": str(out_dir), "device": str(device)}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    console.print(json.dumps(summary), highlight=False, markup=False, soft_wrap=True)
    return result
