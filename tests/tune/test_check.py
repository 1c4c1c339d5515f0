"""The implementation checker (novatune.tune.check_implementation, `novatune tune --check`): planted wrong
candidates, one per failure class the validator used to miss, are each rejected with a reason; the stock formulas
and novatune's own ops (reference path, and the real Triton kernels through the interpreter) are accepted.

The planted candidates are pure PyTorch around the HF stock formula (fast on the CPU); each is wrong in exactly
one way. `repeats` stays at its default (5 calls per case on fresh values) where a fault shows on some calls only.
"""
from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch

import novatune.ops as nops
from novatune.ops import dispatch
from novatune.reference.rms_norm import hf_rms_norm
from novatune.reference.swiglu import hf_swiglu
from novatune.tune import check_implementation

FP32 = (torch.float32,)
BF16 = (torch.bfloat16,)


def _reasons(v) -> str:
    return "\n".join(v.reasons)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, factor):
        ctx.factor = factor
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


# ----------------------------------------------------------------------------------------------- planted faults
def rows_from_shape0(x, weight, eps):
    """Takes x.shape[0] as the row count: right on 2-D inputs, wrong on the model's 3-D hidden states."""
    n = x.shape[-1]
    flat = x.reshape(-1, n)
    rows = x.shape[0]
    return torch.cat([hf_rms_norm(flat[:rows], weight, eps), flat[rows:] * 0]).reshape(x.shape)


def hard_coded_eps(x, weight, eps):
    return hf_rms_norm(x, weight, 1e-6)


def wrong_dtype(x, weight, eps):
    return hf_rms_norm(x, weight, eps).float()


_STATIC: dict = {}


def static_output_buffer(x, weight, eps):
    y = hf_rms_norm(x, weight, eps)
    buf = _STATIC.setdefault((x.shape, x.dtype), torch.empty(x.shape, dtype=y.dtype))
    return buf.copy_(y)  # the same buffer every call (differentiable: copy_ records the graph)


_CACHE: dict = {}


def address_keyed_cache(x, weight, eps):
    key = (x.data_ptr(), weight.data_ptr(), x.shape)
    if key not in _CACHE:
        _CACHE[key] = hf_rms_norm(x, weight, eps).detach()
    y = hf_rms_norm(x, weight, eps)
    return y + (_CACHE[key] - y).detach()


def mutates_input(x, weight, eps):
    y = hf_rms_norm(x, weight, eps)
    with torch.no_grad():
        x[..., 0] = 0
    return y


def fp16_arithmetic(x, weight, eps):
    return hf_rms_norm(x.half(), weight.half(), eps).to(x.dtype)


def scaled_gradients(x, weight, eps):
    return _ScaleGrad.apply(hf_rms_norm(x, weight, eps), 0.997)


def drops_last_row_beyond_grid(x, weight, eps):
    y = hf_rms_norm(x, weight, eps)
    rows = x.numel() // x.shape[-1]
    if rows <= 65_535:
        return y
    keep = torch.ones(rows, 1, dtype=y.dtype)
    keep[-1] = 0
    return (y.reshape(rows, -1) * keep).reshape(y.shape)


_COUNTER = itertools.count()


def noisy_on_one_call_in_ten(x, weight, eps):
    y = hf_rms_norm(x, weight, eps)
    if next(_COUNTER) % 10 == 7:
        return y + 0.05 * torch.randn(y.shape).to(y.dtype)
    return y


def ignores_inplace_flag(gate, up, inplace_backward=False):
    return hf_swiglu(gate, up)


PLANTED_RMS = [
    (rows_from_shape0, "outside the bound", FP32),
    (hard_coded_eps, "eps 1e-5", FP32),
    (wrong_dtype, "dtype", BF16),
    (static_output_buffer, "previous call", FP32),
    (address_keyed_cache, "same buffers, new values", FP32),
    (mutates_input, "changed input x", FP32),
    (fp16_arithmetic, "1e4", BF16),
    (scaled_gradients, "scaled by 0.997", BF16),
    (drops_last_row_beyond_grid, "rows > 65,535", BF16),
    (noisy_on_one_call_in_ten, "outside the bound", BF16),
]


@pytest.mark.parametrize("fn,why,dtypes", PLANTED_RMS, ids=[p[0].__name__ for p in PLANTED_RMS])
def test_planted_rms_norm_faults_are_rejected_with_a_reason(fn, why, dtypes):
    v = check_implementation(fn, "rms_norm", dtypes=dtypes)
    assert not v.passed and v.reasons
    assert why in _reasons(v), _reasons(v)


def test_scaled_gradients_rejected_in_fp32_too():
    v = check_implementation(scaled_gradients, "rms_norm", dtypes=FP32)
    assert not v.passed and "gradient of x" in _reasons(v), _reasons(v)


def test_ignored_inplace_flag_is_rejected():
    v = check_implementation(ignores_inplace_flag, "swiglu", dtypes=FP32)
    assert not v.passed and "inplace_backward=True" in _reasons(v)
    # the same formula honouring the call's flag through the op's own wrapper passes
    assert check_implementation(nops.swiglu, "swiglu", dtypes=FP32, repeats=1).passed


def test_output_in_an_input_s_memory_is_rejected():
    def writes_into_up(gate, up, inplace_backward=False):
        y = hf_swiglu(gate, up)
        with torch.no_grad():
            up.copy_(y)
        return up

    v = check_implementation(writes_into_up, "swiglu", dtypes=FP32, repeats=1)
    assert not v.passed and ("changed input up" in _reasons(v) or "shares memory" in _reasons(v)), _reasons(v)


@pytest.mark.parametrize("op", ["rms_norm", "swiglu", "rope", "qk_norm_rope", "linear_cross_entropy"])
def test_reference_paths_are_accepted(op, reference_backend):
    reference_backend()
    fn = {"rms_norm": nops.rms_norm, "swiglu": nops.swiglu, "rope": nops.apply_rope,
          "qk_norm_rope": nops.qk_norm_rope, "linear_cross_entropy": nops.linear_cross_entropy}[op]
    v = check_implementation(fn, op, repeats=2)
    assert v.passed, _reasons(v)


def _stock_vs_oracle(spec, inputs: dict, gen) -> dict:
    """{output or gradient name: rel_err(stock, fp32 oracle)} for one call, the same incoming gradients for both."""
    from novatune.measure.numerics import rel_err

    def run(fn, fp32: bool):
        leaves = {k: (v.detach().float() if fp32 else v.detach().clone()).requires_grad_(True)
                  if k in spec.tensor_args else v for k, v in inputs.items()}
        out = spec.call(fn, leaves)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        return outs, [leaves[k] for k in spec.tensor_args]

    outs, wrt = run(spec.stock, fp32=False)
    dys = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs]
    grads = torch.autograd.grad(outs, wrt, dys, allow_unused=True)
    ref_outs, ref_wrt = run(spec.reference, fp32=True)
    ref_grads = torch.autograd.grad(ref_outs, ref_wrt, [d.float() for d in dys], allow_unused=True)
    errs = {name: rel_err(o, r) for name, o, r in zip(spec.outputs, outs, ref_outs)}
    for k, g, r in zip(spec.tensor_args, grads, ref_grads):
        if r is not None:
            errs[f"d{k}"] = rel_err(g, r)
    return errs


@pytest.mark.parametrize("op", ["rms_norm", "swiglu", "rope", "qk_norm_rope", "linear_cross_entropy", "attention"])
def test_stock_formulas_match_the_fp32_oracle(op):
    """The checker bounds an implementation by the STOCK formula's own error against the fp32 oracle, so the
    stock formula must itself be the op: forward and every gradient against the oracle on the SPEC's real-call
    cases. fp32: the same math in another order (< 1e-5 relative norm, x the op's tolerance_scale); bf16: the
    stock rounds its inputs' products and its output to bf16 (a few roundings of 2^-8: < 1e-2); a weight's
    gradient sums dy * x over the rows, and with a single row (qk_norm_rope's one-token case) that short sum
    cancels, so it gets twice that (measured worst 1.3e-2)."""
    from novatune.measure.numerics import REL_TOL
    from novatune.ops.registry import OPS

    spec = OPS[op]
    gen = torch.Generator().manual_seed(3)
    checked = 0
    for dtype in (torch.float32, torch.bfloat16):
        tol = REL_TOL[dtype] * spec.tolerance_scale
        for label, inputs in spec.call_cases(dtype, "cpu", gen):
            if sum(v.numel() for v in inputs.values() if isinstance(v, torch.Tensor)) > 300_000:
                continue  # the > 65,535-row cases: the same formula, only slower here
            for name, err in _stock_vs_oracle(spec, inputs, gen).items():
                bound = tol * (2 if dtype == torch.bfloat16 and name.endswith("weight") else 1)
                assert err <= bound, f"{op} {dtype} {label}: stock {name} is {err:.2e} from the oracle (> {bound:.0e})"
            checked += 1
    assert checked >= 2


@pytest.mark.parametrize("op", ["rms_norm", "swiglu"])
def test_real_triton_kernels_are_accepted(op):
    """The Triton kernels through the interpreter (tests/conftest.py sets TRITON_INTERPRET=1), both dtypes."""
    fn = {"rms_norm": nops.rms_norm, "swiglu": nops.swiglu}[op]
    v = check_implementation(fn, op, repeats=1)
    assert v.passed, _reasons(v)


def test_recorded_model_calls_are_checked():
    """Calls recorded from a model (dispatch.recording) are checked as the model made them: a candidate that is
    right on 2-D inputs but wrong on the recorded 3-D call fails on that call alone."""
    with dispatch.recording() as rec:
        nops.rms_norm(torch.randn(2, 5, 16), torch.ones(16), 1e-5)
    calls = list(rec.calls.values())
    assert calls and calls[0].args[0].shape == (2, 5, 16)
    ok = check_implementation(hf_rms_norm, "rms_norm", calls=calls, include_spec_cases=False)
    assert ok.passed and ok.cases == ["recorded call (10, 16) float32/float32"]
    bad = check_implementation(rows_from_shape0, "rms_norm", calls=calls, include_spec_cases=False)
    assert not bad.passed and "recorded call" in _reasons(bad)


def test_cli_check_exit_codes(tmp_path):
    mod = tmp_path / "my_impls.py"
    mod.write_text("from novatune.reference.rms_norm import hf_rms_norm\n"
                   "def good(x, weight, eps):\n    return hf_rms_norm(x, weight, eps)\n"
                   "def bad(x, weight, eps):\n    return hf_rms_norm(x, weight, 1e-6)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.getcwd()]))
    run = [sys.executable, "-m", "novatune", "tune", "--check"]
    good = subprocess.run(run + ["my_impls:good", "--op", "rms_norm", "--dtypes", "float32"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert good.returncode == 0 and "PASS" in good.stdout, good.stdout + good.stderr
    bad = subprocess.run(run + ["my_impls:bad", "--op", "rms_norm", "--dtypes", "float32"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "FAIL" in bad.stdout and "eps 1e-5" in bad.stdout, bad.stdout + bad.stderr
