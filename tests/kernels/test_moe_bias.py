"""The experts' bias kernels (novatune.kernels.moe_bias) against their fp32 references, outputs poisoned.

Tolerances (relative-norm error):
* bias add: one fp32 sum rounded once to y's dtype (round-to-nearest-even, also under the interpreter): fp32 exact
  up to that rounding (1e-6), bf16 one rounding, |err| <= 2^-9 |ref| -> 4e-3;
* column sums and the row dots: fp32 sums of the same fp32 products in another order (tiles, atomic adds) -> 1e-5
  for every input dtype (the inputs are read exactly; measured ~1e-7). The row dot is also bit-identical across
  runs (one program per row: a fixed order).
Shapes: odd widths, one row, experts that receive no row (runs of them), an expert whose rows span several row
tiles, a tile holding several experts.
"""
import pytest
import torch

from novatune.kernels import moe_bias as KB
from novatune.measure.numerics import assert_close, poison_
from novatune.reference import moe as R

DTYPES = [torch.bfloat16, torch.float32]
# (rows per expert, width): empty experts, a single row, an expert over several 64-row tiles, many small experts
CASES = [([3, 0, 0, 5, 1], 37), ([1], 129), ([0, 150, 7, 0], 64), ([2] * 40 + [0, 0, 9], 200), ([0, 0, 1], 1)]


def _rows(counts, width, dtype, device, seed, ids=torch.uint8, bias_dtype=None):
    gen = torch.Generator().manual_seed(seed)
    expert = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts)).to(ids)
    y = torch.randn(len(expert), width, generator=gen).to(dtype)
    bias = torch.randn(len(counts), width, generator=gen).to(bias_dtype or dtype)
    scale = torch.rand(len(expert), generator=gen)
    return (t.to(device) for t in (y, expert, bias, scale))


# (y dtype, bias dtype, id dtype): the routing's uint8 keys and the wider ones past 256 experts, an fp32 bias
KINDS = [(torch.bfloat16, torch.bfloat16, torch.uint8), (torch.float32, torch.float32, torch.uint8),
         (torch.bfloat16, torch.float32, torch.int16), (torch.float32, torch.float32, torch.int32)]
KIND_IDS = ["bf16", "fp32", "bf16-y-fp32-bias-int16", "fp32-int32"]


@pytest.mark.parametrize("dtype,bias_dtype,ids", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("counts,width", CASES, ids=lambda c: str(c)[:12])
def test_bias_add(counts, width, dtype, bias_dtype, ids, device):
    y, expert, bias, _ = _rows(counts, width, dtype, device, 1, ids, bias_dtype)
    want = R.expert_bias_add_ref(y, expert, bias)
    out = y.clone()
    assert KB.expert_bias_add_(out, expert, bias) is out
    assert_close(out, want, 1e-6 if dtype == torch.float32 else 4e-3, "y + b[expert]")
    if dtype == torch.bfloat16:  # one rounding of the fp32 sum: exactly what the in-place `y += b[expert]` gives
        assert torch.equal(out, y.clone().add_(bias[expert.long()]))


def test_bias_add_on_rows_with_a_padded_stride(device):
    """grouped_mm on CUDA pads its output rows to 16 bytes (38 bf16 columns -> a row stride of 40): the add follows
    the row stride and leaves the padding as it was."""
    y, expert, bias, _ = _rows([3, 0, 4], 38, torch.bfloat16, device, 5)
    buf = poison_(torch.empty(7, 40, dtype=torch.bfloat16, device=device))
    buf[:, :38] = y
    view = buf[:, :38]
    assert not view.is_contiguous()
    KB.expert_bias_add_(view, expert, bias)
    assert torch.equal(view, y.clone().add_(bias[expert.long()]))
    assert torch.isnan(buf[:, 38:]).all(), "the padding columns are untouched"


@pytest.mark.parametrize("dtype,bias_dtype,ids", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("counts,width", CASES, ids=lambda c: str(c)[:12])
def test_column_sums_and_row_dot(counts, width, dtype, bias_dtype, ids, device):
    dy, expert, bias, scale = _rows(counts, width, dtype, device, 2, ids, bias_dtype)
    e = len(counts)
    plain = KB.expert_column_sums(dy, expert, e)
    assert_close(plain, R.expert_column_sums_ref(dy, expert, e), 1e-5, "sums")
    assert plain.dtype == torch.float32 and plain.shape == (e, width)
    empty = torch.tensor(counts, device=device) == 0
    assert torch.equal(plain[empty], torch.zeros_like(plain[empty])), "an expert without rows sums to zero"
    scaled = KB.expert_column_sums(dy, expert, e, scale=scale)
    assert_close(scaled, R.expert_column_sums_ref(dy, expert, e, scale), 1e-5, "scaled sums")

    start = torch.randn(len(expert), device=device)  # the dot is added to what is there
    dot = start.clone()
    assert KB.expert_row_dot_(dot, dy, expert, bias) is dot
    assert_close(dot, start + R.expert_row_dot_ref(dy, expert, bias), 1e-5, "row dot")
    again = KB.expert_row_dot_(start.clone(), dy, expert, bias)
    assert torch.equal(again, dot), "the row dot sums in a fixed order: the same bits on every run"


def test_poisoned_bias_add_reads_only_its_inputs(device):
    """The add writes y in place from y and the bias: a poisoned row past the rows (a wider buffer's tail) stays."""
    y, expert, bias, _ = _rows([4, 0, 3], 19, torch.float32, device, 3)
    buf = poison_(torch.empty(9, 19, device=device))
    buf[:7] = y
    KB.expert_bias_add_(buf[:7], expert, bias)
    assert_close(buf[:7], R.expert_bias_add_ref(y, expert, bias), 1e-6, "rows")
    assert torch.isnan(buf[7:]).all(), "the tail past the rows is untouched"


def test_launchers_refuse_wrong_shapes(device):
    y, expert, bias, scale = _rows([2, 3], 8, torch.float32, device, 4)
    with pytest.raises(ValueError, match="expert"):
        KB.expert_bias_add_(y, expert[:-1], bias)
    with pytest.raises(ValueError, match="bias"):
        KB.expert_bias_add_(y, expert, bias[:, :-1].contiguous())
    with pytest.raises(ValueError, match="unit column stride"):
        KB.expert_bias_add_(y.t().contiguous().t(), expert, bias)
    with pytest.raises(ValueError, match="scale"):
        KB.expert_column_sums(y, expert, 2, scale=scale[:-1])
    with pytest.raises(ValueError, match="dot"):
        KB.expert_row_dot_(torch.zeros(5, dtype=torch.float64, device=device), y, expert, bias)
