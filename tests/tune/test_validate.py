"""The validator rejects each planted wrong candidate with the check that should catch it, and accepts the
correct ones. fp32 on the CPU at small odd shapes: the bound is then max(2 x the stock error ~1e-7, 1e-5), so every
planted fault below (errors 1e-3 .. 1) is far outside it and every correct candidate (error ~1e-7) far inside."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from novatune.ops.contract import Candidate
from novatune.ops.registry import OPS
from novatune.reference.rms_norm import hf_rms_norm
from novatune.reference.swiglu import hf_swiglu
from novatune.tune.calls import candidates
from novatune.tune.validate import validate

RMS_NORM, SWIGLU = OPS["rms_norm"], OPS["swiglu"]

SHAPES = [(6, 32), (1, 32), (5, 32)]  # first = "real", then odd row counts


def cand(name, fn, family="triton", kernels=None, deterministic=True, op="rms_norm"):
    return Candidate(op, name, family, make=lambda: fn, kernels=kernels, deterministic=deterministic)


STOCK = cand("hf_eager", hf_rms_norm, family="eager")


def check(c, spec=RMS_NORM, stock=STOCK, shapes=SHAPES, dtype=torch.float32):
    return validate(spec, c, stock, shapes, dtype, "cpu")


class _WrongDx(torch.autograd.Function):
    """Correct forward; dx forgets the mean term (-xhat * mean(g * xhat)): a classic hand-derived mistake."""

    @staticmethod
    def forward(ctx, x, w, eps):
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, w, rstd)
        return w * (x.float() * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, w, rstd = ctx.saved_tensors
        xhat = x.float() * rstd
        return (dy * w * rstd).to(x.dtype), (dy * xhat).reshape(-1, x.shape[-1]).sum(0), None


def _stale():
    memo = {}

    def fn(x, w, eps):  # returns the first result it computed for a shape, whatever the inputs now are
        if x.shape not in memo:
            memo[x.shape] = hf_rms_norm(x, w, eps)
        return memo[x.shape]
    return fn


def _partial_kernels():
    """out= path writes every row but the last (as a launcher whose grid came from a stale row count would)."""
    def fwd(x, w, eps, out=None, rstd=None):
        y, r = hf_rms_norm(x, w, eps).detach(), torch.rsqrt(x.float().pow(2).mean(-1) + eps)
        out[:-1].copy_(y[:-1])
        rstd.copy_(r)
        return out, rstd

    def bwd(dy, x, w, rstd, dx=None, dw=None):
        xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
        gx, gw = torch.autograd.grad(hf_rms_norm(xl, wl, 1e-6), (xl, wl), dy)
        dx.copy_(gx)
        dw.copy_(gw)
        return dx, dw
    return SimpleNamespace(fwd=fwd, bwd=bwd)


def _strided_blind(x, w, eps):
    # reads x's storage as if it were contiguous: right for contiguous inputs, wrong for strided views
    raw = torch.as_strided(x, x.shape, (x.shape[-1], 1), x.storage_offset())
    return hf_rms_norm(raw, w, eps)


def _jitter(x, w, eps):
    y = hf_rms_norm(x, w, eps)
    return y * (1 + 1e-6 * torch.randn_like(y))  # inside the 1e-5 bound, but not bitwise reproducible


PLANTED = {
    "wrong eps": (lambda x, w, eps: hf_rms_norm(x, w, 1e-5), "values", "forward output"),
    "skipped weight": (lambda x, w, eps: hf_rms_norm(x, torch.ones_like(w), eps), "values", "forward output"),
    "wrong gradient": (lambda x, w, eps: _WrongDx.apply(x, w, eps), "values", "gradient of x"),
    "stale output": (None, "fresh", "forward output"),
    "downcast": (lambda x, w, eps: hf_rms_norm(x.bfloat16(), w.bfloat16(), eps).float(), "values", "relative error"),
    "swallowed NaN": (lambda x, w, eps: torch.nan_to_num(hf_rms_norm(x, w, eps)), "nan", "swallowed NaN"),
    "strided inputs": (_strided_blind, "layout", "relative error"),
    "nondeterministic": (_jitter, "deterministic", "differ"),
}


@pytest.mark.parametrize("fault", sorted(PLANTED))
def test_planted_fault_is_rejected_with_its_reason(fault):
    fn, want_check, want_text = PLANTED[fault]
    v = check(cand(fault, fn if fn is not None else _stale()))
    assert not v.ok
    assert v.check == want_check, (v.check, v.reason)
    assert want_text in v.reason, v.reason


def test_partly_written_output_is_caught_by_poisoning():
    # the functional path is right; only the preallocated-output path leaves the last row unwritten
    v = check(cand("partial", hf_rms_norm, kernels=_partial_kernels))
    assert not v.ok and v.check == "poisoned", (v.check, v.reason)
    assert "unwritten" in v.reason and "out" in v.reason


def test_nondeterminism_is_allowed_where_not_promised():
    v = check(cand("jitter", _jitter, deterministic=False))
    assert v.ok, v.reason
    assert "deterministic" not in v.checks


@pytest.mark.parametrize("name", ["hf_eager", "torch_native", "novatune_default"])
def test_correct_rms_norm_candidates_are_accepted(name):
    c = next(c for c in candidates("rms_norm", SHAPES[0], torch.float32, "cpu") if c.name == name)
    v = check(c)
    assert v.ok, (v.check, v.reason)
    assert max(v.errors.values()) < 1e-5  # fp32: reordered reductions only
    assert {"values", "fresh", "nan", "layout"} <= set(v.checks)


def test_triton_kernel_candidate_passes_every_check_including_poisoning():
    # the real Triton kernels (interpreter on the CPU), through their out= launchers too
    c = next(c for c in candidates("rms_norm", (6, 32), torch.float32, "cpu") if c.name == "triton_v0")
    if c.unavailable:
        pytest.skip(c.unavailable)
    v = check(c, shapes=[(6, 32), (1, 32)])
    assert v.ok, (v.check, v.reason)
    assert "poisoned" in v.checks and "deterministic" in v.checks


def test_swiglu_correct_accepted_and_swapped_operands_rejected():
    stock = cand("hf_eager", hf_swiglu, family="eager", op="swiglu")
    shapes = [(4, 24), (1, 24)]
    good = check(cand("default", next(c for c in candidates("swiglu", (4, 24), torch.float32, "cpu")
                                      if c.name == "novatune_default").functional(), op="swiglu"),
                 spec=SWIGLU, stock=stock, shapes=shapes)
    assert good.ok, (good.check, good.reason)
    bad = check(cand("swapped", lambda g, u, *, inplace_backward=False: hf_swiglu(u, g), op="swiglu"), spec=SWIGLU,
                stock=stock, shapes=shapes)
    assert not bad.ok and bad.check == "values"


def test_candidate_with_keyword_only_flag_is_validated_through_the_contract():
    """A swiglu taking inplace_backward by keyword only (the public signature) is called as the op's contract
    says, in every check (values, layout, NaN, timing), and accepted."""
    stock = cand("hf_eager", hf_swiglu, family="eager", op="swiglu")

    default = next(c for c in candidates("swiglu", (4, 24), torch.float32, "cpu")
                   if c.name == "novatune_default").functional()

    def mine(gate, up, *, inplace_backward=False):
        return default(gate, up, inplace_backward)
    v = check(cand("mine", mine, family="default", op="swiglu"), spec=SWIGLU, stock=stock, shapes=[(4, 24)])
    assert v.ok, (v.check, v.reason)


def test_unavailable_and_crashing_candidates_are_recorded_not_raised():
    v = check(Candidate("rms_norm", "nope", "cuda", make=lambda: hf_rms_norm, unavailable="nvcc not found"))
    assert not v.ok and v.check == "available" and v.reason == "nvcc not found"

    def boom():
        raise RuntimeError("ptxas fatal: out of registers")
    v = check(Candidate("rms_norm", "broken", "cuda", make=boom))
    assert not v.ok and v.check == "builds" and "ptxas" in v.reason


def test_real_shape_values_are_checked_once_when_the_contract_runs_the_recorded_call():
    """The contract check runs the model's recorded call at the real shape (its rank, strides, repeats); the
    validator then leaves out its own values and fresh runs there instead of checking the real shape twice."""
    from novatune import ops as nops
    from novatune.ops import dispatch

    with dispatch.recording() as rec:
        nops.rms_norm(torch.randn(2, 3, 32), torch.ones(32), 1e-6)   # the model's call: (2, 3, 32) -> key (6, 32)
    calls = list(rec.calls.values())
    shapes_seen = []

    def counting(x, w, eps):
        shapes_seen.append(tuple(x.shape))
        return hf_rms_norm(x, w, eps)

    def real_2d_calls(**kw):
        shapes_seen.clear()
        v = validate(RMS_NORM, cand("counting", counting, family="default"), STOCK, SHAPES, torch.float32, "cpu",
                     **kw)
        assert v.ok, (v.check, v.reason)
        return shapes_seen.count((6, 32)), shapes_seen.count((2, 3, 32))

    alone, _ = real_2d_calls(contract=False)
    with_calls, recorded = real_2d_calls(calls=calls)
    assert recorded >= 1                  # the contract ran the model's own call
    assert with_calls == alone - 2        # values + fresh at the real shape ran once, in the contract
