"""Validation: a candidate may be timed only after it computes the right thing. Every rejection keeps its reason.

Checks, in order (the first failure rejects; its name and message are recorded):
  builds       the candidate builds/compiles (CUDA extension, torch.compile) without raising
  values       forward and every gradient vs the fp32 reference, on fresh random inputs at each shape (the real
               shape and odd ones); the bound per output is max(FACTOR x the stock implementation's own error on
               the same inputs, the dtype's unit roundoff), so a candidate may be as inexact as the stock one (x2)
               but not a downcast beyond it. Non-finite values where the reference is finite fail here
               ("unwritten or non-finite").
  fresh        a second set of fresh inputs right after the first: a candidate returning a stale/cached result
               fails (its output would match the previous inputs, not these)
  poisoned     kernel candidates: outputs preallocated and filled with NaN before the call; any element left
               unwritten stays NaN and fails. (Candidates that allocate their own outputs: on CUDA the caching
               allocator's free blocks are NaN-filled first, so recycled memory is poisoned too.)
  nan          a NaN planted in one input element must propagate exactly where the reference's does (a
               swallowed NaN, or one smeared over finite elements, fails); ops with a `nan_rule` (attention,
               whose spread inside a document depends on tiling) apply that rule instead
  layout       non-contiguous (and misaligned) input views give the same values
  deterministic  where promised: two runs on the same inputs are bitwise identical
  contract     the implementation checker (novatune.tune.check) on the op's real-call cases and the calls recorded
               from the model; where it runs a recorded call at the real shape, the values and fresh checks
               above are left to it there (the model's own ranks and strides, repeated), not run twice
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from novatune.measure.numerics import rel_err
from novatune.ops.contract import Candidate, OpSpec
from novatune.tune.calls import make_dy, shape_str
from novatune.tune.check import UNIT, Fail, check_implementation, fwd_bwd

FACTOR = 2.0
CPU_MAX_ELEMENTS = 50_000


@dataclass
class Verdict:
    candidate: str
    ok: bool
    check: str = ""            # the failing check ("" when ok)
    reason: str = ""
    errors: dict = field(default_factory=dict)   # "<shape>:<output>" -> rel err (max over trials)
    bounds: dict = field(default_factory=dict)   # "<shape>:<output>" -> bound used
    checks: list = field(default_factory=list)   # the checks that passed


class Rejected(Exception):
    def __init__(self, check: str, reason: str):
        super().__init__(f"{check}: {reason}")
        self.check, self.reason = check, reason


def run_fwd_bwd(spec: OpSpec, fn, inputs: dict, dy, fp32: bool = False) -> dict:
    """{output name: value, <tensor arg>: its gradient} for one forward + backward of fn on `inputs` (views kept
    as they are; fp32: the oracle's call on fp32 copies), through the checker's fwd_bwd. dy (a tensor, or a tuple
    for multi-output ops such as rope's (q_embed, k_embed)) is cloned per call: a candidate that overwrites its
    incoming gradient must not corrupt later checks."""
    dys = tuple(t.clone() for t in dy) if isinstance(dy, tuple) else (dy.clone(),)
    try:
        outs, grads, _ = fwd_bwd(spec, fn, inputs, dys, fp32=fp32, copy=False)
    except Fail as f:
        raise Rejected("values", str(f)) from None
    res = {name: t.detach() for name, t in zip(spec.outputs, outs)}
    res.update(zip(spec.tensor_args, grads))
    return res


def reference(spec: OpSpec, inputs: dict, dy) -> dict:
    """The fp32 reference's output and gradients (fp32 copies of the inputs)."""
    return run_fwd_bwd(spec, spec.reference, inputs, dy, fp32=True)


def _poison_allocator(device, nbytes: int) -> None:
    """NaN-fill `nbytes` of the CUDA caching allocator's memory and free it, so outputs a candidate allocates
    next are likely carved from poisoned blocks (best effort; the CPU allocator returns fresh pages)."""
    if device.type == "cuda" and nbytes > 0:
        t = torch.empty(nbytes // 4 + 1, dtype=torch.float32, device=device)
        t.fill_(float("nan"))
        del t


def _compare(tag: str, got: dict, ref: dict, bounds: dict, verdict: Verdict, check: str) -> None:
    for name, r in ref.items():
        g = got[name]
        if g.shape != r.shape:
            raise Rejected(check, f"{tag} {name}: shape {tuple(g.shape)} != reference {tuple(r.shape)}")
        fin = torch.isfinite(r)
        if bool((~torch.isfinite(g) & fin).any()):
            n_bad = int((~torch.isfinite(g) & fin).sum())
            raise Rejected(check, f"{tag} {name}: {n_bad} unwritten or non-finite elements where the reference "
                                  f"is finite")
        err = rel_err(g, r)
        key = f"{tag}:{name}"
        verdict.errors[key] = max(err, verdict.errors.get(key, 0.0))
        if err > bounds[name]:
            what = (("forward output" + ("" if name == "out" else f" {name}")) if name.startswith("out")
                    else f"gradient of {name}")
            raise Rejected(check, f"{tag} {what}: relative error {err:.3e} > bound {bounds[name]:.3e} "
                                  f"(stock error x{FACTOR:g}, at least the dtype's unit roundoff)")


def _nan_inputs(spec: OpSpec, inputs: dict) -> dict:
    first = spec.nan_arg or spec.tensor_args[0]
    t = inputs[first].detach().clone()
    flat = t.view(-1)
    flat[flat.numel() // 2] = float("nan")
    return dict(inputs, **{first: t})


def _contract(spec: OpSpec, fn, dtype, device, calls, seed: int) -> None:
    """check_implementation on the calls the model makes: every case on a GPU; on the CPU (the Triton
    interpreter is slow) the cases up to CPU_MAX_ELEMENTS, once each."""
    cuda = device.type == "cuda"
    v = check_implementation(fn, spec.name, dtypes=(dtype,), device=device, calls=calls, seed=seed,
                             repeats=8 if cuda else 1, max_elements=None if cuda else CPU_MAX_ELEMENTS)
    if not v.passed:
        raise Rejected("contract", "; ".join(v.reasons)[:900])


def _contract_covers(shape, calls, device) -> bool:
    """True when the contract check will run a call recorded from the model at `shape` (on the CPU only those up
    to CPU_MAX_ELEMENTS run): its values and fresh-input checks there are stricter than the validator's own."""
    for rec in calls or ():
        numel = sum(math.prod(a.shape) for a in rec.args if a.is_tensor)
        if tuple(rec.signature[1]) == tuple(shape) and (device.type == "cuda" or numel <= CPU_MAX_ELEMENTS):
            return True
    return False


def _check_shape(spec: OpSpec, cand: Candidate, fn, stock_fn, shape, dtype, device, gen, verdict: Verdict,
                 values: bool = True) -> None:
    """Every check at one shape; values=False leaves out values and fresh (the contract checks them on the
    model's own call at this shape), the poisoned / nan / layout / deterministic checks still run."""
    tag = shape_str(shape)
    fresh = [spec.make_inputs(shape, dtype, device, gen) for _ in range(2 if values else 1)]
    refs, bounds_per = [], []
    for inputs in fresh:
        dy = make_dy(spec, shape, dtype, device, gen)
        ref = reference(spec, inputs, dy)
        st = run_fwd_bwd(spec, stock_fn, inputs, dy)
        floor = UNIT.get(dtype, 1e-2)
        bounds = {k: max(FACTOR * rel_err(st[k], ref[k]), floor) for k in ref}
        refs.append((inputs, dy, ref))
        bounds_per.append(bounds)
        for k, b in bounds.items():
            verdict.bounds[f"{tag}:{k}"] = max(b, verdict.bounds.get(f"{tag}:{k}", 0.0))
    # values, then fresh: the second input set right after the first (stale results show here)
    for check, (inputs, dy, ref), bounds in zip(("values", "fresh") if values else (), refs, bounds_per):
        _poison_allocator(device, sum(v.numel() * v.element_size() for v in ref.values()))
        got = run_fwd_bwd(spec, fn, inputs, dy)
        _compare(tag, got, ref, bounds, verdict, check)
    inputs, dy, ref = refs[-1]
    bounds = bounds_per[-1]
    if cand.kernels is not None:
        got = spec.poison_call(cand.kernels(), inputs, dy)
        _compare(tag, got, ref, bounds, verdict, "poisoned")
    # NaN propagation: the candidate's non-finite pattern must equal the reference's
    nan_in = _nan_inputs(spec, inputs)
    ref_nan = reference(spec, nan_in, dy)
    got_nan = run_fwd_bwd(spec, fn, nan_in, dy)
    if spec.nan_rule is not None:  # ops whose exact NaN spread is implementation-defined (attention)
        why = spec.nan_rule(nan_in, ref_nan, got_nan)
        if why:
            raise Rejected("nan", f"{tag} {why}")
    for name, r in ref_nan.items() if spec.nan_rule is None else ():
        want, have = ~torch.isfinite(r), ~torch.isfinite(got_nan[name])
        if not torch.equal(want, have):
            lost = int((want & ~have).sum())
            extra = int((have & ~want).sum())
            raise Rejected("nan", f"{tag} {name}: NaN input -> {lost} elements finite that the reference "
                                  f"has non-finite (swallowed NaN), {extra} non-finite that it has finite")
    got = run_fwd_bwd(spec, fn, spec.noncontiguous(inputs), dy)
    _compare(tag, got, ref, bounds, verdict, "layout")
    if cand.deterministic:
        a = run_fwd_bwd(spec, fn, inputs, dy)
        b = run_fwd_bwd(spec, fn, inputs, dy)
        for name in a:
            if not torch.equal(a[name], b[name]):
                raise Rejected("deterministic", f"{tag} {name}: two runs on the same inputs differ "
                                                f"(determinism is promised for this family)")


def validate(spec: OpSpec, cand: Candidate, stock: Candidate, shapes: list, dtype: torch.dtype, device,
             seed: int = 0, calls=None, contract: bool = True) -> Verdict:
    """Run every check for `cand` at each shape in `shapes` (the first is the real one), then (contract) the
    implementation checker on the op's real-call cases and the `calls` recorded from the model (CallRecords).
    Never raises for a bad candidate: the verdict says which check failed and why."""
    verdict = Verdict(cand.name, ok=False)
    if cand.unavailable:
        verdict.check, verdict.reason = "available", cand.unavailable
        return verdict
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    try:
        try:
            fn = cand.functional()
        except Exception as e:  # noqa: BLE001 - any build failure is a rejection with its message
            raise Rejected("builds", f"{type(e).__name__}: {str(e)[-600:]}") from None
        stock_fn = stock.functional()
        real_checked = contract and _contract_covers(shapes[0], calls, device)
        for shape in shapes:
            _check_shape(spec, cand, fn, stock_fn, shape, dtype, device, gen, verdict,
                         values=not (real_checked and shape == shapes[0]))
        if contract:
            _contract(spec, fn, dtype, device, calls, seed)
        verdict.ok = True
        verdict.checks = ["builds", "values", "fresh"] + (["poisoned"] if cand.kernels else []) + \
            ["nan", "layout"] + (["deterministic"] if cand.deterministic else []) + (["contract"] if contract else [])
    except Rejected as r:
        verdict.check, verdict.reason = r.check, r.reason
    except Exception as e:  # noqa: BLE001 - a crash during a check rejects the candidate, with the message
        verdict.check, verdict.reason = "crashed", f"{type(e).__name__}: {str(e)[-600:]}"
    return verdict
