"""novatune.patch on tiny sparse-MoE models (Qwen3-MoE, Mixtral): what it replaces, revert, and that the patched
model computes what stock computes on packed rows - loss, every gradient, the router (load-balancing) loss - and
what each document alone computes (no attention across documents).

Tolerance: fp32 end to end; the patched path differs from stock in summation order only (grouped GEMMs vs per
expert GEMMs, fp32 combine vs HF's sum over k): ~1e-6 relative, 2e-5 leaves room through 2-3 layers and the
backward (as tests/patch/test_patch.py)."""
import pytest
import torch
from tiny_models import MOE_FAMILIES, packed_batch, tiny_model

import novatune
from novatune.measure.numerics import assert_close

TOL = 2e-5
ROWS = [[5, 17, 1, 9], [32]]  # several documents (one of length 1) and one whole-row document


def _step(model, ids, pos, lab, **kw):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, position_ids=pos, labels=lab, **kw)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def _assert_same(got, ref, grads, grads_ref):
    assert_close(got.loss, ref.loss, TOL, "loss")
    assert grads.keys() == grads_ref.keys()
    for name in grads_ref:
        assert_close(grads[name], grads_ref[name], TOL, name)


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_moe_report_counts_and_revert(family):
    model = tiny_model(family)
    keys = list(model.state_dict())
    report = novatune.patch(model)
    sparse = sum(1 for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    assert sparse >= 2
    assert len(report.replaced("moe_router")) == sparse
    assert len(report.replaced("moe_experts")) == sparse
    assert len(report.replaced("mlp")) == model.config.num_hidden_layers - sparse  # Qwen3-MoE's dense layer
    assert len(report.replaced("attention")) == model.config.num_hidden_layers
    assert len(report.replaced("cross_entropy")) == 1
    assert not report.skipped()
    assert list(model.state_dict()) == keys
    report.revert()
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
@pytest.mark.parametrize("router_logits", [False, True])
def test_moe_patched_equals_stock(family, router_logits):
    """Loss and every gradient, with and without the router loss (which then reaches the router weights)."""
    ids, pos, lab = packed_batch(ROWS)
    model = tiny_model(family).train()
    ref, grads_ref = _step(model, ids, pos, lab, output_router_logits=router_logits)
    report = novatune.patch(model)
    got, grads = _step(model, ids, pos, lab, output_router_logits=router_logits)
    _assert_same(got, ref, grads, grads_ref)
    if router_logits:
        assert ref.aux_loss is not None and got.aux_loss is not None
        assert_close(got.aux_loss, ref.aux_loss, TOL, "aux loss")
        assert len(got.router_logits) == len(ref.router_logits)
        for a, b in zip(got.router_logits, ref.router_logits):
            assert_close(a, b, TOL, "router logits")
    report.revert()
    back, _ = _step(model, ids, pos, lab, output_router_logits=router_logits)
    assert torch.equal(back.loss, ref.loss), "after revert the model is stock again, bit for bit"


def test_moe_router_loss_from_config_and_gradient_checkpointing():
    """config.output_router_logits=True (no call flag) adds the router loss as stock does; checkpointed layers
    recompute the same routing in the backward."""
    ids, pos, lab = packed_batch(ROWS)
    model = tiny_model("qwen3_moe", output_router_logits=True).train()
    ref, grads_ref = _step(model, ids, pos, lab)
    assert ref.aux_loss is not None
    novatune.patch(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    got, grads = _step(model, ids, pos, lab)
    _assert_same(got, ref, grads, grads_ref)


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_moe_packed_rows_equal_each_document_alone(family):
    """Each document of a packed row gives the logits the stock model gives that document alone (the per-document
    reference: stock attention on one document cannot see another)."""
    ids, pos, _ = packed_batch([[7, 11, 14]])
    model = tiny_model(family).train()
    starts = [0, 7, 18, 32]
    with torch.no_grad():
        ref = torch.cat([model(input_ids=ids[:, a:b]).logits for a, b in zip(starts, starts[1:])], dim=1)
    novatune.patch(model)
    with torch.no_grad():
        got = model(input_ids=ids, position_ids=pos).logits
    assert_close(got, ref, TOL, "logits")


def test_moe_refusals_name_the_reason():
    """An experts module the op cannot honour (expert parallelism, a post-expert norm) is skipped with the reason;
    moe=False keeps every MoE module stock."""
    model = tiny_model("mixtral")
    experts = model.model.layers[0].mlp.experts
    experts._is_expert_parallel = True
    report = novatune.patch(model)
    assert "expert parallelism" in report.skipped("moe_experts")[0].detail
    assert len(report.replaced("moe_experts")) == model.config.num_hidden_layers - 1
    report.revert()
    report = novatune.patch(tiny_model("qwen3_moe"), moe=False)
    assert not report.replaced("moe_experts") and not report.replaced("moe_router")
    assert {e.detail for e in report.skipped("moe_experts")} == {"moe=False"}


def test_mixtral_router_jitter_stays_the_stock_blocks():
    """Mixtral's router jitter (training only) lives in the stock block forward, which the patch keeps: with the
    same random state the patched model draws the same noise and equals stock; the noise changes the result."""
    ids, pos, lab = packed_batch(ROWS)
    model = tiny_model("mixtral", router_jitter_noise=0.1).train()
    torch.manual_seed(5)
    ref, grads_ref = _step(model, ids, pos, lab)
    novatune.patch(model)
    torch.manual_seed(5)
    got, grads = _step(model, ids, pos, lab)
    _assert_same(got, ref, grads, grads_ref)
    torch.manual_seed(6)
    other, _ = _step(model, ids, pos, lab)
    assert not torch.equal(other.loss, got.loss), "the jitter must change the result, or the test proves nothing"
