"""MoE data-movement and activation kernels (novatune.kernels.moe) against the fp32 references, outputs poisoned.

Tolerances (relative-norm error): every kernel reads the same inputs as the reference, accumulates in fp32 and
rounds once at the store with round-to-nearest-even (also under the interpreter: _round_to's SOFT_RNE), so
* the gather is a copy: exact;
* fp32: only summation order (K terms, or I terms for the routing weight's gradient) -> 1e-5 (measured ~1e-7);
* bf16: one rounding per element, |err| <= 2^-9 |ref| -> rel-norm <= 2e-3 -> 4e-3.
The routing weight gradient dw is fp32 in every case (a dot over I in fp32) -> 1e-5.
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

    xs = K.gather_rows(x, order, div=k, out=poison_(torch.empty(t * k, h, dtype=dtype, device=device)))
    assert torch.equal(xs, R.permute_ref(x, order, k)), "the gather is a copy"

    out = poison_(torch.empty(t, h, dtype=dtype, device=device))
    K.combine(y, pos, w, out=out)
    assert_close(out, R.combine_ref(y, pos, w), TOL[dtype], "combine")
    wb = w.to(dtype)  # ... and weights in the activations' dtype (Qwen3-MoE)
    assert_close(K.combine(y, pos, wb), R.combine_ref(y, pos, wb), TOL[dtype], "combine, weights in dtype")
    assert_close(K.combine(y, pos, None), R.combine_ref(y, pos, None), TOL[dtype], "unweighted combine")


@pytest.mark.parametrize("t,k,h,e,key", [(1, 1, 37, 3, torch.int64), (13, 3, 127, 7, torch.uint8),
                                         (9, 8, 64, 11, torch.int64), (5, 2, 1100, 4, torch.uint8),
                                         (17, 4, 64, 256, torch.uint8), (11, 3, 48, 300, torch.int16)],
                         ids=lambda v: str(v))
def test_dispatch_gathers_rows_and_writes_pos_and_group_ends(t, k, h, e, key, device):
    """dispatch against the plain-torch routing (a scatter and bincount's cumulative counts) on the same sort:
    experts 0 and E-1 and one in the middle receive no row (ends before the first row, between groups and after
    the last), outputs poisoned (pos with -1, ends with a large value); the sorted ids in the int64 of the router
    or the narrow key dtype the op sorts in (256 experts: the largest uint8 count)."""
    gen = torch.Generator().manual_seed(t * 100 + k)
    used = [g for g in range(1, e - 1) if g != e // 2] or [e // 2]
    ids = torch.tensor(used)[torch.randint(0, len(used), (t, k), generator=gen)].to(device)
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(device)
    expert, order = torch.sort(ids.reshape(-1).to(key), stable=True)
    out = poison_(torch.empty(t * k, h, dtype=x.dtype, device=device))
    pos = torch.full((t * k,), -1, dtype=torch.int64, device=device)
    ends = torch.full((e,), 1 << 30, dtype=torch.int32, device=device)
    xs, pos2, ends2 = K.dispatch(x, order, expert, k, e, out=out, pos=pos, ends=ends)
    assert xs is out and pos2 is pos and ends2 is ends
    assert torch.equal(xs, R.permute_ref(x, order, k)), "the gather is a copy"
    ref_pos = torch.empty_like(order)
    ref_pos[order] = torch.arange(t * k, device=device)
    assert torch.equal(pos, ref_pos)
    assert torch.equal(ends.long(), torch.bincount(ids.reshape(-1).cpu(), minlength=e).cumsum(0).to(device))


def test_dispatch_of_no_rows_gives_zero_group_ends(device):
    x = torch.randn(0, 16, device=device)
    ids = torch.empty(0, 2, dtype=torch.int64, device=device)
    expert, order = torch.sort(ids.reshape(-1), stable=True)
    ends = torch.full((5,), 7, dtype=torch.int32, device=device)
    xs, pos, ends = K.dispatch(x, order, expert, 2, 5, ends=ends)
    assert xs.shape == (0, 16) and pos.shape == (0,) and torch.equal(ends, torch.zeros_like(ends))


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_combine_and_pick(shape, dtype, device):
    """The unweighted combine (the permute's backward) and picked[t, k] = values[pos[t, k]] (fp32 row values cast
    to the routing weights' dtype: one rounding, exact as the reference's cast) in one launch."""
    t, k, h = shape
    gen = torch.Generator().manual_seed(3)
    _, pos = _routing(t, k, 4)
    pos = pos.to(device)
    y = torch.randn(t * k, h, generator=gen).to(dtype).to(device)
    values = torch.randn(t * k, generator=gen).to(device)
    out = poison_(torch.empty(t, h, dtype=dtype, device=device))
    picked = poison_(torch.empty(t, k, dtype=dtype, device=device))
    got, got_picked = K.combine_and_pick(y, pos, values, dtype, out=out, picked=picked)
    assert got is out and got_picked is picked
    assert_close(out, R.combine_ref(y, pos, None), TOL[dtype], "combine")
    assert torch.equal(picked, values[pos].to(dtype))


@pytest.mark.parametrize("interleaved", [False, True], ids=["concatenated", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("rows,inter", [(1, 1), (37, 33), (5, 768), (3, 1100)])
def test_glu_forward_and_routed_backward(rows, inter, dtype, interleaved, device):
    """glu against the fp32 reference; the routed backward against autograd through
    sum(w * (glu(h) * da)) (its three outputs are that expression's gradients w.r.t. h, and (up to w) the operand
    of the down weight's gradient and the routing weight's gradient)."""
    gen = torch.Generator().manual_seed(5)
    h = (3 * torch.randn(rows, 2 * inter, generator=gen)).to(dtype).to(device)  # both sigmoid tails
    da = torch.randn(rows, inter, generator=gen).to(dtype).to(device)
    w = torch.rand(rows, generator=gen).to(device)
    a = K.glu_fwd(h, interleaved, out=poison_(torch.empty(rows, inter, dtype=dtype, device=device)))
    assert_close(a, R.glu_ref(h, interleaved), TOL[dtype], "glu")

    h32, w32 = h.float().requires_grad_(), w.clone().requires_grad_()
    a32 = R.glu_ref(h32, interleaved)
    ref_dh, ref_dw = torch.autograd.grad((w32[:, None] * a32 * da.float()).sum(), (h32, w32))
    ref = R.glu_routed_bwd_ref(da, h, w, interleaved)
    assert_close(ref[0], ref_dh, 1e-6, "reference dh vs autograd")
    assert_close(ref[2], ref_dw, 1e-6, "reference dw vs autograd")
    bufs = (poison_(torch.empty_like(h)), poison_(torch.empty(rows, inter, dtype=dtype, device=device)),
            poison_(torch.empty(rows, dtype=torch.float32, device=device)))
    dh, aw, dw = K.glu_routed_bwd(da, h, w, interleaved, *bufs)
    assert dh is bufs[0] and aw is bufs[1] and dw is bufs[2]
    assert_close(dh, ref_dh, TOL[dtype], "dh")
    assert_close(aw, w.float()[:, None] * a32.detach(), TOL[dtype], "w * a")
    # dw: an fp32 dot over I of products of fp32-exact inputs; only the order of summation differs
    assert_close(dw, ref_dw, 1e-5, "dw")

    # the same with the weights read through a sort order: row r's weight is w_pairs[order[r]]
    order = torch.randperm(rows, generator=gen).to(device)
    w_pairs = torch.empty_like(w)
    w_pairs[order] = w
    bufs = tuple(poison_(torch.empty_like(b)) for b in bufs)
    by_order = K.glu_routed_bwd(da, h, w_pairs.to(dtype), interleaved, *bufs, order=order)
    plain = K.glu_routed_bwd(da, h, w.to(dtype), interleaved)
    for name, a, b in zip(("dh", "w * a", "dw"), by_order, plain):
        assert torch.equal(a, b), f"{name}: weights through the order differ from the gathered weights"


def test_launchers_reject_wrong_output_buffers(device):
    y = torch.randn(6, 8, device=device)
    pos = torch.arange(6, device=device).view(3, 2)
    with pytest.raises(ValueError, match="contiguous"):
        K.combine(y, pos, None, out=torch.empty(3, 9, device=device))


@pytest.mark.parametrize("recipe", ["softmax_topk-renorm", "softmax_topk", "topk_softmax"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("t,e,k", [(1, 3, 1), (13, 7, 3), (6, 128, 8), (4, 130, 5)], ids=lambda v: str(v))
def test_route_bwd_against_autograd(t, e, k, dtype, recipe, device):
    """The router logits' gradient against autograd through the fp32 recipe (softmax over E, top-k, optional
    division by the sum; or top-k of the logits, softmax over K); the output (poisoned) rounds once to the
    logits' dtype."""
    gen = torch.Generator().manual_seed(t + e + k)
    z = (2 * torch.randn(t, e, generator=gen)).to(dtype).to(device)
    dw = torch.randn(t, k, generator=gen).to(dtype).to(device)
    z32 = z.float().requires_grad_()
    if recipe == "topk_softmax":
        top, ids = torch.topk(z32, k, dim=-1)
        w = saved = torch.softmax(top, dim=-1)
    else:
        saved = torch.softmax(z32, dim=-1)
        top, ids = torch.topk(saved, k, dim=-1)
        w = top / top.sum(-1, keepdim=True) if recipe.endswith("renorm") else top
    (ref,) = torch.autograd.grad(w, z32, dw.float())
    out = poison_(torch.empty(t, e, dtype=dtype, device=device))
    got = K.route_bwd(dw, saved.detach(), ids, e, topk_softmax=recipe == "topk_softmax",
                      renormalize=recipe.endswith("renorm"), out_dtype=dtype, out=out)
    assert got is out
    if k == 1 and recipe != "softmax_topk":  # the one weight is constant 1: no gradient, both rounding noise
        assert out.abs().max() <= 1e-6 and ref.abs().max() <= 1e-6
        return
    assert_close(out, ref, TOL[dtype], "dlogits")


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("rows,inter", [(2, 3), (37, 33), (3, 1100)])
def test_clamped_routed_backward(rows, inter, dtype, device):
    """GPT-OSS's routed backward (clamp=(alpha, limit)) against autograd through the fp32 clamped SwiGLU reference:
    sum(w * (act(h) * da)); inputs spread past the limit on both sides so both clamps bind (their gradient is
    exactly zero there)."""
    from novatune.reference.clamped_swiglu import GPT_OSS_ALPHA, GPT_OSS_LIMIT, clamped_swiglu_ref

    gen = torch.Generator().manual_seed(7)
    h = 6 * torch.randn(rows, 2 * inter, generator=gen)  # |x| > limit (7) for ~24%
    h[0, 0], h[-1, 1] = 9.0, -9.0  # at least one clamped gate and one clamped up, whatever the shape
    h = h.to(dtype).to(device)
    da = torch.randn(rows, inter, generator=gen).to(device)  # fp32: the down GEMM's fp32 input gradient
    w = torch.rand(rows, generator=gen).to(device)
    h32, w32 = h.float().requires_grad_(), w.clone().requires_grad_()
    a32 = clamped_swiglu_ref(h32)
    ref_dh, ref_dw = torch.autograd.grad((w32[:, None] * a32 * da).sum(), (h32, w32))
    bufs = (poison_(torch.empty_like(h)), poison_(torch.empty(rows, inter, dtype=dtype, device=device)),
            poison_(torch.empty(rows, dtype=torch.float32, device=device)))
    order = torch.randperm(rows, generator=gen).to(device)
    w_pairs = torch.empty_like(w)
    w_pairs[order] = w
    dh, aw, dw = K.glu_routed_bwd(da, h, w_pairs, True, *bufs, order=order, clamp=(GPT_OSS_ALPHA, GPT_OSS_LIMIT))
    assert dh is bufs[0] and aw is bufs[1] and dw is bufs[2]
    assert_close(dh, ref_dh, TOL[dtype], "dh")
    assert_close(aw, w[:, None] * a32.detach(), TOL[dtype], "w * a")
    assert_close(dw, ref_dw, 1e-5, "dw")
    clamped = (h.float()[:, 0::2] > GPT_OSS_LIMIT)
    assert clamped.any() and (dh[:, 0::2][clamped] == 0).all(), "a clamped gate has exactly zero gradient"
    assert dh[-1, 1] == 0, "a clamped up has exactly zero gradient"
