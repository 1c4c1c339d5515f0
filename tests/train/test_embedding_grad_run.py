"""memory.embedding_grad through the run: the config check that names the fix, the plan without the table's
gradient during the forwards (the rows instead), and the run builder: rows train exactly as the dense gradient
does, a step abandoned halfway leaves no rows behind, a table it cannot serve stays dense under auto and stops the
run under rows, with the reason."""
from __future__ import annotations

import pytest
import torch

from novatune.memory import embedding_grad as eg
from novatune.train.config import ConfigError
from novatune.train.errors import SetupError
from tests.train.conftest import TINY_ARCH


def test_rows_under_a_parallel_strategy_is_refused_with_the_fix(make_cfg):
    with pytest.raises(ConfigError, match="memory.embedding_grad: auto or dense"):
        make_cfg(memory={"embedding_grad": "rows"}, parallel={"strategy": "ddp"})


def test_the_plan_counts_no_table_gradient_during_the_forwards(make_cfg):
    from novatune.train.plan import plan, render

    def est(mode, grad_accum=2, tied=False):
        cfg = make_cfg(memory={"embedding_grad": mode}, train={"grad_accum": grad_accum}, model={
            "device": "cuda", "dtype": "bf16",
            "arch_overrides": {**TINY_ARCH, "tie_word_embeddings": tied, "vocab_size": 8192}})
        return plan(cfg, gpu_mem_gib=80)

    dense, rows = est("dense"), est("auto")
    saved = rows["embedding_grad_rows"]
    cfg = make_cfg()
    tokens = cfg.train.micro_batch * cfg.data.max_length
    vocab = rows["vocab_size"]
    table, kept = vocab * TINY_ARCH["hidden_size"] * 2, 1 * tokens * (TINY_ARCH["hidden_size"] * 2 + 8)
    assert "embedding_grad_rows" not in dense and saved == table - kept  # the table's gradient less the rows
    assert rows["gradients"] == dense["gradients"]  # the step still ends with the whole gradient
    assert dense["memory_plan"].peak_bytes - rows["memory_plan"].peak_bytes == saved
    assert "as rows until a step's last backward" in render(rows) and "as rows" not in render(dense)
    assert "embedding_grad_rows" not in est("auto", grad_accum=1)  # one micro-step: nothing to keep apart
    assert "embedding_grad_rows" not in est("rows", grad_accum=1)
    assert "embedding_grad_rows" not in est("auto", tied=True)  # lm_head's gradient fills the table anyway
    # auto keeps rows only while a step's rows stay under half the table's: many micro-steps of long rows not
    assert "embedding_grad_rows" not in est("auto", grad_accum=vocab // tokens + 2)


def _losses_and_grad(make_cfg, name, mode, **sections):
    from novatune.train.session import build

    untied = {"arch_overrides": {**TINY_ARCH, "tie_word_embeddings": False}}
    cfg = make_cfg(name, memory={"embedding_grad": mode}, model=untied, **sections)
    s = build(cfg)
    installed = eg.state_of(s.inner_model) is not None
    losses = []
    for _ in range(3):
        out = s.forward_backward(s.next_micro_batches())
        losses.append(out.loss.item())
        grad = s.inner_model.get_input_embeddings().weight.grad.clone()
        s.apply_update()
    weights = {n: p.detach().clone() for n, p in s.inner_model.named_parameters()}
    return installed, losses, grad, weights


def test_rows_train_exactly_as_dense_through_the_run_builder(make_cfg):
    on, losses_rows, grad_rows, w_rows = _losses_and_grad(make_cfg, "rows", "rows")
    off, losses_dense, grad_dense, w_dense = _losses_and_grad(make_cfg, "dense", "dense")
    assert on and not off
    assert losses_rows == losses_dense
    assert torch.equal(grad_rows, grad_dense)
    for n in w_dense:
        assert torch.equal(w_rows[n], w_dense[n]), n


def test_a_table_it_cannot_serve_stays_dense_under_auto_and_stops_rows(make_cfg, capsys):
    from rich.console import Console

    from novatune.train.session import build

    tied = {"arch_overrides": {**TINY_ARCH, "tie_word_embeddings": True, "vocab_size": 8192}}  # auto: rows fit
    s = build(make_cfg("tied", memory={"embedding_grad": "auto"}, model=tied), console=Console(width=400))
    assert eg.state_of(s.inner_model) is None
    assert "gradient stays dense (the input embedding is tied to lm_head" in capsys.readouterr().out
    with pytest.raises(SetupError, match="tied to lm_head.*memory.embedding_grad: auto or dense"):
        build(make_cfg("tied_rows", memory={"embedding_grad": "rows"}, model=tied))


def test_a_step_abandoned_before_its_last_backward_leaves_no_rows_behind(make_cfg):
    from novatune.train.session import build

    s = build(make_cfg("abandon", memory={"embedding_grad": "rows"},
                       model={"arch_overrides": {**TINY_ARCH, "tie_word_embeddings": False}}))
    state = eg.state_of(s.inner_model)
    mbs = s.next_micro_batches()
    with eg.micro_step(s.inner_model, last=False):  # a micro-step whose step then fails
        out = s.model(**{k: mbs[0][k] for k in ("input_ids", "labels")}, use_cache=False)
    out.loss.backward()
    assert len(state.pending) == 1
    s.optimizer.zero_grad(set_to_none=True)  # the other gradients go as after any step; the rows stay
    assert len(state.pending) == 1
    ref = _dense_step_grad(make_cfg, mbs)
    s.forward_backward(mbs)  # the next step drops them first
    assert not state.pending
    assert torch.equal(s.inner_model.get_input_embeddings().weight.grad, ref)


def _dense_step_grad(make_cfg, mbs):
    from novatune.train.session import build

    s = build(make_cfg("abandon_ref", memory={"embedding_grad": "dense"},
                       model={"arch_overrides": {**TINY_ARCH, "tie_word_embeddings": False}}))
    s.forward_backward(mbs)
    return s.inner_model.get_input_embeddings().weight.grad.clone()


def test_lora_and_one_micro_step_leave_the_gradient_to_autograd(make_cfg):
    from novatune.train.session import build

    untied = {"arch_overrides": {**TINY_ARCH, "tie_word_embeddings": False}}
    for name, sections in (("lora", {"method": {"type": "lora"}}), ("ga1", {"train": {"grad_accum": 1}})):
        s = build(make_cfg(name, memory={"embedding_grad": "auto"}, model=untied, **sections))
        assert eg.state_of(s.inner_model) is None, name
