"""novatune.kernels.moe_wgrad: out[e] += a[group e]^T b[group e] inside one grouped GEMM, against the fp32 reference
(novatune.reference.moe.grouped_outer_accumulate_ref) on odd shapes, uneven and empty groups, strided rows, two tile
configurations (several tiles and several row blocks per expert), bf16 and fp32.

Tolerances: both sides accumulate each dot product in fp32 and round once, in different summation orders. fp32
outputs: the orders differ by at most (rows) * eps32 * sum|a||b| per element, bounded here by 1e-5 relative to that
sum (rows <= 130). bf16 outputs: the fp32 sums agree to that bound, so a stored value differs at most where they
straddle a rounding boundary: one bf16 spacing, and almost all values equal.
"""
import math

import pytest
import torch

from novatune.kernels import moe_wgrad as W
from novatune.kernels.moe_wgrad import DEFAULT_CONFIG, grouped_outer_accumulate
from novatune.reference.moe import grouped_outer_accumulate_ref

SMALL = (16, 32, 16, 4, 1)  # several tiles per expert and several row blocks per group at test sizes


def _inputs(counts, m, n, dtype, device, seed, row_pad=0):
    gen = torch.Generator().manual_seed(seed)
    s = sum(counts)
    # rows strided when row_pad > 0: a and b are column slices of wider tensors
    a = torch.randn(s, m + row_pad, generator=gen).to(dtype).to(device)[:, :m]
    b = torch.randn(s, n + row_pad, generator=gen).to(dtype).to(device)[:, :n]
    ends = torch.tensor(counts).cumsum(0).to(torch.int32).to(device)
    out = torch.randn(len(counts), m, n, generator=gen).to(dtype).to(device)
    return a, b, ends, out


def _spacing(t: torch.Tensor) -> torch.Tensor:
    big = torch.nextafter(t.abs(), torch.full_like(t, math.inf))
    return big.double() - t.abs().double()


def _magnitude(a, b, ends, out):
    """Per element |out| + sum over the group's rows of |a||b|: the scale of the summation-order difference."""
    return grouped_outer_accumulate_ref(a.abs().double(), b.abs().double(), ends, out.abs().double())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("counts,m,n,row_pad", [([0, 5, 37, 0, 64, 1, 23], 37, 53, 0),
                                                ([130, 0, 3], 19, 70, 3),
                                                ([7, 9], 128, 16, 0)])
@pytest.mark.parametrize("config", [DEFAULT_CONFIG, SMALL], ids=["default", "small"])
def test_kernel_matches_reference(counts, m, n, row_pad, dtype, config, device):
    a, b, ends, out = _inputs(counts, m, n, dtype, device, seed=m * n + len(counts), row_pad=row_pad)
    want = grouped_outer_accumulate_ref(a, b, ends, out)
    got = grouped_outer_accumulate(a, b, ends, out, config=config)
    assert got is out
    scale = _magnitude(a, b, ends, want)
    diff = (got.double() - want.double()).abs()
    if dtype == torch.float32:
        assert (diff <= 1e-5 * scale).all(), float((diff / scale).max())
    else:
        assert (diff <= _spacing(want) + 1e-5 * scale).all(), float((diff / _spacing(want)).max())
        assert (diff == 0).double().mean() > 0.98


@pytest.mark.parametrize("counts,m,n,row_pad", [([0, 5, 37, 0, 64, 1, 23], 40, 56, 8), ([130, 0, 3], 24, 72, 0)])
def test_tma_form_matches_reference_and_leaves_empty_experts_alone(counts, m, n, row_pad, device, monkeypatch):
    """The Tensor Memory Accelerator form (bf16, 16-byte aligned rows): experts' row blocks end at the descriptor's
    bound (no mask), the gradient's tile read and written as a box clipped at M, N (tile sizes that do not divide
    them); an expert without rows keeps its bits (NaN and -0.0, which an added 0 would turn into +0.0). Tolerance
    as test_kernel_matches_reference's bf16 case."""
    ran = []
    real = W._launch_tma
    monkeypatch.setattr(W, "_launch_tma", lambda *args: ran.append(1) or real(*args))
    a, b, ends, out = _inputs(counts, m, n, torch.bfloat16, device, seed=m + n, row_pad=row_pad)
    for e, c in enumerate(counts):
        if c == 0:
            out[e] = float("nan")
            out[e, : m // 2] = -0.0
    before = out.clone()
    want = grouped_outer_accumulate_ref(a, b, ends, out)
    got = grouped_outer_accumulate(a, b, ends, out, config=(16, 32, 16, 4, 2), tma=True)
    assert ran == [1] and got is out
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.equal(got[e].view(torch.int16), before[e].view(torch.int16))
    live = torch.tensor([c > 0 for c in counts], device=got.device)
    scale = _magnitude(a, b, ends, want)[live]
    got, want = got[live], want[live]
    diff = (got.double() - want.double()).abs()
    assert (diff <= _spacing(want) + 1e-5 * scale).all(), float((diff / _spacing(want)).max())
    assert (diff == 0).double().mean() > 0.98


@pytest.mark.parametrize("form", ["plain", "tma"])
@pytest.mark.parametrize("counts,m,n,row_pad", [([0, 5, 37, 0, 64, 1, 23], 40, 56, 8), ([130, 0, 3], 24, 72, 0),
                                                ([0, 0], 16, 32, 0)])
def test_squares_are_the_stored_gradient_squared_norm_per_tile(counts, m, n, row_pad, form, device, monkeypatch):
    """squares=True: the same stored values as without it, and one fp32 partial per output tile of every expert
    (poisoned with NaN first) whose sum over an expert's tiles is the squared norm of that expert's slice as
    stored, empty experts included (their slices read, never written: -0.0 kept, the bits equal to the form without
    squares, which the tests above check against the input). Tolerance: fp32 sums of
    at most 16 x 32 squares in a tree, 1e-6 relative to the fp64 sum of the same stored values."""
    monkeypatch.setattr(W, "_POISON_SQUARES", True)
    config = (16, 32, 16, 4, 2)
    a, b, ends, out = _inputs(counts, m, n, torch.bfloat16, device, seed=m + n + 1, row_pad=row_pad)
    for e, c in enumerate(counts):
        if c == 0:
            out[e, : m // 2] = -0.0
    plain = grouped_outer_accumulate(a, b, ends, out.clone(), config=config, tma=form == "tma")
    got, partials = grouped_outer_accumulate(a, b, ends, out, config=config, tma=form == "tma", squares=True)
    assert got is out and torch.equal(got.view(torch.int16), plain.view(torch.int16))
    tiles = -(-m // config[0]) * -(-n // config[1])
    assert partials.dtype == torch.float32 and partials.shape == (len(counts) * tiles,)
    assert torch.isfinite(partials).all()
    per_expert = partials.double().view(len(counts), tiles).sum(1)
    want = got.double().square().flatten(1).sum(1)
    assert ((per_expert - want).abs() <= 1e-6 * want).all(), (per_expert, want)


def test_tma_form_falls_back_where_it_cannot_take_the_operands(device, monkeypatch):
    """Rows whose byte stride is not a multiple of 16 (and fp32) go through the plain kernel, same results."""
    monkeypatch.setattr(W, "_launch_tma", lambda *args: pytest.fail("the TMA form took unaligned rows"))
    a, b, ends, out = _inputs([3, 9], 37, 53, torch.bfloat16, device, seed=5)
    assert not W.tma_eligible(a, b, out)
    want = grouped_outer_accumulate(a, b, ends, out.clone())
    assert torch.equal(grouped_outer_accumulate(a, b, ends, out, tma=True), want)
    a, b, ends, out = _inputs([3, 9], 40, 56, torch.float32, device, seed=6)
    assert not W.tma_eligible(a, b, out)


def test_experts_without_rows_keep_their_slice_bit_for_bit(device):
    """An empty group's slice is never read or written: NaN and -0.0 bits put there stay exactly as they are (an
    added 0 would leave a NaN's bits but turn -0.0 into +0.0)."""
    a, b, ends, out = _inputs([0, 11, 0, 5, 0], 21, 34, torch.bfloat16, device, seed=2)
    for e in (0, 2, 4):
        out[e] = float("nan")
        out[e, :10] = -0.0
    before = out.clone()
    grouped_outer_accumulate(a, b, ends, out, config=SMALL)
    for e in (0, 2, 4):
        assert torch.equal(out[e].view(torch.int16), before[e].view(torch.int16))
    assert torch.isfinite(out[1]).all() and torch.isfinite(out[3]).all()
    assert not torch.equal(out[1], before[1])  # the expert with rows was accumulated


def test_one_rounding_is_at_least_as_close_to_fp64_as_autograds_two(device):
    """autograd's path rounds dW to bf16, then the sum; the kernel rounds once. Against the exact sum in fp64, the
    kernel's largest error is no larger than the two-rounding path's."""
    a, b, ends, out = _inputs([40, 0, 90, 17], 33, 47, torch.bfloat16, device, seed=5)
    exact = grouped_outer_accumulate_ref(a.double(), b.double(), ends, out.double())
    fresh = grouped_outer_accumulate_ref(a, b, ends, torch.zeros_like(out))  # dW rounded to bf16
    two_roundings = (out.float() + fresh.float()).to(torch.bfloat16)
    ours = grouped_outer_accumulate(a, b, ends, out.clone(), config=SMALL)
    err_ours = (ours.double() - exact).abs().max()
    err_two = (two_roundings.double() - exact).abs().max()
    assert err_ours <= err_two, (float(err_ours), float(err_two))


def test_bad_inputs_raise(device):
    a, b, ends, out = _inputs([3, 4], 8, 8, torch.float32, device, seed=0)
    with pytest.raises(ValueError, match="same rows"):
        grouped_outer_accumulate(a[:5], b, ends, out)
    with pytest.raises(ValueError, match="int32 ends"):
        grouped_outer_accumulate(a, b, ends.long(), out)
    with pytest.raises(ValueError, match="int32 ends"):
        grouped_outer_accumulate(a, b, ends, out[:, :, :4])
    with pytest.raises(TypeError, match="one dtype"):
        grouped_outer_accumulate(a.double(), b.double(), ends, out.double())
    with pytest.raises(TypeError, match="one dtype"):
        grouped_outer_accumulate(a.bfloat16(), b, ends, out)
    with pytest.raises(ValueError, match="contiguous"):
        grouped_outer_accumulate(a, b, ends, out.transpose(1, 2).contiguous().transpose(1, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True], ids=["plain", "tma"])
@pytest.mark.parametrize("family", ["qwen3-moe", "gpt-oss"])
def test_cuda_at_real_moe_shapes(family, tma, monkeypatch):
    """Qwen3-30B-A3B's gate/up and down weight gradients (E 128, 2I 1536, H 2048, 4096 tokens x top-8) and GPT-OSS's
    transposed ones (E 32, H 2880, 2I 5760, I 2880, top-4), uneven routing, bf16 on the GPU against the fp32
    reference, both kernel forms (the TMA one on compute capability 9 and later)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if tma and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the TMA form needs compute capability 9 or later")
    ran = []
    real = W._launch_tma
    monkeypatch.setattr(W, "_launch_tma", lambda *args: ran.append(1) or real(*args))
    gen = torch.Generator().manual_seed(3)
    experts, rows, shapes = ((128, 32768, ((1536, 2048), (2048, 768))) if family == "qwen3-moe"
                             else (32, 16384, ((2880, 5760), (2880, 2880))))
    counts = torch.multinomial(torch.softmax(torch.randn(experts, generator=gen), 0), rows, replacement=True,
                               generator=gen).bincount(minlength=experts).tolist()
    for m, n in shapes:
        a, b, ends, out = _inputs(counts, m, n, torch.bfloat16, "cuda", seed=m)
        want = grouped_outer_accumulate_ref(a, b, ends, out)
        got = grouped_outer_accumulate(a, b, ends, out, tma=tma)
        assert len(ran) == (1 if tma else 0)
        ran.clear()
        diff = (got.double() - want.double()).abs()
        scale = _magnitude(a, b, ends, want)
        assert (diff <= _spacing(want) + 1e-5 * scale).all(), (m, n, float((diff / _spacing(want)).max()))
        assert (diff == 0).double().mean() > 0.98, (m, n)
