"""A spec never binds a forward that computes something else: sliding windows are applied per document (against
the stock model run on each document alone, eager attention, documents longer than the window), and a config
attribute that changes the math but is not declared by the family spec is refused with the reason.

Tolerance: fp32; the patched path differs from stock in summation order only -> 2e-5 relative (as test_patch.py)."""
import pytest
import torch
import transformers
from tiny_models import FAMILIES, packed_batch, train_eval_generate_warning_free

import novatune
from novatune.measure.numerics import assert_close

TOL = 2e-5
ROWS = [[5, 19, 8], [32]]  # documents of 19 and 32 tokens are longer than the window
WINDOW = 6
# per family: config overrides that switch sliding windows on the way the family does it
WINDOWED = {
    "mistral": dict(sliding_window=WINDOW),  # every layer, from the config
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),  # layer 1 only
    "qwen3": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
}


def build(family, attn="eager", **overrides):
    cls_name, kw = FAMILIES[family]
    cfg = getattr(transformers, cls_name)(**{**kw, **overrides})
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def per_document_logits(model, ids, pos):
    """The stock model on each document alone: the reference for packed rows."""
    out = []
    for r in range(ids.shape[0]):
        starts = (pos[r] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
        row = [model(input_ids=ids[r:r + 1, a:b]).logits for a, b in zip(starts, starts[1:])]
        out.append(torch.cat(row, dim=1))
    return torch.cat(out, dim=0)


def grads_of(model, logits, weights):
    model.zero_grad(set_to_none=True)
    (logits * weights).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_sliding_window_per_document_equals_stock(family):
    ids, pos, _ = packed_batch(ROWS)
    model = build(family, **WINDOWED[family])
    model.train()
    assert any(getattr(m, "sliding_window", None) for m in model.modules()) or model.config.sliding_window
    ref = per_document_logits(model, ids, pos)
    weights = torch.randn_like(ref)
    ref_grads = grads_of(model, ref, weights)
    full = per_document_logits(build(family, **{**WINDOWED[family], "sliding_window": None,
                                                "use_sliding_window": False}), ids, pos)
    assert (full - ref).abs().max() > 1e-3, "the window must change this batch's result, or the test proves nothing"

    report = novatune.patch(model)
    assert not report.skipped(), str(report)
    assert any("sliding window 6 per document" in e.detail for e in report.replaced("attention"))
    logits = model(input_ids=ids, position_ids=pos).logits
    assert_close(logits, ref, TOL, "logits")
    grads = grads_of(model, logits, weights)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        assert_close(grads[name], ref_grads[name], TOL, name)


@pytest.mark.parametrize("family,overrides,kind,needle", [
    ("qwen3", dict(attn_logit_softcapping=30.0), "attention", "attn_logit_softcapping=30.0"),
    ("llama", dict(partial_rotary_factor=0.5), "attention", "partial rotary"),
    ("llama", dict(sliding_window=8), "attention", "sliding_window=8"),
    ("mistral", dict(layer_types=["sliding_attention", "full_attention"]), "attention", "layer_types"),
    ("qwen2", dict(final_logit_softcapping=15.0), "cross_entropy", "final logit soft-capping"),
    ("qwen3", dict(query_pre_attn_scalar=144), "attention", "query_pre_attn_scalar"),
])
def test_undeclared_math_attribute_is_refused_with_reason(family, overrides, kind, needle):
    model = build(family, attn="sdpa", **overrides)
    report = novatune.patch(model)
    skipped = report.skipped(kind)
    assert skipped and all(needle in e.detail and "does not implement" in e.detail for e in skipped), str(report)
    assert not report.replaced(kind)
    with pytest.raises(RuntimeError, match=needle):
        report.revert()
        novatune.patch(build(family, attn="sdpa", **overrides), strict=True)


def test_model_level_attribute_refuses_the_whole_model():
    model = build("llama", attn="sdpa", embedding_multiplier=12.0)
    report = novatune.patch(model)
    assert not report.replaced()
    assert "embedding_multiplier=12.0" in report.skipped("model")[0].detail
    assert "forward" not in model.__dict__


def test_quirk_refusals_are_computed_once_per_model(monkeypatch):
    """The config's math attributes are read once per patch(), not again for the module walk."""
    from novatune.patch import quirks

    calls = []
    real = quirks.refusals
    monkeypatch.setattr(quirks, "refusals", lambda config, spec: calls.append(spec.name) or real(config, spec))
    report = novatune.patch(build("mistral", attn="sdpa", sliding_window=WINDOW))
    assert report.replaced("attention") and calls == ["mistral"]


def test_attention_module_with_undeclared_qk_norm_is_refused():
    model = build("llama", attn="sdpa")
    attn = model.model.layers[0].self_attn
    attn.q_norm = torch.nn.Identity()
    report = novatune.patch(model)
    (entry,) = [e for e in report.skipped("attention")]
    assert entry.path == "model.layers.0.self_attn" and "q/k norms" in entry.detail


def test_attention_module_with_undeclared_sinks_is_refused():
    """Only a spec that declares sinks (gpt_oss) gets them applied; on any other family they refuse the module."""
    model = build("qwen2", attn="sdpa")
    model.model.layers[1].self_attn.sinks = torch.nn.Parameter(torch.zeros(4))
    report = novatune.patch(model)
    (entry,) = [e for e in report.skipped("attention")]
    assert entry.path == "model.layers.1.self_attn" and "sinks" in entry.detail


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_patched_model_emits_no_deprecation_warning(family):
    """Training forward + backward, eval forward and a short generation of a patched model, with transformers'
    FutureWarning / DeprecationWarning turned into errors (e.g. naming the deprecated `past_key_values`)."""
    ids, pos, lab = packed_batch(ROWS)
    model = build(family, attn="sdpa")
    novatune.patch(model)
    train_eval_generate_warning_free(model, ids, pos, lab, new_tokens=3)


def test_unsupported_transformers_is_refused_with_the_range(monkeypatch):
    from novatune.patch import versions

    monkeypatch.setattr(versions, "installed_transformers", lambda: "5.40.0")
    with pytest.raises(RuntimeError, match=r"transformers >=5\.17,<5\.40 \(found 5\.40\.0\)"):
        novatune.patch(build("llama", attn="sdpa"))
    monkeypatch.setattr(versions, "installed_transformers", lambda: "5.16.2")
    with pytest.raises(RuntimeError, match="found 5.16.2"):
        novatune.patch(build("llama", attn="sdpa"))
    versions.check_transformers("5.17.0")
    versions.check_transformers("5.39.0.dev0")
