"""patch(model)'s dense projections (novatune.ops.linear): over accumulated micro-batches every weight's gradient
equals stock's, the GEMM adds into .grad from the second micro-batch on, and linear_wgrad_in_place=False keeps the
modules' own calls (fp32 on the CPU)."""
from __future__ import annotations

import pytest

import novatune
import novatune.ops.linear as L
from novatune.measure.numerics import assert_close
from tests.patch.tiny_models import packed_batch, tiny_model, tiny_olmo2


def _tiny(family: str):
    return tiny_olmo2() if family == "olmo2" else tiny_model(family)


def _accumulate(model, batches):
    for ids, pos, lab in batches:
        model(input_ids=ids, position_ids=pos, labels=lab).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["qwen3", "llama", "olmo2"])
def test_accumulated_gradients_equal_stock(family, monkeypatch):
    taken: list[bool] = []
    real = L.accumulates_into_grad
    monkeypatch.setattr(L, "accumulates_into_grad", lambda p: taken.append(real(p)) or taken[-1])
    batches = [packed_batch([[9, 14], [23]], seed=s) for s in range(3)]
    stock = _tiny(family).train()
    ours = _tiny(family).train()
    # OLMo 2 takes it by default (auto); the others when asked
    report = novatune.patch(ours) if family == "olmo2" else novatune.patch(ours, linear_wgrad_in_place=True)
    assert "weight gradients accumulated inside the GEMMs" in str(report)
    want, got = _accumulate(stock, batches), _accumulate(ours, batches)
    assert want.keys() == got.keys()
    for name in want:
        assert_close(got[name], want[name], name=name)  # fp32's tolerance: the patched kernels round elsewhere
    layers = ours.config.num_hidden_layers
    per_micro_batch = 7 * layers  # q, k, v, o, gate, up, down
    assert len(taken) == 3 * per_micro_batch
    assert not any(taken[:per_micro_batch]) and all(taken[per_micro_batch:])


def test_auto_takes_it_where_a_post_norm_reads_the_mlp_output():
    """auto: on for OLMo 2 (its post-norm reads the down projection's output, so the recompute runs that GEMM
    anyway), off where the checkpoint would stop before it (Qwen3)."""
    for family, on in (("olmo2", True), ("qwen3", False)):
        model = _tiny(family).train()
        report = novatune.patch(model)
        assert ("weight gradients accumulated inside the GEMMs" in str(report)) is on, family
        assert model.model.layers[0].self_attn._novatune_linear_wgrad is on
    with pytest.raises(ValueError, match="linear_wgrad_in_place"):
        novatune.patch(tiny_model("qwen3"), linear_wgrad_in_place="yes")


def test_off_calls_the_modules(monkeypatch):
    calls: list = []
    monkeypatch.setattr(L, "linear", lambda *a: calls.append(1))
    model = tiny_model("qwen3").train()
    report = novatune.patch(model)  # off by default for Qwen3 (auto)
    assert "weight gradients accumulated inside the GEMMs" not in str(report)
    ids, pos, lab = packed_batch([[9, 14]])
    model(input_ids=ids, position_ids=pos, labels=lab).loss.backward()
    assert calls == []
