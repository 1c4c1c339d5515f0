"""An LM head replaced after novatune.patch: PEFT's LoRA on lm_head or modules_to_save=["lm_head"] (get_peft_model,
or SFTTrainer(peft_config=...) on a patched model), or resize_token_embeddings. The fused loss looks the head up on
each call: a new plain Linear is fused with its own weight; a wrapped head runs through its module (its forward adds
what the bare weight does not: the LoRA delta, the adapter's copy). Loss and gradients equal the unpatched model's
with the same head; the report and a warning say which path runs.

Tolerance: fp32 on the CPU; the patched path differs from stock in summation order only (the fused loss sums per
chunk, the reference kernels per row): ~1e-6 relative; asserted at 1e-5 relative (gradients 1e-4 of each
tensor's largest entry, where small entries lose their relative digits)."""
import warnings

import pytest
import torch

import novatune
from tests.patch.tiny_models import packed_batch, tiny_model

peft = pytest.importorskip("peft")

HEADS = {
    "lora_on_lm_head": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"]),
    "modules_to_save": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]),
}


def peft_model(patched: bool, head: str):
    model = tiny_model("llama")  # untied head: PEFT wraps lm_head alone
    if patched:
        novatune.patch(model)
    torch.manual_seed(1)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(**HEADS[head]))
    with torch.no_grad():  # adapters away from their zero init, so that a dropped delta shows in the loss
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(hash(name) % 2**31))
    wrapped.train()
    return wrapped


def loss_and_grads(model, **call):
    out = model(**call)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(got: dict, want: dict):
    assert got.keys() == want.keys()
    for name, ref in want.items():
        err = (got[name] - ref).abs().max() / ref.abs().max().clamp_min(1e-12)
        assert err < 1e-4, (name, float(err))


@pytest.mark.parametrize("head", sorted(HEADS))
def test_a_head_wrapped_after_the_patch_trains_as_stock(head):
    ids, pos, labels = packed_batch([[9, 14], [23]], seed=3)
    call = dict(input_ids=ids, position_ids=pos, labels=labels)
    want_loss, want_grads = loss_and_grads(peft_model(False, head), **call)
    model = peft_model(True, head)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got_loss, got_grads = loss_and_grads(model, **call)
    assert torch.allclose(got_loss, want_loss, rtol=1e-5), (got_loss, want_loss)
    assert_grads_close(got_grads, want_grads)
    assert any(n.endswith("lm_head.lora_B.default.weight") or "modules_to_save" in n for n in got_grads)
    assert any("lm_head became" in str(w.message) for w in caught)
    report = novatune.patch(model)  # patching again states the head's path in the report
    (entry,) = [e for e in report.entries if e.kind == "cross_entropy"]
    assert entry.action == "skipped" and "after the first patch" in entry.detail, str(report)
    assert any("lm_head became" in e.detail for e in report.entries if e.kind == "note")


@pytest.mark.parametrize("head", sorted(HEADS))
def test_trls_fused_head_over_a_wrapped_head_gives_the_heads_own_log_probs(head):
    """TRL's fused_lm_head contract through a head wrapped after the patch: log_probs, entropy and is_top1 from
    the head module's own logits, and the gradient of TRL's nll loss equal to the same loss on the stock model's
    logits."""
    ids, pos, labels = packed_batch([[11, 17]], seed=4)
    stock = peft_model(False, head)
    logits = stock(input_ids=ids, position_ids=pos).logits[:, :-1].float()
    targets = labels[:, 1:]
    mask = targets != -100
    log_softmax = torch.log_softmax(logits, -1)
    want = log_softmax.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1).masked_fill(~mask, 0)
    (-want.sum() / mask.sum()).backward()
    want_grads = {n: p.grad.clone() for n, p in stock.named_parameters() if p.grad is not None}
    want_entropy = -(log_softmax.exp() * log_softmax).sum(-1)

    model = peft_model(True, head)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model(input_ids=ids, position_ids=pos, labels=labels, fused_lm_head=True)
    assert torch.equal(out.label_mask, mask)
    torch.testing.assert_close(out.log_probs, want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.entropy[mask], want_entropy.detach()[mask], rtol=1e-5, atol=1e-5)
    assert torch.equal(out.is_top1[mask], (logits.argmax(-1) == targets)[mask])
    (-out.log_probs.sum() / out.label_mask.sum()).backward()
    assert_grads_close({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, want_grads)


def test_a_resized_vocabulary_after_the_patch_is_fused_with_the_new_head():
    """resize_token_embeddings after the patch gives the model a new lm_head Linear (untied): the fused loss uses
    it, with no note, and trains its new rows as stock does."""
    ids, pos, labels = packed_batch([[10, 12]], vocab=300, seed=5)
    results = []
    for patched in (False, True):
        model = tiny_model("llama")
        if patched:
            report = novatune.patch(model)
        torch.manual_seed(2)
        model.resize_token_embeddings(300, mean_resizing=False)
        model.train()
        results.append(loss_and_grads(model, input_ids=ids, position_ids=pos, labels=labels))
    (want_loss, want_grads), (got_loss, got_grads) = results
    assert torch.allclose(got_loss, want_loss, rtol=1e-5), (got_loss, want_loss)
    assert_grads_close(got_grads, want_grads)
    assert got_grads["lm_head.weight"].shape[0] == 300 and got_grads["lm_head.weight"][257:].abs().sum() > 0
    assert model.__dict__["_novatune_lm_head"] is model.lm_head  # bound from now on: the old head is not kept
    assert report.replaced("cross_entropy") and not any("lm_head became" in e.detail for e in report.entries)


def test_merging_the_head_adapter_back_restores_the_fused_loss_in_the_report():
    model = peft_model(True, "lora_on_lm_head")
    report = novatune.patch(model)
    assert [e.action for e in report.entries if e.kind == "cross_entropy"] == ["skipped"]
    merged = model.merge_and_unload()  # the base Linear is the head again, with the delta in its weight
    assert novatune.patch(merged) is report
    (entry,) = [e for e in report.entries if e.kind == "cross_entropy"]
    assert entry.action == "replaced", str(report)
