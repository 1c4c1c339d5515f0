"""The expert adapter's in-place low-rank add (novatune.kernels.moe_lora.lowrank_add_) against the fp32 reference.

Tolerances (relative-norm error): the kernel reads the same inputs as the reference, sums the R products in fp32 (in
another order) and rounds once at the store with round-to-nearest-even (SOFT_RNE under the interpreter), so
* fp32 y: summation order only -> 1e-5;
* bf16 y: one rounding per element, |err| <= 2^-9 |ref| -> rel-norm <= 2e-3 -> 4e-3.
"""
import pytest
import torch

from novatune.kernels.moe_lora import lowrank_add_
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
    with pytest.raises(ValueError, match="cast the factors to one dtype"):
        lowrank_add_(torch.zeros(4, 8), torch.zeros(4, 2), torch.zeros(3, 2, 8).bfloat16(),
                     torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="unit column strides"):
        lowrank_add_(torch.zeros(8, 4).t(), torch.zeros(4, 2), torch.zeros(3, 2, 8), torch.zeros(4, dtype=torch.uint8))
