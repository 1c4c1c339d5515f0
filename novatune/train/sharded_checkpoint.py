"""Checkpoints and the export of a ddp/fsdp2 run: torch.distributed.checkpoint (DCP), in the trainer's layout.

The step folder `<output_dir>/checkpoints/step_N/` holds

  dcp/            the model and optimizer state dicts, each rank writing its own shards (`.metadata` + `*.distcp`)
  rng_<rank>.pt   each rank's torch/python RNG states
  state.json      step, scheduler, data position (global: any number of processes resumes it), tokens, config
  manifest.json   "layout": "dcp", the step, every file's size and checksum; written last by rank 0

All ranks write into one temporary folder; then every rank hashes its share of the files (about the same bytes
each, `hash_share`), and rank 0 writes state.json and the manifest from the gathered checksums, fsyncs and
renames the folder into place, then prunes (the same atomic publish as a one-process checkpoint, see
checkpoint.py). The state dicts come from torch.distributed.checkpoint.state_dict (`get_state_dict`), keyed by
parameter name, so a checkpoint resumes under a different number of processes (DCP reshards on load), and in a
one-process run (strategy none) too.

The export gathers the full model state dict onto rank 0's CPU (`get_model_state_dict(full_state_dict=True,
cpu_offload=True)`), loads it into a plain model of the same architecture (LoRA: with the same adapters) built
there, and writes it with the one-process export: one folder, loadable with from_pretrained.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from novatune.parallel.dist import Dist
from novatune.train import checkpoint as ckpt
from novatune.train.nonfinite import NonFiniteError, nonfinite_names
from novatune.train.optim import live_group_flags


def _local(sd: dict) -> dict[str, torch.Tensor]:
    """This rank's shards of the floating tensors of a (nested) state dict, by dotted name."""
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in _local(v).items()})
        elif isinstance(v, torch.Tensor) and v.is_floating_point() and v.ndim > 0:
            out[str(k)] = v.to_local() if isinstance(v, DTensor) else v
    return out


def hash_share(tmp: Path, dist: Dist, algo: str) -> dict:
    """{file: {bytes, hash}} for this rank's share of the files every rank wrote into `tmp` (called once all
    ranks have finished writing): the files, largest first, go to the rank with the fewest bytes so far, so the
    ranks hash the checkpoint in parallel, about the same number of bytes each, and every file exactly once."""
    sizes = {str(p.relative_to(tmp)): p.stat().st_size for p in tmp.rglob("*") if p.is_file()}
    load = [0] * dist.world
    mine = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):  # the same order on every rank
        r = load.index(min(load))
        load[r] += sizes[name]
        if r == dist.rank:
            mine[name] = {"bytes": sizes[name], "hash": ckpt.file_digest(tmp / name, algo)}
    return mine


def _publish(tmp: Path, final: Path, step: int, state: dict, scheduler, files: dict, algo: str) -> None:
    """Rank 0: state.json, the manifest over `files` (every rank's hash_share) and state.json, fsync, rename."""
    (tmp / "state.json").write_text(json.dumps({**state, "step": step, "scheduler": scheduler.state_dict()},
                                               indent=1, default=str))
    files = {**files, "state.json": {"bytes": (tmp / "state.json").stat().st_size,
                                     "hash": ckpt.file_digest(tmp / "state.json", algo)}}
    names = sorted(files)
    manifest = {"format": 1, "layout": ckpt.SHARDED_LAYOUT, "step": step, "hash": algo,
                "files": {n: files[n] for n in names}}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    for n in (*names, "manifest.json"):
        ckpt.fsync_path(tmp / n)
    ckpt.fsync_path(tmp / "dcp")
    ckpt.fsync_path(tmp)
    if final.exists():  # the same step saved again (a resumed run re-reaching it): replace it
        ckpt.remove_tree(final)
    os.replace(tmp, final)
    ckpt.fsync_path(final.parent)


def _agree_or_raise(dist: Dist, error: BaseException | None, what: str) -> None:
    """Raise on every rank when any rank failed (the others must not wait in a collective it never reaches)."""
    if dist.any_true(error is not None):
        if error is not None:
            raise error
        raise ckpt.CheckpointError(f"{what} failed on another rank (its message is in that rank's output)")


def save(output_dir: str | Path, step: int, model, optimizer, scheduler, state: dict, keep: int, dist: Dist) -> Path:
    """Write checkpoint `step` from every rank, atomically published by rank 0; prune to the newest `keep`."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    bad = nonfinite_names(_local(model_sd))
    if dist.any_true(bool(bad)):
        raise NonFiniteError(f"checkpoint at step {step}: weights hold NaN/inf ({bad[:1] or 'on another rank'}); "
                             f"nothing was saved; the previous checkpoints are kept. Lower train.lr or check the data")
    root = ckpt.checkpoints_dir(output_dir)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-step_{step:08d}-sharded"
    error = None
    if dist.main:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        except OSError as e:
            error = ckpt.CheckpointError(f"cannot write checkpoint step {step} to {root} ({e.strerror or e}); make "
                                         f"the folder writable or choose another checkpoint.output_dir")
    _agree_or_raise(dist, error, "creating the checkpoint folder")
    try:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
        torch.save(ckpt.rng_state(), tmp / f"rng_{dist.rank}.pt")
    except (OSError, RuntimeError) as e:
        error = ckpt.CheckpointError(f"{'disk full' if ckpt.is_disk_full(e) else 'error'} while saving checkpoint "
                                     f"step {step} to {root} ({e}); free space or choose another "
                                     f"checkpoint.output_dir, and run the same command to resume")
    _agree_or_raise(dist, error, "writing the checkpoint shards")
    algo = ckpt.default_hash()
    try:
        share = hash_share(tmp, dist, algo)
    except OSError as e:
        share, error = {}, ckpt.CheckpointError(f"cannot read back checkpoint step {step} in {root} ({e})")
    _agree_or_raise(dist, error, "hashing the checkpoint files")
    files = {n: entry for part in dist.gather(share) for n, entry in part.items()}
    if dist.main:
        try:
            _publish(tmp, final, step, state, scheduler, files, algo)
            for old in ckpt.list_checkpoints(output_dir)[:-keep] if keep > 0 else []:
                ckpt.remove_tree(old)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            error = ckpt.CheckpointError(f"cannot publish checkpoint step {step} in {root} ({e.strerror or e})")
    _agree_or_raise(dist, error, "publishing the checkpoint")
    return final


def load(path: Path, model, optimizer, scheduler, dist: Dist | None = None) -> dict:
    """Restore a verified DCP checkpoint into this (wrapped or plain) model and optimizer; returns state.json.
    Every check runs before the model changes: the state is read into fresh state dicts, then set."""
    dist = dist or Dist()
    # every rank reads the same folder: rank 0 hashes it (GBs for a large model) and every rank gets its verdict
    problems = dist.from_main(lambda: ckpt.verify(path))
    if problems:
        raise ckpt.CheckpointError(f"checkpoint {path} is damaged: {'; '.join(problems)}")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    sd = {"model": model_sd, "optim": optim_sd}
    try:
        dcp.load(sd, checkpoint_id=str(path / "dcp"))
    except Exception as e:  # noqa: BLE001  (DCP reports missing keys or shapes as various exception types)
        raise ckpt.CheckpointMismatch(f"checkpoint.resume: {path} does not match this model ({str(e)[:300]}); "
                                      f"resume with the config that wrote it, or start a new output_dir") from None
    state = json.loads((path / "state.json").read_text())
    bad = nonfinite_names(_local(sd["model"])) + nonfinite_names(_local(sd["optim"].get("state", {})))
    if dist.any_true(bool(bad)):
        raise ckpt.CheckpointError(f"checkpoint {path} is damaged: tensors hold NaN/inf "
                                   f"({bad[:1] or 'on another rank'})")
    steps = [float(v) for st in sd["optim"].get("state", {}).values() for k, v in st.items() if k == "step"]
    if steps and max(steps) > state["step"]:
        raise ckpt.CheckpointError(f"checkpoint {path} is damaged: the optimizer has taken {max(steps):.0f} steps, "
                                   f"state.json says {state['step']}")
    set_state_dict(model, optimizer, model_state_dict=sd["model"],
                   optim_state_dict=live_group_flags(optimizer, sd["optim"]))
    scheduler.load_state_dict(state["scheduler"])
    rng = path / f"rng_{dist.rank}.pt"
    ckpt.set_rng_state(torch.load(rng if rng.exists() else path / "rng_0.pt", weights_only=False))
    return state


def read_model_weights(path: Path, model) -> dict[str, torch.Tensor]:
    """The model part of a DCP checkpoint the caller has verified (checkpoint.verify), read into a plain
    one-process `model` (`novatune eval` on a multi-process run's checkpoint): the model's own tensors are filled in
    place and returned by parameter name."""
    model_sd = get_model_state_dict(model)
    try:
        dcp.load({"model": model_sd}, checkpoint_id=str(path / "dcp"))
    except Exception as e:  # noqa: BLE001  (DCP reports missing keys or shapes as various exception types)
        raise ckpt.CheckpointMismatch(f"{path} does not match the model its config builds ({str(e)[:300]})") from None
    names = {n for n, _ in model.named_parameters()}
    return {n: t for n, t in _local(model_sd).items() if n in names}


def full_state_on_rank0(model) -> dict[str, torch.Tensor]:
    """The whole model's state dict on rank 0's CPU (empty on the other ranks); a collective: every rank calls it."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def plain_model(cfg, tokenizer, dtype: torch.dtype, base_dir: Path | None = None):
    """An unwrapped, unpatched model of the run's architecture (LoRA: with its adapters) on the CPU, its weights
    uninitialised: what the gathered state dict is loaded into. Built on the meta device, so a large model is
    never randomly initialised on the host."""
    from transformers import AutoModelForCausalLM

    from novatune.train.model import add_lora, model_config

    config = model_config(cfg.model, tokenizer, base_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        if cfg.method.type != "full":
            model = add_lora(model, cfg.method)
    model = model.to_empty(device="cpu")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.tie_weights()  # to_empty gives each parameter its own storage: tied embeddings share one again
    return model


def export(model, cfg, tokenizer, output_dir: str | Path, dtype: torch.dtype, dist: Dist,
           base_dir: Path | None = None) -> list[Path]:
    """The one-folder export of a ddp/fsdp2 run (every rank calls it; rank 0 writes); returns the folders."""
    full = full_state_on_rank0(model)
    written, error = [], None
    if dist.main:
        try:
            plain = plain_model(cfg, tokenizer, dtype, base_dir)
            plain.load_state_dict(full, strict=True)
            written = ckpt.export(plain, tokenizer, output_dir, cfg.method.type != "full",
                                  cfg.checkpoint.export_merged, merged_dtype=dtype)
        except (OSError, RuntimeError, ValueError, ckpt.CheckpointError) as e:
            error = e
    _agree_or_raise(dist, error, "the export")
    return [Path(p) for p in dist.broadcast([str(p) for p in written])]
