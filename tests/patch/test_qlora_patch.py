"""novatune.patch on PEFT QLoRA models (bitsandbytes NF4 Linear4bit bases): every projection is fused, loss and
every LoRA gradient equal PEFT + bitsandbytes stock, no dequantised weight is kept for the backward (unless inside a
checkpointed layer, where the recomputed forward's one serves it), revert works.

Tolerances: fp32 compute on the CPU: both sides multiply by the same dequantised W (bit-identical dequantisation,
tests/kernels/test_nf4.py); only the order of the LoRA products differs -> 1e-5 (REL_TOL fp32). bf16 compute:
both run bf16 GEMMs on the same W, rounding at different points (PEFT rounds each Linear's output, the fused op
rounds x A^T and accumulates into one buffer), so the two bf16 runs differ by bf16 noise of either (~2.5e-2 on a
LoRA grad here); judged as tests/patch/test_lora_patch.py does: against an fp32-compute copy with the same NF4
codes, novatune's bf16 run must be no further from it than PEFT + bnb's own bf16 run (x 1.5 + 5e-3, the
criterion of test_lora_patch.py's bf16 test; measured here: 3.1e-2 vs PEFT + bnb's 2.0e-2 on the worst grad).
"""
import pytest
import torch
from tiny_models import packed_batch

import novatune
from novatune.measure.numerics import assert_close
from novatune.patch import lora as lora_patch

peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes", reason="qlora needs bitsandbytes: pip install bitsandbytes")

LORA_ONLY = dict(rms_norm=False, swiglu=False, attention=False, cross_entropy=False)
# intermediate 128 (not 96): bnb 0.50.2's native CPU dequantize_4bit mis-handles rows like 96 elements (see
# tests/train/test_merge_export.py); the stock side of this comparison runs it
ARCH = dict(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, use_cache=False)


def _qlora(dtype):
    """bf16 init (same seed) quantised to NF4 with compute `dtype`: the codes do not depend on `dtype` (bnb's
    quantiser works on the fp32 values of the bf16 weights), so an fp32 copy is the bf16 run's exact reference."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from novatune.train.qlora import quantize_linears_

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**ARCH), dtype=torch.bfloat16).to(dtype)
    quantize_linears_(model, dtype)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules="all-linear")
    return peft.get_peft_model(model, cfg).train()


def _loss_and_grads(model, batch):
    ids, pos, lab = batch
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, position_ids=pos, labels=lab)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


BATCH = packed_batch([[5, 17, 1, 9], [32]], vocab=ARCH["vocab_size"])


def test_qlora_fused_matches_peft_bnb_fp32():
    pm = _qlora(torch.float32)
    batch, tol = BATCH, 1e-5
    loss_ref, grads_ref = _loss_and_grads(pm, batch)
    report = novatune.patch(pm, **LORA_ONLY)
    assert len(report.replaced("lora")) == 7 * ARCH["num_hidden_layers"], report
    assert not report.skipped("lora")
    q = pm.base_model.model.model.layers[0].self_attn.q_proj
    assert q.__dict__["forward"].__func__ is lora_patch.lora_linear_forward
    assert any("QLoRA" in str(r) for r in report.replaced("lora"))
    loss, grads = _loss_and_grads(pm, batch)
    assert_close(loss, loss_ref, tol, "loss")
    assert grads.keys() == grads_ref.keys() and len(grads) == 2 * 7 * ARCH["num_hidden_layers"]
    assert all("lora_" in n for n in grads), "only the adapters train (no W gradient)"
    for name in grads_ref:
        assert_close(grads[name], grads_ref[name], tol, name)
    report.revert()
    assert "forward" not in q.__dict__
    loss_back, _ = _loss_and_grads(pm, batch)
    assert torch.equal(loss_back, loss_ref)


def test_qlora_fused_bf16_no_further_from_fp32_than_stock():
    from novatune.measure.numerics import rel_err

    ref_loss, ref_grads = _loss_and_grads(_qlora(torch.float32), BATCH)
    pm = _qlora(torch.bfloat16)
    stock_loss, stock_grads = _loss_and_grads(pm, BATCH)
    novatune.patch(pm, **LORA_ONLY)
    loss, grads = _loss_and_grads(pm, BATCH)
    assert rel_err(loss, ref_loss) <= 1.5 * rel_err(stock_loss, ref_loss) + 5e-3
    for name, g in ref_grads.items():
        ours, stock = rel_err(grads[name], g), rel_err(stock_grads[name], g)
        assert ours <= 1.5 * stock + 5e-3, f"{name}: novatune {ours:.2e} vs PEFT+bnb {stock:.2e} from fp32"


def test_dequantised_weight_never_saved_for_backward():
    """The fused forward saves x, the adapters and x A^T; no (out, in) dense weight reaches autograd's saved set."""
    pm = _qlora(torch.float32)
    novatune.patch(pm, **LORA_ONLY)
    layer = pm.base_model.model.model.layers[0].mlp.up_proj  # (128, 64)
    x = torch.randn(3, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        y = layer(x)
    assert saved and (128, 64) not in saved and (64, 128) not in saved, saved
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_nf4_stand_in_built_once_and_rebuilt_for_a_new_weight():
    # the NF4 view of bnb's state is cached per layer (host time); a re-quantised base weight must not reuse it
    import bitsandbytes as bnb

    pm = _qlora(torch.float32)
    novatune.patch(pm, **LORA_ONLY)
    q = pm.base_model.model.model.layers[0].self_attn.q_proj
    _loss_and_grads(pm, BATCH)
    first = q._novatune_nf4[-1]
    loss1, _ = _loss_and_grads(pm, BATCH)
    assert q._novatune_nf4[-1] is first, "reused across calls"
    base = q.base_layer
    dense = bnb.functional.dequantize_4bit(base.weight.data, base.weight.quant_state) * 2  # a different weight
    base.weight = bnb.nn.Params4bit(dense.to(torch.bfloat16), requires_grad=False, quant_type="nf4",
                                    compress_statistics=True)._quantize("cpu")
    loss2, _ = _loss_and_grads(pm, BATCH)
    assert q._novatune_nf4[-1] is not first and q._novatune_nf4[-1].t.packed.data_ptr() == base.weight.data_ptr()
    assert not torch.equal(loss1, loss2)


def _fp32_stock_reference(checkpointing: bool):
    """The fp32-compute QLoRA model (optionally checkpointed) and PEFT + bnb stock's loss and grads on BATCH."""
    pm = _qlora(torch.float32)
    if checkpointing:
        pm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return (pm, *_loss_and_grads(pm, BATCH))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_dequantised_weight_kept_for_the_backward_only_under_checkpointing(checkpointing, monkeypatch):
    # inside a checkpointed layer the recomputed forward's dense W serves the backward (one dequantisation fewer
    # per linear); without checkpointing every layer would hold its dense W until the backward: never kept then
    from novatune.ops import nf4 as ops_nf4

    pm, loss_ref, grads_ref = _fp32_stock_reference(checkpointing)
    novatune.patch(pm, **LORA_ONLY)
    calls = {"n": 0}
    real = ops_nf4.nf4_dequantize

    def counting(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(ops_nf4, "nf4_dequantize", counting)
    ids, pos, lab = BATCH
    pm.zero_grad(set_to_none=True)
    loss = pm(input_ids=ids, position_ids=pos, labels=lab).loss
    calls["n"] = 0
    loss.backward()
    grads = {n: p.grad for n, p in pm.named_parameters() if p.grad is not None}
    linears = 7 * ARCH["num_hidden_layers"]
    # dequantisations during the backward: checkpointed, one per linear (the recomputed forward's, kept for dx);
    # not checkpointed, one per linear that needs dx (layer 0's q/k/v read the frozen embeddings: no dx)
    assert calls["n"] == (linears if checkpointing else linears - 3), calls
    q = pm.base_model.model.model.layers[0].self_attn.q_proj
    assert q._novatune_nf4[-1].keep_for_backward is checkpointing
    assert_close(loss, loss_ref, 1e-5, "loss")
    for name in grads_ref:
        assert_close(grads[name], grads_ref[name], 1e-5, name)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_qkv_grouped_in_the_patched_attention_equals_peft_bnb(checkpointing, monkeypatch):
    # with novatune's attention forward on packed rows, each layer's q/k/v QLoRA projections run as one grouped op
    # (one stacked dequantised weight, one big GEMM); loss and every LoRA gradient still equal PEFT + bnb stock's
    pm, loss_ref, grads_ref = _fp32_stock_reference(checkpointing)
    report = novatune.patch(pm, rms_norm=False, swiglu=False, cross_entropy=False)
    assert report.replaced("attention")
    calls = []
    real = lora_patch.lora_linear_group
    monkeypatch.setattr(lora_patch, "lora_linear_group", lambda *a, **k: calls.append(1) or real(*a, **k))
    from novatune.ops import nf4 as ops_nf4

    dequants = {"n": 0}
    real_dq = ops_nf4.nf4_dequantize
    monkeypatch.setattr(ops_nf4, "nf4_dequantize", lambda *a, **k: dequants.__setitem__("n", dequants["n"] + 1)
                        or real_dq(*a, **k))
    ids, pos, lab = BATCH
    pm.zero_grad(set_to_none=True)
    loss = pm(input_ids=ids, position_ids=pos, labels=lab).loss
    fwd_calls, dequants["n"] = len(calls), 0
    loss.backward()
    loss = loss.detach()
    grads = {n: p.grad.detach().clone() for n, p in pm.named_parameters() if p.grad is not None}
    layers = ARCH["num_hidden_layers"]
    assert fwd_calls == layers and len(calls) == layers * (2 if checkpointing else 1), "one per forward (+ recompute)"
    # dequantisations in the backward: checkpointed, the recompute's (7 per layer) and none more (the stacked q/k/v
    # and each o/gate/up/down weight kept for dx); not checkpointed, every linear that needs dx again (layer 0's
    # q/k/v read the frozen embeddings: no dx, no dequantisation)
    assert dequants["n"] == 7 * layers - (0 if checkpointing else 3), dequants
    # fp32: the patched attention (varlen reference on the CPU) vs sdpa with HF's packed mask: summation order
    assert_close(loss, loss_ref, 1e-5, "loss")
    assert grads.keys() == grads_ref.keys()
    for name in grads_ref:
        assert_close(grads[name], grads_ref[name], 1e-5, name)


def test_a_hook_on_a_projection_keeps_its_own_forward(monkeypatch):
    # the grouped op does not call the q/k/v modules: a hook on one of them (PEFT's adapter_names pre-hook, FSDP,
    # a user's) must see its module run, so the layer falls back to one call per projection
    pm = _qlora(torch.float32)
    novatune.patch(pm, rms_norm=False, swiglu=False, cross_entropy=False)
    seen = []
    q = pm.base_model.model.model.layers[0].self_attn.q_proj
    handle = q.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    calls = []
    real = lora_patch.lora_linear_group
    monkeypatch.setattr(lora_patch, "lora_linear_group", lambda *a, **k: calls.append(1) or real(*a, **k))
    loss_hooked, _ = _loss_and_grads(pm, BATCH)
    assert seen and len(calls) == ARCH["num_hidden_layers"] - 1, "layer 0 ungrouped, the others grouped"
    handle.remove()
    loss_plain, _ = _loss_and_grads(pm, BATCH)
    assert len(calls) == 2 * ARCH["num_hidden_layers"] - 1
    assert_close(loss_hooked, loss_plain, 1e-6, "same loss either way")
