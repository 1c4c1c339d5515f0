"""Checkpoints are verified before a resume (manifest sizes and checksums, the step cross-checked), a damaged newest
one falls back loudly to the newest intact one (or is an error when named explicitly), a full disk says so and
leaves nothing behind, and a kill mid-prune never leaves a half checkpoint under a valid name."""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file, save_file

from novatune.train import checkpoint as ckpt
from novatune.train.loop import train


def quiet():
    return Console(file=open("/dev/null", "w"), soft_wrap=True)


def recorder():
    lines = []
    return Console(file=type("W", (), {"write": lambda s, x: lines.append(x), "flush": lambda s: None})(),
                   soft_wrap=True, width=400), lines


def rewrite_manifest(cp: Path) -> None:
    """Make the manifest agree with the files again (damage a checksum cannot see)."""
    m = json.loads((cp / "manifest.json").read_text())
    for name, entry in m["files"].items():
        entry["bytes"] = (cp / name).stat().st_size
        entry["hash"] = ckpt.file_digest(cp / name, m["hash"])
    (cp / "manifest.json").write_text(json.dumps(m))


def truncate(cp):
    p = cp / "weights.safetensors"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def edit_step(cp):  # an edited state.json, the manifest made consistent: the cross-check catches it
    st = json.loads((cp / "state.json").read_text())
    st["step"] = 99
    (cp / "state.json").write_text(json.dumps(st))
    rewrite_manifest(cp)


def missing_key(cp):
    st = json.loads((cp / "state.json").read_text())
    del st["data"]
    (cp / "state.json").write_text(json.dumps(st))
    rewrite_manifest(cp)


def nan_weight(cp):
    w = load_file(str(cp / "weights.safetensors"))
    next(iter(w.values())).view(-1)[0] = float("nan")
    save_file(w, str(cp / "weights.safetensors"), metadata={"step": cp.name[5:].lstrip("0")})
    rewrite_manifest(cp)


DAMAGE = {
    "truncated": truncate,
    "missing_file": lambda cp: (cp / "optimizer.pt").unlink(),
    "bad_json": lambda cp: (cp / "state.json").write_text("{\"step\": 4,"),
    "no_manifest": lambda cp: (cp / "manifest.json").unlink(),
    "missing_key": missing_key,
    "edited_step": edit_step,
    "nan_weight": nan_weight,
    "malformed_manifest": lambda cp: (cp / "manifest.json").write_text(json.dumps(
        {"step": 4, "files": {"weights.safetensors": {"size": 1}}})),
    "state_not_object": lambda cp: ((cp / "state.json").write_text("[4]"), rewrite_manifest(cp)),
}




@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_newest_checkpoint_falls_back_loudly(make_cfg, damage):
    cfg = make_cfg("d", train={"max_steps": 6}, checkpoint={"save_every": 2})
    first = train(cfg, console=quiet(), stop_after=4)
    cps = ckpt.list_checkpoints(cfg.checkpoint.output_dir)
    assert [p.name for p in cps] == ["step_00000002", "step_00000004"] and all(ckpt.verify(p) == [] for p in cps)
    DAMAGE[damage](cps[-1])
    if damage != "nan_weight":  # that one is caught when the weights are read
        assert ckpt.verify(cps[-1]), damage
    # named explicitly: an error, nothing falls back
    explicit = make_cfg("d", train={"max_steps": 6}, checkpoint={"save_every": 2, "resume": str(cps[-1])})
    with pytest.raises(ckpt.CheckpointError, match="damaged"):
        train(explicit, console=quiet())
    # auto: the newest intact one, said loudly; the damaged one is set aside
    console, lines = recorder()
    second = train(cfg, console=console)
    text = "".join(lines)
    assert "WARNING" in text and "older intact checkpoint" in text, text[-2000:]
    assert second.resumed_from.name == "step_00000002" and sorted(second.losses) == [3, 4, 5, 6]
    for s in (3, 4):
        assert second.losses[s] == first.losses[s], s  # the same curve from the fallback point
    root = ckpt.checkpoints_dir(cfg.checkpoint.output_dir)
    assert [p.name for p in root.iterdir() if p.name.startswith("damaged-step_00000004")]


def test_no_intact_checkpoint_is_an_error(make_cfg):
    cfg = make_cfg("none", train={"max_steps": 6}, checkpoint={"save_every": 2})
    train(cfg, console=quiet(), stop_after=2)
    truncate(ckpt.latest(cfg.checkpoint.output_dir))
    with pytest.raises(ckpt.CheckpointError, match="no intact checkpoint"):
        train(cfg, console=quiet())


def _tiny():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


@pytest.mark.parametrize("error", [RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0"),
                                   OSError(errno.ENOSPC, "No space left on device")], ids=["torch", "oserror"])
def test_disk_full_is_a_clear_error_and_leaves_no_temporary(tmp_path, monkeypatch, error):
    model, opt, sched = _tiny()
    ckpt.save(tmp_path, 1, model, opt, sched, {"data": {}})

    def full(*a, **k):
        raise error

    monkeypatch.setattr(ckpt.torch, "save", full)
    with pytest.raises(ckpt.CheckpointError, match="disk full while saving checkpoint step 2 to .*free space"):
        ckpt.save(tmp_path, 2, model, opt, sched, {"data": {}})
    assert [p.name for p in ckpt.checkpoints_dir(tmp_path).iterdir()] == ["step_00000001"]


def test_kill_mid_prune_leaves_no_half_checkpoint(tmp_path, monkeypatch):
    model, opt, sched = _tiny()
    for s in (1, 2):
        sched.last_epoch = s  # as if s steps were taken (verify cross-checks it)
        ckpt.save(tmp_path, s, model, opt, sched, {"data": {}}, keep=2)
    sched.last_epoch = 3

    def killed(path, *a, **k):  # deletes one file, then the process "dies"
        next(p for p in Path(path).iterdir() if p.is_file()).unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(tmp_path, 3, model, opt, sched, {"data": {}}, keep=2)
    monkeypatch.undo()
    cps = ckpt.list_checkpoints(tmp_path)
    assert [p.name for p in cps] == ["step_00000002", "step_00000003"]
    assert all(ckpt.verify(p) == [] for p in cps)
    assert ckpt.clean_leftovers(tmp_path) and not [p for p in ckpt.checkpoints_dir(tmp_path).iterdir()
                                                   if p.name.startswith(".")]


def test_save_fsyncs_files_and_folders_before_publishing(tmp_path, monkeypatch):
    model, opt, sched = _tiny()
    synced, real_fsync, real_replace = [], os.fsync, os.replace
    monkeypatch.setattr(ckpt.os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")),
                                                      real_fsync(fd)))
    published = []
    monkeypatch.setattr(ckpt.os, "replace", lambda a, b: (published.append(list(synced)), real_replace(a, b)))
    ckpt.save(tmp_path, 1, model, opt, sched, {"data": {}})
    before = {Path(p).name for p in published[0]}
    assert {"weights.safetensors", "optimizer.pt", "rng.pt", "state.json", "manifest.json"} <= before
    assert any(Path(p).name.startswith(".tmp-step_") for p in published[0])  # the folder itself
    assert str(ckpt.checkpoints_dir(tmp_path)) in synced  # and the parent after the rename


def test_disk_full_during_export_is_a_clear_error(tmp_path, monkeypatch):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=8))

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(type(model), "save_pretrained", full)
    with pytest.raises(ckpt.CheckpointError, match="disk full while exporting"):
        ckpt.export(model, None, tmp_path, lora=False)
    assert list(tmp_path.iterdir()) == []
