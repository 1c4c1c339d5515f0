"""GPT-OSS patched on a tiny random-init model: attention sinks, alternating sliding-window layers, YaRN tables at
half the head size, biases and the one-rounding RMSNorm, against the stock model run one document at a time.

HF's eager GPT-OSS attention does not detect packed rows (packed documents attend to each other in stock), so the
ground truth is the stock model on each document alone; the packed patched model must reproduce it. fp32 end to
end: the kernels and references differ from HF only in summation order (~1e-6 relative); 2e-5 leaves room for that
through 2 layers (one sliding, one full), the routing (the same top-k: no logit is within 1e-5 of a tie here) and
the backward.
"""
import warnings

import pytest
import torch
from tiny_models import (
    assert_as_close_as_stock_bf16,
    assert_checkpointing_keeps_gradients,
    packed_batch,
    packed_loss_and_grads,
    stock_per_document,
    tiny_gpt_oss,
)

import novatune
from novatune.measure.numerics import assert_close

TOL = 2e-5
ROWS = [[5, 17, 1, 9], [32]]  # documents longer than the window (5), one of length 1, a one-document row


def test_patched_packed_equals_stock_per_document():
    ids, pos, lab = packed_batch(ROWS)
    model = tiny_gpt_oss().train()
    loss_ref, grads_ref = stock_per_document(model, ids, pos, lab)
    stock_packed, _ = packed_loss_and_grads(model, ids, pos, lab)
    assert abs(float(stock_packed - loss_ref)) > 1e-5, "stock packed rows leak across documents (the known trap)"
    report = novatune.patch(model)
    loss, grads = packed_loss_and_grads(model, ids, pos, lab)
    assert report.calls["cross_entropy"] == 1
    assert_close(loss, loss_ref, TOL, "loss")
    assert grads.keys() == grads_ref.keys()
    for name in grads_ref:  # sinks, attention biases, norms, router and experts included
        assert_close(grads[name], grads_ref[name], TOL, name)
    assert any(n.endswith("sinks") for n in grads) and any("q_proj.bias" in n for n in grads)
    report.revert()
    loss_back, _ = packed_loss_and_grads(model, ids, pos, lab)
    assert torch.equal(loss_back, stock_packed), "after revert the model is stock again, bit for bit"


def test_report_lists_sinks_windows_and_the_moe_block():
    model = tiny_gpt_oss()
    layers = model.config.num_hidden_layers
    keys = list(model.state_dict())
    report = novatune.patch(model)
    assert report.family == "gpt_oss"
    attn = report.replaced("attention")
    assert len(attn) == layers and all("attention sinks" in e.detail for e in attn)
    assert sum("sliding window 5" in e.detail for e in attn) == layers // 2
    assert len(report.replaced("rms_norm")) == 2 * layers + 1
    assert len(report.replaced("cross_entropy")) == 1
    assert len(report.replaced("moe_router")) == layers and len(report.replaced("moe_experts")) == layers
    assert all("gpt_oss GLU" in e.detail for e in report.replaced("moe_experts"))
    assert not report.replaced("mlp")
    assert list(model.state_dict()) == keys
    report.revert()
    assert "forward" not in model.model.layers[0].self_attn.__dict__


@pytest.mark.parametrize("backend", ["flex", "sdpa"])
def test_backend_without_sinks_refuses_the_attention(backend):
    report = novatune.patch(tiny_gpt_oss(), attention=backend)
    assert not report.replaced("attention")
    skipped = report.skipped("attention")
    assert len(skipped) == 2 and all("sinks" in e.detail and backend in e.detail for e in skipped)


def test_sink_capable_backends_are_accepted():
    """On the CPU "auto" already runs the reference backend (the stock-equality test above); naming it, or varlen
    (which a CPU call then refuses at run time with the reason), patches every attention."""
    for backend in ("reference", "varlen"):
        report = novatune.patch(tiny_gpt_oss(), attention=backend)
        assert len(report.replaced("attention")) == 2 and not report.skipped("attention")


def test_router_aux_loss_is_added_as_stock_adds_it():
    """output_router_logits, in the config or in a call, adds the load-balancing loss: the fused loss forward adds
    the family's own load_balancing_loss_func on the patched router's logits, so loss and aux loss equal stock's.
    TRL's fused head returns it as `aux_loss` (the trainer adds coef x aux_loss) and adds the weighted one to
    `loss`, as TRL's own fused head does."""
    ids, pos, lab = packed_batch([[32]])  # one document per row: stock attention is exact here
    for where in ("config", "call"):
        model = tiny_gpt_oss().train()
        kw = {"output_router_logits": True} if where == "call" else {}
        model.config.output_router_logits = where == "config"
        ref = model(input_ids=ids, position_ids=pos, labels=lab, **kw)
        report = novatune.patch(model)
        assert report.replaced("cross_entropy"), where
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no bypassed fused loss
            out = model(input_ids=ids, position_ids=pos, labels=lab, **kw)
        assert out.aux_loss is not None and float(out.aux_loss.detach()) > 0
        assert_close(out.aux_loss, ref.aux_loss, TOL, f"aux loss ({where})")
        assert_close(out.loss, ref.loss, TOL, f"loss with the router's aux loss ({where})")
    fused = model(input_ids=ids, position_ids=pos, labels=lab, output_router_logits=True, fused_lm_head=True)
    assert_close(fused.aux_loss, ref.aux_loss, TOL, "aux loss (TRL's fused head)")
    assert_close(fused.loss, ref.loss, TOL, "loss with the router's aux loss (TRL's fused head)")


def test_norm_rounds_once_in_the_input_dtype_with_fp32_weights():
    """GPT-OSS keeps its norm weights in fp32 under a bf16 model: the patched norm returns bf16, round(w * x_hat)."""
    model = tiny_gpt_oss()
    norm = model.model.layers[0].input_layernorm
    x = torch.randn(2, 7, 64).to(torch.bfloat16)
    ref = norm(x)
    report = novatune.patch(model)
    out = norm(x)
    assert out.dtype == ref.dtype == torch.bfloat16
    assert torch.equal(out, ref), "one rounding of the same fp32 value"
    report.revert()


def test_tuned_backend_that_cannot_add_sinks_is_not_applied():
    """A tuned attention setting (e.g. flex, measured on a dense model of the same shape) stays off the modules
    with sinks; the report says so. A sink-capable one is applied."""
    from novatune.ops.dispatch import Selection, Setting

    model = tiny_gpt_oss()
    report = novatune.patch(model, selection=Selection(settings=(
        Setting("attention", "_novatune_attn_backend", "flex"),)))
    attns = [layer.self_attn for layer in model.model.layers]
    assert all(a._novatune_attn_backend == "auto" for a in attns)
    assert any("cannot run it" in e.detail for e in report.entries if e.kind == "tune")
    report.revert()
    novatune.patch(model, selection=Selection(settings=(Setting("attention", "_novatune_attn_backend",
                                                                "reference"),)))
    assert all(a._novatune_attn_backend == "reference" for a in attns)


@pytest.mark.gpu
def test_cuda_bf16_sinks_through_flash_are_as_close_to_fp32_as_stock_bf16():
    """The patched bf16 model on CUDA (sinks through aten FlashAttention-2, experts through the MoE op) against the
    truth: the same weights in fp32, stock, one document at a time. The yardstick is stock's own bf16 error on the
    same documents: the sinks' gradient sums c(1 - c) rowsum(g * out) over every token, a sum with cancellation
    that bf16 activations move by several percent in stock too. Bound: 2x stock's relative error + 5e-3."""
    import copy

    from novatune.attention import last_choice

    ids, pos, lab = (t.cuda() for t in packed_batch([[60, 200, 3, 249], [256, 256]]))
    model = tiny_gpt_oss(dtype=torch.bfloat16, layers=4).cuda().train()
    truth_model = copy.deepcopy(model).float()
    loss_true, grads_true = stock_per_document(truth_model, ids, pos, lab)
    loss_stock, grads_stock = stock_per_document(model, ids, pos, lab)
    novatune.patch(model)
    loss, grads = packed_loss_and_grads(model, ids, pos, lab)
    assert last_choice().backend in ("flash", "varlen") and "sinks" in last_choice().detail
    names = [n for n in grads_true if n.endswith("sinks") or "q_proj" in n or "experts" in n]
    assert assert_as_close_as_stock_bf16(loss, grads, loss_stock, grads_stock, loss_true, grads_true, names) >= 3 * 4


def test_gradient_checkpointing_and_lora_on_attention(monkeypatch, reference_backend):
    """Checkpointed layers recompute the sink attention in the backward with the same PackedBatch: same gradients.
    PEFT LoRA on the biased q/k/v/o projections takes novatune's fused LoRA forward and matches stock per
    document. The ops run their fp32 references here (the interpreted kernels are covered above and in their own
    tests; this test is about the wiring)."""
    peft = pytest.importorskip("peft")
    reference_backend()
    ids, pos, lab = packed_batch(ROWS)
    model = tiny_gpt_oss().train()
    report = novatune.patch(model)
    assert_checkpointing_keeps_gradients(model, ids, pos, lab)
    report.revert()
    model.gradient_checkpointing_disable()
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    pm = peft.get_peft_model(model, cfg)
    loss_ref, grads_ref = stock_per_document(pm, ids, pos, lab)
    report = novatune.patch(pm)
    assert len(report.replaced("attention")) == 2 and len(report.replaced("lora")) == 8
    loss, grads = packed_loss_and_grads(pm, ids, pos, lab)
    assert_close(loss, loss_ref, TOL, "loss")
    for name in grads_ref:
        assert_close(grads[name], grads_ref[name], TOL, name)
