"""The one dispatch table (novatune.ops.dispatch): a Selection installed as a plain value, per-signature lookup,
and the recording of the calls the ops see (rank, shapes, strides, dtypes, eps and flags)."""
from __future__ import annotations

import torch

from novatune import ops
from novatune.ops import dispatch
from novatune.ops.dispatch import Selection, Setting
from novatune.patch.report import PatchReport


def test_dispatch_runs_the_selected_function_for_its_shape_only():
    calls = []

    def fake(x, weight, eps):
        calls.append(x.shape)
        return torch.full_like(x, 7.0)

    x, w = torch.randn(3, 8), torch.ones(8)
    key = ("rms_norm", (3, 8), "float32/float32", "cpu")
    prev = dispatch.install({key: fake})
    try:
        assert torch.equal(ops.rms_norm(x, w, 1e-6), torch.full_like(x, 7.0))
        other = ops.rms_norm(torch.randn(5, 8), w, 1e-6)  # another shape: the default path
        assert not torch.equal(other, torch.full_like(other, 7.0))
        assert calls == [(3, 8)]
    finally:
        dispatch.install(prev)
    assert dispatch.ACTIVE is prev


def test_recording_keeps_every_distinct_call_as_the_model_made_it():
    with dispatch.recording() as rec:
        for _ in range(3):
            ops.rms_norm(torch.randn(2, 3, 8), torch.ones(8), 1e-6)   # (2*3, 8) rows
        ops.rms_norm(torch.randn(2, 3, 8), torch.ones(8), 1e-5)
        fused = torch.randn(4, 12)
        ops.swiglu(fused[:, :6], fused[:, 6:], inplace_backward=True)
    assert rec.seen[("rms_norm", (6, 8), "float32/float32", "cpu")] == 4
    assert rec.seen[("swiglu", (4, 6), "float32", "cpu")] == 1
    assert dispatch.ACTIVE is None
    recs = {(r.op, r.args[-1].value): r for r in rec.calls.values()}
    assert set(recs) == {("rms_norm", 1e-6), ("rms_norm", 1e-5), ("swiglu", True)}
    x = recs[("rms_norm", 1e-5)].args[0]
    assert x.shape == (2, 3, 8) and x.dtype == torch.float32            # the rank is kept, not only rows x n
    gate = recs[("swiglu", True)].args[0]
    assert gate.stride == (12, 1)                                        # the fused projection's halves


def test_selection_apply_installs_table_and_settings_and_revert_restores():
    class Lm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(2, 2)
            self.__dict__["_novatune_ce_mode"] = "auto"

    model, report = Lm(), PatchReport(family="x", model_class="Lm")
    key = ("swiglu", (1, 4), "float32", "cpu")
    sel = Selection(table={key: lambda g, u, *, inplace_backward=False: g * 0},
                    settings=(Setting("loss", "_novatune_ce_mode", "vocab", "n"),),
                    entries=({"op": "swiglu"},), notes=("a note",))
    sel.apply(model, report)
    assert model.__dict__["_novatune_ce_mode"] == "vocab" and report.choices == [{"op": "swiglu"}]
    assert torch.equal(ops.swiglu(torch.ones(1, 4), torch.ones(1, 4)), torch.zeros(1, 4))
    report.revert()
    assert model.__dict__["_novatune_ce_mode"] == "auto" and dispatch.ACTIVE is None


def test_selected_function_gets_keyword_only_flags_by_keyword():
    """A user's swiglu written to the public signature (`*, inplace_backward`) runs after dispatch: the dispatcher
    calls through the op's contract (OpSpec.call), not positionally."""
    seen = []

    def mine(gate, up, *, inplace_backward=False):
        seen.append(inplace_backward)
        return torch.nn.functional.silu(gate) * up

    gate, up = torch.randn(3, 8), torch.randn(3, 8)
    prev = dispatch.install({("swiglu", (3, 8), "float32", "cpu"): mine})
    try:
        out = ops.swiglu(gate, up, inplace_backward=True)
    finally:
        dispatch.install(prev)
    assert seen == [True]
    assert torch.equal(out, torch.nn.functional.silu(gate) * up)
