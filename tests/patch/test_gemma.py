"""Gemma, Gemma 2 and Gemma 3 (text) patched on tiny random-init models, against the stock model run one document
at a time: the per-document stock loss and gradients are the ground truth whether or not a transformers release's
eager attention detects packed rows. Every quirk is on and made to matter (tiny_gemma):
(1 + w) norms with one rounding, GeGLU, embeddings scaled by sqrt(hidden), pre/post norms, sliding-window layers
with documents longer than the window, attention and final logit soft-capping, query_pre_attn_scalar, Gemma 3's
q/k norms and per-layer-type rotary bases.

Tolerance: fp32 end to end; the kernels (run through the Triton interpreter) and references differ from HF in
summation order, and the tanh of both soft-caps is computed through the sigmoid (~1e-7 absolute); 2e-5 relative
leaves room for that through 3 layers and the backward (as test_gpt_oss.py).
"""
import pytest
import torch
from tiny_models import (
    assert_as_close_as_stock_bf16,
    assert_checkpointing_keeps_gradients,
    packed_batch,
    packed_loss_and_grads,
    stock_per_document,
    tiny_gemma,
)

import novatune
from novatune.measure.numerics import assert_close

TOL = 2e-5
ROWS = [[5, 17, 1, 9], [32]]  # documents longer than the window (5), one of length 1, a one-document row
FAMILIES = ["gemma", "gemma2", "gemma3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_packed_equals_stock_per_document(family):
    ids, pos, lab = packed_batch(ROWS)
    model = tiny_gemma(family).train()
    loss_ref, grads_ref = stock_per_document(model, ids, pos, lab)
    stock_packed, _ = packed_loss_and_grads(model, ids, pos, lab)  # the revert check's reference
    report = novatune.patch(model)
    assert not report.skipped(), str(report)
    loss, grads = packed_loss_and_grads(model, ids, pos, lab)
    assert report.calls["cross_entropy"] == 1
    assert_close(loss, loss_ref, TOL, "loss")
    assert grads.keys() == grads_ref.keys()
    for name in grads_ref:  # every norm (offset), q/k norm, projection and the tied embedding
        assert_close(grads[name], grads_ref[name], TOL, name)
    report.revert()
    assert "forward" not in model.__dict__ and "forward" not in model.model.layers[0].self_attn.__dict__
    loss_back, _ = packed_loss_and_grads(model, ids, pos, lab)
    assert torch.equal(loss_back, stock_packed), "after revert the model is stock again, bit for bit"


@pytest.mark.parametrize("family,quirk", [
    ("gemma2", dict(attn_logit_softcapping=None)), ("gemma2", dict(final_logit_softcapping=None)),
    ("gemma3", dict(final_logit_softcapping=None)), ("gemma2", dict(query_pre_attn_scalar=16)),
    ("gemma3", dict(query_pre_attn_scalar=16)), ("gemma2", dict(sliding_window=64)),
    ("gemma3", dict(sliding_window=64))])
def test_each_quirk_changes_this_batch(family, quirk):
    """The stock loss moves when any one quirk is switched off: the equality test above proves each is honoured."""
    ids, pos, lab = packed_batch(ROWS)
    with torch.no_grad():
        base = tiny_gemma(family).train()(input_ids=ids[1:], labels=lab[1:]).loss
        other = tiny_gemma(family, **quirk).train()(input_ids=ids[1:], labels=lab[1:]).loss
    assert abs(float(base - other)) > 1e-4, quirk


@pytest.mark.parametrize("family", FAMILIES)
def test_report_names_every_quirk(family):
    model = tiny_gemma(family)
    layers = model.config.num_hidden_layers
    report = novatune.patch(model)
    assert report.family == family
    norms = report.replaced("rms_norm") + report.replaced("qk_norm")
    per_layer = 2 if family == "gemma" else 4
    assert len(norms) == per_layer * layers + 1 + (2 * layers if family == "gemma3" else 0)
    assert all("weight offset 1" in e.detail and "one rounding" in e.detail for e in norms)
    assert len(report.replaced("mlp")) == layers and all("geglu" in e.detail for e in report.replaced("mlp"))
    attn = report.replaced("attention")
    assert len(attn) == layers
    if family != "gemma":
        assert sum("sliding window 5" in e.detail for e in attn) == 2
        assert "soft-capped at 2.0" in report.replaced("cross_entropy")[0].detail
    # Gemma 3's stock attention ignores its attn_logit_softcapping attribute, and so does the patched one
    assert all(("soft-capped at 1.0" in e.detail) == (family == "gemma2") for e in attn)
    assert "q/k-norm + RoPE fused" not in str(report)


@pytest.mark.parametrize("backend", ["varlen", "sdpa"])
def test_backend_that_cannot_soft_cap_refuses_the_attention(backend):
    report = novatune.patch(tiny_gemma("gemma2"), attention=backend)
    assert not report.replaced("attention")
    skipped = report.skipped("attention")
    assert len(skipped) == 3 and all("soft-caps" in e.detail and backend in e.detail for e in skipped)


def test_gemma3_without_soft_caps_takes_any_backend():
    report = novatune.patch(tiny_gemma("gemma3", attn_logit_softcapping=None), attention="varlen")
    assert len(report.replaced("attention")) == 3 and not report.skipped()


def test_soft_capped_loss_refuses_the_plan_that_cannot_cap():
    with pytest.raises(ValueError, match="final_logit_softcapping=2.0"):
        novatune.patch(tiny_gemma("gemma2"), cross_entropy_mode="inplace")


def test_bidirectional_gemma3_is_refused_with_the_reason():
    report = novatune.patch(tiny_gemma("gemma3", use_bidirectional_attention=True))
    assert not report.replaced("attention")
    assert all("use_bidirectional_attention" in e.detail for e in report.skipped("attention"))


def test_embedding_scale_is_the_models_own():
    """sqrt(hidden), rounded to the embedding dtype, is applied by the model's embedding module (left stock)."""
    model = tiny_gemma("gemma2", dtype=torch.bfloat16)
    emb = model.model.embed_tokens
    ids = torch.tensor([[3, 7, 11]])
    scale = torch.tensor(model.config.hidden_size ** 0.5).to(torch.bfloat16)
    novatune.patch(model)
    assert "forward" not in emb.__dict__
    assert torch.equal(emb(ids), emb.weight[ids] * scale)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_cuda_bf16_is_as_close_to_fp32_as_stock_bf16(family, monkeypatch):
    """The patched bf16 model on CUDA (Triton norms, GeGLU, fused soft-capped loss; Gemma 2's soft-capped attention
    through flex, Gemma 3's through varlen) against the truth: the same weights in fp32, stock, one document at a
    time, documents longer than the window (5). The yardstick is stock bf16's own error against that truth on the
    same documents. Bound: 2x stock's relative error + 5e-3 (as GPT-OSS's GPU test). A backend an earlier test in
    the process marked broken is forgotten first: the test sees this model's own outcome, and a fallback's reason."""
    import copy

    from novatune.attention import backends, last_choice

    monkeypatch.setattr(backends, "_BROKEN", {})

    ids, pos, lab = (t.cuda() for t in packed_batch([[60, 200, 3, 249], [256, 256]]))
    model = tiny_gemma(family, dtype=torch.bfloat16, layers=6).cuda().train()
    truth_model = copy.deepcopy(model).float()
    loss_true, grads_true = stock_per_document(truth_model, ids, pos, lab)
    loss_stock, grads_stock = stock_per_document(model, ids, pos, lab)
    report = novatune.patch(model)
    assert not report.skipped(), str(report)
    loss, grads = packed_loss_and_grads(model, ids, pos, lab)
    # the reasons as one string: pytest shortens a list's repr, and the reason a backend was passed over is the point
    assert last_choice().backend in (("flex",) if family == "gemma2" else ("fa4", "flash", "varlen")), "; ".join(
        f"{name}: {why}" for name, why in last_choice().skipped)
    assert grads.keys() == grads_true.keys()
    assert_as_close_as_stock_bf16(loss, grads, loss_stock, grads_stock, loss_true, grads_true)


def test_gradient_checkpointing_lora_and_trl_head_on_gemma2(monkeypatch):
    """Wiring on Gemma 2 (the ops run their fp32 references: the interpreted kernels are covered above): the
    checkpointed layers recompute the soft-capped windowed attention with the same PackedBatch (same gradients);
    PEFT LoRA on every projection (the GeGLU MLP's included) matches stock per document; TRL's fused head gives the
    log-probs of the soft-capped logits."""
    peft = pytest.importorskip("peft")
    monkeypatch.setenv("NOVATUNE_BACKEND", "reference")
    ids, pos, lab = packed_batch(ROWS)
    model = tiny_gemma("gemma2").train()
    report = novatune.patch(model)
    assert_checkpointing_keeps_gradients(model, ids, pos, lab)
    model.gradient_checkpointing_disable()

    one = ids[1:], pos[1:], lab[1:]  # one document: stock's full logits are exact there
    with torch.no_grad():
        report.revert()
        logits = model(input_ids=one[0]).logits  # stock: soft-capped by the model
        report = novatune.patch(model)
    out = model(input_ids=one[0], position_ids=one[1], labels=one[2], fused_lm_head=True)
    want = torch.log_softmax(logits[0, :-1].float(), -1).gather(1, one[2][0, 1:, None]).squeeze(1)
    assert_close(out.log_probs[0], want, TOL, "TRL log_probs")
    report.revert()

    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules="all-linear")
    pm = peft.get_peft_model(model, cfg)
    loss_ref, grads_ref = stock_per_document(pm, ids, pos, lab)
    report = novatune.patch(pm)
    assert len(report.replaced("lora")) == 7 * 3 and len(report.replaced("mlp")) == 3
    loss, grads = packed_loss_and_grads(pm, ids, pos, lab)
    assert_close(loss, loss_ref, TOL, "loss")
    for name in grads_ref:
        assert_close(grads[name], grads_ref[name], TOL, name)
