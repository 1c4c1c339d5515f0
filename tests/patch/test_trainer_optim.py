"""novatune.patch(trainer): the Trainer's torch AdamW built as FusedClipAdamW, its clipping folded into the update
(patch/trainer_optim.py). CPU, a real TRL SFTTrainer on the tiny Qwen3 of test_trainers.py; the swap is enabled on
the CPU here (the product swaps on CUDA only), where the update runs its fp32 reference.

Tolerance against the unpatched trainer: fp32 throughout; the two AdamW implementations round differently
(torch's single-tensor path: lerp and addcdiv; ours: the reference's order), ~1e-7 relative per update, and the
clipped gradient is not rounded in between: losses within test_trainers.py's 2e-5 relative, the logged gradient
norms (computed by the same torch call on the same gradients before any update differs) within 1e-5.
"""
import pytest
import torch
from test_trainers import assert_losses_match, sft_trainer, train_recording_losses

import novatune
from novatune.ops.adamw import FusedClipAdamW
from novatune.patch import trainer_optim
from tests.train.test_fused_clip_adamw import record_clip_coefs


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(trainer_optim, "ON_DEVICES", ("cuda", "cpu"))


def _norms(trainer):
    return [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]


def test_trainer_adamw_swapped_and_clipping_folded(tokenizer, dataset, tmp_path, on_cpu, monkeypatch):
    # max_grad_norm far below the tiny model's gradient norms: every step clips. adam_epsilon 1e-4, near the clipped
    # gradients' size, makes the update depend on the clipping (m / sqrt(v) alone hardly does): a coefficient that
    # never reached the update would show in the second step's losses
    clipped = dict(max_grad_norm=0.05, adam_epsilon=1e-4)
    stock = sft_trainer("packing", tokenizer, dataset, tmp_path, **clipped)
    stock_losses = train_recording_losses(stock)
    trainer = sft_trainer("packing", tokenizer, dataset, tmp_path, **clipped)
    report = novatune.patch(trainer)
    assert report.replaced("trainer_adamw"), str(report)
    scales = record_clip_coefs(monkeypatch)
    losses = train_recording_losses(trainer)
    assert isinstance(trainer.optimizer.optimizer, FusedClipAdamW)
    assert_losses_match(losses, stock_losses)
    assert len(scales) == 2 and all(s is not None and 0 < s < 1 for s in scales), scales  # clipped, in the update
    assert _norms(trainer) == pytest.approx(_norms(stock), rel=1e-5)
    groups = trainer.optimizer.optimizer.param_groups
    assert len(groups) == 2  # the Trainer's own decay / no-decay groups
    report.revert()
    assert "get_optimizer_cls_and_kwargs" not in vars(trainer) and "clip_grad_norm_" not in vars(trainer.accelerator)


def test_what_stays_with_torch_is_said(tokenizer, dataset, tmp_path, on_cpu):
    sgd = sft_trainer("packing", tokenizer, dataset, tmp_path, optim="sgd")
    assert "optim='sgd' is not torch's AdamW" in str(novatune.patch(sgd))
    given = sft_trainer("packing", tokenizer, dataset, tmp_path)
    given.optimizer = torch.optim.SGD(given.model.parameters(), lr=0.1)
    assert "the trainer's optimizer already exists" in str(novatune.patch(given))
    assert "clip_grad_norm_" not in vars(given.accelerator)


def test_on_the_cpu_the_trainer_keeps_torchs_adamw(tokenizer, dataset, tmp_path):
    trainer = sft_trainer("packing", tokenizer, dataset, tmp_path)
    report = novatune.patch(trainer)
    assert "runs on cpu, not CUDA" in str(report) and not report.replaced("trainer_adamw")
    assert "get_optimizer_cls_and_kwargs" not in vars(trainer)


def test_adapters_keep_torchs_adamw(tokenizer, dataset, tmp_path, on_cpu):
    """LoRA: most weights frozen, many small adapter tensors (torch's multi-tensor launches suit them)."""
    trainer = sft_trainer("peft_lora", tokenizer, dataset, tmp_path)
    report = novatune.patch(trainer)
    assert "adapters train (LoRA)" in str(report) and not report.replaced("trainer_adamw")


def test_the_choice_is_made_when_the_optimizer_is_built(tokenizer, dataset, tmp_path, on_cpu):
    """The Trainer's own get_optimizer_cls_and_kwargs answers at create_optimizer time: the arguments of that
    moment (a hyperparameter-search trial's learning rate) reach FusedClipAdamW."""
    trainer = sft_trainer("packing", tokenizer, dataset, tmp_path)
    novatune.patch(trainer)
    trainer.args.learning_rate = 0.0123
    trainer.create_optimizer()
    assert isinstance(trainer.optimizer, FusedClipAdamW) and trainer.optimizer.param_groups[0]["lr"] == 0.0123
