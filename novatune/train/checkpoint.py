"""Checkpoints that resume the same loss curve, and the final export.

A checkpoint is a folder `<output_dir>/checkpoints/step_00000120/` holding

  weights.safetensors  the trainable parameters by name (full: all of them, tied ones once; LoRA: the adapter);
                       its metadata carries the step
  optimizer.pt         optimizer.state_dict()
  state.json           step, scheduler state, data position (epoch, index), tokens seen, config
  rng.pt               torch CPU/CUDA and python RNG states (dropout, anything random after the resume point)
  manifest.json        the step, and every file's size and checksum (xxh3-128 where xxhash is installed, else
                       sha256); written last, so a folder without it is incomplete

Saving writes a temporary folder beside the checkpoint, fsyncs its files and the folder, renames it into place and
fsyncs the parent (atomic on POSIX): a run killed while saving leaves either the complete checkpoint or a
`.tmp-*` folder that the next run removes. Pruning to the newest `keep` first renames a checkpoint to a `.trash-*`
name, then deletes it, so a kill mid-prune never leaves a half folder that looks like a checkpoint. Only finite
weights are written (novatune/train/nonfinite.py); a full disk is reported as such and the temporary folder removed.

Before a resume `verify()` checks the manifest (sizes, checksums) and that the step agrees across the folder name,
manifest, state.json, the weights' metadata, the scheduler and the optimizer; `load()` also refuses non-finite
weights or optimizer moments, and changes nothing in the model before every check has passed.
`resume()` applies checkpoint.resume: `auto` takes the newest intact checkpoint and sets each damaged newer one
aside as `damaged-step_N` with a warning naming the problem; an explicit path to a damaged checkpoint is an error.

The export (`<output_dir>/final/`) loads with `from_pretrained`: full fine-tuning writes the model and tokenizer;
LoRA writes `final/adapter/` (PEFT) and `final/merged/` (adapter merged into the base weights). QLoRA writes the
same two folders; its merged model is dense (NF4 base weights dequantised, delta added in fp32, saved in the
compute dtype: novatune/train/qlora.py's merged_model), where PEFT's merge_and_unload would re-quantise the sum to
NF4. The novatune patch is reverted before saving, so the exported model is a plain transformers model.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from novatune.train.nonfinite import nonfinite_names, require_finite
from novatune.train.optim import live_group_flags

STEP_RE = re.compile(r"^step_(\d{8})$")
FILES = ("weights.safetensors", "optimizer.pt", "rng.pt", "state.json")
SHARDED_LAYOUT = "dcp"
SHARDED_REQUIRED = {"state.json", "rng_0.pt", "dcp/.metadata"}  # every sharded checkpoint has these
STATE_KEYS = ("step", "scheduler", "data")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or resumed from; the message says why and what to do."""


class CheckpointMismatch(CheckpointError):
    """An intact checkpoint written for another model or method: no older checkpoint of that run fits either."""


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def step_of(path: Path) -> int:
    return int(STEP_RE.match(path.name).group(1))


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Every `step_N` folder, oldest first, intact or not (verify() tells them apart)."""
    d = checkpoints_dir(output_dir)
    if not d.is_dir():
        return []
    return sorted((p for p in d.iterdir() if STEP_RE.match(p.name) and p.is_dir()), key=step_of)


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


# ------------------------------------------------------------------------------------------ files on disk
def file_digest(path: Path, algo: str) -> str:
    if algo == "xxh3_128":
        import xxhash

        h = xxhash.xxh3_128()
    else:
        h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def default_hash() -> str:
    try:
        import xxhash  # noqa: F401  (a non-cryptographic hash: checksums of multi-GB states cost less than sha256)

        return "xxh3_128"
    except ImportError:
        return "sha256"


def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's entry to the disk (what makes a rename durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_disk_full(e: BaseException) -> bool:
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(e)  # torch's zip writer reports a short write as "unexpected pos N vs M" / "file write failed"
    return "unexpected pos" in text or "file write failed" in text or "No space left" in text


def remove_tree(path: Path) -> None:
    """Delete a folder so that no half of it keeps a valid name: rename to a trash name first."""
    trash = path.parent / f".trash-{path.name}-{os.getpid()}-{time.monotonic_ns()}"
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def clean_leftovers(output_dir: str | Path) -> list[str]:
    """Remove what killed saves and prunes leave behind (`.tmp-*`, `.trash-*`); returns their names."""
    removed = []
    for root in (Path(output_dir), checkpoints_dir(output_dir)):
        if not root.is_dir():
            continue
        for p in root.iterdir():
            if p.name.startswith((".tmp-", ".trash-")):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                removed.append(p.name)
    return removed


# ------------------------------------------------------------------------------------------------- saving
def _write_files(tmp: Path, step: int, model, optimizer, scheduler, state: dict) -> None:
    weights = {k: v.cpu() for k, v in trainable_state(model).items()}
    save_file(weights, str(tmp / "weights.safetensors"), metadata={"step": str(step)})
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({**state, "step": step, "scheduler": scheduler.state_dict()},
                                               indent=1, default=str))
    algo = default_hash()
    files = {name: {"bytes": (tmp / name).stat().st_size, "hash": file_digest(tmp / name, algo)} for name in FILES}
    (tmp / "manifest.json").write_text(json.dumps({"format": 1, "step": step, "hash": algo, "files": files},
                                                  indent=1))
    for name in (*FILES, "manifest.json"):
        fsync_path(tmp / name)
    fsync_path(tmp)


def save(output_dir: str | Path, step: int, model, optimizer, scheduler, state: dict, keep: int = 2) -> Path:
    """Write checkpoint `step` atomically; prune to the newest `keep`. Returns its folder."""
    require_finite(trainable_state(model), f"checkpoint at step {step}",
                   "nothing was saved; the previous checkpoints are kept. Lower train.lr or check the data")
    root = checkpoints_dir(output_dir)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-step_{step:08d}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        _write_files(tmp, step, model, optimizer, scheduler, state)
        if final.exists():  # the same step saved again (e.g. a resumed run re-reaching it): replace it
            remove_tree(final)
        os.replace(tmp, final)
        fsync_path(root)
    except (OSError, RuntimeError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(e):
            raise CheckpointError(f"disk full while saving checkpoint step {step} to {root}: free space (or lower "
                                  f"checkpoint.keep, or point checkpoint.output_dir at a bigger disk) and run the "
                                  f"same command to resume from the last checkpoint") from None
        if isinstance(e, OSError):
            raise CheckpointError(f"cannot write checkpoint step {step} to {root} ({e.strerror or e}); make the "
                                  f"folder writable or choose another checkpoint.output_dir") from None
        raise
    for old in list_checkpoints(output_dir)[:-keep] if keep > 0 else []:
        remove_tree(old)
    return final


# ---------------------------------------------------------------------------------------- checking, loading
def _read_json(path: Path, problems: list[str]):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        problems.append(f"{path.name} is missing")
    except (OSError, ValueError) as e:
        problems.append(f"{path.name} is not valid JSON ({e})")
    return None


def _check_files(path: Path, manifest: dict, problems: list[str]) -> None:
    algo = manifest.get("hash", "sha256")
    # a sharded (DCP) checkpoint lists its own files (one shard per rank); its required ones must be among them
    names = FILES if manifest.get("layout") != SHARDED_LAYOUT else sorted(set(manifest["files"]) | SHARDED_REQUIRED)
    for name in names:
        entry, f = manifest["files"].get(name), path / name
        if entry is None:
            problems.append(f"manifest.json lists no {name}")
        elif not f.is_file():
            problems.append(f"{name} is missing")
        elif f.stat().st_size != entry["bytes"]:
            problems.append(f"{name} has {f.stat().st_size} bytes, the manifest says {entry['bytes']} (truncated?)")
        elif file_digest(f, algo) != entry["hash"]:
            problems.append(f"{name} does not match its checksum (changed or corrupted after it was written)")


def verify(path: str | Path) -> list[str]:
    """Problems that make a checkpoint folder unusable (empty: intact)."""
    path, problems = Path(path), []
    manifest = _read_json(path / "manifest.json", problems)
    if manifest is None:
        return [p.replace("manifest.json is missing", "manifest.json is missing (an incomplete save, or a checkpoint "
                                                       "written without one)") for p in problems]
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict) or "step" not in manifest:
        return ["manifest.json lacks its step or file list"]
    try:
        _check_files(path, manifest, problems)
    except (KeyError, TypeError, ValueError) as e:
        return [f"manifest.json is malformed ({type(e).__name__}: {e})"]
    if problems:
        return problems
    step = manifest["step"]
    state = _read_json(path / "state.json", problems)
    if not isinstance(state, dict):
        return problems or ["state.json is not a JSON object"]
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        problems.append(f"state.json lacks {missing}")
    steps = {"manifest.json": step, "state.json": state.get("step"),
             "the scheduler": (state.get("scheduler") or {}).get("last_epoch")
             if isinstance(state.get("scheduler") or {}, dict) else None}
    if STEP_RE.match(path.name):
        steps["the folder name"] = step_of(path)
    if manifest.get("layout") != "dcp":
        try:
            with safe_open(str(path / "weights.safetensors"), framework="pt") as f:
                steps["the weights"] = int((f.metadata() or {}).get("step", -1))
        except Exception as e:  # noqa: BLE001  (any unreadable header is damage)
            problems.append(f"weights.safetensors is unreadable ({e})")
    disagree = {k: v for k, v in steps.items() if v != step}
    if disagree:
        problems.append(f"the step disagrees: manifest.json says {step}, " +
                        ", ".join(f"{k} says {v}" for k, v in disagree.items()))
    return problems


def _read_checked(path: Path, model, device: torch.device) -> tuple[dict, dict, dict, dict]:
    """Everything a resume needs, checked (intact, this model's, finite), without touching the model."""
    problems = verify(path)
    if problems:
        raise CheckpointError(f"checkpoint {path} is damaged: {'; '.join(problems)}")
    weights = load_file(str(path / "weights.safetensors"), device=str(device))
    expected = set(trainable_state(model))
    if set(weights) != expected:
        missing, extra = sorted(expected - set(weights))[:3], sorted(set(weights) - expected)[:3]
        raise CheckpointMismatch(f"checkpoint.resume: {path} does not match this model (missing {missing}, unexpected "
                              f"{extra}); resume with the config that wrote it, or start a new output_dir")
    opt_state = torch.load(path / "optimizer.pt", map_location=device, weights_only=True)
    state = json.loads((path / "state.json").read_text())
    moments = {f"{i}.{k}": v for i, st in opt_state.get("state", {}).items() for k, v in st.items()
               if isinstance(v, torch.Tensor) and v.is_floating_point() and v.ndim > 0}
    bad = nonfinite_names(weights) + nonfinite_names(moments)
    if bad:
        raise CheckpointError(f"checkpoint {path} is damaged: {len(bad)} tensor(s) hold NaN/inf ({bad[0]}, ...)")
    steps = [float(v) for st in opt_state.get("state", {}).values() for k, v in st.items() if k == "step"]
    if steps and max(steps) > state["step"]:
        raise CheckpointError(f"checkpoint {path} is damaged: the optimizer has taken {max(steps):.0f} steps, "
                              f"state.json says {state['step']}")
    return weights, opt_state, state, torch.load(path / "rng.pt", weights_only=False)


def load(path: str | Path, model, optimizer, scheduler, device: torch.device, dist=None,
         load_sharded=None) -> dict:
    """Restore weights, optimizer, scheduler and RNG from a verified checkpoint; returns its state.json.
    A sharded (DCP) checkpoint loads through `load_sharded` (train/sharded_checkpoint.load, handed in by the loop:
    that module builds on this one), into a wrapped or a plain model; a one-process checkpoint only into a
    one-process run (`dist`: the run's novatune.parallel Dist, or None)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint.resume: {path} is not a checkpoint folder; give a checkpoints/step_N "
                              f"folder, or resume: auto / never")
    if is_sharded(path):
        if load_sharded is None:
            raise CheckpointMismatch(f"checkpoint {path} is sharded (written by a multi-process run); resume it "
                                     f"through novatune train")
        return load_sharded(path, model, optimizer, scheduler, dist)
    if dist is not None and dist.active:
        raise CheckpointMismatch(f"checkpoint.resume: {path} was written by a one-process run (parallel.strategy "
                                 f"none); resume it with parallel.strategy none, or start a new output_dir")
    weights, opt_state, state, rng = _read_checked(path, model, device)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in weights.items():
            params[name].copy_(t)
    optimizer.load_state_dict(live_group_flags(optimizer, opt_state))
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(rng)
    return state




def is_sharded(path: Path) -> bool:
    """A checkpoint written by torch.distributed.checkpoint (its manifest names the sharded layout; without a
    readable manifest, its dcp/ folder says so, and verify() reports the manifest as the damage)."""
    try:
        return json.loads((Path(path) / "manifest.json").read_text()).get("layout") == SHARDED_LAYOUT
    except (OSError, ValueError):
        return (Path(path) / "dcp").is_dir()


def set_aside(path: Path) -> Path:
    """Move a damaged checkpoint out of the way (kept for inspection, no longer counted or pruned)."""
    dest = path.parent / f"damaged-{path.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    os.replace(path, dest)
    return dest


def resume(setting: str, output_dir: str | Path, model, optimizer, scheduler, device: torch.device,
           warn=print, dist=None, load_sharded=None) -> tuple[Path | None, dict | None]:
    """Apply checkpoint.resume (auto | never | a path); returns (checkpoint resumed from, its state) or Nones."""
    if setting == "never":
        return None, None
    if setting != "auto":
        p = Path(setting)
        if p.is_dir() and not (p / "manifest.json").exists() and list_checkpoints(p):
            p = latest(p)  # an output_dir: its newest checkpoint
        try:
            return p, load(p, model, optimizer, scheduler, device, dist, load_sharded)
        except CheckpointError as e:
            raise CheckpointError(f"{e}. checkpoint.resume names it explicitly, so nothing falls back: give an "
                                  f"intact checkpoint, or resume: auto to take the newest intact one") from None
    damaged = []
    candidates = list_checkpoints(output_dir)
    if dist is not None:
        dist.barrier()  # every rank has listed the folder before any rank sets one aside
    for p in reversed(candidates):
        try:
            state = load(p, model, optimizer, scheduler, device, dist, load_sharded)
        except CheckpointMismatch:
            raise
        except CheckpointError as e:
            damaged.append(str(e))
            # one rank moves it (every rank sees the same damage and goes on to the same previous checkpoint)
            aside = set_aside(p).name if dist is None or dist.main else f"damaged-{p.name}"
            warn(f"WARNING: {e}; set aside as {aside}; trying the previous checkpoint")
            continue
        if damaged:
            warn(f"WARNING: resuming from the older intact checkpoint {p} (step {state['step']}), not the newest")
        return p, state
    if damaged:
        raise CheckpointError(f"no intact checkpoint in {checkpoints_dir(output_dir)} ({len(damaged)} damaged, set "
                              f"aside); set checkpoint.resume: never with a new output_dir to start over")
    return None, None


# ------------------------------------------------------------------------------------------------- export
def export(model, tokenizer, output_dir: str | Path, lora: bool, merged: bool = True, qlora: bool = False,
           merged_dtype: torch.dtype = torch.bfloat16) -> list[Path]:
    """Final weights loadable with from_pretrained; returns the folders written. qlora: the base weights are
    bnb NF4 (implies lora); the merged model is dequantised and saved in merged_dtype."""
    lora = lora or qlora
    require_finite(trainable_state(model), "export", "nothing was exported; the checkpoints are kept")
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
    except (OSError, RuntimeError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(e):
            raise CheckpointError(f"disk full while exporting the final model to {out}: free space (or point "
                                  f"checkpoint.output_dir at a bigger disk) and run again") from None
        raise
    finally:
        cfg.use_cache = old_cache
        if bars:
            hf_logging.enable_progress_bar()
    if out.exists():
        remove_tree(out)
    os.replace(tmp, out)
    fsync_path(out.parent)
    return [out / w for w in written]
