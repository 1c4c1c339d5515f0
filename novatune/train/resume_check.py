"""A resume must continue the run that wrote the checkpoint, not a different one under the same name.

A checkpoint's state.json holds the config that wrote it. The optimizer and scheduler state loaded on resume carry
the old learning rate, betas, eps, weight decay and schedule, so a changed value there would be recorded in
config.yaml yet silently not used; a changed seed, batch shape or data setting reorders or changes the data past
the saved position; a changed model or method does not match the saved weights. Those differences are an error
listing each key (old -> new). Settings that only change how the run goes on are allowed: its length
(max_steps/epochs, to extend a run), checkpointing, logging, non-finite handling, clipping, memory policies, the
parallel layout (another number of processes, with micro_batch x grad_accum x processes kept: the same global
batch) and how the model is run (patch, attention kernel, device, loading).
"""
from __future__ import annotations

import yaml

from novatune.train.config import Config, ConfigError, to_yaml

__all__ = ["changed_settings", "check_resume_config"]

# keys (or whole sections) that a resumed run may change; every other key must match the checkpoint's config
ALLOWED = ("train.max_steps", "train.epochs", "train.max_grad_norm", "train.fused_adamw", "train.adamw_kernel",
           "train.on_nonfinite", "train.max_skipped_steps", "model.patch", "model.patch_options", "model.attention",
           "model.device", "model.low_memory_load", "memory", "parallel", "checkpoint", "logging")


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and k != "arch_overrides" and k != "patch_options":
            out.update(_flatten(v, key))
        else:
            out[key] = v
    return out


def _allowed(key: str) -> bool:
    return any(key == a or key.startswith(a + ".") for a in ALLOWED)


def changed_settings(saved_yaml: str, cfg: Config) -> dict[str, tuple]:
    """{key: (old, new)} for every setting that differs between the saved config and `cfg` (both through YAML, so
    a value compares the same way it is written)."""
    old = _flatten(yaml.safe_load(saved_yaml) or {})
    new = _flatten(yaml.safe_load(to_yaml(cfg)))
    return {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)}


def _saved_batch(changed: dict, cfg: Config) -> tuple:
    """The checkpoint's (micro_batch, grad_accum): the changed old values, else the current ones."""
    return tuple(changed.get(k, (v, v))[0] for k, v in (("train.micro_batch", cfg.train.micro_batch),
                                                          ("train.grad_accum", cfg.train.grad_accum)))


def _same_global_batch(changed: dict, cfg: Config, saved_world: int, world: int) -> bool:
    """Whether micro_batch x grad_accum x processes is the checkpoint's: resuming on another number of processes
    splits the same global batch differently (the data stream hands out the same rows)."""
    mb, ga = _saved_batch(changed, cfg)
    try:
        return int(mb) * int(ga) * saved_world == cfg.train.micro_batch * cfg.train.grad_accum * world
    except (TypeError, ValueError):
        return False


def check_resume_config(state: dict, cfg: Config, checkpoint, note=print, world: int = 1) -> None:
    """Raise ConfigError listing the settings that differ from the checkpoint's and that the resumed state would
    override or that change the data; `note` says when max_steps changed. A checkpoint without a saved config
    (older versions) is not checked. train.micro_batch, train.grad_accum and the number of processes may change
    when the global batch (micro_batch x grad_accum x the `world` processes, against the checkpoint's
    world_size) stays the same; any other global batch is refused, a change of processes alone included."""
    if not state or not state.get("config"):
        return
    changed = changed_settings(state["config"], cfg)
    batch_keys = {"train.micro_batch", "train.grad_accum"}
    saved_world = int(state.get("world_size", 1))
    if _same_global_batch(changed, cfg, saved_world, world):
        changed = {k: v for k, v in changed.items() if k not in batch_keys}
    else:  # another split of the rows, or the same split over another number of processes: another global batch
        old_mb, old_ga = _saved_batch(changed, cfg)
        raise ConfigError("train.grad_accum", f"the global batch changed since checkpoint {checkpoint} was saved: "
                          f"{old_mb} x {old_ga} x {saved_world} "
                          f"process(es) then, {cfg.train.micro_batch} x {cfg.train.grad_accum} x {world} now "
                          "(micro_batch x grad_accum x processes); the resumed schedule and data position count "
                          "steps of the old batch",
                          "keep micro_batch x grad_accum x processes the same (e.g. double train.grad_accum when "
                          "halving the processes), or start a new run")
    refused = {k: v for k, v in changed.items() if not _allowed(k)}
    if refused:
        lines = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in refused.items())
        raise ConfigError(", ".join(refused), f"changed since checkpoint {checkpoint} was saved ({lines}); the "
                          "resumed optimizer/scheduler state or data order would not follow the new values",
                          "restore these values to resume the run, or start a new run: another --output-dir (or "
                          "delete this run's checkpoints and use checkpoint.resume=never)")
    if "train.max_steps" in changed:
        old, new = changed["train.max_steps"]
        note(f"note: train.max_steps changed on resume: {old} -> {new}")
