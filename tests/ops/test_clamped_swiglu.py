"""novatune.ops.clamped_swiglu (GPT-OSS's gated activation): the public functional's value and gradient against
autograd through HF's own formula in fp32, the registered ops (opcheck, torch.compile) and the tune checker.

Tolerances: fp32 1e-5 (same math, sigmoid ulps); bf16 4e-3 (one rounding of each output: <= 2^-9 per element, see
tests/kernels/test_clamped_swiglu.py) for y and the gradient; on the NOVATUNE_BACKEND=reference path too (fp32
math cast once).
"""
import pytest
import torch

import novatune.ops as nops
from novatune.measure.numerics import assert_close
from novatune.ops.clamped_swiglu import clamped_swiglu
from novatune.reference.clamped_swiglu import hf_clamped_swiglu

TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3}


def _leaf(shape, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gu = (4 * torch.randn(shape, generator=gen)).to(dtype).to(device).requires_grad_()
    dy = torch.randn(*shape[:-1], shape[-1] // 2, generator=gen).to(dtype).to(device)
    return gu, dy


def _check(shape, dtype, device, alpha=1.702, limit=7.0):
    gu, dy = _leaf(shape, dtype, device)
    y = clamped_swiglu(gu, alpha, limit)
    (d,) = torch.autograd.grad(y, gu, dy)
    x = gu.detach().float().requires_grad_()
    ref = hf_clamped_swiglu(x, alpha, limit)
    ref.backward(dy.float())
    assert y.shape == ref.shape and y.dtype == d.dtype == dtype
    assert_close(y, ref, TOL[dtype], "y")
    assert_close(d, x.grad, TOL[dtype], "dgate_up")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(1, 2), (37, 254), (2, 19, 34)], ids=lambda s: "x".join(map(str, s)))
def test_autograd_matches_hf_formula_in_fp32(shape, dtype, device):
    _check(shape, dtype, device)


def test_other_alpha_and_limit(device):
    _check((23, 30), torch.float32, device, alpha=1.0, limit=2.5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_reference_backend(dtype, reference_backend):
    reference_backend()
    _check((5, 21, 18), dtype, "cpu")


def test_public_name_and_argument_checks(device):
    assert nops.clamped_swiglu is clamped_swiglu
    gu, _ = _leaf((3, 7), torch.float32, device)
    with pytest.raises(ValueError, match="even last dimension"):
        clamped_swiglu(gu)
    with pytest.raises(ValueError, match="limit must be > 0"):
        clamped_swiglu(torch.zeros(2, 4, device=device), limit=0.0)
    with pytest.raises(TypeError, match="gate_up must be floating point"):
        clamped_swiglu(torch.zeros(2, 4, device=device, dtype=torch.int32))


def test_opcheck_and_eager_path_agree(device):
    for dtype in (torch.float32, torch.bfloat16):
        gu, dy = _leaf((5, 38), dtype, device)
        torch.library.opcheck(torch.ops.novatune.clamped_swiglu_fwd.default, (gu, 1.702, 7.0))
        torch.library.opcheck(torch.ops.novatune.clamped_swiglu_bwd.default, (dy, gu.detach(), 1.702, 7.0))
        y1 = clamped_swiglu(gu)
        assert type(y1.grad_fn).__name__ == "_ClampedSwiGLUFunctionBackward"
        y2 = torch.ops.novatune.clamped_swiglu_fwd(gu, 1.702, 7.0)
        assert torch.equal(y1, y2)
        assert torch.equal(torch.autograd.grad(y1, gu, dy)[0], torch.autograd.grad(y2, gu, dy)[0])


def test_torch_compile_traces_registered_op(device):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    gu, dy = _leaf((3, 22), torch.float32, device)
    counter = CompileCounterWithBackend("aot_eager")
    y = torch.compile(clamped_swiglu, backend=counter, fullgraph=True)(gu)
    targets = [str(n.target) for gm in counter.graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert any("novatune.clamped_swiglu_fwd" in t for t in targets), targets
    assert torch.equal(y, clamped_swiglu(gu))
    assert torch.equal(torch.autograd.grad(y, gu, dy)[0], torch.autograd.grad(clamped_swiglu(gu), gu, dy)[0])


def test_tune_checker_accepts_the_op_and_rejects_an_unclamped_one():
    from novatune.tune.check import check_implementation

    v = check_implementation(clamped_swiglu, "clamped_swiglu", repeats=1)
    assert v.passed, v

    def unclamped(gate_up, alpha, limit):
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        return (up + 1) * gate * torch.sigmoid(alpha * gate)

    assert not check_implementation(unclamped, "clamped_swiglu", repeats=1).passed


@pytest.mark.gpu
def test_gpu_expert_shape():
    """GPT-OSS-20B's expert activation: 2 x 2880 interleaved columns, 4096 tokens x top-4 rows."""
    _check((16384, 5760), torch.bfloat16, "cuda")
