"""SwiGLU Triton kernels (novatune.kernels.swiglu) against the fp32 reference.

Tolerances (relative-norm error, novatune.measure.numerics): the kernels read the same bf16/fp32 inputs as the
reference and do all math in fp32, so the only error is the single rounding of each output element:
* fp32: a few ulp from exp/sigmoid implementations -> 1e-5 (REL_TOL) with a wide margin (measured ~7e-8).
* bf16 on a GPU: round-to-nearest, |err_i| <= 2^-8 |ref_i| for every element, hence rel-norm <= 3.9e-3 -> 4e-3.
* bf16 under TRITON_INTERPRET: the interpreter truncates fp32 -> bf16 (round toward zero; the GPU uses
  cvt.rn), so the bound doubles to 2^-7 = 7.8e-3 (measured ~3.3e-3, the rms of truncation error) -> 8e-3.
"""
import pytest
import torch

from novatune.kernels import swiglu as K
from novatune.measure.numerics import assert_close, poison_, rel_err
from novatune.reference import swiglu as R

HAS_CUDA = torch.cuda.is_available()
BF16_TOL = 4e-3 if HAS_CUDA else 8e-3
TOL = {torch.float32: 1e-5, torch.bfloat16: BF16_TOL}

# The interpreter is slow: 4097 rows only with a small hidden size, hidden 2560 only with few rows.
SHAPES = [(1, 127), (37, 127), (4097, 127), (1, 2560), (3, 2560), (2, 37, 127), (2, 3, 2560)]
DTYPES = [torch.bfloat16, torch.float32]


def _inputs(shape, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # scale 3 so the sigmoid's saturated tails (|g| > 5) are exercised as well as its middle
    g = (3 * torch.randn(shape, generator=gen)).to(dtype).to(device)
    u = torch.randn(shape, generator=gen).to(dtype).to(device)
    dy = torch.randn(shape, generator=gen).to(dtype).to(device)
    return g, u, dy


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fwd_bwd_match_reference(shape, dtype, device):
    g, u, dy = _inputs(shape, dtype, device)
    y = poison_(torch.empty(shape, dtype=dtype, device=device))
    out = K.swiglu_fwd(g, u, out=y)
    assert out is y and y.dtype == dtype
    assert_close(y, R.swiglu_ref(g, u), TOL[dtype], "y")

    dg = poison_(torch.empty_like(g))
    du = poison_(torch.empty_like(u))
    rdg, rdu = R.swiglu_bwd_ref(dy, g, u)
    K.swiglu_bwd(dy, g, u, dgate=dg, dup=du)
    assert_close(dg, rdg, TOL[dtype], "dgate")
    assert_close(du, rdu, TOL[dtype], "dup")


def test_fp16(device):
    """fp16 (unit roundoff 2^-11 = 4.9e-4, round-to-nearest on GPU and in the interpreter) -> 1e-3."""
    g, u, dy = _inputs((37, 127), torch.float16, device)
    assert_close(K.swiglu_fwd(g, u), R.swiglu_ref(g, u), 1e-3, "y")
    for out, ref, name in zip(K.swiglu_bwd(dy, g, u), R.swiglu_bwd_ref(dy, g, u), ("dgate", "dup")):
        assert out.dtype == torch.float16
        assert_close(out, ref, 1e-3, name)


def test_bwd_ref_matches_autograd():
    """The closed-form backward the kernel implements equals autograd of silu(g) * u (fp64, so exact-ish)."""
    g, u, dy = (t.double() for t in _inputs((37, 127), torch.float32, "cpu"))
    g.requires_grad_(True)
    u.requires_grad_(True)
    (torch.nn.functional.silu(g) * u).backward(dy)
    rdg, rdu = R.swiglu_bwd_ref(dy, g.detach(), u.detach())
    assert_close(rdg, g.grad, 1e-6, "dgate closed form")  # fp32 arithmetic inside the reference
    assert_close(rdu, u.grad, 1e-6, "dup closed form")


@pytest.mark.parametrize("block,warps,numel", [(512, 4, 2 * 4096), (1024, 4, 4 * 1024), (512, 4, 37 * 127),
                                               (1024, 4, 37 * 127)], ids=["even512", "even1024", "masked512",
                                                                          "masked1024"])
def test_gpu_configs(block, warps, numel, device):
    """The two GPU configs of default_config (the interpreter defaults to one big block), each with the EVEN
    (no mask: BLOCK divides numel) and the masked-tail path."""
    g, u, dy = _inputs((numel,), torch.float32, device)
    y = poison_(torch.empty_like(g))
    K.swiglu_fwd(g, u, out=y, block=block, num_warps=warps)
    assert_close(y, R.swiglu_ref(g, u), 1e-5, "y")
    dg, du = poison_(torch.empty_like(g)), poison_(torch.empty_like(u))
    K.swiglu_bwd(dy, g, u, dgate=dg, dup=du, block=block, num_warps=warps)
    rdg, rdu = R.swiglu_bwd_ref(dy, g, u)
    assert_close(dg, rdg, 1e-5, "dgate")
    assert_close(du, rdu, 1e-5, "dup")


def test_int64_offsets_path(device, monkeypatch):
    """The int64-offset variant (used from 2^31 elements on) computes the same values; forced on a small tensor."""
    monkeypatch.setattr(K, "_I64_THRESHOLD", 0)
    g, u, dy = _inputs((37, 127), torch.float32, device)
    assert_close(K.swiglu_fwd(g, u), R.swiglu_ref(g, u), 1e-5, "y")
    dg, du = K.swiglu_bwd(dy, g, u)
    rdg, rdu = R.swiglu_bwd_ref(dy, g, u)
    assert_close(dg, rdg, 1e-5, "dgate")
    assert_close(du, rdu, 1e-5, "dup")


def test_launch_config_cache_keys(monkeypatch):
    """The cached (grid, constexprs) follow numel, the overrides and the int64 threshold (so the test above really
    runs the int64 variant even when an earlier test cached the same size)."""
    n = 37 * 127
    grid, meta = K._launch_args(n, 1024, 4)
    assert grid == (5,) and meta == dict(BLOCK=1024, EVEN=False, I64=False, num_warps=4, COLS=0)
    assert K._launch_args(n, 1024, 4) is K._launch_args(n, 1024, 4)   # cached
    assert K._launch_args(4096, 1024, 8)[1]["EVEN"]
    monkeypatch.setattr(K, "_I64_THRESHOLD", 0)
    assert K._launch_args(n, 1024, 4)[1]["I64"]


def test_non_contiguous_inputs(device):
    """Strided views are made contiguous by the launcher; outputs are contiguous with the view's shape."""
    g, u, dy = _inputs((127, 37), torch.float32, device)
    g, u, dy = g.t(), u.t(), dy.t()  # (37, 127), column-major
    y = K.swiglu_fwd(g, u)
    assert y.is_contiguous() and y.shape == (37, 127)
    assert_close(y, R.swiglu_ref(g, u), 1e-5, "y")
    dg, du = K.swiglu_bwd(dy, g, u)
    rdg, rdu = R.swiglu_bwd_ref(dy, g, u)
    assert_close(dg, rdg, 1e-5, "dgate")
    assert_close(du, rdu, 1e-5, "dup")


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # numpy under the interpreter; inf is intended
def test_extreme_gate_values_stay_finite(device):
    """Saturated sigmoid: exp(-g) overflows to inf for g << 0; sig = 0 there and nothing becomes NaN."""
    g = torch.tensor([-1e4, -100.0, -88.0, -20.0, 0.0, 20.0, 88.0, 100.0, 1e4], device=device)
    u = torch.full_like(g, 1.5)
    dy = torch.full_like(g, -2.0)
    y = K.swiglu_fwd(g, u)
    dg, du = K.swiglu_bwd(dy, g, u)
    rdg, rdu = R.swiglu_bwd_ref(dy, g, u)
    for out, ref, name in [(y, R.swiglu_ref(g, u), "y"), (dg, rdg, "dgate"), (du, rdu, "dup")]:
        assert torch.isfinite(out).all(), name
        assert_close(out, ref, 1e-6, name)


def test_empty_and_bad_arguments(device):
    e = torch.empty(0, 5, device=device)
    assert K.swiglu_fwd(e, e).shape == (0, 5)
    assert all(t.shape == (0, 5) for t in K.swiglu_bwd(e, e, e))
    a, b = torch.randn(4, 8, device=device), torch.randn(4, 9, device=device)
    with pytest.raises(ValueError, match="same shape"):
        K.swiglu_fwd(a, b)
    with pytest.raises(ValueError, match="contiguous"):
        K.swiglu_fwd(a, a, out=torch.empty(8, 4, device=device).t())


# ---- GPU only: the real shape (Qwen3-4B MLP, 4096 tokens x 9728) -------------------------------------------

@pytest.mark.gpu
def test_gpu_real_shape_values_and_rounding():
    g, u, dy = _inputs((4096, 9728), torch.bfloat16, "cuda")
    y = poison_(torch.empty_like(g))
    K.swiglu_fwd(g, u, out=y)
    ref = R.swiglu_ref(g, u)
    err = assert_close(y, ref, 4e-3, "y")
    # one rounding beats eager's two (silu rounded to bf16, then the product)
    assert err <= rel_err(torch.nn.functional.silu(g) * u, ref)
    dg, du = poison_(torch.empty_like(g)), poison_(torch.empty_like(u))
    K.swiglu_bwd(dy, g, u, dgate=dg, dup=du)
    rdg, rdu = R.swiglu_bwd_ref(dy, g, u)
    assert_close(dg, rdg, 4e-3, "dgate")
    assert_close(du, rdu, 4e-3, "dup")


@pytest.mark.timing
@pytest.mark.gpu
def test_gpu_speed_fraction_of_hbm_floor():
    """fwd+bwd kernel time within the target: >= 70% of the HBM floor (8 * N elements * 2 bytes)."""
    from novatune.measure.timing import copy_bandwidth_gbps, kernel_us

    g, u, dy = _inputs((4096, 9728), torch.bfloat16, "cuda")
    y, dg, du = torch.empty_like(g), torch.empty_like(g), torch.empty_like(u)

    def step():
        K.swiglu_fwd(g, u, out=y)
        K.swiglu_bwd(dy, g, u, dgate=dg, dup=du)

    floor_us = 8 * g.numel() * 2 / (copy_bandwidth_gbps() * 1e3)
    us = kernel_us(step)
    assert floor_us / us >= 0.7, f"swiglu fwd+bwd {us:.1f} us, floor {floor_us:.1f} us ({floor_us / us:.2f})"


# ---------------------------------------------------------------- fused [gate | up] layout (Phi-3's gate_up_proj)
GATE_UP = [  # (shape of gate_up, block, num_warps): odd widths and rows, a block that spans rows, one that divides
    ((37, 2 * 127), None, None), ((2, 19, 2 * 48), 16, 4), ((2, 19, 2 * 48), 32, 4), ((1, 2), None, None),
    ((3, 2 * 2560), 512, 4), ((4097, 2 * 7), None, None)]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape,block,warps", GATE_UP, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple)
                         else str(v))
def test_gate_up_fwd_bwd_match_reference(shape, block, warps, dtype, device):
    """One (..., 2I) [gate | up] tensor in: the same values as the two-tensor kernels' reference on its halves;
    d(gate_up) in the same layout, into a poisoned buffer and over gate_up itself (its last use)."""
    gen = torch.Generator().manual_seed(1)
    gu = torch.cat([3 * torch.randn(shape[:-1] + (shape[-1] // 2,), generator=gen),
                    torch.randn(shape[:-1] + (shape[-1] // 2,), generator=gen)], dim=-1).to(dtype).to(device)
    g, u = gu.chunk(2, dim=-1)
    dy = torch.randn(g.shape, generator=gen).to(dtype).to(device)
    y = poison_(torch.empty(g.shape, dtype=dtype, device=device))
    assert K.swiglu_gate_up_fwd(gu, out=y, block=block, num_warps=warps) is y
    assert_close(y, R.swiglu_ref(g, u), TOL[dtype], "y")
    rdg, rdu = R.swiglu_bwd_ref(dy, g, u)
    dgu = K.swiglu_gate_up_bwd(dy, gu, poison_(torch.empty_like(gu)), block=block, num_warps=warps)
    assert_close(dgu, torch.cat([rdg, rdu], dim=-1), TOL[dtype], "dgate_up")
    inplace = gu.clone()
    assert K.swiglu_gate_up_bwd(dy, inplace, inplace, block=block, num_warps=warps) is inplace
    assert torch.equal(inplace, dgu), "over gate_up: the same numbers"


def test_gate_up_bad_arguments(device):
    gu = torch.randn(3, 9, device=device)
    with pytest.raises(ValueError, match="even"):
        K.swiglu_gate_up_fwd(gu)
    gu = torch.randn(3, 8, device=device)
    with pytest.raises(ValueError, match="halved"):
        K.swiglu_gate_up_bwd(torch.randn(3, 8, device=device), gu)
    with pytest.raises(ValueError, match="contiguous with shape"):
        K.swiglu_gate_up_fwd(gu, out=torch.empty(3, 8, device=device))
