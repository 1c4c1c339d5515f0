"""The expert adapter's thin kernels against fp32 references: the in-place low-rank add
(novatune.kernels.moe_lora.lowrank_add_), the thin projection (lowrank_project) and the factor gradients written in
the factors' dtype and layout (novatune.kernels.moe_wgrad.grouped_outer).

Tolerances (relative-norm error): the kernel reads the same inputs as the reference, sums the R products in fp32 (in
another order) and rounds once at the store with round-to-nearest-even (SOFT_RNE under the interpreter), so
* fp32 y: summation order only -> 1e-5;
* bf16 y: one rounding per element, |err| <= 2^-9 |ref| -> rel-norm <= 2e-3 -> 4e-3.
fp32 factors read by a bf16 kernel are rounded to bf16 as they load; the reference gets the same rounded factors
(that cast is the op's definition: PEFT casts its factors to the weights' dtype), so the bounds above hold.
"""
import pytest
import torch

from novatune.kernels.moe_lora import expert_major, lowrank_add_, lowrank_project
from novatune.kernels.moe_wgrad import grouped_outer
from novatune.measure.numerics import assert_close
from novatune.reference import moe as R

TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3}


def _sorted_experts(s, e, gen, empty=(1,), dtype=torch.uint8):
    """(S,) expert ids sorted ascending, drawn from [0, E) minus `empty` (experts that receive no row)."""
    allowed = torch.tensor([i for i in range(e) if i not in empty])
    return allowed[torch.randint(0, len(allowed), (s,), generator=gen)].sort().values.to(dtype)


@pytest.mark.parametrize("y_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("s, n, r, e", [(1, 37, 3, 2), (37, 75, 5, 7), (70, 131, 16, 5), (33, 300, 8, 3),
                                        (45, 50, 24, 4)], ids=lambda v: str(v))
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_lowrank_add_matches_the_reference(s, n, r, e, y_dtype, layout, device):
    gen = torch.Generator().manual_seed(s * 131 + n)
    expert = _sorted_experts(s, e, gen)
    u = torch.randn(s, r, generator=gen).bfloat16()
    if layout == "contiguous":  # the backward's A (E, R, N)
        m = torch.randn(e, r, n, generator=gen).bfloat16()
    else:  # the forward's B^T: a transposed view of B (E, N, R)
        m = torch.randn(e, n, r, generator=gen).bfloat16().transpose(1, 2)
    # y is a column slice of a wider buffer: the columns beside it must stay as they are
    wide = torch.randn(s, n + 9, generator=gen).to(y_dtype)
    ref = R.lowrank_add(wide[:, 4:4 + n], u, m, expert, 0.37)
    wide, u, m, expert = wide.to(device), u.to(device), m.to(device), expert.to(device)
    before = wide.clone()
    out = lowrank_add_(wide[:, 4:4 + n], u, m, expert, 0.37)
    assert out.data_ptr() == wide[:, 4:].data_ptr()
    assert_close(out.cpu(), ref, TOL[y_dtype], f"lowrank_add {y_dtype}")
    assert torch.equal(wide[:, :4], before[:, :4]) and torch.equal(wide[:, 4 + n:], before[:, 4 + n:])


@pytest.mark.parametrize("ids", [torch.int64, torch.int32], ids=["int64 ids", "int32 ids"])
def test_fp32_factors_a_wide_rank_and_wide_ids(ids, device):
    """fp32 operands (IEEE products, no TF32), a rank past one 16-wide dot (64), int64 / int32 expert ids."""
    gen = torch.Generator().manual_seed(7)
    s, n, r, e = 29, 70, 64, 6
    expert = _sorted_experts(s, e, gen, empty=(0, 4), dtype=ids)
    u, m = torch.randn(s, r, generator=gen), torch.randn(e, r, n, generator=gen)
    y = torch.randn(s, n, generator=gen)
    ref = R.lowrank_add(y, u, m, expert, -1.5)
    out = lowrank_add_(y.to(device), u.to(device), m.to(device), expert.to(device), -1.5)
    assert_close(out.cpu(), ref, TOL[torch.float32], "lowrank_add fp32 r64")


def test_no_rows_and_bad_shapes(device):
    y = torch.zeros(0, 8, device=device)
    assert lowrank_add_(y, torch.zeros(0, 2, device=device), torch.zeros(3, 2, 8, device=device),
                        torch.zeros(0, dtype=torch.uint8, device=device)) is y
    with pytest.raises(ValueError, match=r"\(S, N\), \(S, R\), \(E, R, N\)"):
        lowrank_add_(torch.zeros(4, 8), torch.zeros(4, 2), torch.zeros(3, 8, 2), torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="u bf16 or fp32"):
        lowrank_add_(torch.zeros(4, 8), torch.zeros(4, 2, dtype=torch.int32), torch.zeros(3, 2, 8),
                     torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="unit column strides"):
        lowrank_add_(torch.zeros(8, 4).t(), torch.zeros(4, 2), torch.zeros(3, 2, 8), torch.zeros(4, dtype=torch.uint8))


def test_fp32_factor_read_in_bf16(device):
    """PEFT's fp32 B (a permuted view of its (out, r * E) storage) added to bf16 rows: read and rounded in place."""
    gen = torch.Generator().manual_seed(3)
    s, n, r, e = 41, 67, 5, 4
    expert = _sorted_experts(s, e, gen)
    u = torch.randn(s, r, generator=gen).bfloat16()
    m = torch.randn(n, r * e, generator=gen).view(n, r, e).permute(2, 1, 0)  # (E, R, N), fp32, strided
    y = torch.randn(s, n, generator=gen).bfloat16()
    ref = R.lowrank_add(y, u, m.bfloat16(), expert, 2.0)
    out = lowrank_add_(y.to(device), u.to(device), m.to(device), expert.to(device), 2.0)
    assert_close(out.cpu(), ref, TOL[torch.bfloat16], "lowrank_add fp32 factor")


def _ends(expert, e):
    return torch.bincount(expert.long(), minlength=e).cumsum(0).to(torch.int32)


def _project_ref(x, m, expert, scale, dtype):
    """scale * x[r] @ m[expert[r]] in fp32 with m rounded to x's dtype first, rounded once to `dtype`."""
    prod = torch.einsum("sk,skr->sr", x.float(), m.to(x.dtype).float()[expert.long()])
    return (scale * prod).to(dtype)


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("s, k, r, e", [(1, 37, 3, 2), (37, 75, 5, 7), (70, 131, 16, 5), (130, 300, 8, 3),
                                        (45, 50, 24, 4), (200, 70, 4, 2), (300, 40, 5, 40)], ids=lambda v: str(v))
@pytest.mark.parametrize("layout", ["A^T view of fp32 (E, R, K)", "PEFT's B view (fp32)", "contiguous bf16"])
def test_lowrank_project_matches_the_reference(s, k, r, e, x_dtype, layout, device):
    gen = torch.Generator().manual_seed(s * 17 + k)
    # 40 experts: more than one 16-wide block of ends, a run of empty experts before one that spans several tiles
    expert = _sorted_experts(s, e, gen, empty=(0, 1, 2, 5, 6, 7, 8) if e == 40 else (1,))
    if e == 40:
        expert[:150] = 9
        expert = expert.sort().values
    x = torch.randn(s, k + 6, generator=gen).to(x_dtype)[:, 3:3 + k]  # strided rows
    if layout.startswith("A^T"):
        m = torch.randn(e, r, k, generator=gen).transpose(1, 2)
    elif layout.startswith("PEFT"):
        m = torch.randn(k, r * e, generator=gen).view(k, r, e).permute(2, 0, 1)
    else:
        m = torch.randn(e, k, r, generator=gen).bfloat16()
    ref = _project_ref(x, m, expert, -0.7, x_dtype)
    out = lowrank_project(x.to(device), m.to(device), _ends(expert, e).to(device), -0.7)
    assert out.dtype == x_dtype and out.shape == (s, r)
    assert_close(out.cpu(), ref, TOL[x_dtype], f"lowrank_project {x_dtype}")


def test_lowrank_project_no_rows_and_bad_shapes(device):
    ends = torch.zeros(3, dtype=torch.int32, device=device)
    out = lowrank_project(torch.zeros(0, 8, device=device), torch.zeros(3, 8, 2, device=device), ends)
    assert out.shape == (0, 2)
    with pytest.raises(ValueError, match=r"\(S, K\), \(E, K, R\), int32 \(E,\)"):
        lowrank_project(torch.zeros(4, 8), torch.zeros(3, 2, 8), ends.cpu())
    with pytest.raises(ValueError, match="unit column stride"):
        lowrank_project(torch.zeros(8, 4).t(), torch.zeros(3, 8, 2), ends.cpu())


def _outer_ref(a, b, counts, scale):
    out, start = [], 0
    for c in counts:
        out.append(scale * a[start:start + c].double().T @ b[start:start + c].double())
        start += c
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("out_layout", ["(E, M, N) fp32", "PEFT's B storage fp32", "A's transposed view bf16"])
def test_grouped_outer_writes_the_factor_gradient_in_its_layout(dtype, out_layout, device):
    """Uneven groups, an expert without rows (it gets zeros, whatever was there), odd M and N, any out strides."""
    gen = torch.Generator().manual_seed(11)
    counts, m, n = [5, 0, 70, 1, 33], 200, 5  # m: two tiles of a's columns
    e, s = len(counts), sum(counts)
    a = torch.randn(s, m, generator=gen).to(dtype)
    b = torch.randn(s, n + 2, generator=gen).to(dtype)[:, :n]  # strided rows
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    ref = _outer_ref(a, b, counts, 0.25)
    if out_layout.startswith("(E"):
        out = torch.full((e, m, n), float("nan"))
    elif out_layout.startswith("PEFT"):
        out = torch.full((m, n * e), float("nan")).view(m, n, e).permute(2, 0, 1)
    else:
        out = torch.full((e, n, m), float("nan")).bfloat16().transpose(1, 2)
    out = out.to(device)
    got = grouped_outer(a.to(device), b.to(device), ends.to(device), out, 0.25)
    assert got is out
    assert torch.equal(got[1].cpu(), torch.zeros(m, n, dtype=got.dtype)), "an expert without rows gets zeros"
    # fp32 accumulation of <= 70 products; bf16 operands are exact in fp32, one rounding at the store
    tol = 4e-3 if out.dtype == torch.bfloat16 else 1e-5
    assert_close(got.cpu().double(), ref, tol, f"grouped_outer {out_layout}")


def test_grouped_outer_refuses_mixed_operands():
    ends = torch.tensor([2, 4], dtype=torch.int32)
    with pytest.raises(TypeError, match="one dtype"):
        grouped_outer(torch.zeros(4, 3), torch.zeros(4, 2).bfloat16(), ends, torch.zeros(2, 3, 2))
    with pytest.raises(ValueError, match=r"out \(E, M, N\)"):
        grouped_outer(torch.zeros(4, 3), torch.zeros(4, 2), ends, torch.zeros(2, 2, 3))


@pytest.mark.parametrize("e, n, r, rp", [(1, 1, 1, 1), (5, 37, 3, 4), (33, 70, 16, 16), (130, 45, 5, 32)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("layout", ["PEFT's B view", "contiguous", "PEFT's B view, bf16 storage"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_expert_major_casts_and_lays_out_the_factor(e, n, r, rp, layout, dtype, device):
    """The factor in expert-major order, rounded to `dtype` as torch's cast rounds it (bit for bit), the padded
    ranks zero (the output is a fresh tensor: the zeros are written, not inherited)."""
    gen = torch.Generator().manual_seed(e * 7 + n)
    if layout.startswith("PEFT"):
        m = torch.randn(n, r * e, generator=gen).view(n, r, e).permute(2, 0, 1)
    else:
        m = torch.randn(e, n, r, generator=gen)
    if layout.endswith("bf16 storage"):
        m = m.bfloat16()
    out = expert_major(m.to(device), dtype, rp)
    ref = torch.zeros(e, n, rp, dtype=dtype)
    ref[:, :, :r] = m.to(dtype)
    assert out.is_contiguous() and out.dtype == dtype
    assert torch.equal(out.cpu(), ref)


def test_expert_major_needs_a_power_of_two_rank():
    with pytest.raises(ValueError, match="power of two >= the rank 3"):
        expert_major(torch.zeros(2, 4, 3), torch.bfloat16, 6)
    with pytest.raises(ValueError, match="power of two >= the rank 3"):
        expert_major(torch.zeros(2, 4, 3), torch.bfloat16, 2)
