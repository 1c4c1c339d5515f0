"""RoPE and Qwen3's fused q/k-norm + RoPE in the tune engine: registered, correct candidates accepted (fp32 and
bf16 on the CPU; the real Triton kernels under TRITON_INTERPRET=1), planted wrong ones rejected with the check
that should catch them, and the selection applied through the ops' dispatch hook. Small odd shapes (13 tokens
in 3 documents, GQA 3:1, head_dim 8): the interpreter runs one program at a time."""
from __future__ import annotations

import pytest
import torch

from novatune.ops import dispatch
from novatune.ops.contract import Candidate
from novatune.ops.qk_norm_rope import qk_norm_rope
from novatune.ops.registry import OPS
from novatune.ops.rope import apply_rope
from novatune.reference.qk_norm_rope import hf_qk_norm_rope
from novatune.reference.rope import hf_apply_rope
from novatune.tune import engine
from novatune.tune.calls import candidates
from novatune.tune.validate import validate

SHAPE = (13, 3, 1, 8)  # tokens, q heads, kv heads, head_dim (odd_shapes adds 37 and 1 tokens)
ROPE, QK = OPS["rope"], OPS["qk_norm_rope"]


def cand(op, name, fn, family="triton"):
    return Candidate(op, name, family, make=lambda: fn)


def check(spec, c, stock_fn, dtype=torch.float32, shapes=None):
    stock = cand(spec.name, "hf_eager", stock_fn, "eager")
    return validate(spec, c, stock, shapes or engine.odd_shapes(SHAPE, "cpu", spec), dtype, "cpu")


def _get(op, name, shape=SHAPE):
    return next(c for c in candidates(op, shape, torch.float32, "cpu") if c.name == name)


def test_registry_lists_rope_ops_with_their_families():
    assert {"rope", "qk_norm_rope"} <= set(OPS)
    for op in ("rope", "qk_norm_rope"):
        cs = {c.name: c for c in candidates(op, SHAPE, torch.float32, "cpu")}
        assert {c.family for c in cs.values()} == {"eager", "default", "triton", "compile"}
        assert not cs["hf_eager"].selectable  # the baseline is never chosen
        assert all(c.selectable for n, c in cs.items() if n != "hf_eager")
        assert OPS[op].applied_by == "dispatch" and OPS[op].outputs == ("out_q", "out_k")
    assert engine.odd_shapes(SHAPE, "cpu", ROPE) == [SHAPE, (37, 3, 1, 8), (1, 3, 1, 8)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op", ["rope", "qk_norm_rope"])
def test_default_and_stock_candidates_are_accepted(op, dtype):
    spec, stock = (ROPE, hf_apply_rope) if op == "rope" else (QK, hf_qk_norm_rope)
    for name in ("hf_eager", "novatune_default"):
        v = check(spec, _get(op, name), stock, dtype)
        assert v.ok, (name, v.check, v.reason)
        assert {"values", "fresh", "nan", "layout", "deterministic"} <= set(v.checks)
        if dtype == torch.float32:
            assert max(v.errors.values()) < 1e-5


@pytest.mark.parametrize("op,name", [("rope", "triton_v0"), ("qk_norm_rope", "triton_v4")])
def test_triton_variant_passes_every_check_including_poisoning(op, name):
    # the real kernels with a non-default launch config, through their out= launchers too (interpreter on the CPU)
    c = _get(op, name)
    if c.unavailable:
        pytest.skip(c.unavailable)
    spec, stock = (ROPE, hf_apply_rope) if op == "rope" else (QK, hf_qk_norm_rope)
    v = check(spec, c, stock, shapes=[SHAPE, (1, 3, 1, 8)])
    assert v.ok, (v.check, v.reason)
    assert "poisoned" in v.checks and "deterministic" in v.checks


def _rope_sign_flipped(q, k, cos, sin, unsqueeze_dim=1):
    # rotate_half as [x2, -x1]: a rotation by -theta (the backward's formula used in the forward)
    def rot(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x2, -x1), dim=-1)
    c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * c + rot(q) * s, k * c + rot(k) * s


def _rope_positions_from_zero(q, k, cos, sin, unsqueeze_dim=1):
    # ignores the per-token tables beyond the first document: as if positions ran 0..T-1 across the packed row
    t = q.shape[1]
    inv = 1.0 / (1e6 ** (torch.arange(0, q.shape[-1], 2, dtype=torch.float32) / q.shape[-1]))
    emb = torch.arange(t, dtype=torch.float32)[:, None] * inv[None]
    emb = torch.cat((emb, emb), -1)[None]
    return hf_apply_rope(q, k, emb.cos().to(q.dtype), emb.sin().to(q.dtype), unsqueeze_dim)


class _RopeWrongBwd(torch.autograd.Function):
    """Correct forward; backward applies the forward rotation again (forgets the transpose)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return hf_apply_rope(q, k, cos, sin, 2)

    @staticmethod
    def backward(ctx, gq, gk):
        cos, sin = ctx.saved_tensors
        dq, dk = hf_apply_rope(gq, gk, cos, sin, 2)
        return dq, dk, None, None


@pytest.mark.parametrize("fn,want", [
    (_rope_sign_flipped, "forward output out_q"),
    (_rope_positions_from_zero, "forward output"),
    (lambda q, k, cos, sin, u=1: _RopeWrongBwd.apply(q, k, cos, sin), "gradient of q"),
], ids=["rotate-half sign flipped", "positions not restarting", "backward not transposed"])
def test_rope_planted_wrong_candidates_are_rejected(fn, want):
    v = check(ROPE, cand("rope", "wrong", fn), hf_apply_rope)
    assert not v.ok and v.check == "values" and want in v.reason, (v.check, v.reason)


@pytest.mark.parametrize("fn,want", [
    (lambda q, k, wq, wk, eps, cos, sin: hf_qk_norm_rope(q, k, wq, wk, 1e-5, cos, sin), "forward output"),
    (lambda q, k, wq, wk, eps, cos, sin: hf_qk_norm_rope(q, k, wq, wq, eps, cos, sin), "forward output out_k"),
    (lambda q, k, wq, wk, eps, cos, sin: hf_apply_rope(q, k, cos, sin, 2), "forward output"),
], ids=["wrong eps", "k normed with q's weight", "norm skipped"])
def test_qk_norm_rope_planted_wrong_candidates_are_rejected(fn, want):
    v = check(QK, cand("qk_norm_rope", "wrong", fn), hf_qk_norm_rope)
    assert not v.ok and v.check == "values" and want in v.reason, (v.check, v.reason)


def test_a_candidate_returning_one_tensor_is_rejected_not_crashed():
    v = check(ROPE, cand("rope", "one", lambda q, k, cos, sin, u=1: hf_apply_rope(q, k, cos, sin, u)[0]),
              hf_apply_rope)
    assert not v.ok and v.check in ("values", "crashed"), (v.check, v.reason)


def test_selection_is_applied_through_the_dispatch_hook():
    gen = torch.Generator().manual_seed(0)
    r_in = ROPE.make_inputs(SHAPE, torch.float32, "cpu", gen)
    q_in = QK.make_inputs(SHAPE, torch.float32, "cpu", gen)
    r_args, q_args = tuple(r_in.values()), tuple(q_in.values())
    calls = []

    def spy(fn, op):
        def run(*args):
            calls.append(op)
            return fn(*args)
        return run
    table = {ROPE.call_signature(r_args): spy(hf_apply_rope, "rope"),
             QK.call_signature(q_args): spy(hf_qk_norm_rope, "qk_norm_rope")}
    assert ROPE.call_signature(r_args) == ("rope", SHAPE, "float32/float32", "cpu")
    prev = dispatch.install(table)
    try:
        got_r = apply_rope(*r_args)
        got_q = qk_norm_rope(*q_args)
        # (b, h, s, d) calls are not dispatched: entries were validated and timed in (b, s, h, d)
        apply_rope(r_in["q"].transpose(1, 2), r_in["k"].transpose(1, 2), r_in["cos"], r_in["sin"], 1)
    finally:
        dispatch.install(prev)
    assert calls == ["rope", "qk_norm_rope"]
    for a, b in zip(got_r + got_q, hf_apply_rope(*r_args) + hf_qk_norm_rope(*q_args)):
        torch.testing.assert_close(a, b)
    with dispatch.recording() as rec:  # the tune engine learns the real shapes this way
        apply_rope(*r_args)
        qk_norm_rope(*q_args)
    assert set(rec.seen) == set(table)
    assert dispatch.ACTIVE is prev


def test_spent_budget_keeps_the_default_instead_of_failing():
    # a tune that runs out of time before an op must still end with a choice for it: the stock baseline and
    # novatune's default are validated and timed, every other candidate is skipped with the reason
    entry, _ = engine.tune_op("rope", SHAPE, torch.float32, "cpu", iters=3, warmup=1, deadline=0.0,
                              log=lambda *_: None)
    assert entry["choice"] == "novatune_default"
    status = {r["name"]: r["status"] for r in entry["candidates"]}
    assert status["hf_eager"] == "timed" and status["novatune_default"] == "chosen"
    skipped = [r for r in entry["candidates"] if r["status"] == "skipped"]
    assert skipped and all(r["check"] == "budget" for r in skipped), skipped
