"""Grouped LoRA linears on one input (novatune.ops.lora_linear_group, the q/k/v of a QLoRA attention layer):
outputs and every gradient against the per-member fp32 reference, with dense members and with a stand-in that
dequantises into the stacked weight (kept for the backward or densified again there), outputs written in full.

Tolerances as tests/ops/test_lora.py: fp32 1e-5 (summation order); bf16 8e-3 (fp32-accumulated GEMMs, a few bf16
roundings per output). dx sums the members inside GEMMs, so it has fewer roundings than the members' own sum.
"""
import pytest
import torch

from novatune.measure.numerics import assert_close
from novatune.ops.lora import lora_linear_group
from novatune.reference.lora import lora_linear_ref

TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}


class StandIn:
    """A frozen weight held elsewhere (as DequantWeight is): dense on request, or written into a given buffer."""

    def __init__(self, w, keep):
        self.w, self.keep_for_backward = w, keep
        self.shape, self.dtype, self.device = w.shape, w.dtype, w.device
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return self.w.clone()

    def into(self, out):
        self.calls += 1
        out.fill_(float("nan"))  # poisoned first: a block the op forgot to fill would show
        return out.copy_(self.w)


def _members(outs, ranks, n_in, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    ws = [(torch.randn(o, n_in, generator=g) / n_in ** 0.5).to(device, dtype) for o in outs]
    as_ = [(torch.randn(r, n_in, generator=g) / n_in ** 0.5).to(device, torch.float32).requires_grad_(True)
           for r in ranks]
    bs = [(torch.randn(o, r, generator=g) / r ** 0.5).to(device, torch.float32).requires_grad_(True)
          for o, r in zip(outs, ranks)]
    return ws, as_, bs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["dense", "stand-in kept", "stand-in again"])
@pytest.mark.parametrize("lead,n_in,outs,ranks", [((1,), 127, (65, 17, 17), (4, 4, 4)),
                                                  ((2, 37), 127, (96, 32, 32), (8, 8, 8)),
                                                  ((37,), 64, (48, 48), (16, 4))],
                         ids=["1tok", "2x37", "two-members"])
def test_group_matches_each_members_reference(lead, n_in, outs, ranks, kind, dtype, device):
    ws, as_, bs = _members(outs, ranks, n_in, dtype, device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*lead, n_in, generator=g).to(device, dtype).requires_grad_(True)
    dys = [torch.randn(*lead, o, generator=g).to(device, dtype) for o in outs]
    weights = ws if kind == "dense" else [StandIn(w, keep=kind == "stand-in kept") for w in ws]
    ys = lora_linear_group(x, weights, as_, bs, 2.0)
    assert [y.shape for y in ys] == [(*lead, o) for o in outs] and all(y.dtype == dtype for y in ys)
    assert all(torch.isfinite(y).all() for y in ys), "every output block written"
    torch.autograd.backward(ys, dys)
    got = [x.grad] + [a.grad for a in as_] + [b.grad for b in bs]
    if kind != "dense":
        want = 1 if kind == "stand-in kept" else 2  # the backward densifies again unless the weight was kept
        assert all(w.calls == want for w in weights), [w.calls for w in weights]
    # reference: the members one by one in fp32, autograd summing their input gradients
    x32 = x.detach().float().requires_grad_(True)
    a32 = [a.detach().float().requires_grad_(True) for a in as_]
    b32 = [b.detach().float().requires_grad_(True) for b in bs]
    refs = [lora_linear_ref(x32, w.float(), None, a, b, 2.0) for w, a, b in zip(ws, a32, b32)]
    torch.autograd.backward(refs, [dy.float() for dy in dys])
    for i, (y, r) in enumerate(zip(ys, refs)):
        assert_close(y, r, TOL[dtype], f"y{i}")
    for name, gv, rv in zip(["dx"] + [f"dA{i}" for i in range(len(outs))] + [f"dB{i}" for i in range(len(outs))],
                            got, [x32.grad] + [a.grad for a in a32] + [b.grad for b in b32]):
        assert gv is not None and gv.shape == rv.shape, name
        assert_close(gv, rv, TOL[dtype], name)
    assert all(a.grad.dtype == torch.float32 for a in as_), "adapter grads in the adapters' dtype"


def test_outputs_are_column_blocks_that_reshape_into_heads():
    # the attention forward views each output as (b, s, heads, d): last dim contiguous, rows strided
    ws, as_, bs = _members((64, 32, 32), (4, 4, 4), 48, torch.float32, "cpu")
    x = torch.randn(1, 5, 48)
    q, k, v = lora_linear_group(x, ws, as_, bs, 1.0)
    assert q.stride(-1) == 1 and q.stride(-2) == 128
    assert q.view(1, 5, 4, 16).shape == (1, 5, 4, 16) and k.view(1, 5, 2, 16).is_contiguous() is False


def test_group_rejects_mismatched_members():
    ws, as_, bs = _members((8, 8), (2, 2), 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="lora_linear_group"):
        lora_linear_group(torch.randn(3, 16), ws, as_[:1], bs, 1.0)
    with pytest.raises(ValueError, match="A .* do not fit"):
        lora_linear_group(torch.randn(3, 16), ws, [as_[0], torch.randn(2, 15)], bs, 1.0)


def test_double_backward_raises_instead_of_being_wrong():
    """xa is saved from the forward: a second-order gradient would miss its dependence on x and A (it came back
    None for both, silently); the backward is once-differentiable and says so."""
    ws, as_, bs = _members((29, 7), (4, 2), 37, torch.float32, "cpu", seed=3)
    x = torch.randn(3, 37, generator=torch.Generator().manual_seed(4)).requires_grad_(True)
    ys = lora_linear_group(x, ws, as_, bs, 0.5)
    dys = [torch.randn(y.shape).requires_grad_(True) for y in ys]
    grads = torch.autograd.grad(ys, [x, *as_, *bs], dys, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        sum((g * g).sum() for g in grads).backward()
