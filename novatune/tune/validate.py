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
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from novatune.measure.numerics import rel_err
from novatune.ops.contract import Candidate, OpSpec
from novatune.tune.calls import make_dy, map_dy, shape_str
from novatune.tune.check import check_implementation

FACTOR = 2.0
CPU_MAX_ELEMENTS = 50_000
UNIT_ROUNDOFF = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}  # fp32: reductions


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


def _leaves(spec: OpSpec, inputs: dict, fp32: bool = False) -> dict:
    out = {}
    for k, v in inputs.items():
        if k in spec.tensor_args:
            t = v.detach().float() if fp32 else v.detach()
            out[k] = t.clone().requires_grad_(True) if fp32 else t.requires_grad_(True)
        else:
            out[k] = v
    return out


def run_fwd_bwd(spec: OpSpec, fn, leaves: dict, dy: torch.Tensor) -> dict:
    """{"out": y, <tensor arg>: its gradient} for one forward + backward of fn on `leaves` (from _leaves).
    dy is cloned per call: a candidate that overwrites its incoming gradient must not corrupt later checks.
    Multi-output ops (spec.outputs, e.g. rope's (q_embed, k_embed)) return a tuple and take a tuple dy."""
    y = spec.call(fn, leaves)
    grads = torch.autograd.grad(y, [leaves[k] for k in spec.tensor_args], map_dy(torch.clone, dy),
                                allow_unused=True)
    if len(spec.outputs) == 1:
        res = {"out": y.detach()}
    else:
        if not isinstance(y, (tuple, list)) or len(y) != len(spec.outputs):
            raise Rejected("values", f"returned {type(y).__name__}, expected a tuple of {len(spec.outputs)} "
                                     f"outputs {spec.outputs}")
        res = {name: t.detach() for name, t in zip(spec.outputs, y)}
    for k, g in zip(spec.tensor_args, grads):
        res[k] = g if g is not None else torch.zeros_like(leaves[k])
    return res


def reference(spec: OpSpec, inputs: dict, dy: torch.Tensor) -> dict:
    """The fp32 reference's output and gradients (fp32 copies of the inputs)."""
    return run_fwd_bwd(spec, spec.reference, _leaves(spec, inputs, fp32=True), map_dy(torch.Tensor.float, dy))


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
        for shape in shapes:
            tag = shape_str(shape)
            fresh = [spec.make_inputs(shape, dtype, device, gen) for _ in range(2)]
            refs, bounds_per = [], []
            for inputs in fresh:
                dy = make_dy(spec, shape, dtype, device, gen)
                ref = reference(spec, inputs, dy)
                st = run_fwd_bwd(spec, stock_fn, _leaves(spec, inputs), dy)
                floor = UNIT_ROUNDOFF.get(dtype, 1e-2)
                bounds = {k: max(FACTOR * rel_err(st[k], ref[k]), floor) for k in ref}
                refs.append((inputs, dy, ref))
                bounds_per.append(bounds)
                for k, b in bounds.items():
                    verdict.bounds[f"{tag}:{k}"] = max(b, verdict.bounds.get(f"{tag}:{k}", 0.0))
            # values, then fresh: the second input set right after the first (stale results show here)
            for check, (inputs, dy, ref), bounds in zip(("values", "fresh"), refs, bounds_per):
                _poison_allocator(device, sum(v.numel() * v.element_size() for v in ref.values()))
                got = run_fwd_bwd(spec, fn, _leaves(spec, inputs), dy)
                _compare(tag, got, ref, bounds, verdict, check)
            inputs, dy, ref = refs[1]
            bounds = bounds_per[1]
            if cand.kernels is not None:
                got = spec.poison_call(cand.kernels(), inputs, dy)
                _compare(tag, got, ref, bounds, verdict, "poisoned")
            # NaN propagation: the candidate's non-finite pattern must equal the reference's
            nan_in = _nan_inputs(spec, inputs)
            ref_nan = reference(spec, nan_in, dy)
            got_nan = run_fwd_bwd(spec, fn, _leaves(spec, nan_in), dy)
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
            got = run_fwd_bwd(spec, fn, _leaves(spec, spec.noncontiguous(inputs)), dy)
            _compare(tag, got, ref, bounds, verdict, "layout")
            if cand.deterministic:
                a = run_fwd_bwd(spec, fn, _leaves(spec, inputs), dy)
                b = run_fwd_bwd(spec, fn, _leaves(spec, inputs), dy)
                for name in a:
                    if not torch.equal(a[name], b[name]):
                        raise Rejected("deterministic", f"{tag} {name}: two runs on the same inputs differ "
                                                        f"(determinism is promised for this family)")
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
