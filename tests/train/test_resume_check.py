"""A resume with changed settings: those the resumed state would override or that change the data are refused
(each key old -> new), those that only extend or reshape the run are allowed."""
from __future__ import annotations

import pytest
from rich.console import Console

from novatune.train import checkpoint as ckpt
from novatune.train.config import ConfigError, to_yaml
from novatune.train.loop import train
from novatune.train.resume_check import changed_settings, check_resume_config


def quiet():
    return Console(file=open("/dev/null", "w"), soft_wrap=True)


def test_changed_optimizer_and_data_settings_are_refused_listing_each(make_cfg):
    old = make_cfg("a")
    new = make_cfg("b", train={"lr": 1e-3, "seed": 7, "betas": [0.9, 0.95]}, data={"shuffle": False},
                   method={"type": "lora"}, model={"arch_overrides": {"num_hidden_layers": 3}})
    with pytest.raises(ConfigError) as info:
        check_resume_config({"config": to_yaml(old)}, new, "ckpt/step_2")
    msg = str(info.value)
    for text in ("train.lr: 0.003 -> 0.001", "train.seed: 0 -> 7", "train.betas", "data.shuffle: True -> False",
                 "method.type: 'full' -> 'lora'", "model.arch_overrides", "--output-dir", "checkpoint.resume=never"):
        assert text in msg, text
    assert "checkpoint.output_dir" not in msg  # the output folder may differ


def test_extending_and_reshaping_a_run_is_allowed(make_cfg):
    old = make_cfg("a")
    new = make_cfg("b", train={"max_steps": 9, "max_grad_norm": 0.5}, checkpoint={"save_every": 3, "keep": 5},
                   logging={"every": 2}, parallel={"strategy": "ddp"}, memory={"gradient_checkpointing": True})
    notes = []
    check_resume_config({"config": to_yaml(old)}, new, "ckpt/step_2", note=notes.append)
    assert notes == ["note: train.max_steps changed on resume: 4 -> 9"]
    assert "train.max_steps" in changed_settings(to_yaml(old), new)
    check_resume_config({}, new, "old-format checkpoint")  # no saved config: nothing to compare


def test_the_same_global_batch_on_another_number_of_processes_is_allowed(make_cfg):
    """2 processes x micro_batch 1 x grad_accum 2 resumed as 1 process x micro_batch 2 (the same global batch) is
    allowed; a different global batch is refused."""
    two = make_cfg("a", train={"micro_batch": 1, "grad_accum": 2})
    state = {"config": to_yaml(two), "world_size": 2}
    check_resume_config(state, make_cfg("b", train={"micro_batch": 2, "grad_accum": 2}), "ck", world=1)
    check_resume_config(state, make_cfg("c", train={"micro_batch": 1, "grad_accum": 4}), "ck", world=1)
    with pytest.raises(ConfigError, match=r"1 x 2 x 2 process\(es\) then, 4 x 2 x 1 now"):
        check_resume_config(state, make_cfg("d", train={"micro_batch": 4, "grad_accum": 2}), "ck", world=1)


def test_another_number_of_processes_alone_is_refused(make_cfg):
    """The same micro_batch and grad_accum over half the processes halves the global batch: the resumed schedule
    and data position would count steps of the old batch. Refused, naming the product and the fix; the same
    settings resumed on the checkpoint's number of processes are fine."""
    two = make_cfg("a", train={"micro_batch": 2, "grad_accum": 1})
    state = {"config": to_yaml(two), "world_size": 2}
    with pytest.raises(ConfigError, match=r"2 x 1 x 2 process\(es\) then, 2 x 1 x 1 now") as info:
        check_resume_config(state, make_cfg("b", train={"micro_batch": 2, "grad_accum": 1}), "ck", world=1)
    assert "double train.grad_accum" in str(info.value)
    with pytest.raises(ConfigError, match="global batch changed"):
        check_resume_config({"config": to_yaml(two)}, two, "ck", world=2)  # 1 process then, 2 now
    check_resume_config(state, make_cfg("c", train={"micro_batch": 2, "grad_accum": 1}), "ck", world=2)


def test_resume_with_a_changed_lr_fails_before_training(make_cfg):
    cfg = make_cfg("r", checkpoint={"save_every": 2})
    train(cfg, console=quiet(), stop_after=2)
    (cp,) = ckpt.list_checkpoints(cfg.checkpoint.output_dir)
    changed = make_cfg("r", train={"lr": 1e-3}, checkpoint={"save_every": 2})
    steps = []
    with pytest.raises(ConfigError, match=r"train\.lr: 0\.003 -> 0\.001"):
        train(changed, console=quiet(), step_hook=lambda s, m: steps.append(s))
    assert steps == [] and ckpt.list_checkpoints(cfg.checkpoint.output_dir) == [cp]
    longer = train(make_cfg("r", train={"max_steps": 5}, checkpoint={"save_every": 2}), console=quiet())
    assert longer.resumed_from == cp and sorted(longer.losses) == [3, 4, 5]
