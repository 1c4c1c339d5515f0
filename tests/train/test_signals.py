"""SIGINT/SIGTERM mid-step: the step finishes, a checkpoint with the exact data position is saved, the run ends
with 128 + the signal number, and the resumed run reproduces the uninterrupted run's losses exactly (CPU)."""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from rich.console import Console

from novatune.commands import cli
from novatune.train import checkpoint as ckpt
from novatune.train.loop import train
from novatune.train.signals import RunInterrupted


def quiet():
    return Console(file=open("/dev/null", "w"), soft_wrap=True)


def signal_during_step(signum: int, step: int, grad_accum: int):
    """A model hook that sends `signum` to this process inside the first micro-batch forward of `step`."""
    calls = {"n": 0}

    def hook(model):
        def pre(module, args, kwargs):
            calls["n"] += 1
            if calls["n"] == (step - 1) * grad_accum + 1:
                os.kill(os.getpid(), signum)

        model.register_forward_pre_hook(pre, with_kwargs=True)

    return hook


@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["sigint", "sigterm"])
def test_signal_mid_step_saves_that_step_and_resumes_exactly(make_cfg, signum, code):
    steps = {"max_steps": 7, "micro_batch": 2, "grad_accum": 2}
    full = train(make_cfg("full", train=steps), console=quiet())
    cfg = make_cfg("sig", train=steps, checkpoint={"save_every": 0}, logging={"every": 3})
    # the process's own handler, whatever its launcher left (a background job of a shell starts with SIGINT ignored)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(RunInterrupted) as info:
        train(cfg, console=quiet(), model_hook=signal_during_step(signum, 5, 2))
    assert info.value.exit_code == code
    (cp,) = ckpt.list_checkpoints(cfg.checkpoint.output_dir)
    state = json.loads((cp / "state.json").read_text())
    assert cp.name == "step_00000005" and state["step"] == 5
    assert state["data"]["index"] == 5 * 2 * 2  # rows consumed by 5 steps of 2 x 2: none skipped
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored
    metrics = Path(cfg.checkpoint.output_dir) / "metrics.jsonl"
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [3, 5]  # the stop step is logged
    second = train(cfg, console=quiet())
    assert second.resumed_from == cp and sorted(second.losses) == [6, 7]
    for s in (6, 7):
        assert second.losses[s] == full.losses[s], s
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [3, 5, 6, 7]


def test_cli_exits_with_the_signal_code(monkeypatch, capsys):
    def stopped(args):
        raise RunInterrupted(signal.SIGTERM, "stopped by SIGTERM after step 3")

    monkeypatch.setattr(cli, "cmd_train", stopped)
    assert cli.main(["train"]) == 143
    assert "SIGTERM after step 3" in capsys.readouterr().err


@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["sigint", "sigterm"])
def test_signal_during_the_export_keeps_the_run(make_cfg, monkeypatch, signum, code):
    cfg = make_cfg("exp", train={"max_steps": 2}, checkpoint={"save_every": 0})
    real_export = ckpt.export

    def export_signalled(*a, **k):  # the signal lands inside the export, which still completes
        os.kill(os.getpid(), signum)
        return real_export(*a, **k)

    monkeypatch.setattr(ckpt, "export", export_signalled)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(RunInterrupted) as info:
        train(cfg, console=quiet())
    assert info.value.exit_code == code and "export completed" in str(info.value)
    out = Path(cfg.checkpoint.output_dir)
    (cp,) = ckpt.list_checkpoints(out)  # saved before the export, although save_every is 0
    assert cp.name == "step_00000002" and (out / "final" / "config.json").exists()
    assert json.loads((out / "run.json").read_text())["status"] == "finished"
    assert signal.getsignal(signal.SIGINT) is before  # restored after the export


def test_signal_before_the_export_leaves_a_checkpoint_that_resumes_to_it(make_cfg, monkeypatch):
    cfg = make_cfg("pre", train={"max_steps": 2}, checkpoint={"save_every": 0})
    real_save = ckpt.save

    def save_signalled(*a, **k):  # SIGTERM while the final checkpoint is written
        os.kill(os.getpid(), signal.SIGTERM)
        return real_save(*a, **k)

    monkeypatch.setattr(ckpt, "save", save_signalled)
    with pytest.raises(RunInterrupted) as info:
        train(cfg, console=quiet())
    assert info.value.exit_code == 143 and "before the export" in str(info.value)
    out = Path(cfg.checkpoint.output_dir)
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_00000002"] and not (out / "final").exists()
    monkeypatch.setattr(ckpt, "save", real_save)
    again = train(cfg, console=quiet())  # resumes at the last step: nothing to train, only the export
    assert again.steps == 2 and not again.losses and (out / "final" / "config.json").exists()
