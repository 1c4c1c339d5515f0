"""The training loop: logging, checkpoints and exports around the session's step (train/session.py builds the
model, data, optimizer and scheduler, and owns the forward/backward and the update; see its docstring for the loss
normalisation under gradient accumulation).
"""
from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from novatune.measure.gc_freeze import LongLivedFreeze
from novatune.memory import host_embedding
from novatune.train import checkpoint as ckpt
from novatune.train import run_dir
from novatune.train import sharded_checkpoint as sharded
from novatune.train.config import Config, to_yaml
from novatune.train.config import summary as config_summary
from novatune.train.metrics import MetricsLog, Progress, gpu_mem_gib, peak_tflops
from novatune.train.nonfinite import HostCopy, StepGuard, UnhealthyTraining, as_json_number, stack_scalars
from novatune.train.resume_check import check_resume_config
from novatune.train.session import build, join
from novatune.train.signals import RunInterrupted, StopSignals, signal_name

__all__ = ["RunResult", "train"]


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


def train(cfg: Config, base_dir: Path | None = None, console=None, stop_after: int | None = None,
          model_hook=None, step_hook=None, select=None) -> RunResult:
    """Run training as configured. `stop_after` ends the process's loop after that many optimizer steps without
    exporting, like a killed run (tests use it to check that a resume continues the same loss curve).

    Hooks for the harness (`novatune bench` / `validate` measure this loop rather than a copy of it):
    `model_hook(model)` runs once the model is built, prepared and patched, before the optimizer exists (snapshot
    weights, switch a peer stack's attention); `step_hook(step, micro_batches)` runs after each optimizer step (time
    and meter the steps); its metrics row is written by then, or during the next step where the check is read a
    step late (train/nonfinite.py).

    Under torchrun (parallel.strategy ddp/fsdp2) every rank runs this function; rank 0 alone claims the output
    folder, prints, and writes config.yaml, metrics.jsonl, run.json and summary.json; checkpoints and the export
    are written by all ranks together (train/sharded_checkpoint.py). `select`: the tune engine's Selection maker
    (train.session.build)."""
    from rich.console import Console

    dist = join(cfg)
    console = console or Console(soft_wrap=True)
    if not dist.main:
        console = Console(quiet=True)  # one display: rank 0's
    t_start = time.perf_counter()
    out_dir = Path(cfg.checkpoint.output_dir)
    notes = run_dir.claim(out_dir, cfg.checkpoint.resume) if dist.main else []  # refuses to mix or overwrite runs
    dist.barrier()
    console.rule("[bold]novatune train")
    for note in notes:
        console.print(f"[yellow]{note}[/]")
    console.print(config_summary(cfg), highlight=False, markup=False)
    if dist.main:
        (out_dir / "config.yaml").write_text(to_yaml(cfg))

    session = build(cfg, base_dir, console, model_hook=model_hook, dist=dist, select=select)
    model, opt, sched, stream = session.model, session.optimizer, session.scheduler, session.stream
    device, report, total = session.device, session.patch_report, session.total_steps

    step, tokens_seen = 0, 0
    resume_from, state = ckpt.resume(cfg.checkpoint.resume, out_dir, model, opt, sched, device,
                                     warn=lambda msg: console.print(f"[bold red]{msg}[/]", highlight=False),
                                     dist=dist, load_sharded=sharded.load)
    if resume_from is not None:
        check_resume_config(state, cfg, resume_from, note=lambda msg: console.print(msg, highlight=False),
                            world=dist.world)
        stream.load_state_dict(state["data"])
        step, tokens_seen = state["step"], state.get("tokens", 0)
        console.print(f"resumed from {resume_from} at step {step}", highlight=False)
        saved_total = state.get("total_steps")
        if saved_total is not None and saved_total != total:  # train.max_steps or epochs changed, or their count
            console.print(f"[bold yellow]the run is now {total} optimizer steps long, the checkpoint's run was "
                          f"{saved_total}: the learning-rate schedule follows {total} from step {step}[/]",
                          highlight=False)
    if dist.main:
        run_dir.mark(out_dir, "running", total_steps=total)

    result = RunResult(out_dir, step, total, resumed_from=resume_from, patch_report=report,
                       pack_stats=session.data.stats)
    peak = peak_tflops(device, cfg.logging.peak_tflops, cfg.logging.measure_peak)
    metrics = MetricsLog(out_dir, cfg.logging.tensorboard, console, resume_step=step) if dist.main else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def save(at: int) -> Path:
        settle()  # every step's check read and its metrics row written before a checkpoint holds its weights
        state = {"data": stream.state_dict(), "tokens": tokens_seen, "total_steps": total, "config": to_yaml(cfg),
                 "world_size": dist.world}
        if session.strategy != "none":
            return sharded.save(out_dir, at, model, opt, sched, state, cfg.checkpoint.keep, dist)
        return ckpt.save(out_dir, at, model, opt, sched, state, keep=cfg.checkpoint.keep)

    def stop_requested() -> bool:  # every rank stops at the same step boundary
        return dist.any_true(signals.requested is not None)

    progress = Progress(total, step, cfg.logging.progress, console)
    win_t, win_tokens, win_keys = time.perf_counter(), 0, 0.0
    pending: list[tuple[int, torch.Tensor, torch.Tensor, float, bool]] = []
    drafts: list[dict] = []  # logged steps whose metrics row waits for its values (at most one)

    def write_row(d: dict) -> None:
        """The metrics row of a logged step from its draft (the step's window of steps, its values on the way to
        the host); tokens/s over the time since the previous row was written."""
        nonlocal win_t
        n = len(d["window"])
        vals = d["values"].values()  # losses, then grad norms, of the window's steps
        losses, norms = vals[:n], vals[n:]
        result.losses.update({s: v for (s, _, _), v in zip(d["window"], losses, strict=True)})
        now = time.perf_counter()
        tps = d["win_tokens"] / max(now - win_t, 1e-9)
        mfu = None
        if peak:
            mfu = tps * session.flops_per_token(d["win_keys"] / max(1, d["win_tokens"])) / (peak * dist.world * 1e12)
        mem = gpu_mem_gib(device)
        at = d["step"]
        row = {"step": at, "total_steps": total, "loss": as_json_number(losses[-1]), "lr": d["window"][-1][1],
               "grad_norm": as_json_number(norms[-1]), "tokens": d["tokens"], "tokens_per_s": tps,
               "mfu": mfu, "mem_gib": mem[1] if mem else None, "elapsed_s": now - t_start}
        _memory_vs_plan(row, session.memory_plan, console, first=at == start_step + cfg.logging.every)
        if dist.active:  # tokens_per_s is the total over the processes; memory is per rank
            row.update(world_size=dist.world, tokens_per_s_per_proc=tps / dist.world,
                       mem_gib_per_rank=dist.gather(mem[1] if mem else None))
        skipped = [s for s, _, ok in d["window"] if not ok]  # any step of the window, not only the last
        if skipped:
            row["skipped"] = True
            row["skipped_steps"] = skipped
        if metrics is not None:
            metrics.write(row)
        progress.update(at, row)
        win_t = now

    def settle(keep: int = 0) -> None:
        """Every deferred check but the newest `keep` read (raises on a non-finite step), then every drafted
        metrics row written (a draft is made after its step's check was deferred, so its check is read by then)."""
        guard.resolve(keep)
        while drafts:
            write_row(drafts.pop(0))

    def settle_before_leaving() -> None:
        """On an exception inside the loop, the drafted row of a step whose check holds is still written, as it
        would have been within that step without the deferral. Never raises over the exception being handled (a
        non-finite step, or a CUDA error the event wait repeats, just leaves the rest unwritten); one process only:
        a row's memory gather is a collective the other ranks are not entering."""
        if dist.active or not drafts:
            return
        try:
            settle()
        except Exception:  # noqa: BLE001 - the exception being handled is the one to report
            pass

    start_step, aborted, to_export = step, False, False
    guard = StepGuard(cfg.train.on_nonfinite, cfg.train.max_skipped_steps)
    deferred = guard.defers(session.optimizer)  # the check decided on the device, read a step late
    signals = StopSignals()
    long_lived = LongLivedFreeze()
    try:
        signals.__enter__()
        stopping = stop_requested()
        while step < total and not stopping:
            mbs = session.next_micro_batches()
            out = session.forward_backward(mbs)
            loss, gnorm = out.loss, out.grad_norm
            lr = sched.get_last_lr()[0]  # the lr this step's update uses
            # the weights change only in apply_update(): the non-finite check sits between the two
            if deferred:  # the optimizer leaves the weights as they are on a non-finite step; read a step late
                applied = True
                session.apply_update(found_inf=guard.defer(step + 1, loss, gnorm))
                # the previous step's check (finished on the GPU by now; raises in stop mode) and the previous
                # logged step's row
                settle(keep=1)
            else:
                applied = guard.allow(step + 1, loss, gnorm)  # raises on non-finite (stop mode)
                if applied:
                    session.apply_update()
                else:
                    session.skip_update()  # the schedule still advances (train/nonfinite.py)
            step += 1
            n_tok = sum(mb.get("global_tokens", mb["num_tokens"]) for mb in mbs)  # all ranks' tokens
            tokens_seen += n_tok
            win_tokens += n_tok
            win_keys += sum(mb.get("global_attn_keys", mb["attn_keys"]) for mb in mbs)
            pending.append((step, loss, gnorm, lr, applied))
            stopping = stop_requested()
            if step % cfg.logging.every == 0 or step == total or stopping:
                # the window's values queued for the host; read now, or (check read a step late) at the next
                # step, once the GPU has finished them: no wait for the GPU in the loop
                drafts.append({"step": step, "window": [(s, lr_, ok) for s, _, _, lr_, ok in pending],
                               "values": HostCopy(stack_scalars([l_ for _, l_, _, _, _ in pending] +
                                                                [g for _, _, g, _, _ in pending])),
                               "tokens": tokens_seen, "win_tokens": win_tokens, "win_keys": win_keys})
                pending.clear()
                win_tokens, win_keys = 0, 0.0
                if not deferred or step == total or stopping:
                    settle()  # a metrics row never shows a step whose check is unread
            else:
                progress.update(step)
            if cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0:
                save(step)
            if step == start_step + 1:
                long_lived.freeze()  # what exists after the first step lives for the run (measure/gc_freeze.py)
            if step_hook is not None:
                step_hook(step, mbs)
            if stop_after is not None and step - start_step >= stop_after:
                break
        settle()
        to_export = step >= total
    except UnhealthyTraining as e:  # the steps after the bad one are not written: their rows would follow it
        set_aside_dead_checkpoints(e, out_dir, dist, console)
        if dist.main:
            run_dir.mark(out_dir, "unhealthy", steps=step, reason=str(e).split(". ")[0])
        raise
    except KeyboardInterrupt:  # a second Ctrl-C (or one outside the main thread): the step may be half done
        settle_before_leaving()
        aborted = True
    except BaseException:
        settle_before_leaving()
        raise
    finally:
        if not to_export:  # else the handlers stay for the export: a signal there must not lose the run
            signals.__exit__()
        long_lived.release()  # frozen objects are never collected: hand them back once training is over
        progress.close()
        if metrics is not None:
            metrics.close()
    for s, l_, _, _, _ in pending:
        result.losses[s] = float(l_)
    result.steps, result.tokens = step, tokens_seen
    if aborted:
        last = ckpt.latest(out_dir)
        console.print(f"[yellow]aborted during step {step + 1} without saving; "
                      + (f"the last checkpoint is {last}[/]" if last else "no checkpoint was written[/]"))
        raise KeyboardInterrupt
    if stopping and step < total:
        signum = signals.requested or signal.SIGTERM  # a rank the signal did not reach stops with the others
        last = ckpt.latest(out_dir)  # already saved at this step (save_every), or nothing trained since the resume
        where = last if step == start_step or (last and ckpt.step_of(last) == step) else save(step)
        msg = f"stopped by {signal_name(signum)} after step {step}; checkpoint {where}; run the same " \
              f"command to resume"
        console.print(f"[yellow]{msg}[/]", highlight=False)
        raise RunInterrupted(signum, msg)
    if to_export:
        try:
            _finish(cfg, session, result, out_dir, step, start_step, save, signals, stop_requested, console, dist,
                    base_dir)
        finally:
            signals.__exit__()
    session.release_optimizer_state()  # the caller keeps the model (and the session), not the AdamW moments
    # the caller's model computes where it reads its table: a host-resident one goes back to the device
    host_embedding.restore(session.inner_model)
    result.model, result.session = model, session
    result.wall_s = time.perf_counter() - t_start
    losses = [result.losses[k] for k in sorted(result.losses)]
    summary = {"steps": step, "total_steps": total, "first_loss": as_json_number(losses[0]) if losses else None,
               "last_loss": as_json_number(losses[-1]) if losses else None, "tokens": tokens_seen,
               "wall_s": round(result.wall_s, 2), "output_dir": str(out_dir), "device": str(device)}
    if dist.active:
        summary["world_size"] = dist.world
    if dist.main:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    console.print(json.dumps(summary), highlight=False, markup=False, soft_wrap=True)
    return result


def set_aside_dead_checkpoints(error: UnhealthyTraining, out_dir: Path, dist, console) -> None:
    """After a stop for zero gradients: the checkpoints written from the step whose update left weights with no
    gradient on (ZeroGradientError.dead_from) hold weights that no longer train; they are set aside (renamed
    damaged-..., kept for inspection), so `resume: auto` never continues from them. A non-finite stop needs
    nothing: its update was never applied and no checkpoint follows it."""
    dead_from = getattr(error, "dead_from", None)
    if dead_from is None:
        return
    dist.barrier()  # every rank has finished writing before one rank moves the folders
    try:
        if dist.main:
            for path in ckpt.list_checkpoints(out_dir):
                if ckpt.step_of(path) >= max(dead_from, 1):
                    try:
                        moved = ckpt.set_aside(path).name
                    except OSError as e:  # the stop's own error is the one to report
                        console.print(f"[yellow]could not set aside {path.name} ({e}): do not resume from it[/]")
                        continue
                    console.print(f"[yellow]set aside {path.name} as {moved}: its weights no longer train[/]",
                                  highlight=False)
    finally:
        dist.barrier()


def _finish(cfg: Config, session, result: RunResult, out_dir: Path, step: int, start_step: int, save, signals,
            stop_requested, console, dist, base_dir) -> None:
    """The end of a run that reached its last step: the final checkpoint, then the export, with SIGINT/SIGTERM
    still caught. The checkpoint comes first whenever an export follows (save_every 0 included), so a signal or a
    kill during the export never loses the run: the same command resumes at the last step and exports."""
    last = ckpt.latest(out_dir)
    saved_last = step == start_step or (last is not None and ckpt.step_of(last) == step)
    if not saved_last and (cfg.checkpoint.export or cfg.checkpoint.save_every):
        last = save(step)  # also tells `resume: auto` on a finished run that it is finished
    if cfg.checkpoint.export and stop_requested():  # every rank skips the export together
        signum = signals.requested or signal.SIGTERM
        msg = (f"stopped by {signal_name(signum)} after the last step ({step}), before the export; checkpoint "
               f"{last}; run the same command to export")
        console.print(f"[yellow]{msg}[/]", highlight=False)
        raise RunInterrupted(signum, msg)
    model, tokenizer, report, dtype = session.model, session.tokenizer, session.patch_report, session.dtype
    if cfg.checkpoint.export:
        if (session.memory_plan is not None and session.memory_plan.streamer is not None) \
                or cfg.memory.embeddings_on_host:
            session.release_optimizer_state()  # room for the streamed weights, which come back for the export
            session.stop_streaming()
        if report is not None:
            report.revert()  # export a plain transformers model
        if session.strategy != "none":  # gathered to rank 0, loaded into a plain model there
            result.exported = sharded.export(model, cfg, tokenizer, out_dir, dtype, dist, base_dir)
        else:  # QLoRA: merged/ is dense (NF4 dequantised + delta) in the run's compute dtype
            result.exported = ckpt.export(model, tokenizer, out_dir, session.lora, cfg.checkpoint.export_merged,
                                          qlora=cfg.method.type == "qlora", merged_dtype=dtype)
        console.print("exported: " + ", ".join(str(p) for p in result.exported), highlight=False)
    if dist.main:
        run_dir.mark(out_dir, "finished", steps=step)
    if signals.requested is not None:  # arrived during the export, which completed: the run is finished
        msg = f"{signal_name(signals.requested)} during the export; the export completed and the run is finished"
        console.print(f"[yellow]{msg}[/]", highlight=False)
        raise RunInterrupted(signals.requested, msg)


def _memory_vs_plan(row: dict, memory_plan, console, first: bool) -> None:
    """The planner's predicted peak beside the measured one in each metrics row; said once at the first row,
    where a prediction more than 10% off is worth knowing before a long run."""
    if memory_plan is None:
        return
    predicted = memory_plan.predicted_peak_gib
    row["predicted_peak_gib"] = predicted
    if memory_plan.engine is not None:  # bytes moved to host memory since the start (the layers' inputs)
        row["offloaded_gib"] = memory_plan.engine.stats["offloaded_bytes"] / 2**30
    if memory_plan.streamer is not None:  # frozen weights copied in since the start, and copies not prefetched
        row["streamed_h2d_gb"] = memory_plan.streamer.stats["copied_bytes"] / 1e9
        row["stream_fetched_on_demand"] = memory_plan.streamer.stats["fetched_on_demand"]
    speed = memory_plan.predicted_tokens_per_s
    if speed is not None:
        row["predicted_tokens_per_s"] = speed
    if first and row.get("mem_gib") and console is not None:
        off = row["mem_gib"] / predicted - 1
        pace = (f"; {row['tokens_per_s']:,.0f} tok/s, planned {speed:,.0f} (the first step includes warm-up)"
                if speed else "")
        console.print(f"memory: measured peak {row['mem_gib']:.2f} GiB, planned {predicted:.2f} GiB ({off:+.0%}; "
                      f"policy {memory_plan.policy}: {memory_plan.plan.describe()}){pace}", highlight=False)

