"""A patched Trainer's logging NaN/inf filter runs on the device: no Python bool of a loss tensor per micro-batch,
the same logged losses, the trainer's setting back on revert (novatune/patch/trainer_syncs.py)."""
import sys
import types

import pytest
import torch
from test_trainers import sft_trainer

import novatune
from novatune.patch import trainer_syncs


def _logged_losses(trainer) -> list[float]:
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _loop_bool_reads(monkeypatch) -> list[str]:
    """Python bools taken of tensors by transformers' Trainer loop (each one a host sync on a GPU)."""
    seen, real = [], torch.Tensor.__bool__

    def counting(self):
        caller = sys._getframe(1)
        if caller.f_code.co_filename.endswith("transformers/trainer.py"):
            seen.append(f"{caller.f_code.co_name}:{caller.f_lineno}")
        return real(self)

    monkeypatch.setattr(torch.Tensor, "__bool__", counting)
    return seen


def test_the_filter_moves_to_the_device_with_the_same_logged_losses(tokenizer, dataset, tmp_path, monkeypatch):
    stock = _logged_losses(sft_trainer("padding_free", tokenizer, dataset, tmp_path))
    trainer = sft_trainer("padding_free", tokenizer, dataset, tmp_path)
    report = novatune.patch(trainer)
    assert report.replaced("trainer_nan_filter"), str(report)
    assert not trainer.args.logging_nan_inf_filter
    reads = _loop_bool_reads(monkeypatch)
    patched = _logged_losses(trainer)
    assert not reads, reads
    assert patched == pytest.approx(stock, rel=1e-4)  # fp32 CPU; the fused loss sums in another order
    report.revert()
    assert trainer.args.logging_nan_inf_filter and "training_step" not in trainer.__dict__


def test_the_stock_loop_reads_each_micro_batch_loss_on_the_host(tokenizer, dataset, tmp_path, monkeypatch):
    """The yardstick of the test above: without the patch the loop takes a bool of every micro-batch's loss."""
    trainer = sft_trainer("padding_free", tokenizer, dataset, tmp_path)
    reads = _loop_bool_reads(monkeypatch)
    trainer.train()
    assert len(reads) >= 2 * trainer.args.gradient_accumulation_steps, reads


@pytest.mark.parametrize("loss", [1.5, float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_loss_adds_the_running_average_as_the_trainer_would(loss):
    """HF's filter: a NaN/inf micro-batch loss adds _tr_loss / (1 + global_step - _globalstep_last_logged)."""
    class Base:
        def training_step(self, *args, **kwargs):
            return torch.tensor(loss)

    trainer = Base()
    trainer._tr_loss, trainer._globalstep_last_logged = torch.tensor(6.0), 3
    trainer.state = types.SimpleNamespace(global_step=5)
    got = trainer_syncs.training_step(trainer)
    want = 6.0 / (1 + 5 - 3) if loss != loss or abs(loss) == float("inf") else loss
    assert float(got) == pytest.approx(want)


def test_a_filter_that_is_off_or_a_loop_not_read_stays_as_it_is(tokenizer, dataset, tmp_path, monkeypatch):
    off = sft_trainer("padding_free", tokenizer, dataset, tmp_path, logging_nan_inf_filter=False)
    report = novatune.patch(off)
    assert not report.replaced("trainer_nan_filter") and not off.training_step.nan_filter
    monkeypatch.setattr(trainer_syncs, "FILTER_SOURCE", ("a line no Trainer has",))
    other = sft_trainer("padding_free", tokenizer, dataset, tmp_path)
    report = novatune.patch(other)
    assert not report.replaced("trainer_nan_filter") and other.args.logging_nan_inf_filter
    assert any("not the one novatune has read" in n for n in report.to_dict()["notes"]), report.to_dict()["notes"]


def _counting(monkeypatch, cls, name: str) -> list:
    calls, real = [], getattr(cls, name)

    def counted(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, counted)
    return calls


def test_the_module_walks_run_once_per_step_with_the_same_logged_values(tokenizer, dataset, tmp_path, monkeypatch):
    """model.train() and the FLOP count's parameter walk ran on every micro-batch; patched, on the first micro-batch
    of each optimizer step, and the logged losses and total_flos are stock's."""
    import transformers

    walks = _counting(monkeypatch, transformers.PreTrainedModel, "train")
    counts = _counting(monkeypatch, transformers.PreTrainedModel, "num_parameters")
    stock = sft_trainer("padding_free", tokenizer, dataset, tmp_path, gradient_accumulation_steps=3)
    stock_losses = _logged_losses(stock)
    micro_batches = 3 * stock.state.global_step
    assert len(walks) >= micro_batches and len(counts) >= micro_batches  # the yardstick
    trainer = sft_trainer("padding_free", tokenizer, dataset, tmp_path, gradient_accumulation_steps=3)
    report = novatune.patch(trainer)
    assert report.replaced("trainer_host_work"), str(report)
    walks.clear(), counts.clear()
    patched_losses = _logged_losses(trainer)
    steps = trainer.state.global_step
    assert steps == stock.state.global_step and len(walks) <= steps + 2 and len(counts) <= steps + 1, (walks, counts)
    assert patched_losses == pytest.approx(stock_losses, rel=1e-4)
    assert trainer.state.total_flos == stock.state.total_flos > 0
    assert all(m.training for m in trainer.model.modules()) and "train" not in vars(trainer.model)
    report.revert()
    assert "training_step" not in trainer.__dict__ and "floating_point_ops" not in trainer.__dict__


def test_a_model_set_to_eval_inside_a_step_is_walked_again():
    """The walk is skipped only while the model is still in training mode; eval() inside the step is the real one."""
    class Base:
        def training_step(self, model, inputs, num_items_in_batch=None):
            model.train()
            return torch.tensor(1.0)

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout())
    trainer = Base()
    trainer.state = types.SimpleNamespace(global_step=0)
    step = trainer_syncs.TrainingStep(trainer, nan_filter=False)
    step(model, {})
    model[1].eval()  # a submodule, mid-step: the root still trains, so the walk stays skipped until the next step
    step(model, {})
    assert not model[1].training
    trainer.state.global_step = 1
    step(model, {})
    assert model[1].training
    model.eval()
    step(model, {})
    assert model[1].training and "train" not in vars(model)


def test_eval_then_train_inside_a_skipped_step_is_the_real_walk():
    """An RL trainer generates inside training_step: model.eval(), then model.train(). On a micro-batch whose walk
    is skipped, both are the real walks (the model trains in training mode afterwards)."""
    class Generating:
        def training_step(self, model, inputs, num_items_in_batch=None):
            model.train()
            model.eval()
            seen.append((model.training, model[1].training))
            model.train()
            seen.append((model.training, model[1].training))
            return torch.tensor(1.0)

    seen = []
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout())
    trainer = Generating()
    trainer.state = types.SimpleNamespace(global_step=0)
    step = trainer_syncs.TrainingStep(trainer, nan_filter=False)
    step(model, {})
    step(model, {})  # the second micro-batch of step 0: its first train() is skipped
    assert seen == [(False, False), (True, True)] * 2 and "train" not in vars(model)


def test_objects_alive_after_the_first_step_are_frozen_until_train_ends(tokenizer, dataset, tmp_path):
    """The garbage collector's full walks skip what lives for the whole run: frozen at the end of the first optimizer
    step (not before: the first step creates the optimizer state), unfrozen when train() ends; the logged losses
    are the same; revert removes the callback."""
    import gc

    import transformers

    seen = []

    class Watch(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append((state.global_step, gc.get_freeze_count()))

    stock = _logged_losses(sft_trainer("padding_free", tokenizer, dataset, tmp_path))
    trainer = sft_trainer("padding_free", tokenizer, dataset, tmp_path)
    report = novatune.patch(trainer)
    assert "trainer_host_work: objects alive after the first optimizer step are frozen" in str(
        report.to_dict()["implementations"]), str(report)
    trainer.add_callback(Watch())  # after novatune's: sees the freeze of the step it observes
    assert gc.get_freeze_count() == 0
    try:
        patched = _logged_losses(trainer)
    finally:
        frozen_after = gc.get_freeze_count()
        gc.unfreeze()  # a failure must not leave the freeze to the later tests of this process
    assert patched == pytest.approx(stock, rel=1e-4)
    assert len(seen) >= 2 and seen[0][1] > 0 and all(count > 0 for _, count in seen), seen
    assert frozen_after == 0  # handed back at the end of train()
    novatune.patch(trainer)  # a second patch adds no second callback
    assert sum(type(c).__name__ == "GcFreeze" for c in trainer.callback_handler.callbacks) == 1
    report.revert()
    assert not any(type(c).__name__ == "GcFreeze" for c in trainer.callback_handler.callbacks)


def test_a_freeze_made_before_training_is_left_as_it_was():
    import gc

    callback = trainer_syncs.GcFreeze()
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        callback.on_train_begin(None, None, None)
        callback.on_step_end(None, None, None)
        callback.on_train_end(None, None, None)
        assert gc.get_freeze_count() >= before > 0
        assert callback.on_evaluate(None, None, None) is None  # every other event does nothing
    finally:
        gc.unfreeze()


def test_a_train_that_raises_after_the_freeze_hands_it_back(tokenizer, dataset, tmp_path):
    """on_train_end never fires when train() raises (out of memory, Ctrl-C): the wrapped train() unfreezes anyway,
    so the dead trainer's reference cycles can still be collected; revert restores train() even after the user
    removed the callback."""
    import gc

    import transformers

    class Boom(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                assert gc.get_freeze_count() > 0  # frozen at the end of step 1
                raise RuntimeError("boom")

    trainer = sft_trainer("padding_free", tokenizer, dataset, tmp_path)
    report = novatune.patch(trainer)
    trainer.add_callback(Boom())
    try:
        with pytest.raises(RuntimeError, match="boom"):
            trainer.train()
        assert gc.get_freeze_count() == 0
        trainer.pop_callback(trainer_syncs.GcFreeze)  # the user took it out
        report.revert()
        assert "train" not in vars(trainer)
    finally:
        gc.unfreeze()


def test_a_train_that_raised_leaves_no_freeze_behind_the_next_one():
    import gc

    callback = trainer_syncs.GcFreeze()
    try:
        callback.on_train_begin(None, None, None)
        callback.on_step_end(None, None, None)
        assert gc.get_freeze_count() > 0  # ... and train() raised outside the wrapper: no on_train_end
        callback.on_train_begin(None, None, None)
        assert gc.get_freeze_count() == 0
        callback.on_step_end(None, None, None)
        callback.on_train_end(None, None, None)
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
