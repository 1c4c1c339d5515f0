"""Checkpoints that resume the same loss curve, and the final export.

A checkpoint is a folder `<output_dir>/checkpoints/step_00000120/` holding

  weights.safetensors  the trainable parameters by name (full: all of them, tied ones once; LoRA: the adapter)
  optimizer.pt         optimizer.state_dict()
  state.json           step, scheduler state, data position (epoch, index), tokens seen, config
  rng.pt               torch CPU/CUDA and python RNG states (dropout, anything random after the resume point)

It is written to a temporary folder beside it and renamed into place (atomic on POSIX), so a run killed while
saving leaves either the complete checkpoint or none; `latest()` ignores leftovers. The newest `keep` are kept.

The export (`<output_dir>/final/`) loads with `from_pretrained`: full fine-tuning writes the model and tokenizer;
LoRA writes `final/adapter/` (PEFT) and `final/merged/` (adapter merged into the base weights). QLoRA writes the
same two folders; its merged model is dense (NF4 base weights dequantised, delta added in fp32, saved in the
compute dtype: novatune/train/qlora.py's merged_model), where PEFT's merge_and_unload would re-quantise the sum to
NF4. The novatune patch is reverted before saving, so the exported model is a plain transformers model.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

STEP_RE = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from; the message says why and what to do."""


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    d = checkpoints_dir(output_dir)
    if not d.is_dir():
        return []
    found = [p for p in d.iterdir() if STEP_RE.match(p.name) and (p / "state.json").is_file()]
    return sorted(found, key=lambda p: int(STEP_RE.match(p.name).group(1)))


def latest(output_dir: str | Path) -> Path | None:
    cks = list_checkpoints(output_dir)
    return cks[-1] if cks else None


def trainable_state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad}


def rng_state() -> dict:
    st = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def save(output_dir: str | Path, step: int, model, optimizer, scheduler, state: dict, keep: int = 2) -> Path:
    """Write checkpoint `step` atomically; prune to the newest `keep`. Returns its folder."""
    root = checkpoints_dir(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-step_{step:08d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file({k: v.cpu() for k, v in trainable_state(model).items()}, str(tmp / "weights.safetensors"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({**state, "step": step, "scheduler": scheduler.state_dict()},
                                               indent=1, default=str))
    if final.exists():  # the same step saved again (e.g. a resumed run re-reaching it): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(output_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-step_*"):  # leftovers of runs killed while saving
        if stale != tmp:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def load(path: str | Path, model, optimizer, scheduler, device: torch.device) -> dict:
    """Restore weights, optimizer, scheduler and RNG from a checkpoint; returns its state.json."""
    path = Path(path)
    if not (path / "state.json").is_file():
        raise CheckpointError(f"checkpoint.resume: {path} is not a checkpoint folder (no state.json); give a "
                                f"checkpoints/step_N folder, or resume: auto / never")
    weights = load_file(str(path / "weights.safetensors"), device=str(device))
    expected = set(trainable_state(model))
    if set(weights) != expected:
        missing, extra = sorted(expected - set(weights))[:3], sorted(set(weights) - expected)[:3]
        raise CheckpointError(f"checkpoint.resume: {path} does not match this model (missing {missing}, unexpected "
                           f"{extra}); resume with the config that wrote it, or start a new output_dir")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in weights.items():
            params[name].copy_(t)
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=device, weights_only=True))
    state = json.loads((path / "state.json").read_text())
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(torch.load(path / "rng.pt", weights_only=False))
    return state


def export(model, tokenizer, output_dir: str | Path, lora: bool, merged: bool = True, qlora: bool = False,
           merged_dtype: torch.dtype = torch.bfloat16) -> list[Path]:
    """Final weights loadable with from_pretrained; returns the folders written. qlora: the base weights are
    bnb NF4 (implies lora); the merged model is dequantised and saved in merged_dtype."""
    lora = lora or qlora
    out = Path(output_dir) / "final"
    tmp = Path(output_dir) / f".tmp-final-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = base.config
    old_cache = cfg.use_cache
    cfg.use_cache = True  # the exported model is for inference too; the trainer forces use_cache=False itself
    written = []
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # our own console reports the export
    try:
        if lora:
            model.save_pretrained(str(tmp / "adapter"))
            written.append("adapter")
            if merged and qlora:
                from novatune.train.qlora import merged_model as dense_merge

                dense_merge(model, merged_dtype).save_pretrained(str(tmp / "merged"))
                written.append("merged")
            elif merged:
                merged_model = model.merge_and_unload()
                merged_model.save_pretrained(str(tmp / "merged"))
                written.append("merged")
        else:
            model.save_pretrained(str(tmp))
            written.append("")
        if tokenizer is not None:
            for w in written:
                tokenizer.save_pretrained(str(tmp / w))
    finally:
        cfg.use_cache = old_cache
        if bars:
            hf_logging.enable_progress_bar()
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return [out / w for w in written]
