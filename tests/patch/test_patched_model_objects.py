"""A patched model as users handle it beyond the training call: copies (copy.deepcopy for an EMA, a teacher or a
DPO reference; torch.save of the whole module), calls by position or with return_dict=False, training forwards
without labels, a second patch() call, and PEFT adapters added after the patch.

Tolerance: fp32 on the CPU; the patched and stock paths differ only in summation order (1e-5 relative)."""
import copy
import inspect
import io
import warnings

import pytest
import torch
from tiny_models import packed_batch, tiny_model

import novatune
from novatune.measure.numerics import assert_close

TOL = 1e-5


def _batch():
    ids, pos, lab = packed_batch([[7, 11], [18]])
    return dict(input_ids=ids, position_ids=pos, labels=lab)


def test_a_deep_copy_runs_its_own_weights():
    """The copy's forwards (the loss forward and the stock path it delegates to) belong to the copy: after the
    original's weights change, the copy still computes what an unpatched model with its weights computes."""
    from torch.optim.swa_utils import AveragedModel

    model, plain = tiny_model("qwen3"), tiny_model("qwen3")
    novatune.patch(model)
    copies = {"deepcopy": copy.deepcopy(model), "AveragedModel": AveragedModel(model).module}
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    ids = _batch()["input_ids"]
    with torch.no_grad():
        want = plain.eval()(input_ids=ids).logits
        for name, c in copies.items():
            assert_close(c.eval()(input_ids=ids).logits, want, TOL, f"{name}: logits")
    b = _batch()
    twin = copy.deepcopy(copies["deepcopy"]).train()
    loss = copies["deepcopy"].train()(**b).loss
    assert_close(loss, twin(**b).loss, TOL, "training loss of the copy")
    report = copies["deepcopy"]._novatune_report
    assert report is not model._novatune_report and report.calls["cross_entropy"] == 1
    assert model._novatune_report.calls["cross_entropy"] == 0, "the copy's calls are counted on the copy"
    with pytest.raises(RuntimeError, match="copy of a patched model"):
        report.revert()
    assert "forward" in model.__dict__, "the original stays patched"


def test_torch_save_and_load_of_a_patched_model():
    model = tiny_model("qwen3").train()
    novatune.patch(model)
    b = _batch()
    want = model(**b).loss
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False).train()
    assert_close(loaded(**b).loss, want, TOL, "loss after torch.load")
    assert loaded._novatune_report.calls["cross_entropy"] == model._novatune_report.calls["cross_entropy"] + 1


def test_calls_by_position_and_with_return_dict_false_equal_keyword_calls():
    """The patched forward shows the stock forward's signature and binds positional arguments by it (input_ids,
    attention_mask, position_ids, the cache, inputs_embeds, labels); return_dict=False gives a tuple."""
    stock, model = tiny_model("qwen3"), tiny_model("qwen3")
    novatune.patch(model)
    assert list(inspect.signature(model.forward).parameters) == list(inspect.signature(stock.forward).parameters)
    b = _batch()
    model.train()
    want = model(**b).loss
    got = model(b["input_ids"], None, b["position_ids"], None, None, b["labels"]).loss
    assert_close(got, want, TOL, "positional call")
    out = model(**b, return_dict=False)
    assert isinstance(out, tuple)
    assert_close(out[0], want, TOL, "return_dict=False: loss first")


def test_training_forwards_without_labels_are_not_reported_as_bypassed():
    """A training loop that computes its own loss from the logits calls the model without labels: that is the
    stock path on purpose, so no warning about a bypassed loss, and the report keeps the fused loss (with a note)."""
    model = tiny_model("qwen3").train()
    report = novatune.patch(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        logits = model(input_ids=_batch()["input_ids"]).logits
    assert logits is not None and logits.requires_grad
    assert report.replaced("cross_entropy") and report.calls["bypassed_loss"] == 0
    assert any("without labels" in e.detail for e in report.entries if e.action == "note")


def test_a_second_patch_with_other_options_raises():
    model = tiny_model("qwen3")
    report = novatune.patch(model, cross_entropy_mode="tokens")
    assert novatune.patch(model) is report  # defaults ask for nothing new
    assert novatune.patch(model, cross_entropy_mode="tokens") is report
    with pytest.raises(ValueError, match="already patched.*revert"):
        novatune.patch(model, cross_entropy=False)
    report.revert()
    assert novatune.patch(model, cross_entropy=False).skipped("cross_entropy")


def test_lora_added_after_the_patch_is_fused_by_patching_again():
    """patch(model), then get_peft_model (or a trainer's peft_config) and patch(peft_model or trainer): the new
    LoRA layers get the fused forward, as a first patch of the PEFT model gives them, with the same loss."""
    peft = pytest.importorskip("peft")

    def lora_model():
        return peft.get_peft_model(tiny_model("qwen3"), peft.LoraConfig(r=4, target_modules="all-linear"))

    late = tiny_model("qwen3")
    report = novatune.patch(late)
    late = peft.get_peft_model(late, peft.LoraConfig(r=4, target_modules="all-linear"))
    assert novatune.patch(late) is report
    first = novatune.patch(fresh := lora_model())
    assert len(report.replaced("lora")) == len(first.replaced("lora")) > 0
    assert any("added after the first" in e.detail for e in report.entries if e.action == "note")
    with torch.no_grad():
        for a, b in zip(fresh.parameters(), late.parameters()):
            b.copy_(a)
    b = _batch()
    assert_close(late.train()(**b).loss, fresh.train()(**b).loss, TOL, "loss")
    n = len(report.entries)
    novatune.patch(late)
    assert len(report.entries) == n, "patching again adds nothing"


def test_sdpa_docs_is_a_patch_backend():
    """The CPU's packed-row backend (one SDPA call per document), which the attention errors on the CPU name."""
    model = tiny_model("qwen3").train()
    report = novatune.patch(model, attention="sdpa_docs")
    assert len(report.replaced("attention")) == 2
    b = _batch()
    assert torch.isfinite(model(**b).loss)
