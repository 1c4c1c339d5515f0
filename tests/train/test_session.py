"""The run builder (train/session.py): the trainer, bench, proof and eval all step the model through it."""
from __future__ import annotations

import pytest
import torch

from novatune.train.loop import train
from novatune.train.session import build


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_session_steps_give_the_trainers_losses(make_cfg):
    """build() + step() is the trainer's step: the same seed gives bit-identical per-step losses and weights."""
    cfg = make_cfg("loop")
    res = train(cfg)
    session = build(make_cfg("session"))
    losses = [float(session.step(session.next_micro_batches()).loss) for _ in range(session.total_steps)]
    assert losses == [res.losses[s] for s in sorted(res.losses)]
    after = _params(session.model)
    for name, p in res.model.named_parameters():
        assert torch.equal(p.detach(), after[name]), name
    assert session.optimizer.state and not res.session.optimizer.state  # a finished run frees the AdamW moments


def test_forward_backward_then_skip_update_leaves_the_run_unchanged(make_cfg):
    """The seam for a non-finite check: forward_backward() changes no weight; skip_update() drops the gradients
    without touching weights or optimizer state and advances the schedule (a skipped step counts);
    apply_update() then changes the weights."""
    session = build(make_cfg())
    before = _params(session.model)
    out = session.forward_backward(session.next_micro_batches())
    assert out.loss.ndim == 0 and out.grad_norm.ndim == 0 and torch.isfinite(out.loss)
    assert all(p.grad is not None for p in session.params)
    assert all(torch.equal(p, before[n]) for n, p in session.model.named_parameters())
    session.skip_update()
    assert all(p.grad is None for p in session.params)
    assert session.scheduler.last_epoch == 1 and not session.optimizer.state
    assert all(torch.equal(p, before[n]) for n, p in session.model.named_parameters())
    session.step(session.next_micro_batches())
    assert session.scheduler.last_epoch == 2
    assert any(not torch.equal(p, before[n]) for n, p in session.model.named_parameters())


@pytest.mark.parametrize("kernel", ["novatune", "torch"])
def test_only_the_steps_last_backward_records_final_gradient_squares(kernel, make_cfg, monkeypatch):
    """With novatune's AdamW (whose clipping norm reads the gradients right after the last backward) that backward,
    and only it, runs under grad_norm.final_gradient_squares; with torch's optimizer none does."""
    import contextlib

    from novatune.train import session as S

    entered = []

    def recording():
        entered.append(1)
        return contextlib.nullcontext()

    monkeypatch.setattr(S, "final_gradient_squares", recording)
    session = build(make_cfg(train={"adamw_kernel": kernel}))
    session.forward_backward(session.next_micro_batches())  # grad_accum 2: two backwards
    assert len(entered) == (1 if kernel == "novatune" else 0)


def test_hooks_run_before_the_model_and_before_the_optimizer(make_cfg):
    seen = []
    session = build(make_cfg(), before_model=lambda conf: seen.append(("before", conf.model_type)),
                    model_hook=lambda m: seen.append(("model", type(m).__name__)))
    assert seen == [("before", "qwen3"), ("model", type(session.model).__name__)]


def test_batches_are_the_streams_next_steps(make_cfg):
    a, b = build(make_cfg("a")), build(make_cfg("b"))
    ahead = a.batches(2)
    assert len(ahead) == 2 and all(len(mbs) == a.cfg.train.grad_accum for mbs in ahead)
    for mbs in ahead:
        for x, y in zip(mbs, b.next_micro_batches()):
            assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["cu_seqlens"], y["cu_seqlens"])
    assert a.flops_per_token(10.0) > 0


def test_rows_are_padded_to_max_length_where_lora_layers_run_as_cuda_graphs(make_cfg):
    """data.pad_rows auto: LoRA/QLoRA with novatune's layer graphs get one batch shape (max_length); full
    fine-tuning, graphs off, LoRA dropout (eager layers) or no packing keep each batch at its longest row. The
    padding changes no loss."""
    from novatune.train.session import row_padding

    lora = {"type": "lora", "r": 4}
    assert row_padding(make_cfg(model={"patch": True}, method=lora)) == 128
    assert row_padding(make_cfg(model={"patch": True})) is None
    assert row_padding(make_cfg(model={"patch": True, "patch_options": {"cuda_graphs": False}}, method=lora)) is None
    assert row_padding(make_cfg(model={"patch": True}, method=lora, data={"packing": False})) is None
    assert row_padding(make_cfg(model={"patch": True}, method={**lora, "dropout": 0.1})) is None  # eager layers
    assert row_padding(make_cfg(data={"pad_rows": "max_length"})) == 128
    # full fine-tuning asks for graphs only explicitly, and they take recomputed layers on a GPU
    forward = {"patch": True, "patch_options": {"cuda_graphs": "forward"}}
    assert row_padding(make_cfg(model=forward, memory={"gradient_checkpointing": True})) is None  # the CPU
    if torch.cuda.is_available():
        gpu = {**forward, "device": "cuda"}
        assert row_padding(make_cfg(model=gpu, memory={"gradient_checkpointing": True})) == 128
        assert row_padding(make_cfg(model=gpu, memory={"policy": "none"})) is None

    def losses(pad_rows):
        s = build(make_cfg(pad_rows, data={"pad_rows": pad_rows}))
        shapes = {tuple(mb["input_ids"].shape) for mb in s.batches(2)[0]}
        s = build(make_cfg(pad_rows + "2", data={"pad_rows": pad_rows}))
        return [float(s.step(s.next_micro_batches()).loss) for _ in range(3)], shapes

    (longest, _), (fixed, shapes) = losses("longest"), losses("max_length")
    assert shapes == {(2, 128)}
    assert fixed == pytest.approx(longest, rel=1e-5, abs=1e-6)  # fp32: the same sums over other row lengths


def test_stock_gpt_oss_on_packed_rows_is_warned_about(make_cfg):
    """Stock GPT-OSS builds its mask without the documents' position_ids: packed documents attend to each other.
    Its stock runs on packed rows say so; patched runs, unpacked data and other families say nothing."""
    from types import SimpleNamespace

    from novatune.train.session import stock_packing_crosses_documents

    gpt_oss, qwen3 = SimpleNamespace(model_type="gpt_oss"), SimpleNamespace(model_type="qwen3")
    stock, unpacked = make_cfg("s", model={"patch": False}), make_cfg("u", model={"patch": False},
                                                                       data={"packing": False})
    warning = stock_packing_crosses_documents(stock, None, gpt_oss)
    assert "packed documents attend to each other" in warning and "model.patch: true" in warning
    patched = SimpleNamespace(replaced=lambda kind: ["layer"], skipped=lambda kind: [])
    assert stock_packing_crosses_documents(stock, patched, gpt_oss) is None  # every layer: novatune's attention
    attention_off = SimpleNamespace(replaced=lambda kind: [], skipped=lambda kind: ["layer"])
    assert "not applied to every layer" in stock_packing_crosses_documents(stock, attention_off, gpt_oss)
    assert stock_packing_crosses_documents(unpacked, None, gpt_oss) is None
    assert stock_packing_crosses_documents(stock, None, qwen3) is None


def test_an_epoch_ends_with_a_short_step_and_trains_each_row_once(make_cfg):
    """train.epochs without max_steps: each epoch is ceil(micro-batches / grad_accum) steps, the last one holding
    what is left of the epoch (HF Trainer's count), so no row of the next epoch joins it and a one-epoch run
    trains every row exactly once. Before, the last step filled up with the next epoch's first rows."""
    session = build(make_cfg(train={"max_steps": None, "epochs": 2, "micro_batch": 1, "grad_accum": 4}))
    rows = len(session.stream.rows)
    per_epoch = -(-rows // 4)
    assert rows % 4 and session.total_steps == 2 * per_epoch  # a short last step exists
    seen, sizes = [], []
    for _ in range(session.total_steps):
        mbs = session.next_micro_batches()
        sizes.append(len(mbs))
        seen += [mb["input_ids"][0].tolist() for mb in mbs]
    assert sizes == ([4] * (per_epoch - 1) + [rows % 4]) * 2
    first, second = seen[:rows], seen[rows:]
    assert len(first) == len(second) == rows
    assert len({tuple(r) for r in first}) == len({tuple(r) for r in second}) == rows  # each epoch: every row once
