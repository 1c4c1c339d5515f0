"""novatune.patch on tiny models of every family: what it replaces, revert, and that a patched model computes what
the stock model computes (CPU, fp32: the ops run their Triton kernels in the interpreter, or the references)."""
import warnings

import pytest
import torch
from tiny_models import FAMILIES, packed_batch, tiny_model

import novatune
from novatune.measure.numerics import assert_close

# fp32 end to end: kernels and references differ from HF only in summation order -> ~1e-6 relative; the tolerance
# leaves room for that through 2 layers and the backward.
TOL = 2e-5
ROWS = [[5, 17, 1, 9], [32]]  # two rows of 32 tokens: several documents (one of length 1), and one document


def _loss_and_grads(model, ids, pos, lab):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, position_ids=pos, labels=lab)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_patch_report_counts_and_revert(family):
    model = tiny_model(family)
    keys = list(model.state_dict())
    layers = model.config.num_hidden_layers
    report = novatune.patch(model)
    assert report.family == family
    n_norms = 2 * layers + 1
    assert len(report.replaced("rms_norm")) == n_norms
    assert len(report.replaced("qk_norm")) == (2 * layers if family == "qwen3" else 0)
    assert len(report.replaced("mlp")) == layers
    assert len(report.replaced("attention")) == layers
    assert len(report.replaced("cross_entropy")) == 1
    assert not report.skipped()
    assert list(model.state_dict()) == keys, "patching must not change parameters or state_dict keys"
    assert "forward" in model.model.layers[0].mlp.__dict__
    assert novatune.patch(model) is report, "patching twice returns the existing report"
    report.revert()
    assert "forward" not in model.model.layers[0].mlp.__dict__
    assert "forward" not in model.__dict__
    assert not model.model._forward_pre_hooks
    assert "replaced" in str(report) and "[reverted]" in str(report)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_patched_equals_stock_loss_and_grads(family):
    ids, pos, lab = packed_batch(ROWS)
    model = tiny_model(family)
    model.train()
    loss_ref, grads_ref = _loss_and_grads(model, ids, pos, lab)
    report = novatune.patch(model)
    loss, grads = _loss_and_grads(model, ids, pos, lab)
    assert_close(loss, loss_ref, TOL, "loss")
    assert grads.keys() == grads_ref.keys()
    for name in grads_ref:
        assert_close(grads[name], grads_ref[name], TOL, name)
    report.revert()
    loss_back, _ = _loss_and_grads(model, ids, pos, lab)
    assert torch.equal(loss_back, loss_ref), "after revert the model is stock again, bit for bit"


def test_num_items_in_batch_normaliser_matches_stock():
    """Gradient accumulation: HF passes num_items_in_batch; the fused loss must use it as its divisor."""
    ids, pos, lab = packed_batch(ROWS)
    model = tiny_model("qwen3").train()
    ref = model(input_ids=ids, position_ids=pos, labels=lab, num_items_in_batch=torch.tensor(100)).loss
    novatune.patch(model)
    out = model(input_ids=ids, position_ids=pos, labels=lab, num_items_in_batch=torch.tensor(100)).loss
    assert_close(out, ref, TOL, "loss with num_items_in_batch")


def test_gradient_checkpointing_same_grads():
    ids, pos, lab = packed_batch(ROWS)
    model = tiny_model("qwen3").train()
    novatune.patch(model)
    _, grads = _loss_and_grads(model, ids, pos, lab)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _, grads_ckpt = _loss_and_grads(model, ids, pos, lab)
    for name in grads:
        assert_close(grads_ckpt[name], grads[name], 1e-6, name)


def test_documents_do_not_see_each_other():
    """Perturb one document: every other document's logits stay exactly the same (eval, use_cache=False)."""
    model = tiny_model("qwen3").eval()
    novatune.patch(model)
    ids, pos, _ = packed_batch([[7, 11, 14]])
    with torch.no_grad():
        base = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        ids2 = ids.clone()
        ids2[0, 7:18] = (ids2[0, 7:18] + 1) % 257  # the second document
        pert = model(input_ids=ids2, position_ids=pos, use_cache=False).logits
    assert torch.equal(base[0, :7], pert[0, :7])
    assert torch.equal(base[0, 18:], pert[0, 18:])
    assert not torch.equal(base[0, 7:18], pert[0, 7:18])


def test_eval_generation_unchanged():
    model = tiny_model("llama").eval()
    prompt = torch.tensor([[1, 5, 9, 33, 4]])
    ref = model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True)
    novatune.patch(model)
    out = model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True)
    assert torch.equal(out, ref)


def test_peft_model_patched():
    peft = pytest.importorskip("peft")
    ids, pos, lab = packed_batch(ROWS)
    model = tiny_model("qwen3").train()
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    pm = peft.get_peft_model(model, cfg)
    loss_ref, grads_ref = _loss_and_grads(pm, ids, pos, lab)
    report = novatune.patch(pm)
    assert len(report.replaced("attention")) == 2 and len(report.replaced("mlp")) == 2
    loss, grads = _loss_and_grads(pm, ids, pos, lab)
    assert_close(loss, loss_ref, TOL, "loss")
    assert any("lora" in n for n in grads) and grads.keys() == grads_ref.keys()
    for name in grads_ref:
        assert_close(grads[name], grads_ref[name], TOL, name)


def test_trainer_like_target_and_options():
    class FakeTrainer:  # what patch() needs from a transformers/TRL Trainer: .model and .args
        def __init__(self, model):
            self.model, self.args = model, object()

    model = tiny_model("mistral")
    report = novatune.patch(FakeTrainer(model), attention=False, cross_entropy=False)
    assert model._novatune_report is report
    assert not report.replaced("attention") and not report.replaced("cross_entropy")
    assert {e.detail for e in report.skipped()} == {"attention=False", "cross_entropy=False"}


def test_unsupported_family_is_reported_and_strict_raises():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    report = novatune.patch(model)
    assert report.family is None and "no novatune spec" in report.skipped()[0].detail
    with pytest.raises(ValueError, match="no novatune spec"):
        novatune.patch(model, strict=True)
    with pytest.raises(ValueError, match="attention="):
        novatune.patch(tiny_model("qwen3"), attention="fa9")


def test_host_cu_seq_lens_same_as_position_ids():
    """A collator's host-side document offsets (TRL flattening style) give the same result as position_ids."""
    ids, pos, lab = packed_batch([[5, 17, 1, 9]])
    model = tiny_model("qwen3").train()
    novatune.patch(model)
    ref = model(input_ids=ids, position_ids=pos, labels=lab).loss
    cu = torch.tensor([0, 5, 22, 23, 32], dtype=torch.int32)
    out = model(input_ids=ids, position_ids=pos, labels=lab, cu_seq_lens_q=cu, max_length_q=17).loss
    assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="max_seqlen"):
        model(input_ids=ids, position_ids=pos, labels=lab, cu_seq_lens_q=cu, max_length_q=3)


def test_fused_qk_norm_rope_option_equals_stock():
    ids, pos, lab = packed_batch(ROWS)
    model = tiny_model("qwen3").train()
    loss_ref, grads_ref = _loss_and_grads(model, ids, pos, lab)
    report = novatune.patch(model, fuse_qk_norm_rope=True, cross_entropy_mode="vocab")
    assert all("fused" in e.detail for e in report.replaced("attention"))
    loss, grads = _loss_and_grads(model, ids, pos, lab)
    assert_close(loss, loss_ref, TOL, "loss")
    for name in grads_ref:
        assert_close(grads[name], grads_ref[name], TOL, name)


def test_tied_lm_head_gradient_accumulates_like_stock():
    """Two micro-batches into the same .grad of a tied lm_head/embedding weight: the fused loss's backward adds the
    lm_head part into the existing .grad on the second (the embedding part accumulates as usual); equal to stock."""
    batches = [packed_batch(ROWS, seed=s) for s in (1, 2)]
    model = tiny_model("qwen3").train()
    assert model.lm_head.weight is model.model.embed_tokens.weight

    def accumulate():
        model.zero_grad(set_to_none=True)
        for ids, pos, lab in batches:
            model(input_ids=ids, position_ids=pos, labels=lab).loss.backward()
        return model.model.embed_tokens.weight.grad.clone()

    ref = accumulate()
    novatune.patch(model)
    assert_close(accumulate(), ref, TOL, "tied embedding gradient")


def test_a_tied_weights_hook_and_autograd_grad_see_its_whole_gradient():
    """A tensor hook on the tied weight sees (and scales) the lm_head part too, and torch.autograd.grad on it
    returns both parts, as stock's do. Before, a stand-in leaf added the lm_head part into .grad past both: the
    hook saw the embedding part alone (.grad off by 33%), autograd.grad returned the embedding part alone."""
    ids, pos, lab = packed_batch(ROWS, seed=3)
    stock, ours = tiny_model("qwen3").train(), tiny_model("qwen3").train()
    novatune.patch(ours)
    seen = {}
    for name, model in (("stock", stock), ("ours", ours)):
        weight = model.model.embed_tokens.weight
        got = torch.autograd.grad(model(input_ids=ids, position_ids=pos, labels=lab).loss, [weight])[0]
        seen[name + " autograd.grad"] = got
        handle = weight.register_hook(lambda g, name=name: (seen.setdefault(name + " hook", g), g * 2)[1])
        for _ in range(2):  # the second micro-batch finds .grad
            model(input_ids=ids, position_ids=pos, labels=lab).loss.backward()
        handle.remove()
        seen[name + " grad"] = weight.grad
    for what in ("autograd.grad", "hook", "grad"):
        assert_close(seen["ours " + what], seen["stock " + what], TOL, what)
    model = tiny_model("qwen3")
    with pytest.warns(FutureWarning, match="early_tied_grad"):
        novatune.patch(model, early_tied_grad=False)
    with pytest.warns(FutureWarning, match="early_tied_grad"):  # a repatch compares every option but this one
        novatune.patch(model, early_tied_grad=True)


def test_a_hooked_lm_head_runs_as_a_module_with_its_hooks():
    """Hooks on lm_head itself (here a forward hook that counts, and a backward hook that halves the gradient of
    its input) run only in the module's call: the loss then runs through the module, with a warning, and
    everything equals stock's."""
    ids, pos, lab = packed_batch(ROWS, seed=4)
    stock, ours = tiny_model("qwen3").train(), tiny_model("qwen3").train()
    novatune.patch(ours)
    calls, grads = {"stock": 0, "ours": 0}, {}
    for name, model in (("stock", stock), ("ours", ours)):
        model.lm_head.register_forward_hook(lambda m, a, o, name=name: calls.__setitem__(name, calls[name] + 1))
        model.lm_head.register_full_backward_hook(lambda m, gi, go: (gi[0] * 0.5,))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(input_ids=ids, position_ids=pos, labels=lab).loss.backward()
        assert any("lm_head has module hooks" in str(w.message) for w in caught) is (name == "ours")
        grads[name] = {n: p.grad for n, p in model.named_parameters()}
    assert calls == {"stock": 1, "ours": 1}
    for n, g in grads["stock"].items():
        assert_close(grads["ours"][n], g, TOL, n)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_rows_with_their_own_position_ids_train_as_stock(side):
    """A padded batch that also carries position_ids (TRL's collator with return_position_ids pads them with 0):
    each row's unmasked tokens are one document, so it is plain padding, for stock attention with the mask."""
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 257, (2, 24), generator=g)
    mask = torch.ones_like(ids)
    pos = torch.arange(24).repeat(2, 1)
    pad = slice(17, None) if side == "right" else slice(None, 7)
    mask[0, pad] = 0
    pos[0] = 0
    pos[0, mask[0] == 1] = torch.arange(17)
    labels = ids.masked_fill(mask == 0, -100)
    model = tiny_model("qwen3")
    model.train()
    want = model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels).loss.detach()
    novatune.patch(model)
    got = model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels).loss.detach()
    assert_close(got, want, TOL, "loss")


def test_output_attentions_calls_return_stocks_attention_weights():
    """An eager-attention family asked for its attention weights (a training forward with labels, one document per
    row): the call runs stock attention, which forms them, and the report says so; the loss stays stock's."""
    from tiny_models import tiny_gemma

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 257, (1, 20), generator=g)
    model = tiny_gemma("gemma2", attn="eager")
    model.train()
    want = model(input_ids=ids, labels=ids, output_attentions=True)
    report = novatune.patch(model)
    got = model(input_ids=ids, labels=ids, output_attentions=True)
    assert len(got.attentions) == len(want.attentions) == model.config.num_hidden_layers
    for a, b in zip(got.attentions, want.attentions):
        assert_close(a, b, TOL, "attention weights")
    assert_close(got.loss, want.loss, TOL, "loss")
    assert "output_attentions=True use stock attention" in str(report)


def test_a_sequence_classification_model_keeps_its_head_and_says_so():
    """A reward model (ForSequenceClassification over the decoder): the decoder is patched, its score head and
    loss stay stock, the report says so, and the loss equals stock's."""
    import transformers
    from tiny_models import COMMON

    cfg = transformers.Qwen3Config(**{**COMMON, "head_dim": 16, "num_labels": 1, "pad_token_id": 0})
    torch.manual_seed(0)
    model = transformers.Qwen3ForSequenceClassification(cfg).train()
    ids = torch.randint(1, 257, (2, 12), generator=torch.Generator().manual_seed(8))
    labels = torch.tensor([0.5, -1.0])
    want = model(input_ids=ids, labels=labels).loss.detach()
    report = novatune.patch(model)
    got = model(input_ids=ids, labels=labels).loss.detach()
    assert_close(got, want, TOL, "loss")
    assert report.replaced("rms_norm") and not report.replaced("cross_entropy")
    assert "has no lm_head: its own head and loss stay stock" in str(report)
