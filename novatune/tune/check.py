"""Check an implementation of a registered op against its contract, on the calls models really make.

    from novatune.tune import check_implementation
    verdict = check_implementation(my_fn, op=name)   # name: a key of novatune.ops.registry.OPS
    print(verdict)                      # PASS / FAIL with one reason per failed check
    assert verdict.passed

CLI: `novatune tune --check my_module:my_rms_norm --op rms_norm` (exit 0 pass, 1 fail). The expected signature of
`fn` per op is the op's SPEC.signature (novatune.ops.registry.OPS[op].signature; `--check ... --op NAME` prints
it). The checks, on every case of the op's SPEC.call_cases (the ranks, eps values, flags and strides models use,
plus odd shapes, > 65,535 rows and |x| ~ 1e4) for each dtype, and on calls recorded from a model (`calls`):

  values     forward output and every gradient vs the fp32 reference, bounded by the STOCK implementation's own
             error on the same inputs: per element |fn - ref| <= 4 |stock - ref| + 2u |ref| + 2u rms(ref's row)
             + stock's largest error in that row;
             per tensor rms(fn - ref) <= 2 rms(stock - ref) + u rms(ref); and no systematic scaling (the
             projection of the error on ref, sum(e * ref) / sum(ref^2), <= 4 x stock's + u / 4 + 2u / sqrt(n)),
             u = the unit roundoff of the tensor's dtype (fp32: 1e-5, reductions; times SPEC.tolerance_scale).
             Non-finite values where the reference is finite fail.
  dtype      the output's dtype is the stock's, each gradient has its input's dtype; shapes match
  strides    the output is contiguous or has the stock's strides (a dense tensor, no broadcast buffer)
  aliasing   no output shares memory with an input or with a previous call's output
  inputs     the inputs are unchanged by the forward and, unless the call's inplace flag allows it, the backward
  inplace    with inplace_backward=True on contiguous inputs, the gradients are written into the inputs' memory
  fresh      a previous call's output is unchanged by the next call; a call on the same buffers holding new
             values gives the new result (no output cache keyed by address)
  repeats    each case runs `repeats` times on fresh values (an error on some calls only shows)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from novatune.ops.contract import OpSpec
from novatune.ops.registry import OPS

K_ELEM, K_RMS, K_SCALE = 4.0, 2.0, 4.0
UNIT = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float64: 1e-12}
BIG_CASE = 200_000  # elements: larger cases run once (the repeats are for intermittent faults, not sizes)


@dataclass
class Verdict:
    passed: bool
    reasons: list[str] = field(default_factory=list)
    cases: list[str] = field(default_factory=list)
    calls: int = 0
    skipped: list[str] = field(default_factory=list)   # cases over max_elements

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        head = f"{'PASS' if self.passed else 'FAIL'}: {len(self.cases)} cases, {self.calls} calls" + (
            f" ({len(self.skipped)} cases skipped as too large here)" if self.skipped else "")
        return "\n".join([head] + [f"  - {r}" for r in self.reasons])


class Fail(Exception):
    """One failed check, its message the reason."""


# ----------------------------------------------------------------------------------------------- inputs
def _restrided(t: Tensor, shape, stride, dtype) -> Tensor:
    """t's values (reshaped to `shape`) in a fresh tensor with `stride` (broadcast dims: an expanded view)."""
    t = t.reshape(shape).to(dtype)
    base = [1 if st == 0 else sz for sz, st in zip(shape, stride)]
    src = t[tuple(slice(0, 1) if st == 0 else slice(None) for st in stride)]
    out = torch.empty_strided(base, [st or 1 for st in stride], dtype=dtype, device=t.device).copy_(src)
    return out.expand(shape)


def inputs_like(spec: OpSpec, record, device, gen) -> dict:
    """Fresh inputs with a recorded call's ranks, shapes, strides, dtypes and values of eps / flags (values from
    the SPEC's input maker at the call's shape key)."""
    _op, shape_key, _dt, _dev = record.signature
    first = next(a for a in record.args if a.is_tensor)
    base = spec.make_inputs(shape_key, first.dtype, device, gen)
    out = {}
    for (name, v), rec in zip(base.items(), record.args):
        out[name] = _restrided(v, rec.shape, rec.stride, rec.dtype) if rec.is_tensor else rec.value
    return out


def _clone_layout(t: Tensor) -> Tensor:
    """A copy with t's strides (a strided view stays strided; broadcast stays broadcast)."""
    if 0 in t.stride():
        return _restrided(t, t.shape, t.stride(), t.dtype)
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)


def as_intermediate(t: Tensor) -> Tensor:
    """A copy of t with its strides as an autograd intermediate (made by a copy from a leaf that requires grad),
    as a projection output is: gradients are taken with respect to it, and an op's in-place backward may write
    over it (ops.swiglu's may_write_over leaves a leaf alone: a leaf is a caller's own tensor). A broadcast
    (stride 0) tensor stays a leaf copy: nothing writes over it."""
    copy = _clone_layout(t.detach())
    if 0 in t.stride():
        return copy.requires_grad_(True)
    with torch.enable_grad():  # the copy's values again, now through autograd: a non-leaf over its own memory
        return copy.copy_(t.detach().requires_grad_(True))


def _refresh(inputs: dict, spec: OpSpec, gen) -> dict:
    """New values of the same magnitudes and layouts: each float input times random signs and factors 0.75-1.25."""
    out = {}
    for k, v in inputs.items():
        if isinstance(v, Tensor) and v.is_floating_point() and k in spec.tensor_args:
            magnitude = torch.rand(v.shape, generator=gen) * 0.5 + 0.75
            sign = torch.randint(0, 2, v.shape, generator=gen) * 2 - 1
            f = magnitude * sign
            out[k] = _clone_layout((v.float() * f.to(v.device)).to(v.dtype))
        else:
            out[k] = v
    return out


# ----------------------------------------------------------------------------------------------- one call
def _as_tuple(y, spec: OpSpec) -> tuple:
    if len(spec.outputs) == 1:
        if not isinstance(y, Tensor):
            raise Fail(f"returned {type(y).__name__}, expected a tensor")
        return (y,)
    if not isinstance(y, (tuple, list)) or len(y) != len(spec.outputs) or not all(isinstance(t, Tensor) for t in y):
        raise Fail(f"returned {type(y).__name__}, expected a tuple of {len(spec.outputs)} tensors {spec.outputs}")
    return tuple(y)


def fwd_bwd(spec: OpSpec, fn, inputs: dict, dys: tuple, fp32: bool = False, copy: bool = True):
    """(outputs, grads, the inputs as called) of one forward + backward of fn on `inputs` (through spec.call),
    the incoming gradients `dys` (one per output, cast to each output's dtype). fp32: on fp32 copies (the oracle's
    call). copy: the tensor inputs are copied first as intermediates, strides kept (as_intermediate: an in-place
    backward cannot touch the caller's inputs); copy=False differentiates views of them as they are (the
    validator's misaligned-view check).
    Shared by the checker and the tune validator (novatune.tune.validate)."""
    leaves = {}
    for k, v in inputs.items():
        if k in spec.tensor_args:
            if copy and not fp32:
                leaves[k] = as_intermediate(v)
                continue
            t = v.detach().float().clone() if fp32 else v.detach()
            leaves[k] = t.requires_grad_(True)
        else:
            leaves[k] = v
    outs = _as_tuple(spec.call(fn, leaves), spec)
    wrt = [leaves[k] for k in spec.tensor_args]
    used = [(o, d.to(o.dtype)) for o, d in zip(outs, dys) if o.requires_grad]
    grads = torch.autograd.grad([o for o, _ in used], wrt, [d for _, d in used], allow_unused=True) if used else \
        [None] * len(wrt)
    grads = [torch.zeros_like(w) if g is None else g for w, g in zip(wrt, grads)]
    return outs, grads, leaves


def _err_stats(got: Tensor, stock: Tensor, ref: Tensor, dtype, label: str, scale: float = 1.0) -> None:
    g, s, r = got.detach().float(), stock.detach().float(), ref.detach().float()
    fin = torch.isfinite(r)
    bad = ~torch.isfinite(g) & fin
    if bool(bad.any()):
        raise Fail(f"{label}: {int(bad.sum())} non-finite elements where the reference is finite")
    # the absolute floor follows each row's magnitude (rows of very different scales; cancellation inside a row)
    row_rms = r.where(fin, 0).pow(2).mean(-1, keepdim=True).sqrt().expand_as(r) if r.dim() >= 2 else None
    # Two correct implementations that round intermediates in a different order have uncorrelated errors per
    # element: where stock happens to land on the reference, 4x its error is ~0, and a term that cancels (RoPE's
    # dq = dy cos + rot(dy) sin) leaves the candidate a few ulps of the terms off. Stock's worst error in the same
    # row bounds what rounding alone does there; larger faults still fail, and the rms and scaling checks below
    # catch an error that is worse everywhere.
    row_worst = (s - r).abs().where(fin, 0).amax(-1, keepdim=True).expand_as(r) if r.dim() >= 2 else None
    g, s, r = g[fin], s[fin], r[fin]
    if r.numel() == 0:
        return
    u = UNIT.get(dtype, 1e-2) * scale
    ec, es = (g - r).abs(), (s - r).abs()
    rms_r = float(r.pow(2).mean().sqrt())
    floor = 2 * u * (row_rms[fin].clamp_min(0.05 * rms_r) if row_rms is not None else rms_r)
    limit = K_ELEM * es + 2 * u * r.abs() + floor + (row_worst[fin] if row_worst is not None else 0)
    over = ec > limit
    if bool(over.any()):
        i = int(torch.argmax((ec - limit) / (limit + 1e-30)))
        raise Fail(f"{label}: {int(over.sum())} of {r.numel()} elements outside the bound (worst: {float(g[i]):.6g} "
                    f"vs reference {float(r[i]):.6g}, stock {float(s[i]):.6g})")
    rms_c, rms_s = float(ec.pow(2).mean().sqrt()), float(es.pow(2).mean().sqrt())
    if rms_c > K_RMS * rms_s + u * rms_r:
        raise Fail(f"{label}: rms error {rms_c:.3e} > {K_RMS:g} x stock's {rms_s:.3e} + {u:.1e} x rms(ref)")
    rr = float(r.pow(2).sum())
    if rr > 0 and r.numel() > 1:
        beta_c, beta_s = float(((g - r) * r).sum()) / rr, float(((s - r) * r).sum()) / rr
        # rounding errors average out as 1/sqrt(n): small tensors get a wider floor (large ones catch a scaling)
        if abs(beta_c) > K_SCALE * abs(beta_s) + u / 4 + 2 * u / r.numel() ** 0.5:
            raise Fail(f"{label}: systematically scaled by {1 + beta_c:.5f} (stock {1 + beta_s:.5f})")


def _storage(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _check_layout(spec: OpSpec, outs, stock_outs, grads, leaves, keep: list, label: str) -> None:
    input_mem = {_storage(v) for v in leaves.values() if isinstance(v, Tensor)}
    for name, o, s in zip(spec.outputs, outs, stock_outs):
        if o.dtype != s.dtype:
            raise Fail(f"{label} {name}: dtype {o.dtype}, the stock implementation returns {s.dtype}")
        if o.shape != s.shape:
            raise Fail(f"{label} {name}: shape {tuple(o.shape)}, expected {tuple(s.shape)}")
        if not o.is_contiguous() and o.stride() != s.stride():
            raise Fail(f"{label} {name}: strides {o.stride()} are neither contiguous nor the stock's {s.stride()}")
        if _storage(o) in input_mem:
            raise Fail(f"{label} {name}: the output shares memory with an input")
        if any(_storage(o) == _storage(prev) for prev, _ in keep):
            raise Fail(f"{label} {name}: the output shares memory with a previous call's output (a static buffer)")
    for k, g in zip(spec.tensor_args, grads):
        if g.dtype != leaves[k].dtype or g.shape != leaves[k].shape:
            raise Fail(f"{label} gradient of {k}: {g.dtype} {tuple(g.shape)}, expected {leaves[k].dtype} "
                        f"{tuple(leaves[k].shape)}")


def _one_call(spec: OpSpec, fn, inputs: dict, label: str, keep: list, gen) -> None:
    """One checked call of fn on `inputs` (compared with the stock and the fp32 reference on the same values)."""
    dys = _dys(spec, inputs, gen)
    stock_outs, stock_grads, _ = fwd_bwd(spec, spec.stock, inputs, dys)
    ref_outs, ref_grads, _ = fwd_bwd(spec, spec.reference, inputs, dys, fp32=True)
    snapshot = {k: _clone_layout(v) for k, v in inputs.items() if isinstance(v, Tensor)}
    outs, grads, leaves = _fwd_bwd_checked(spec, fn, inputs, dys, snapshot, label)
    _check_layout(spec, outs, stock_outs, grads, leaves, keep, label)
    for name, o, s, r in zip(spec.outputs, outs, stock_outs, ref_outs):
        _err_stats(o, s, r, o.dtype, f"{label} output {name}" if len(spec.outputs) > 1 else f"{label} output",
                   spec.tolerance_scale)
    for k, g, s, r in zip(spec.tensor_args, grads, stock_grads, ref_grads):
        _err_stats(g, s, r, g.dtype, f"{label} gradient of {k}", spec.tolerance_scale)
    for prev, copy in keep:
        if not torch.equal(prev, copy):
            raise Fail(f"{label}: a previous call's output changed during this call (outputs must be fresh)")
    keep.extend((o, o.detach().clone()) for o in outs)


def _dys(spec: OpSpec, inputs: dict, gen) -> tuple:
    """Random incoming gradients shaped like the stock's outputs (the same for stock, reference and fn)."""
    with torch.no_grad():
        outs = _as_tuple(spec.call(spec.stock, inputs), spec)
    # in the outputs' dtype: the reference then sees exactly the values fn and the stock see
    return tuple(torch.randn(o.shape, generator=gen).to(device=o.device, dtype=o.dtype) for o in outs)


def _fwd_bwd_checked(spec: OpSpec, fn, inputs: dict, dys, snapshot: dict, label: str):
    """fn's forward + backward with the input checks between them."""
    leaves = {k: (as_intermediate(v) if k in spec.tensor_args else v) for k, v in inputs.items()}
    try:
        outs = _as_tuple(spec.call(fn, leaves), spec)
    except Fail:
        raise
    except Exception as e:  # noqa: BLE001 - a crash on a valid call is a failed check, with its message
        raise Fail(f"{label}: the forward raised {type(e).__name__}: {str(e)[:300]}") from None
    _unchanged(leaves, snapshot, f"{label}: the forward changed input")
    wrt = [leaves[k] for k in spec.tensor_args]
    used = [(o, d.to(o.dtype)) for o, d in zip(outs, dys) if o.requires_grad]
    if not used:
        raise Fail(f"{label}: the output does not require grad (not differentiable in {spec.tensor_args})")
    try:
        grads = torch.autograd.grad([o for o, _ in used], wrt, [d for _, d in used], allow_unused=True)
    except Exception as e:  # noqa: BLE001
        raise Fail(f"{label}: the backward raised {type(e).__name__}: {str(e)[:300]}") from None
    grads = [torch.zeros_like(w) if g is None else g for w, g in zip(wrt, grads)]
    inplace = bool(leaves.get("inplace_backward", False))
    if inplace:
        for k, g in zip(spec.tensor_args, grads):
            if snapshot[k].is_contiguous() and _storage(g) != _storage(leaves[k]):
                raise Fail(f"{label}: inplace_backward=True but the gradient of {k} is not written into {k}'s "
                            f"memory (the patched MLP relies on it to save two activation-sized buffers)")
    else:
        _unchanged(leaves, snapshot, f"{label}: the backward changed input")
    return outs, grads, leaves


def _unchanged(leaves: dict, snapshot: dict, what: str) -> None:
    for k, v in snapshot.items():
        now = leaves[k]
        if not torch.equal(now.detach(), v):
            raise Fail(f"{what} {k}")


# ----------------------------------------------------------------------------------------------- public
def _cases(spec: OpSpec, dtypes, device, gen, calls) -> list:
    cases = []
    for dt in dtypes:
        cases += [(f"{dt_name(dt)} {label}", inputs) for label, inputs in spec.call_cases(dt, device, gen)]
    for rec in calls or ():
        try:
            cases.append((f"recorded call {rec.signature[1]} {rec.signature[2]}", inputs_like(spec, rec, device, gen)))
        except RuntimeError as e:
            cases.append((f"recorded call {rec.signature[1]}: inputs could not be rebuilt ({e})", None))
    return cases


def dt_name(dt) -> str:
    return str(dt).replace("torch.", "")


def _numel(inputs: dict) -> int:
    return sum(v.numel() for v in inputs.values() if isinstance(v, Tensor))


def check_implementation(fn, op: str, *, dtypes=(torch.bfloat16, torch.float32), device="cpu", calls=None,
                         repeats: int = 5, seed: int = 0, include_spec_cases: bool = True,
                         max_elements: int | None = None) -> Verdict:
    """Verdict(passed, reasons) for `fn` as an implementation of `op` (see the module docstring; the signature fn
    must have: novatune.ops.registry.OPS[op].signature). calls: CallRecords from novatune.ops.dispatch.recording
    (the calls a model made), checked in addition to the op's own cases (include_spec_cases=False: only them).
    max_elements: skip cases with more input elements (the Triton interpreter on the CPU is slow), named in
    Verdict.skipped."""
    if op not in OPS:
        raise KeyError(f"no op {op!r} in the registry (registered: {', '.join(OPS)})")
    spec = OPS[op]
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    verdict = Verdict(passed=True)
    cases = _cases(spec, dtypes if include_spec_cases else (), device, gen, calls)
    for label, inputs in cases:
        verdict.cases.append(label)
        if inputs is None:
            verdict.reasons.append(label)
            continue
        if max_elements is not None and _numel(inputs) > max_elements:
            verdict.skipped.append(label)
            continue
        keep: list = []
        try:
            n = 1 if _numel(inputs) > BIG_CASE else max(1, repeats)
            cur = inputs
            for i in range(n):
                _one_call(spec, fn, cur, label if i == 0 else f"{label} (repeat {i})", keep, gen)
                verdict.calls += 1
                cur = _refresh(inputs, spec, gen)
            _same_buffers_new_values(spec, fn, inputs, label, keep, gen)
            verdict.calls += 1
        except Fail as f:
            verdict.reasons.append(str(f))
    verdict.passed = not verdict.reasons
    return verdict


def _same_buffers_new_values(spec: OpSpec, fn, inputs: dict, label: str, keep: list, gen) -> None:
    """Call fn on tensors at fixed addresses twice, new values written between: an output cache keyed by the
    inputs' addresses returns the first result again."""
    fixed = {k: (_clone_layout(v) if isinstance(v, Tensor) else v) for k, v in inputs.items()}
    with torch.no_grad():
        spec.call(fn, fixed)
        for k, v in _refresh(inputs, spec, gen).items():
            if k in spec.tensor_args and 0 not in fixed[k].stride():
                fixed[k].copy_(v)
        got = _as_tuple(spec.call(fn, fixed), spec)
        want = _as_tuple(spec.call(spec.stock, fixed), spec)
        ref = _as_tuple(spec.call(spec.reference, {k: v.float() if isinstance(v, Tensor) and v.is_floating_point()
                                                   else v for k, v in fixed.items()}), spec)
    for name, g, s, r in zip(spec.outputs, got, want, ref):
        try:
            _err_stats(g, s, r, g.dtype, f"{label} same buffers, new values: output {name}", spec.tolerance_scale)
        except Fail as f:
            raise Fail(f"{f} (an output cache keyed by the inputs' addresses?)") from None


def describe(op: str) -> str:
    """The signature a user's implementation of `op` must have, and what it is checked on."""
    spec = OPS[op]
    return f"{op}: {spec.signature}"
