"""MoE data-movement and activation kernels (novatune.kernels.moe) against the fp32 references, outputs poisoned.

Tolerances (relative-norm error): every kernel reads the same inputs as the reference, accumulates in fp32 and
rounds once at the store with round-to-nearest-even (also under the interpreter: _round_to's SOFT_RNE), so
* the gather is a copy: exact;
* fp32: only summation order (K terms, or H terms for the weight gradient) -> 1e-5 (measured ~1e-7);
* bf16: one rounding per element, |err| <= 2^-9 |ref| -> rel-norm <= 2e-3 -> 4e-3.
The routing weight gradient dw is fp32 in every case (a dot over H in fp32) -> 1e-5.
"""
import pytest
import torch

from novatune.kernels import moe as K
from novatune.measure.numerics import assert_close, poison_
from novatune.reference import moe as R

TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3}
DTYPES = [torch.bfloat16, torch.float32]
# (tokens, top-k, hidden): odd hidden sizes, top-k 1/3/8, a single token, hidden past one column block
SHAPES = [(1, 1, 37), (13, 3, 127), (9, 8, 64), (5, 2, 1100)]


def _routing(t, k, seed):
    """A random permutation of the S = t*k rows as HF's sort would produce it: pos[t, k] -> row."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(t * k, generator=gen)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(t * k)
    return order, pos.view(t, k)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gather_and_combine(shape, dtype, device):
    t, k, h = shape
    gen = torch.Generator().manual_seed(1)
    order, pos = _routing(t, k, 2)
    x = torch.randn(t, h, generator=gen).to(dtype).to(device)
    y = torch.randn(t * k, h, generator=gen).to(dtype).to(device)
    w = torch.rand(t, k, generator=gen).to(device)  # fp32 weights (Mixtral) ...
    order, pos = order.to(device), pos.to(device)

    xs = K.gather_rows(x, order // k, out=poison_(torch.empty(t * k, h, dtype=dtype, device=device)))
    assert torch.equal(xs, R.permute_ref(x, order, k)), "the gather is a copy"

    out = poison_(torch.empty(t, h, dtype=dtype, device=device))
    K.combine(y, pos, w, out=out)
    assert_close(out, R.combine_ref(y, pos, w), TOL[dtype], "combine")
    wb = w.to(dtype)  # ... and weights in the activations' dtype (Qwen3-MoE)
    assert_close(K.combine(y, pos, wb), R.combine_ref(y, pos, wb), TOL[dtype], "combine, weights in dtype")
    assert_close(K.combine(y, pos, None), R.combine_ref(y, pos, None), TOL[dtype], "unweighted combine")


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_combine_backward_matches_autograd_of_reference(shape, dtype, device):
    t, k, h = shape
    gen = torch.Generator().manual_seed(3)
    _, pos = _routing(t, k, 4)
    pos = pos.to(device)
    y = torch.randn(t * k, h, generator=gen).to(dtype).to(device)
    w = torch.rand(t, k, generator=gen).to(device)
    dout = torch.randn(t, h, generator=gen).to(dtype).to(device)
    y32, w32 = y.float().requires_grad_(), w.clone().requires_grad_()
    ref_dy, ref_dw = torch.autograd.grad(R.combine_ref(y32, pos, w32), (y32, w32), dout.float())
    dy = poison_(torch.empty_like(y))
    dw = poison_(torch.empty(t, k, dtype=torch.float32, device=device))
    K.combine_bwd(dout, y, pos, w, dy=dy, dw=dw)
    assert_close(dy, ref_dy, TOL[dtype], "dy")
    assert_close(dw, ref_dw, 1e-5, "dw")


@pytest.mark.parametrize("interleaved", [False, True], ids=["concatenated", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("rows,inter", [(1, 1), (37, 33), (5, 768)])
def test_glu_fwd_bwd(rows, inter, dtype, interleaved, device):
    gen = torch.Generator().manual_seed(5)
    h = (3 * torch.randn(rows, 2 * inter, generator=gen)).to(dtype).to(device)  # both sigmoid tails
    da = torch.randn(rows, inter, generator=gen).to(dtype).to(device)
    a = K.glu_fwd(h, interleaved, out=poison_(torch.empty(rows, inter, dtype=dtype, device=device)))
    assert_close(a, R.glu_ref(h, interleaved), TOL[dtype], "glu")
    h32 = h.float().requires_grad_()
    (ref_dh,) = torch.autograd.grad(R.glu_ref(h32, interleaved), h32, da.float())
    assert_close(R.glu_bwd_ref(da, h, interleaved), ref_dh, 1e-6, "reference backward vs autograd")
    dh = K.glu_bwd(da, h, interleaved, dh=poison_(torch.empty_like(h)))
    assert_close(dh, ref_dh, TOL[dtype], "dh")


def test_launchers_reject_wrong_output_buffers(device):
    y = torch.randn(6, 8, device=device)
    pos = torch.arange(6, device=device).view(3, 2)
    with pytest.raises(ValueError, match="contiguous"):
        K.combine(y, pos, None, out=torch.empty(3, 9, device=device))
