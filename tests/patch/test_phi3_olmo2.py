"""Phi-3 / Phi-4-mini and OLMo 2 patched on tiny random-init models, against the stock model run one document at a
time (the ground truth for packed rows: no attention across documents).

Phi-3: fused qkv_proj and gate_up_proj, partial rotary (3/4 of each head), a sliding window of 5 (every document
but two is longer), LongRoPE tables; OLMo 2: post-norms and q/k norms over the whole projection. Weights at std 0.1
and norm weights drawn around 1, so dropping any quirk moves the loss far past the tolerance.

Tolerance: fp32 end to end; the kernels and references differ from HF only in summation order (~1e-6 relative),
so 2e-5 leaves room for that through 2 layers and the backward (as tests/patch/test_gpt_oss.py).
"""
import pytest
import torch
from tiny_models import (
    assert_as_close_as_stock_bf16,
    packed_batch,
    packed_loss_and_grads,
    stock_per_document,
    tiny_olmo2,
    tiny_phi3,
    train_eval_generate_warning_free,
)

import novatune
from novatune.measure.numerics import assert_close

TOL = 2e-5
ROWS = [[5, 17, 1, 9], [32]]  # documents longer than the window (5), one of length 1, a one-document row
MODELS = {
    "phi4-mini": lambda **kw: tiny_phi3(**kw),  # partial rotary 0.75 + window 5
    "phi3-mini": lambda **kw: tiny_phi3(partial_rotary_factor=1.0, sliding_window=None, **kw),
    "olmo2": lambda **kw: tiny_olmo2(**kw),
    "olmo2-bias": lambda **kw: tiny_olmo2(attention_bias=True, **kw),  # biases on q/k/v/o, under the q/k norms
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_patched_packed_equals_stock_per_document(name):
    ids, pos, lab = packed_batch(ROWS)
    model = MODELS[name]().train()
    loss_ref, grads_ref = stock_per_document(model, ids, pos, lab)
    stock_packed, _ = packed_loss_and_grads(model, ids, pos, lab)  # eager stock: the dense packed mask
    report = novatune.patch(model)
    assert not report.skipped(), str(report)
    loss, grads = packed_loss_and_grads(model, ids, pos, lab)
    assert report.calls["cross_entropy"] == 1
    assert_close(loss, loss_ref, TOL, "loss")
    assert grads.keys() == grads_ref.keys() and len(grads) == len(list(model.parameters()))
    for param in grads_ref:  # fused qkv / gate_up, q/k norms, post-norms included
        assert_close(grads[param], grads_ref[param], TOL, param)
    report.revert()
    loss_back, _ = packed_loss_and_grads(model, ids, pos, lab)
    assert torch.equal(loss_back, stock_packed), "after revert the model is stock again, bit for bit"


@pytest.mark.parametrize("name", ["phi4-mini", "olmo2"])
def test_gradient_checkpointing_same_grads(name):
    """Checkpointed layers recompute the fused projections' split, the in-place SwiGLU on gate_up and the
    projection-wide norms with the same PackedBatch: the same gradients (recompute repeats the same ops: 1e-6)."""
    ids, pos, lab = packed_batch(ROWS)
    model = MODELS[name]().train()
    novatune.patch(model)
    loss, grads = packed_loss_and_grads(model, ids, pos, lab)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    loss_ckpt, grads_ckpt = packed_loss_and_grads(model, ids, pos, lab)
    assert_close(loss_ckpt, loss, 1e-6, "loss")
    for param in grads:
        assert_close(grads_ckpt[param], grads[param], 1e-6, param)


@pytest.mark.parametrize("name", ["phi4-mini", "olmo2"])
def test_generation_unchanged_and_no_deprecation_warning(name):
    """Greedy generation (the KV-cache path runs the stock forwards) gives stock's tokens, and a training step,
    an eval forward and the generation raise none of transformers' FutureWarning / DeprecationWarning."""
    ids, pos, lab = packed_batch(ROWS)
    model = MODELS[name]().eval()
    with torch.no_grad():
        ref = model.generate(ids[:1, :5], max_new_tokens=4, do_sample=False)
    novatune.patch(model)
    out = train_eval_generate_warning_free(model, ids, pos, lab, new_tokens=4)
    assert torch.equal(out, ref)


def test_the_window_and_partial_rotary_change_this_batch():
    """Otherwise the equality above would prove nothing about them."""
    ids, pos, lab = packed_batch(ROWS)
    ref, _ = stock_per_document(tiny_phi3().train(), ids, pos, lab)
    for other in (dict(sliding_window=None), dict(partial_rotary_factor=1.0)):
        changed, _ = stock_per_document(tiny_phi3(**other).train(), ids, pos, lab)
        assert abs(float(changed - ref)) > 100 * TOL * abs(float(ref)), other


def test_report_names_every_quirk():
    phi = novatune.patch(tiny_phi3())
    attn = phi.replaced("attention")
    assert len(attn) == 2 and all("fused qkv_proj split [64, 32, 32]" in e.detail and "partial rotary (first 12 of 16"
                                  in e.detail and "sliding window 5 per document" in e.detail for e in attn)
    assert all("fused gate_up GEMM" in e.detail for e in phi.replaced("mlp")) and len(phi.replaced("mlp")) == 2
    assert len(phi.replaced("rms_norm")) == 5
    olmo = novatune.patch(tiny_olmo2())
    assert all("q/k norms over the whole projection" in e.detail for e in olmo.replaced("attention"))
    assert len(olmo.replaced("post_norm")) == 4 and len(olmo.replaced("qk_norm")) == 4
    assert len(olmo.replaced("rms_norm")) == 1  # the final norm
    assert {e.path.rsplit(".", 1)[-1] for e in olmo.replaced("post_norm")} == {"post_attention_layernorm",
                                                                              "post_feedforward_layernorm"}


@pytest.mark.parametrize("rows,factors", [([[5, 19, 8]], "long"), ([[10, 12, 10]], "short")])
def test_longrope_factor_choice_matches_stock_on_packed_rows(rows, factors):
    """LongRoPE picks the long factors when the largest position passed reaches original_max_position_embeddings
    (16 here). On packed rows that is the longest document (19 tokens: long), not the row (32 tokens of documents
    <= 12: short); the model's rotary embedding makes the choice and the patched attention uses its tables as they
    are, so the patched model matches stock's packed batch (sdpa, which isolates documents by position_ids)."""
    ids, pos, lab = packed_batch(rows)
    model = tiny_phi3(longrope_original=16, sliding_window=None, attn="sdpa").train()
    rotary = model.model.rotary_emb
    ref, grads_ref = packed_loss_and_grads(model, ids, pos, lab)
    # the short table is the one built at init (`original_inv_freq`); the long one is 1 / (long_factor x
    # theta^(2j / rotary dims)), which transformers 5.24 keeps as `long_inv_freq` and 5.17 computes when chosen
    rope = model.config.rope_parameters
    dims = 2 * len(rope["long_factor"])
    long_table = 1.0 / (torch.tensor(rope["long_factor"]) * rope["rope_theta"] ** (torch.arange(0, dims, 2) / dims))
    chosen = "short" if torch.equal(rotary.inv_freq, rotary.original_inv_freq) else "long"
    assert chosen == factors
    if chosen == "long":
        torch.testing.assert_close(rotary.inv_freq, long_table.to(rotary.inv_freq.dtype))
    table = rotary.inv_freq.clone()
    if factors == "long":  # the choice matters for this batch: the same documents alone would take the short ones
        alone, _ = stock_per_document(model, ids, pos, lab)
        assert abs(float(alone - ref)) > 10 * TOL * abs(float(ref))
    report = novatune.patch(model)
    loss, grads = packed_loss_and_grads(model, ids, pos, lab)
    assert torch.equal(rotary.inv_freq, table)  # the patched model's batch made the same choice
    assert_close(loss, ref, TOL, "loss")
    for param in grads_ref:
        assert_close(grads[param], grads_ref[param], TOL, param)
    report.revert()


def test_resid_dropout_draws_as_stock():
    """resid_pdrop stays in the stock decoder layer; the patched modules draw no random numbers, so the same seed
    gives stock's dropout masks and the same loss and gradients (one document: stock eager is exact there)."""
    ids, pos, lab = packed_batch([[32]])
    model = tiny_phi3(resid_pdrop=0.3).train()
    torch.manual_seed(7)
    ref, grads_ref = packed_loss_and_grads(model, ids, pos, lab)
    torch.manual_seed(8)
    other, _ = packed_loss_and_grads(model, ids, pos, lab)
    assert abs(float(other - ref)) > 1e-3, "the dropout is active"
    report = novatune.patch(model)
    assert not report.skipped()
    torch.manual_seed(7)
    loss, grads = packed_loss_and_grads(model, ids, pos, lab)
    assert_close(loss, ref, TOL, "loss")
    for param in grads_ref:
        assert_close(grads[param], grads_ref[param], TOL, param)


def test_olmo2_norms_round_once_like_stock_in_bf16():
    """OLMo 2's RMSNorm rounds once after the weight: the patched q/k and post norms return stock's bf16 values."""
    model = tiny_olmo2(dtype=torch.bfloat16)
    layer = model.model.layers[0]
    xq, xh = torch.randn(2, 7, 64).to(torch.bfloat16), torch.randn(2, 7, 64).to(torch.bfloat16)
    ref = layer.self_attn.q_norm(xq), layer.post_feedforward_layernorm(xh)
    report = novatune.patch(model)
    out = layer.self_attn.q_norm(xq), layer.post_feedforward_layernorm(xh)
    assert all(o.dtype == torch.bfloat16 and torch.equal(o, r) for o, r in zip(out, ref))
    report.revert()


def test_fused_projection_of_the_wrong_width_is_refused():
    """A fused qkv_proj whose width is not the head counts' split refuses that attention with the reason."""
    model = tiny_phi3()
    model.model.layers[1].self_attn.qkv_proj = torch.nn.Linear(64, 120, bias=False)
    report = novatune.patch(model)
    (entry,) = report.skipped("attention")
    assert entry.path == "model.layers.1.self_attn" and "120 outputs" in entry.detail and "[64, 32, 32]" in \
        entry.detail.replace("(", "[").replace(")", "]")
    assert len(report.replaced("attention")) == 1


@pytest.mark.parametrize("name,targets", [
    ("phi4-mini", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    ("olmo2", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])])
def test_lora_on_every_projection_equals_peft_per_document(name, targets):
    """PEFT LoRA on the fused projections (Phi-3) and on OLMo 2's: every adapter takes the fused LoRA forward, and
    the whole patch (fused attention, MLP, norms, loss) matches PEFT stock per document, adapters' grads included."""
    peft = pytest.importorskip("peft")
    ids, pos, lab = packed_batch(ROWS)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=targets)
    model = peft.get_peft_model(MODELS[name]().train(), cfg)
    loss_ref, grads_ref = stock_per_document(model, ids, pos, lab)
    report = novatune.patch(model)
    layers = model.config.num_hidden_layers
    assert len(report.replaced("lora")) == len(targets) * layers and not report.skipped("lora"), str(report)
    loss, grads = packed_loss_and_grads(model, ids, pos, lab)
    assert_close(loss, loss_ref, TOL, "loss")
    assert grads.keys() == grads_ref.keys() and sum("lora_" in n for n in grads) == 2 * len(targets) * layers
    for param in grads_ref:
        assert_close(grads[param], grads_ref[param], TOL, param)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(MODELS))
def test_cuda_bf16_is_as_close_to_fp32_as_stock_bf16(name):
    """The patched bf16 model on CUDA (Triton kernels, packed attention through the GPU backends, partial rotary
    at the kernel, the fused projections) against the truth: the same weights in fp32, stock, one document at a
    time. The yardstick is stock bf16's own error on the same documents (every activation rounded to bf16, in
    stock and patched alike) with HF's default attention (sdpa): loss and every parameter gradient within 2x stock's
    relative error + 5e-3. sdpa, not eager: a fused bf16 attention's q/k gradients carry more rounding than eager's
    fp32 softmax (OLMo 2 with biases: ~3x on the q/k-norm weights, in stock's sdpa and in ours alike)."""
    import copy

    from novatune.attention import last_choice

    ids, pos, lab = (t.cuda() for t in packed_batch([[60, 200, 3, 249], [256, 256]]))
    model = MODELS[name](dtype=torch.bfloat16, layers=4).cuda().train()
    truth_model = copy.deepcopy(model).float()
    loss_true, grads_true = stock_per_document(truth_model, ids, pos, lab)
    stock_model = copy.deepcopy(model)
    stock_model.config._attn_implementation = "sdpa"
    loss_stock, grads_stock = stock_per_document(stock_model, ids, pos, lab)
    report = novatune.patch(model)
    assert not report.skipped(), str(report)
    loss, grads = packed_loss_and_grads(model, ids, pos, lab)
    assert last_choice().backend in ("fa4", "flash", "varlen", "flex"), last_choice()
    assert grads.keys() == grads_true.keys()
    assert_as_close_as_stock_bf16(loss, grads, loss_stock, grads_stock, loss_true, grads_true)
