"""Model-level ops in the tune engine: linear cross-entropy modes and attention backends. Validation at small odd
shapes (fp32, CPU: the modes' plain-PyTorch paths; the Triton paths under TRITON_INTERPRET=1), planted wrong
candidates rejected, the memory rule with injected peak-memory figures, and patch applying a cached choice as
the model's cross_entropy_mode / attention backend."""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import novatune
from novatune.ops.contract import Candidate, doc_lengths
from novatune.ops.registry import OPS
from novatune.reference.attention import hf_attention
from novatune.reference.linear_cross_entropy import hf_linear_ce
from novatune.tune import engine
from novatune.tune.cache import TuneCache, environment
from novatune.tune.calls import candidates
from novatune.tune.measure import Timing
from novatune.tune.select import Measured, memory_filter
from novatune.tune.validate import validate

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "patch"))
from tiny_models import tiny_model  # noqa: E402

CE, ATTN = OPS["linear_cross_entropy"], OPS["attention"]
CE_SHAPE = (45, 24, 131)            # tokens >= hidden: "inplace" runs its own path; odd vocab
ATTN_SHAPE = (53, 4, 2, 16, 4)      # 4 uneven documents in one row, GQA 2


def cand(op, name, fn, family="triton", **kw):
    return Candidate(op, name, family, make=lambda: fn, **kw)


def check(spec, c, stock, shape):
    return validate(spec, c, stock, engine.odd_shapes(shape, "cpu", spec), torch.float32, "cpu")


CE_STOCK = cand("linear_cross_entropy", "hf_eager", hf_linear_ce, "eager")
ATTN_STOCK = cand("attention", "hf_eager", hf_attention, "eager")


# ----------------------------------------------------------------------------------------------- linear CE
def test_ce_odd_shapes_cover_the_inplace_path():
    assert engine.odd_shapes(CE_SHAPE, "cpu", CE) == [CE_SHAPE, (37, 24, 131), (61, 24, 131)]


@pytest.mark.parametrize("name", ["novatune_default", "mode_tokens", "mode_vocab", "mode_inplace"])
def test_ce_modes_are_accepted(name):
    shape = (17, 16, 67)  # small but odd (+ 37 and 53 tokens: "inplace" runs its own path at odd counts)
    c = next(c for c in candidates("linear_cross_entropy", shape, torch.float32, "cpu") if c.name == name)
    v = check(CE, c, CE_STOCK, shape)
    assert v.ok, (v.check, v.reason)
    assert max(v.errors.values()) < 1e-5 and {"values", "fresh", "nan", "layout"} <= set(v.checks)
    assert c.params["mode"] == name.replace("mode_", "").replace("novatune_default", "auto")


def _ce_counts_ignored(hidden, weight, labels):  # mean over ALL rows, ignored ones included in the divisor
    loss = F.cross_entropy((hidden @ weight.T).float(), labels, ignore_index=-100, reduction="sum")
    return loss / labels.numel()


def _ce_sum(hidden, weight, labels):
    return F.cross_entropy((hidden @ weight.T).float(), labels, ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("fn", [_ce_counts_ignored, _ce_sum], ids=["divisor counts ignored", "sum not mean"])
def test_ce_planted_wrong_candidates_are_rejected(fn):
    v = check(CE, cand("linear_cross_entropy", "wrong", fn), CE_STOCK, CE_SHAPE)
    assert not v.ok and v.check == "values" and "forward output" in v.reason, (v.check, v.reason)


def test_ce_baselines_are_not_selectable():
    cs = {c.name: c for c in candidates("linear_cross_entropy", CE_SHAPE, torch.float32, "cpu")}
    assert not cs["hf_eager"].selectable and not cs["torch_compile"].selectable
    assert all(cs[n].selectable for n in ("novatune_default", "mode_tokens", "mode_vocab", "mode_inplace"))


# ----------------------------------------------------------------------------------------------- memory rule
def test_memory_filter_drops_candidates_above_the_default_peak():
    ms = [Measured("novatune_default", 2, 100.0, 1.0, 1000), Measured("mode_tokens", 3, 50.0, 1.0, 2000),
          Measured("mode_inplace", 3, 80.0, 1.0, 1000)]
    allowed, excluded, note = memory_filter(ms, "novatune_default")
    assert [m.name for m in allowed] == ["novatune_default", "mode_inplace"]
    assert "mode_tokens" in excluded and "allow-more-memory" in excluded["mode_tokens"]
    assert len(memory_filter(ms, "novatune_default", allow_more=True)[0]) == 3
    unmeasured = [Measured("novatune_default", 2, 100.0, 1.0), Measured("mode_tokens", 3, 50.0, 1.0)]
    assert len(memory_filter(unmeasured, "novatune_default")[0]) == 2  # off CUDA: rule not applied, with a note


def _injected_tune(monkeypatch, allow):
    """tune_op over fakes: mode_tokens is fastest but peaks above the default; mode_vocab faster than the default
    at the same peak. Timings and peaks injected; the candidates are correct, so all validate."""
    ops = {}
    for name, fam, us, peak in [("hf_eager", "eager", 900.0, 5000), ("novatune_default", "default", 100.0, 1000),
                                ("mode_tokens", "triton", 40.0, 3000), ("mode_vocab", "triton", 70.0, 1000)]:
        def fn(h, w, y):  # a distinct function per candidate: the fake timings are looked up by its id
            return hf_linear_ce(h, w, y)

        ops[name] = (Candidate("linear_cross_entropy", name, fam, make=lambda fn=fn: fn,
                               selectable=name != "hf_eager"), fn, us, peak)
    by_fn = {id(v[1]): v for v in ops.values()}
    monkeypatch.setattr(engine, "candidates", lambda *a, **k: [v[0] for v in ops.values()])
    monkeypatch.setattr(engine, "time_fwd_bwd", lambda spec, fn, sets, **k: Timing(by_fn[id(fn)][2], 1.0, 5, "x"))
    monkeypatch.setattr(engine, "peak_extra_bytes", lambda spec, fn, sets: by_fn[id(fn)][3])
    monkeypatch.setattr(engine, "kernel_us", lambda *a, **k: None)
    return engine.tune_op("linear_cross_entropy", (9, 8, 17), torch.float32, "cpu", allow_more_memory=allow,
                          log=lambda *a: None)[0]


def test_memory_rule_in_tune_op_with_injected_measurements(monkeypatch):
    e = _injected_tune(monkeypatch, allow=False)
    assert e["choice"] == "mode_vocab" and "memory rule" in e["memory_rule"]
    recs = {r["name"]: r for r in e["candidates"]}
    assert recs["mode_tokens"]["status"] == "timed" and "peak memory" in recs["mode_tokens"]["excluded"]
    assert {n: r["peak_bytes"] for n, r in recs.items()} == {"hf_eager": 5000, "novatune_default": 1000,
                                                             "mode_tokens": 3000, "mode_vocab": 1000}
    assert "baseline" in recs["hf_eager"]["note"]  # timed for the report, never chosen
    assert e["chosen_peak_bytes"] == 1000 and e["default_peak_bytes"] == 1000


def test_allow_more_memory_lifts_the_rule(monkeypatch):
    e = _injected_tune(monkeypatch, allow=True)
    assert e["choice"] == "mode_tokens" and "off" in e["memory_rule"]


def test_cli_has_allow_more_memory_flag():
    from novatune.commands.tune import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["x.yaml", "--allow-more-memory"]).allow_more_memory
    assert not p.parse_args(["x.yaml"]).allow_more_memory


# ----------------------------------------------------------------------------------------------- attention
def test_doc_lengths_are_uneven_and_cover_the_tokens():
    lens = doc_lengths(53, 4)
    assert sum(lens) == 53 and len(lens) == 4 and len(set(lens)) > 1 and min(lens) >= 1
    assert doc_lengths(3, 5) == [1, 1, 1]


@pytest.mark.parametrize("name", ["novatune_default", "backend_reference", "backend_sdpa_docs"])
def test_attention_backends_are_accepted(name):
    c = next(c for c in candidates("attention", ATTN_SHAPE, torch.float32, "cpu") if c.name == name)
    v = check(ATTN, c, ATTN_STOCK, ATTN_SHAPE)
    assert v.ok, (v.check, v.reason)
    assert max(v.errors.values()) < 1e-5 and {"values", "nan", "layout"} <= set(v.checks)


def test_cuda_backends_are_skipped_on_the_cpu_with_a_reason():
    cs = {c.name: c for c in candidates("attention", ATTN_SHAPE, torch.float32, "cpu")}
    for name in ("backend_varlen", "backend_flash", "backend_flex"):
        assert cs[name].unavailable and "CUDA" in cs[name].unavailable
        v = check(ATTN, cs[name], ATTN_STOCK, ATTN_SHAPE)
        assert not v.ok and v.check == "available"


def _plain_causal(q, k, v, packed):  # ignores the document boundaries: attends across documents
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    return o[0].transpose(0, 1)


def _wrong_gqa(q, k, v, packed):  # query head h reads kv head h % hk instead of h // G
    g = q.shape[1] // k.shape[1]
    return hf_attention(q, k.repeat(1, g, 1), v.repeat(1, g, 1), packed)


def _nan_leak(q, k, v, packed):  # right values, but a NaN anywhere poisons the whole output
    out = hf_attention(q, k, v, packed)
    return out + 0.0 * v.sum()


@pytest.mark.parametrize("fn,want", [(_plain_causal, "values"), (_wrong_gqa, "values"), (_nan_leak, "nan")],
                         ids=["cross-document", "wrong GQA mapping", "NaN leaks across documents"])
def test_attention_planted_wrong_candidates_are_rejected(fn, want):
    v = check(ATTN, cand("attention", "wrong", fn), ATTN_STOCK, ATTN_SHAPE)
    assert not v.ok and v.check == want, (v.check, v.reason)


def test_attention_reference_matches_the_math():
    inputs = ATTN.make_inputs((7, 2, 1, 4, 2), torch.float32, "cpu", torch.Generator().manual_seed(0))
    out = ATTN.reference(inputs["q"], inputs["k"], inputs["v"], inputs["packed"])
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    t = 5  # second document starts at doc_lengths(7, 2)[0]
    a = doc_lengths(7, 2)[0]
    s = (q[t, 1] @ k[a:t + 1, 0].T) / math.sqrt(4)
    assert torch.allclose(out[t, 1], torch.softmax(s, -1) @ v[a:t + 1, 0], atol=1e-6)


# ----------------------------------------------------------------------------------------------- patch applies
def _put(cache, op, shape, choice, params):
    cache.put({"op": op, "shape": list(shape), "dtype": "float32", "layout": OPS[op].layout,
               "env": environment("cpu"), "choice": choice, "params": params, "family": "triton",
               "reason": "injected", "chosen_us": 1.0, "default_us": 2.0, "kept": True, "candidates": [],
               "applied_by": "patch"})


def test_patch_applies_cached_ce_mode_and_attention_backend(tmp_path):
    cache = TuneCache(tmp_path / "tune_cache.json")
    _put(cache, "linear_cross_entropy", (4096, 64, 257), "mode_vocab", {"mode": "vocab"})
    _put(cache, "linear_cross_entropy", (100, 64, 257), "mode_tokens", {"mode": "tokens"})  # other token count
    _put(cache, "linear_cross_entropy", (4096, 32, 257), "mode_inplace", {"mode": "inplace"})  # other model
    _put(cache, "attention", (4096, 4, 2, 16, 4), "backend_reference", {"backend": "reference"})
    cache.save()
    model = tiny_model("qwen3")
    rep = novatune.patch(model)  # tune_tokens 4096: the exact token count wins
    assert model._novatune_ce_mode == "vocab"
    backends = {m._novatune_attn_backend for m in model.modules() if "_novatune_attn_backend" in m.__dict__}
    assert backends == {"reference"}
    assert {c["choice"] for c in rep.choices} == {"mode_vocab", "backend_reference"}
    assert "tuned" in str(rep) and "mode_vocab" in str(rep)
    ids = torch.randint(0, 257, (1, 12))
    model.train()
    model(input_ids=ids, labels=ids, position_ids=torch.arange(12)[None], use_cache=False).loss.backward()
    rep.revert()
    assert "_novatune_ce_mode" not in model.__dict__

    model2 = tiny_model("qwen3")
    rep2 = novatune.patch(model2, cross_entropy_mode="tokens", attention="sdpa")  # explicit settings win
    assert model2._novatune_ce_mode == "tokens"
    assert rep2.choices == [] and sum("explicit setting" in e.detail for e in rep2.entries) == 2
    rep2.revert()
