"""novatune.patch on PEFT LoRA models of every family: the fused LoRA linear replaces every attention/MLP projection's
PEFT forward, computes what PEFT computes (loss and every gradient), keeps PEFT's dropout draws, reverts, and
reports what it cannot fuse.

Tolerances: fp32 on the CPU. LoRA alone (everything else stock): the same products in another order -> 1e-5.
The whole patch (fused attention, norms, loss as well): TOL of tests/patch/test_patch.py (2e-5). bf16 with PEFT's
fp32 adapters: judged against an fp32 copy of the model, no further from it than PEFT's own bf16 run (see the test).
"""
import pytest
import torch
from tiny_models import FAMILIES, packed_batch, tiny_model
from torch import nn

import novatune
from novatune.measure.numerics import assert_close
from novatune.patch import lora as lora_patch

peft = pytest.importorskip("peft")

ROWS = [[5, 17, 1, 9], [32]]
PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RUNTIME = lora_patch.RUNTIME_NOTE
LORA_ONLY = dict(rms_norm=False, swiglu=False, attention=False, cross_entropy=False)  # everything else stock


def _peft(family, dropout=0.0, dtype=torch.float32, targets=PROJ, **lora_kw):
    model = tiny_model(family, dtype=dtype).train()
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, init_lora_weights=False, target_modules=targets,
                          **lora_kw)
    return peft.get_peft_model(model, cfg)


def _loss_and_grads(model, batch, seed=0):
    ids, pos, lab = batch
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the dropout masks
    out = model(input_ids=ids, position_ids=pos, labels=lab)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(got, ref, tol):
    (loss, grads), (loss_ref, grads_ref) = got, ref
    assert_close(loss, loss_ref, tol, "loss")
    assert grads.keys() == grads_ref.keys() and sum("lora_" in n for n in grads) == 2 * len(PROJ) * 2
    for name in grads_ref:
        assert_close(grads[name], grads_ref[name], tol, name)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_projection_replaced_and_reverted(family):
    pm = _peft(family)
    keys = list(pm.state_dict())
    report = novatune.patch(pm)
    assert len(report.replaced("lora")) == len(PROJ) * pm.config.num_hidden_layers
    assert not report.skipped("lora")
    q = pm.base_model.model.model.layers[0].self_attn.q_proj
    assert q.__dict__["forward"].__func__ is lora_patch.lora_linear_forward
    assert list(pm.state_dict()) == keys, "parameters and state_dict keys unchanged"
    assert any(RUNTIME in e.detail for e in report.entries if e.action == "note")
    report.revert()
    assert "forward" not in q.__dict__ and "_novatune_lora" not in q.__dict__


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_lora_only_patch_equals_peft_stock(family):
    batch = packed_batch(ROWS)
    pm = _peft(family)
    ref = _loss_and_grads(pm, batch)
    report = novatune.patch(pm, **LORA_ONLY)
    _assert_same(_loss_and_grads(pm, batch), ref, 1e-5)
    report.revert()
    loss_back, _ = _loss_and_grads(pm, batch)
    assert torch.equal(loss_back, ref[0]), "after revert PEFT's forward runs again, bit for bit"


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_full_patch_with_lora_equals_peft_stock(family):
    """Fused attention, norms, SwiGLU MLP (which calls the LoRA-wrapped projections) and loss, all at once."""
    batch = packed_batch(ROWS)
    pm = _peft(family)
    ref = _loss_and_grads(pm, batch)
    novatune.patch(pm)
    _assert_same(_loss_and_grads(pm, batch), ref, 2e-5)


@pytest.mark.parametrize("ckpt", [False, True], ids=["", "checkpointing"])
def test_dropout_exact_parity_with_peft(ckpt):
    """lora_dropout > 0: the same seed gives PEFT's masks, so loss and gradients match PEFT stock in train mode."""
    batch = packed_batch(ROWS)
    pm = _peft("qwen3", dropout=0.3)
    if ckpt:
        pm.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref = _loss_and_grads(pm, batch, seed=7)
    other = _loss_and_grads(pm, batch, seed=8)
    assert not torch.equal(other[0], ref[0]), "the masks must matter, or this test proves nothing"
    report = novatune.patch(pm)
    assert all("exact path" in e.detail for e in report.replaced("lora"))
    _assert_same(_loss_and_grads(pm, batch, seed=7), ref, 2e-5)
    pm.eval()  # dropout off: the fast path, and still PEFT's numbers
    with torch.no_grad():
        ids, pos, lab = batch
        got = pm(input_ids=ids, position_ids=pos, labels=lab).loss
        report.revert()
        want = pm(input_ids=ids, position_ids=pos, labels=lab).loss
    assert_close(got, want, 2e-5, "eval loss")


def test_fused_forward_runs_inside_the_fused_mlp_and_attention(monkeypatch):
    calls = []
    real = lora_patch.lora_linear
    monkeypatch.setattr(lora_patch, "lora_linear", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    pm = _peft("qwen3")
    report = novatune.patch(pm)
    assert report.replaced("mlp") and report.replaced("attention")
    _loss_and_grads(pm, packed_batch(ROWS))
    assert len(calls) == len(PROJ) * pm.config.num_hidden_layers


def test_state_changes_after_patching_run_peft_forward():
    """Disabling, merging or switching adapters after the patch: PEFT's own forward (its semantics) runs."""
    batch = packed_batch(ROWS)
    ids, pos, lab = batch
    pm = _peft("llama")
    with torch.no_grad():
        with pm.disable_adapter():
            base_ref = pm(input_ids=ids, position_ids=pos, labels=lab).loss
        lora_ref = pm(input_ids=ids, position_ids=pos, labels=lab).loss
    novatune.patch(pm, **LORA_ONLY)
    with torch.no_grad():
        with pm.disable_adapter():
            assert torch.equal(pm(input_ids=ids, position_ids=pos, labels=lab).loss, base_ref)
        pm.merge_adapter()
        assert_close(pm(input_ids=ids, position_ids=pos, labels=lab).loss, lora_ref, 1e-5, "merged")
        pm.unmerge_adapter()
        assert_close(pm(input_ids=ids, position_ids=pos, labels=lab).loss, lora_ref, 1e-5, "unmerged")


def test_bf16_model_with_peft_fp32_adapters():
    """PEFT upcasts adapters to fp32 on a bf16 model; the fused op runs the LoRA GEMMs in bf16 and returns fp32
    adapter gradients. Both bf16 runs are judged against the same model in fp32: PEFT's own bf16 error there is
    2-6% on these tiny layers (bf16 activations through two layers and back), so novatune must be as close to
    fp32 as PEFT is, not bitwise equal to PEFT. One tensor's error is the bf16 noise of the whole small network and
    moves with the CPU's bf16 GEMMs (measured on an AMX machine: 0.8-1.65x PEFT's per tensor, 1.0x on average), so
    each tensor is held to 2x PEFT's + 5e-3 and the mean over all adapter tensors to 1.2x PEFT's mean."""
    import copy

    from novatune.measure.numerics import rel_err

    batch = packed_batch(ROWS)
    pm = _peft("qwen3", dtype=torch.bfloat16)
    q = pm.base_model.model.model.layers[0].self_attn.q_proj
    assert q.lora_A["default"].weight.dtype == torch.float32 and q.base_layer.weight.dtype == torch.bfloat16
    loss32, grads32 = _loss_and_grads(copy.deepcopy(pm).float(), batch)
    loss_peft, grads_peft = _loss_and_grads(pm, batch)
    novatune.patch(pm, **LORA_ONLY)
    loss, grads = _loss_and_grads(pm, batch)
    assert abs(loss - loss32) <= 1.5 * abs(loss_peft - loss32) + 5e-3 * abs(loss32)
    assert grads.keys() == grads_peft.keys()
    errs, errs_peft = [], []
    for name in grads_peft:
        assert grads[name].dtype == grads_peft[name].dtype
        err, err_peft = rel_err(grads[name], grads32[name]), rel_err(grads_peft[name], grads32[name])
        assert err <= 2 * err_peft + 5e-3, f"{name}: {err:.2e} vs PEFT's own {err_peft:.2e}"
        errs.append(err), errs_peft.append(err_peft)
    assert sum(errs) <= 1.2 * sum(errs_peft), f"mean {sum(errs) / len(errs):.2e} vs {sum(errs_peft) / len(errs):.2e}"


class _QuantisedLinear(nn.Linear):
    """Stands in for a quantised base layer (bnb Linear4bit subclasses nn.Linear too)."""


def test_unsupported_layers_are_skipped_with_reasons():
    # DoRA on one family, lora_bias on another target set, lm_head targeted, a "quantised" base layer
    dora = novatune.patch(_peft("qwen3", use_dora=True), **LORA_ONLY)
    assert len(dora.skipped("lora")) == 14 and "variant" in dora.skipped("lora")[0].detail
    bias = novatune.patch(_peft("qwen2", lora_bias=True), **LORA_ONLY)
    assert "lora_bias" in bias.skipped("lora")[0].detail and not bias.replaced("lora")
    head = novatune.patch(_peft("llama", targets=["q_proj", "lm_head"]), **LORA_ONLY)
    assert len(head.replaced("lora")) == 2
    (skip,) = head.skipped("lora")
    assert skip.path == "lm_head" and "outside the attention/MLP" in skip.detail
    pm = _peft("mistral", targets=["q_proj", "v_proj"])
    v = pm.base_model.model.model.layers[1].self_attn.v_proj
    old = v.base_layer
    v.base_layer = _QuantisedLinear(old.in_features, old.out_features, bias=False)
    rep = novatune.patch(pm, **LORA_ONLY)
    (skip,) = rep.skipped("lora")
    assert skip.path.endswith("layers.1.self_attn.v_proj") and "not a plain nn.Linear" in skip.detail
    assert len(rep.replaced("lora")) == 3
    off = novatune.patch(_peft("qwen3"), lora=False, **LORA_ONLY)
    assert {e.detail for e in off.skipped("lora")} == {"lora=False"} and not off.replaced("lora")
    assert "skipped" in str(off)


def test_merged_and_multiple_active_adapters_are_skipped():
    pm = _peft("qwen3", targets=["q_proj"])
    pm.merge_adapter()
    rep = novatune.patch(pm, **LORA_ONLY)
    assert len(rep.skipped("lora")) == 2 and "merged" in rep.skipped("lora")[0].detail
    rep.revert()
    pm.unmerge_adapter()
    pm.add_adapter("second", peft.LoraConfig(r=2, target_modules=["q_proj"]))
    pm.base_model.set_adapter(["default", "second"])
    rep = novatune.patch(pm, **LORA_ONLY)
    assert len(rep.skipped("lora")) == 2 and "2 active adapters" in rep.skipped("lora")[0].detail


def test_the_fused_lora_mlp_writes_its_gradients_over_gate_and_up(monkeypatch):
    """The fused LoRA layer returns its output as a view of a buffer made inside its autograd Function: an
    intermediate the fused MLP owns, so swiglu's backward still writes the two gradients over gate and up (the two
    activation-sized buffers it saves per layer)."""
    import importlib

    swiglu_module = importlib.import_module("novatune.ops.swiglu")  # the module (novatune.ops.swiglu: the function)
    decided = []
    real = swiglu_module.may_write_over

    def spy(*tensors):
        decided.append(real(*tensors))
        return decided[-1]

    monkeypatch.setattr(swiglu_module, "may_write_over", spy)
    pm = _peft("llama")
    report = novatune.patch(pm)
    assert report.replaced("mlp") and report.replaced("lora")
    _loss_and_grads(pm, packed_batch(ROWS))
    assert decided and all(decided), decided
