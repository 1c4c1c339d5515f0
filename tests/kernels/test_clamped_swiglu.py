"""GPT-OSS clamped SwiGLU Triton kernels (novatune.kernels.clamped_swiglu) against the fp32 reference.

Tolerances (relative norm): the kernels read the same inputs as the reference and compute in fp32 with one
round-to-nearest at each store (the interpreter too: the kernels round in software there), so
* fp32: sigmoid/exp implementations differ by a few ulp -> 1e-5;
* bf16: one rounding, |err_i| <= 2^-9 |ref_i| -> rel-norm <= 2e-3; 4e-3 leaves room for the fp32 ulps.
The clamps compare the same input values in kernel and reference, so a clamped gradient is exactly 0 in both.
"""
import pytest
import torch

from novatune.kernels import clamped_swiglu as K
from novatune.measure.numerics import assert_close, poison_
from novatune.reference.clamped_swiglu import clamped_swiglu_bwd_ref, clamped_swiglu_ref, hf_clamped_swiglu

TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3}
ALPHA, LIMIT = 1.702, 7.0
# (rows..., 2I): odd intermediate sizes, one row, 4097 rows with a small width, a 3-D call
SHAPES = [(1, 10), (37, 254), (4097, 6), (3, 5120), (2, 19, 34)]


def _inputs(shape, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gu = (4 * torch.randn(shape, generator=gen)).to(dtype).to(device)  # |x| > 7 in ~8%: every clamp branch
    dy = torch.randn(*shape[:-1], shape[-1] // 2, generator=gen).to(dtype).to(device)
    return gu, dy


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fwd_bwd_match_reference(shape, dtype, device):
    gu, dy = _inputs(shape, dtype, device)
    y = poison_(torch.empty(dy.shape, dtype=dtype, device=device))
    assert K.clamped_swiglu_fwd(gu, ALPHA, LIMIT, out=y) is y
    assert_close(y, clamped_swiglu_ref(gu, ALPHA, LIMIT), TOL[dtype], "y")
    d = poison_(torch.empty_like(gu))
    assert K.clamped_swiglu_bwd(dy, gu, ALPHA, LIMIT, dgate_up=d) is d
    assert_close(d, clamped_swiglu_bwd_ref(dy, gu, ALPHA, LIMIT), TOL[dtype], "dgate_up")


def test_gradient_is_exactly_zero_where_the_clamp_is_active(device):
    gu, dy = _inputs((301, 46), torch.float32, device, seed=3)
    gu[0, 0], gu[0, 1], gu[0, 3] = LIMIT, -LIMIT, LIMIT  # at the bounds torch's clamp passes the gradient
    d = K.clamped_swiglu_bwd(dy, gu, ALPHA, LIMIT)
    gate, up = gu[..., ::2], gu[..., 1::2]
    dgate, dup = d[..., ::2], d[..., 1::2]
    assert bool((gate > LIMIT).any()) and bool((up.abs() > LIMIT).any())
    assert bool((dgate[gate > LIMIT] == 0).all()) and bool((dup[up.abs() > LIMIT] == 0).all())
    assert bool((dgate[gate <= LIMIT] != 0).all()) and bool((dup[up.abs() <= LIMIT] != 0).all())


def test_closed_form_backward_is_autograd_of_hf_formula():
    """fp64 autograd through HF's own code (torch.clamp's gradient rule included) equals the closed form, which
    computes in fp32 (1e-6: fp32 rounding of a few chained operations)."""
    gu, dy = _inputs((53, 38), torch.float64, "cpu", seed=5)
    gu[1, 0], gu[1, 1] = LIMIT, LIMIT
    x = gu.clone().requires_grad_()
    hf_clamped_swiglu(x, ALPHA, LIMIT).backward(dy)
    assert_close(clamped_swiglu_bwd_ref(dy, gu, ALPHA, LIMIT), x.grad, 1e-6, "closed form vs autograd")


def test_nan_stays_in_its_element_and_follows_torch_clamp(device):
    gu, dy = _inputs((9, 14), torch.float32, device, seed=7)
    gu[4, 6], gu[2, 3] = float("nan"), float("nan")   # a gate and an up element
    y, d = K.clamped_swiglu_fwd(gu, ALPHA, LIMIT), K.clamped_swiglu_bwd(dy, gu, ALPHA, LIMIT)
    ry, rd = clamped_swiglu_ref(gu, ALPHA, LIMIT), clamped_swiglu_bwd_ref(dy, gu, ALPHA, LIMIT)
    assert torch.equal(torch.isnan(y), torch.isnan(ry)) and int(torch.isnan(y).sum()) == 2
    assert torch.equal(torch.isnan(d), torch.isnan(rd))
    ok = ~torch.isnan(ry)
    assert_close(y[ok], ry[ok], 1e-5, "y off the NaNs")


def test_int64_offsets(monkeypatch, device):
    monkeypatch.setattr(K, "_I64_THRESHOLD", 64)
    gu, dy = _inputs((37, 22), torch.float32, device, seed=2)
    assert_close(K.clamped_swiglu_fwd(gu, ALPHA, LIMIT), clamped_swiglu_ref(gu, ALPHA, LIMIT), 1e-5, "y (int64)")
    assert_close(K.clamped_swiglu_bwd(dy, gu, ALPHA, LIMIT), clamped_swiglu_bwd_ref(dy, gu, ALPHA, LIMIT), 1e-5,
                 "dgate_up (int64)")


def test_strided_input_and_bad_shapes(device):
    gu, _ = _inputs((13, 40), torch.float32, device)
    wide = torch.zeros(13, 50, device=device)
    wide[:, 5:45] = gu
    assert_close(K.clamped_swiglu_fwd(wide[:, 5:45], ALPHA, LIMIT), clamped_swiglu_ref(gu, ALPHA, LIMIT), 1e-5,
                 "strided")
    with pytest.raises(ValueError, match="even last dimension"):
        K.clamped_swiglu_fwd(gu[:, :7], ALPHA, LIMIT)
    with pytest.raises(ValueError, match="contiguous with shape"):
        K.clamped_swiglu_fwd(gu, ALPHA, LIMIT, out=torch.empty(13, 40, device=device))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("rows,inter,experts", [(1, 1, 1), (37, 33, 5), (6, 700, 3)])
def test_forward_with_the_experts_bias_is_the_separate_add_then_the_activation(rows, inter, experts, dtype, device):
    """gate_up += bias[expert[r]] written back (rounded to gate_up's dtype) and y from it: bit for bit the separate
    add followed by the plain forward, whatever rows the experts get (some none)."""
    gen = torch.Generator().manual_seed(11)
    h = (5 * torch.randn(rows, 2 * inter, generator=gen)).to(dtype).to(device)
    bias = torch.randn(experts, 2 * inter, generator=gen).to(dtype).to(device)
    expert = torch.randint(0, experts, (rows,), generator=gen).sort().values.to(torch.uint8).to(device)
    added = h.clone().add_(bias[expert.long()])
    want = K.clamped_swiglu_fwd(added, ALPHA, LIMIT)
    fused = h.clone()
    y = K.clamped_swiglu_fwd(fused, ALPHA, LIMIT, out=poison_(torch.empty(rows, inter, dtype=dtype, device=device)),
                             bias=bias, expert=expert)
    assert torch.equal(fused, added), "gate_up carries the bias afterwards (the backward reads it)"
    assert torch.equal(y, want)
    with pytest.raises(ValueError, match="bias"):
        K.clamped_swiglu_fwd(h.clone(), ALPHA, LIMIT, bias=bias)


@pytest.mark.parametrize("path", ["even", "int64"])
def test_bias_forward_on_the_even_and_int64_paths(path, device, monkeypatch):
    """The bias add on the unmasked path (a whole number of blocks) and with int64 offsets (threshold lowered):
    the same bits as the separate add and the plain forward."""
    if path == "int64":
        monkeypatch.setattr(K, "_I64_THRESHOLD", 64)
    gen = torch.Generator().manual_seed(12)
    rows, inter = 4, 64  # 256 output elements: 1 block of 256 (EVEN)
    h = (5 * torch.randn(rows, 2 * inter, generator=gen)).to(device)
    bias = torch.randn(3, 2 * inter, generator=gen).to(device)
    expert = torch.tensor([0, 0, 2, 2], dtype=torch.int32, device=device)
    want = K.clamped_swiglu_fwd(h.clone().add_(bias[expert.long()]), ALPHA, LIMIT, block=256)
    fused = h.clone()
    y = K.clamped_swiglu_fwd(fused, ALPHA, LIMIT, block=256, bias=bias, expert=expert)
    assert torch.equal(fused, h + bias[expert.long()]) and torch.equal(y, want)
    with pytest.raises(ValueError, match="integer expert ids"):
        K.clamped_swiglu_fwd(h.clone(), ALPHA, LIMIT, bias=bias, expert=expert.float())
