"""A patched Trainer's packed batches carry their document offsets from the collator's CPU tensors, so the model
call builds its PackedBatch without a device-to-host copy (novatune/patch/host_offsets.py)."""
import sys

import pytest
import torch
from test_trainers import assert_losses_match, sft_trainer, train_recording_losses

import novatune
from novatune.attention.packed import PackedBatch
from novatune.patch.host_offsets import HOST_OFFSETS_KWARG, HostOffsets, HostOffsetsCollator, host_offsets_of


@pytest.mark.parametrize("mode", ["packing", "padding_free"])
def test_packed_trainer_batches_build_their_offsets_on_the_host(mode, tokenizer, dataset, tmp_path, monkeypatch):
    stock = train_recording_losses(sft_trainer(mode, tokenizer, dataset, tmp_path))
    trainer = sft_trainer(mode, tokenizer, dataset, tmp_path)
    report = novatune.patch(trainer)
    assert report.replaced("host_offsets"), str(report)
    seen = []
    real_packed = HostOffsets.packed
    monkeypatch.setattr(HostOffsets, "packed", lambda self, *a: seen.append(self) or real_packed(self, *a))

    real_from_kwargs = PackedBatch.from_kwargs.__func__

    def from_kwargs(cls, *args, **kwargs):  # the collator may read its CPU batch; the model call may not
        caller = sys._getframe(1).f_globals["__name__"]
        assert caller != "novatune.patch.forwards", "the model call read its offsets from the device batch"
        return real_from_kwargs(cls, *args, **kwargs)

    monkeypatch.setattr(PackedBatch, "from_kwargs", classmethod(from_kwargs))
    patched = train_recording_losses(trainer)
    assert_losses_match(patched, stock)
    assert len(seen) == 4, "one PackedBatch per micro-step, from the collator's offsets"
    report.revert()
    assert not isinstance(trainer.data_collator, HostOffsetsCollator)


def test_offsets_equal_the_model_calls_reading_and_refuse_another_shape():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 1, 0, 1, 2, 3, 4, 0, 1]])
    offsets = host_offsets_of({"position_ids": pos, "input_ids": torch.zeros_like(pos)})
    expected = PackedBatch.from_position_ids(pos)
    assert offsets.cu_seqlens == tuple(expected.cu_seqlens_cpu.tolist()) and (offsets.batch, offsets.seq_len) == (2, 9)
    assert offsets.packed(2, 9, torch.device("cpu")).lengths == expected.lengths
    with pytest.raises(ValueError, match="pass the collated batch unchanged"):
        offsets.packed(1, 18, torch.device("cpu"))
    flat = {"input_ids": torch.zeros(1, 9, dtype=torch.long),
            "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]]),
            "cu_seq_lens_q": torch.tensor([0, 4, 9], dtype=torch.int32), "max_length_q": 5}
    assert host_offsets_of(flat).cu_seqlens == (0, 4, 9)  # TRL's own offsets, as the model call reads them


def test_padded_or_device_batches_get_no_offsets():
    pos = torch.arange(6).unsqueeze(0)
    mask = torch.ones_like(pos)
    mask[0, 4:] = 0
    assert host_offsets_of({"input_ids": pos, "position_ids": pos, "attention_mask": mask}) is None  # plain padding
    assert host_offsets_of({"input_ids": pos, "position_ids": pos.to("meta")}) is None
    assert host_offsets_of({"input_ids": pos}) is None  # nothing says the rows are packed
    wrapped = HostOffsetsCollator(lambda features: {"position_ids": pos, "input_ids": pos})
    assert HOST_OFFSETS_KWARG in wrapped([])


@pytest.mark.parametrize("workers", [0, 2])
def test_main_process_collation_is_named_in_the_report(workers, tokenizer, dataset, tmp_path):
    """With dataloader_num_workers=0 the GPU waits while the main process collates each step's batches: the report
    says so and names the setting; with workers it says nothing, and either way the trainer's args stay as set."""
    trainer = sft_trainer("padding_free", tokenizer, dataset, tmp_path)
    trainer.args.dataloader_num_workers = workers
    notes = novatune.patch(trainer).to_dict()["notes"]
    named = [n for n in notes if "dataloader_num_workers" in n]
    assert len(named) == (1 if workers == 0 else 0), notes
    assert trainer.args.dataloader_num_workers == workers
