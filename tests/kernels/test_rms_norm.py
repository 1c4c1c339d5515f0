"""RMSNorm Triton kernels vs the fp32 reference (CPU: through the Triton interpreter; GPU: real shapes).

Reference: rms_norm_ref on fp32 copies of the same inputs, differentiated by autograd, i.e. the pure-fp32 math.
Tolerances (relative norm error, novatune.measure.numerics):
* fp32 everything: 1e-5. Only the summation order of the row reduction / the dw sum over rows differs (~1e-7).
* bf16 outputs: 1e-2 (REL_TOL). y carries two bf16 roundings (normalised value, then the weighted product), dx one
  (its store), dw the bf16 rounding of each normalised term (averaged over rows) plus its store: ~2e-3 measured.
"""
import pytest
import torch

from novatune.kernels.rms_norm import (
    _sum_partials,
    rms_norm_bwd,
    rms_norm_bwd_config,
    rms_norm_bwd_launch_config,
    rms_norm_fwd,
    rms_norm_fwd_config,
)
from novatune.measure.numerics import REL_TOL, assert_close, poison_
from novatune.reference.rms_norm import rms_norm_bwd_ref, rms_norm_ref

EPS = 1e-6
# (rows, N): the interpreter is slow, so many rows only with small N and N=2560 only with few rows.
SHAPES = [(1, 127), (1, 2560), (37, 127), (37, 128), (3, 2560), (4097, 128)]
DTYPES = [torch.bfloat16, torch.float32]


def _inputs(shape, dtype, device, w_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = shape[-1]
    x = torch.randn(shape, generator=g).to(device, dtype)
    w = (1.0 + 0.5 * torch.randn(n, generator=g)).to(device, w_dtype or dtype)  # non-trivial weight
    dy = torch.randn(shape, generator=g).to(device, torch.promote_types(dtype, w.dtype))
    return x, w, dy


def _fp32_reference(x, w, dy, eps=EPS):
    """(y, rstd, dx, dw) of the pure-fp32 math on the same input values."""
    xr = x.detach().float().requires_grad_()
    wr = w.detach().float().requires_grad_()
    y, rstd = rms_norm_ref(xr, wr, eps, return_rstd=True)
    y.backward(dy.float())
    return y.detach(), rstd.detach(), xr.grad, wr.grad


def _run(x, w, dy, **cfg):
    """Kernel fwd + bwd into NaN-poisoned output buffers (catches any element a kernel forgets to write)."""
    out_dtype = torch.promote_types(x.dtype, w.dtype)
    y = poison_(torch.empty(x.shape, dtype=out_dtype, device=x.device))
    rstd = poison_(torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device))
    dx = poison_(torch.empty_like(x))
    dw = poison_(torch.empty_like(w))
    fwd_cfg = {k: v for k, v in cfg.items() if k in ("block_m", "num_warps")}
    y2, rstd2 = rms_norm_fwd(x, w, EPS, out=y, rstd=rstd, **fwd_cfg)
    dx2, dw2 = rms_norm_bwd(dy, x, w, rstd, dx=dx, dw=dw, **cfg)
    assert y2 is y and rstd2 is rstd and dx2 is dx and dw2 is dw
    return y, rstd, dx, dw


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fwd_bwd_vs_fp32_reference(shape, dtype, device):
    x, w, dy = _inputs(shape, dtype, device)
    y, rstd, dx, dw = _run(x, w, dy)
    ry, rrstd, rdx, rdw = _fp32_reference(x, w, dy)
    assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == dtype
    assert_close(y, ry, name="y")
    assert_close(rstd, rrstd, tol=1e-5, name="rstd")  # fp32 from the same input values: summation order only
    assert_close(dx, rdx, name="dx")
    assert_close(dw, rdw, name="dw")


def test_fp32_weight_with_bf16_input(device):
    """Mixed precision as in HF with fp32 norm weights: y is fp32 (promotion), dx bf16, dw fp32."""
    x, w, dy = _inputs((37, 128), torch.bfloat16, device, w_dtype=torch.float32)
    y, rstd, dx, dw = _run(x, w, dy)
    ry, _, rdx, rdw = _fp32_reference(x, w, dy)
    assert y.dtype == torch.float32 and dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    # y is fp32 but the normalised value is rounded to bf16 by definition: one bf16 rounding -> bf16 tolerance
    assert_close(y, ry, tol=REL_TOL[torch.bfloat16], name="y")
    assert_close(dx, rdx, name="dx")
    # dw: fp32 sum of dy * n with n rounded to bf16 (2^-9 relative per term, random signs): ~1e-3 vs fp32 math
    assert_close(dw, rdw, tol=REL_TOL[torch.bfloat16], name="dw")


def test_leading_dims_and_strides(device):
    """3-D input, a row stride != N (a column slice of a wider tensor) and a non-contiguous dy, as q/k-norm sees it
    (its output is transposed to (batch, heads, tokens, head_dim) before attention)."""
    b, t, h, d = 2, 9, 4, 128
    wide = torch.randn(b, t, h, 2 * d).to(device, torch.bfloat16)
    x = wide[..., :d]  # (b, t, h, d), row stride 2d
    w = (1.0 + 0.5 * torch.randn(d)).to(device, torch.bfloat16)
    dy = torch.randn(b, h, t, d).to(device, torch.bfloat16).transpose(1, 2)  # (b, t, h, d), non-contiguous
    y, rstd, dx, dw = _run(x, w, dy)
    ry, rrstd, rdx, rdw = _fp32_reference(x, w, dy)
    assert y.shape == x.shape and rstd.shape == x.shape[:-1] and dx.shape == x.shape
    assert_close(y, ry, name="y")
    assert_close(rstd, rrstd, tol=1e-5, name="rstd")
    assert_close(dx, rdx, name="dx")
    assert_close(dw, rdw, name="dw")


@pytest.mark.parametrize("shape,cfg", [
    ((67, 128), {"block_m": 1, "num_programs": 1}),  # one program loops over every row
    ((67, 128), {"block_m": 8, "num_programs": 3}),  # uneven blocks per program, partial last block
    ((67, 128), {"block_m": 64, "num_warps": 4, "num_programs": 64}),  # G clamped to the 2 row blocks
    ((67, 128), {"block_m": 4, "num_programs": 5, "stages": 3}),  # Triton-pipelined loop instead of prefetch
], ids=str)
def test_launch_config_overrides(shape, cfg, device):
    """Every config the tune engine may sweep gives the same numbers."""
    x, w, dy = _inputs(shape, torch.float32, device, seed=1)
    y, rstd, dx, dw = _run(x, w, dy, **cfg)
    ry, rrstd, rdx, rdw = _fp32_reference(x, w, dy)
    for out, ref, name in [(y, ry, "y"), (rstd, rrstd, "rstd"), (dx, rdx, "dx"), (dw, rdw, "dw")]:
        assert_close(out, ref, tol=1e-5, name=name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_partial_sum_loops_over_many_programs(dtype, device):
    """The dw reduction over G partial rows when G spans several tiles (a large num_programs override)."""
    partial = torch.randn(1100, 40).to(device)  # > 512 rows: more than one tile per column strip
    dw = poison_(torch.empty(40, dtype=dtype, device=device))
    _sum_partials(partial, dw)
    assert_close(dw, partial.sum(0), name="dw")  # fp32: order only; bf16: one rounding at the store


def test_bwd_ref_formula_matches_autograd():
    """The closed-form backward (used by kernels and the CPU path) equals autograd through the forward (fp32)."""
    x, w, dy = _inputs((5, 3, 64), torch.float32, "cpu")
    _, rstd, rdx, rdw = _fp32_reference(x, w, dy)
    dx, dw = rms_norm_bwd_ref(dy, x, w, rstd)
    assert_close(dx, rdx, tol=1e-5, name="dx")
    assert_close(dw, rdw, tol=1e-5, name="dw")


def test_empty_rows(device):
    x, w, dy = _inputs((0, 64), torch.bfloat16, device)
    y, rstd = rms_norm_fwd(x, w, EPS)
    dx, dw = rms_norm_bwd(dy, x, w, rstd)
    assert y.shape == (0, 64) and dx.shape == (0, 64) and torch.all(dw == 0)


def test_bad_arguments_raise_value_errors_not_asserts(device):
    """The launchers validate with exceptions (python -O strips asserts): a weight that is not (N,) (the kernel
    would read N elements past a (1,) one), integer inputs, mismatched dy / rstd, and preallocated buffers of the
    wrong shape, dtype or layout."""
    x, w, dy = _inputs((5, 37), torch.float32, device, seed=4)
    y, rstd = rms_norm_fwd(x, w, EPS)
    for bad_w in (w[:1], w.view(1, 37), torch.cat([w, w[:1]])):
        with pytest.raises(ValueError, match=r"weight must have shape \(37,\)"):
            rms_norm_fwd(x, bad_w, EPS)
        with pytest.raises(ValueError, match=r"weight must have shape \(37,\)"):
            rms_norm_bwd(dy, x, bad_w, rstd)
    with pytest.raises(TypeError, match="floating point"):
        rms_norm_fwd(x.long(), w, EPS)
    with pytest.raises(ValueError, match="dy"):
        rms_norm_bwd(dy[:4], x, w, rstd)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        rms_norm_fwd(x, w, EPS, out=torch.empty(5, 38, device=device))
    with pytest.raises(ValueError, match="rstd must be a contiguous"):
        rms_norm_fwd(x, w, EPS, rstd=torch.empty(5, device=device, dtype=torch.float64))
    with pytest.raises(ValueError, match="dx must be a contiguous"):
        rms_norm_bwd(dy, x, w, rstd, dx=torch.empty(37, 5, device=device).t())
    with pytest.raises(ValueError, match="dw must be a contiguous"):
        rms_norm_bwd(dy, x, w, rstd, dw=torch.empty(37, device=device, dtype=torch.bfloat16))


def test_heuristics_cover_both_regimes():
    assert rms_norm_fwd_config(131072, 128)["block_m"] >= 16, "q/k-norm needs many rows per program"
    assert rms_norm_bwd_config(131072, 128, num_sms=132)["block_m"] >= 16
    assert rms_norm_fwd_config(4096, 2560)["block_m"] <= 2
    hidden = rms_norm_bwd_config(4096, 2560, num_sms=132, resident_per_sm=2)
    assert hidden["num_programs"] == 256  # 16 rows each; the (G, 2560) fp32 partials are 2.6 MB
    x, w, dy = _inputs((37, 128), torch.bfloat16, "cpu")
    cfg = rms_norm_bwd_launch_config(dy, x, w, block_m=4)
    assert cfg["block_m"] == 4 and 1 <= cfg["num_programs"] <= 10


# ----------------------------------------------------------------------------------------------- GPU, real shapes
@pytest.mark.gpu
@pytest.mark.parametrize("rows,n", [(4096, 2560), (131072, 128)])
def test_real_shapes_gpu(rows, n):
    x, w, dy = _inputs((rows, n), torch.bfloat16, "cuda")
    y, rstd, dx, dw = _run(x, w, dy)
    ry, rrstd, rdx, rdw = _fp32_reference(x, w, dy)
    assert_close(y, ry, name="y")
    assert_close(rstd, rrstd, tol=1e-5, name="rstd")
    assert_close(dx, rdx, name="dx")
    assert_close(dw, rdw, name="dw")
    # HF's op sequence (torch CUDA): bit-identical but for rare flips where rstd differs in its last fp32 bit
    # (1 ulp in the rounded normalised value -> <= 2 ulps after the weight; see tests/ops/test_rms_norm.py)
    hf = rms_norm_ref(x, w, EPS)
    ulps = (y.view(torch.int16).int() - hf.view(torch.int16).int()).abs()
    assert int(ulps.max()) <= 2 and float((ulps > 0).float().mean()) < 1e-3
    assert_close(dx, rms_norm_bwd_ref(dy, x, w, rstd)[0], name="dx vs closed form")


@pytest.mark.gpu
def test_persistent_grid_from_measured_residency_gpu():
    """The backward grid is sized from the compiled kernel's registers, not the static fallback (Triton API drift
    in warmup()/_init_handles()/n_regs would silently land on the fallback)."""
    from novatune.kernels.rms_norm import RESIDENCY

    x, w, dy = _inputs((4096, 2560), torch.bfloat16, "cuda")
    cfg = rms_norm_bwd_launch_config(dy, x, w)
    assert RESIDENCY and all(how.startswith("measured") for _, how in RESIDENCY.values()), RESIDENCY
    assert cfg["num_programs"] >= torch.cuda.get_device_properties(0).multi_processor_count // 2


@pytest.mark.timing
@pytest.mark.gpu
@pytest.mark.parametrize("rows,n", [(4096, 2560), (131072, 128)])
def test_real_shapes_speed_sanity_gpu(rows, n):
    """Loose guard only (the figures come from bench/bench_rms_norm.py): fwd+bwd kernels reach >= 35% of copy BW."""
    from novatune.measure.timing import copy_bandwidth_gbps, kernel_us

    x, w, dy = _inputs((rows, n), torch.bfloat16, "cuda")

    def step():
        _, rstd = rms_norm_fwd(x, w, EPS)
        rms_norm_bwd(dy, x, w, rstd)

    floor_us = 5 * rows * n * 2 / copy_bandwidth_gbps() / 1e3
    us = kernel_us(step)
    assert floor_us / us >= 0.35, f"{us:.1f} µs vs floor {floor_us:.1f} µs"


def test_pipeline_stages_fit_the_devices_shared_memory(monkeypatch):
    # the backward's cp.async stages hold (stages - 1) tiles of x and dy in shared memory: capped per device so a
    # wide row launches on an A100 (164 KB per block) as on an H100 (227 KB), falling back to register prefetch
    from types import SimpleNamespace

    from novatune.kernels import rms_norm as K

    def props(kb):
        return lambda device: SimpleNamespace(shared_memory_per_block_optin=kb * 1024)

    row = 16384 * (2 + 2)  # one bf16 row of x and of dy
    monkeypatch.setattr(torch.cuda, "get_device_properties", props(227))
    K._block_smem.cache_clear()
    assert K._fit_stages(4, 4096 * 4, "cuda:0") == 4  # N = 2560 (4096 padded): 16 KB per stage
    assert K._fit_stages(4, row, "cuda:0") == 4  # 3 x 64 KB = 192 KB fits 227
    monkeypatch.setattr(torch.cuda, "get_device_properties", props(164))
    K._block_smem.cache_clear()
    assert K._fit_stages(4, row, "cuda:0") == 3  # 2 x 64 KB
    assert K._fit_stages(4, 2 * row, "cuda:0") == 2  # 128 KB
    assert K._fit_stages(4, 4 * row, "cuda:0") == 0  # not even one tile: register prefetch
    K._block_smem.cache_clear()
