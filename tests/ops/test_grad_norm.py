"""novatune.ops.grad_norm.total_norm: torch.nn.utils.get_total_norm's value from novatune's kernels.

Checked against the fp64 reference (novatune/reference/grad_norm.py) and against torch's own function, on fresh
random tensors of odd sizes (one element, a block and one, several blocks with a ragged end), bf16 and fp32 mixed,
with the kernels' partial sums poisoned with NaN beforehand (a slot no program wrote would show). Tolerances:
each tensor's fp32 norm differs from the exact one by fp32 summation error (n * 2^-24 relative at worst, far less
in a tree: 1e-6 here); after rounding to bf16 the per-tensor norms equal torch's except when the exact value sits
within that error of a rounding boundary, so a bf16 total is compared within one spacing of its dtype and an fp32
one within 1e-6 relative.
"""
import pytest
import torch

from novatune.kernels import grad_norm as K
from novatune.ops.grad_norm import total_norm
from novatune.reference.grad_norm import tensor_norms_ref, total_norm_ref

SIZES = [1, 7, K.BLOCK + 1, 3 * K.BLOCK - 5, 2 * 1001]


def _tensors(seed, dtypes, device, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(SIZES * len(dtypes)):
        dtype = dtypes[i // len(SIZES)]
        out.append((torch.randn(n, generator=gen) * scale * (i + 1)).to(dtype).to(device))
    return out


def _spacing(x: torch.Tensor) -> float:
    return float(torch.nextafter(x, torch.full_like(x, float("inf"))) - x)


@pytest.fixture
def poisoned(monkeypatch):
    monkeypatch.setattr(K, "_POISON", True)


@pytest.mark.parametrize("dtypes", [[torch.bfloat16], [torch.float32], [torch.bfloat16, torch.float32]],
                         ids=["bf16", "fp32", "mixed"])
def test_total_norm_matches_torch_and_the_fp64_reference(dtypes, device, poisoned, backend_env):
    if device == "cpu":
        backend_env("TRITON_INTERPRET", "1")  # the kernels themselves, not torch's CPU path
    for seed in range(3):
        ts = _tensors(seed, dtypes, device)
        got = total_norm(ts)
        want = torch.nn.utils.get_total_norm(ts, 2.0)
        assert got.dtype == want.dtype and got.shape == () and got.device == want.device
        tol = max(_spacing(want), 1e-6 * float(want))  # bf16: one spacing; fp32: the per-tensor sums' order
        assert abs(float(got) - float(want)) <= tol, (float(got), float(want))
        ref = total_norm_ref(ts)
        assert abs(float(got) - float(ref)) <= tol + _spacing(want), (float(got), float(ref))


def test_per_tensor_norms_are_fp32_accurate_and_deterministic(device, poisoned, backend_env):
    if device == "cpu":
        backend_env("TRITON_INTERPRET", "1")
    ts = _tensors(5, [torch.bfloat16, torch.float32], device)
    got = K.norms(ts)
    ref = tensor_norms_ref(ts).to(got.device)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert ((got.double() - ref).abs() <= 1e-6 * ref).all()
    assert torch.equal(got, K.norms(ts)), "the same gradients give the same bits"


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_gradients_give_a_non_finite_norm(bad, device, backend_env):
    if device == "cpu":
        backend_env("TRITON_INTERPRET", "1")
    ts = _tensors(7, [torch.bfloat16], device)
    ts[2][K.BLOCK - 1] = bad
    got, want = total_norm(ts), torch.nn.utils.get_total_norm(ts, 2.0)
    assert (torch.isinf(got) and torch.isinf(want)) if bad == float("inf") else (got.isnan() and want.isnan())


def test_squares_beyond_fp32_overflow_to_inf_as_torch(device, backend_env):
    if device == "cpu":
        backend_env("TRITON_INTERPRET", "1")
    ts = [torch.full((9,), 3e30, device=device), torch.ones(4, dtype=torch.bfloat16, device=device)]
    assert torch.isinf(total_norm(ts)) and torch.isinf(torch.nn.utils.get_total_norm(ts, 2.0))


def test_empty_inputs_and_what_the_kernels_do_not_take(device, backend_env):
    if device == "cpu":
        backend_env("TRITON_INTERPRET", "1")
    assert float(total_norm([])) == 0.0
    ts = [torch.zeros(0, device=device), torch.full((3,), 2.0, device=device)]
    assert float(total_norm(ts)) == pytest.approx(12 ** 0.5)
    base = torch.randn(6, 5, device=device)
    strided = [base.t(), torch.randn(4, device=device)]  # non-contiguous: torch's own function
    assert torch.equal(total_norm(strided), torch.nn.utils.get_total_norm(strided, 2.0))
    assert float(total_norm(torch.full((4,), 0.5, device=device))) == pytest.approx(1.0)


def test_given_partials_stand_in_for_reading_the_tensor(device, poisoned, backend_env):
    """norms(tensors, given): a tensor whose sums of squares are given is not read (here its data is NaN), and its
    norm is the square root of their sum; the others are read as without them."""
    if device == "cpu":
        backend_env("TRITON_INTERPRET", "1")
    ts = _tensors(9, [torch.float32], device)
    stand_in = torch.full_like(ts[1], float("nan"))
    parts = torch.tensor([1.5, 2.5, 5.0], device=device)  # squares summing to 9: norm 3
    got = K.norms([ts[0], stand_in, ts[2]], [None, parts, None])
    want = K.norms([ts[0], ts[1], ts[2]])
    assert float(got[1]) == 3.0 and got[0] == want[0] and got[2] == want[2]
