"""PEFT LoRA on the routed experts (LoraConfig.target_parameters) and on attention, patched: the adapters run
inside the grouped GEMMs (novatune/patch/moe_lora.py) and the model computes what PEFT's stock forward computes
(its ParamWrapper forms W + s * B A per forward) - loss and every gradient, adapters included - on packed rows.

Stock here is PEFT over the stock HF model. Qwen3-MoE and Mixtral detect packed rows from position_ids, so stock
runs the packed batch; HF's GPT-OSS does not (its packed documents attend to each other), so its truth is stock
run one document at a time (tests/patch/test_gpt_oss.py).
Tolerance: fp32 end to end, as tests/patch/test_moe_patch.py (2e-5): the adapter as two thin GEMMs instead of a
folded weight changes the summation order only (measured ~1e-6).
"""
import pytest
import torch
from test_gpt_oss import packed_loss_and_grads, stock_per_document
from tiny_models import packed_batch, tiny_gpt_oss, tiny_model

import novatune
from novatune.measure.numerics import assert_close

peft = pytest.importorskip("peft")
TOL = 2e-5
ROWS = [[5, 17, 1, 9], [32]]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _peft_model(family, targets=EXPERTS, seed=0, r=4):
    model = (tiny_gpt_oss(seed) if family == "gpt_oss" else tiny_model(family, seed)).train()
    cfg = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj"], target_parameters=targets)
    pm = peft.get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero: make the adapters change the result
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return pm


def _truth(family, pm, ids, pos, lab):
    if family == "gpt_oss":
        return stock_per_document(pm, ids, pos, lab)
    return packed_loss_and_grads(pm, ids, pos, lab)


def _assert_same(loss, grads, loss_ref, grads_ref):
    assert_close(loss, loss_ref, TOL, "loss")
    assert grads.keys() == grads_ref.keys()
    for name in grads_ref:
        assert_close(grads[name], grads_ref[name], TOL, name)
    assert sum("experts" in n and "lora_A" in n for n in grads) >= 2, "the expert adapters must get gradients"


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_lora_on_experts_equals_peft_stock(family, monkeypatch):
    ids, pos, lab = packed_batch(ROWS)
    pm = _peft_model(family)
    loss_ref, grads_ref = _truth(family, pm, ids, pos, lab)
    report = novatune.patch(pm)
    sparse = len(report.replaced("moe_experts"))
    assert sparse >= 2 and len(report.replaced("moe_lora")) == sparse and not report.skipped("moe_lora")
    assert not [e for e in report.skipped("lora") if "experts" in e.path]
    # the patched forward never forms PEFT's delta weight (its parametrization would call these)
    from peft.tuners.lora.layer import ParamWrapper

    def formed(*a, **k):
        raise AssertionError("PEFT's delta weight was formed")
    monkeypatch.setattr(ParamWrapper, "get_delta_factors", formed)
    monkeypatch.setattr(ParamWrapper, "get_delta_weight", formed)
    loss, grads = packed_loss_and_grads(pm, ids, pos, lab)
    _assert_same(loss, grads, loss_ref, grads_ref)
    monkeypatch.undo()
    report.revert()
    assert not any("forward" in m.__dict__ for m in pm.modules())


def test_one_targeted_expert_weight_gradient_checkpointing_and_rank_per_layer():
    """Only the down weights adapted; checkpointed layers recompute the same adapted forward."""
    ids, pos, lab = packed_batch(ROWS)
    pm = _peft_model("qwen3_moe", targets=["mlp.experts.down_proj"], r=3)
    loss_ref, grads_ref = packed_loss_and_grads(pm, ids, pos, lab)
    report = novatune.patch(pm)
    assert all("down_proj r=3" in e.detail and "gate_up" not in e.detail for e in report.replaced("moe_lora"))
    pm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    loss, grads = packed_loss_and_grads(pm, ids, pos, lab)
    assert_close(loss, loss_ref, TOL, "loss")
    for name in grads_ref:
        assert_close(grads[name], grads_ref[name], TOL, name)


def test_disabled_adapters_run_peft_forward_per_call():
    """With the adapters disabled the call runs PEFT's forward (the base experts), as PEFT would."""
    ids, pos, lab = packed_batch(ROWS)
    pm = _peft_model("mixtral")

    def loss():
        with torch.no_grad():
            return pm(input_ids=ids, position_ids=pos, labels=lab).loss

    with pm.disable_adapter():
        base_ref = loss()
    novatune.patch(pm)
    with pm.disable_adapter():
        base = loss()
    adapted = loss()
    assert_close(base, base_ref, TOL, "loss without adapters")
    assert abs(float(adapted - base)) > 1e-4, "the adapters must change the loss, or the test proves nothing"


def test_refusals_name_the_reason():
    """moe=False keeps the stock experts (so PEFT's forward stays); lora=False keeps every adapter PEFT's; a
    second active adapter is refused."""
    pm = _peft_model("qwen3_moe")
    report = novatune.patch(pm, moe=False)
    assert not report.replaced("moe_lora")
    assert all("stock forward" in e.detail for e in report.skipped("moe_lora"))
    report.revert()
    report = novatune.patch(pm, lora=False)
    assert {e.detail for e in report.skipped("moe_lora")} == {"lora=False"}
    report.revert()
    wrapper = pm.base_model.model.model.layers[0].mlp.experts
    wrapper._active_adapter = ["default", "other"]
    report = novatune.patch(pm)
    assert "2 active adapters" in report.skipped("moe_lora")[0].detail
    assert len(report.replaced("moe_lora")) == 1
