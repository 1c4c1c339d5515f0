"""novatune.ops.offset_rms_norm: registered ops (opcheck), the eager path equal to the registered op, agreement with
transformers' GemmaRMSNorm (bit for bit on the CPU reference path; the kernels within one bf16 rounding), and the
SPEC's poisoned-output call.

Tolerances as tests/kernels/test_offset_rms_norm.py: fp32 1e-5 (summation order), bf16 1e-2 (one rounding of each
output)."""
import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

from novatune.measure.numerics import REL_TOL, assert_close, poison_
from novatune.ops import offset_rms_norm
from novatune.ops.offset_rms_norm import SPEC, offset_rms_norm_bwd, offset_rms_norm_fwd
from novatune.reference.rms_norm import offset_rms_norm_ref

EPS = 1e-6


def _hf(n, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    hf = GemmaRMSNorm(n, eps=EPS).to(device, dtype)
    with torch.no_grad():
        hf.weight.copy_(0.5 * torch.randn(n, generator=g))
    return hf


def _leaf(shape, dtype, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g).to(device, dtype).requires_grad_(),
            torch.randn(shape, generator=g).to(device, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_hf_gemma_rms_norm(dtype, device):
    hf = _hf(96, dtype, device)
    x, dy = _leaf((3, 37, 96), dtype, device)
    y_hf = hf(x)
    dx_hf, dw_hf = torch.autograd.grad(y_hf, (x, hf.weight), dy)
    y = offset_rms_norm(x, hf.weight, EPS)
    dx, dw = torch.autograd.grad(y, (x, hf.weight), dy)
    assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else REL_TOL[dtype]
    assert_close(y, y_hf, tol, "y")
    assert_close(dx, dx_hf, tol, "dx")
    assert_close(dw, dw_hf, tol, "dw")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_reference_path_is_hf_exact(dtype, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    hf = _hf(127, dtype, "cpu")
    x, _ = _leaf((2, 37, 127), dtype, "cpu")
    with torch.no_grad():
        assert torch.equal(offset_rms_norm(x, hf.weight, EPS), hf(x))


def test_custom_op_and_eager_paths_agree(device):
    w = (0.5 * torch.randn(128)).to(device, torch.bfloat16).requires_grad_()
    x, dy = _leaf((37, 128), torch.bfloat16, device)
    y1 = offset_rms_norm(x, w, EPS)
    dx1, dw1 = torch.autograd.grad(y1, (x, w), dy)
    y2, _ = torch.ops.novatune.offset_rms_norm_fwd(x, w, EPS, 1.0)
    dx2, dw2 = torch.autograd.grad(y2, (x, w), dy)
    for a, b in [(y1, y2), (dx1, dx2), (dw1, dw2)]:
        assert torch.equal(a, b)


def test_torch_compile_traces_registered_op(device):
    w = (0.5 * torch.randn(64)).to(device).requires_grad_()
    x, _ = _leaf((4, 7, 64), torch.float32, device)
    y = torch.compile(offset_rms_norm, backend="aot_eager", fullgraph=True)(x, w, EPS, 1.0)
    dx, dw = torch.autograd.grad(y.sum(), (x, w))
    yr = offset_rms_norm_ref(x, w, EPS, 1.0)
    rdx, rdw = torch.autograd.grad(yr.sum(), (x, w))
    for name, a, b in [("y", y, yr), ("dx", dx, rdx), ("dw", dw, rdw)]:
        assert_close(a, b, 1e-5, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_opcheck(dtype, device):
    x = torch.randn(3, 5, 32).to(device, dtype).requires_grad_()
    w = (0.5 * torch.randn(32)).to(device, dtype).requires_grad_()
    torch.library.opcheck(offset_rms_norm_fwd, (x, w, EPS, 1.0))
    y, rstd = offset_rms_norm_fwd(x.detach(), w.detach(), EPS, 1.0)
    dy = poison_(torch.empty_like(y)).normal_()
    torch.library.opcheck(offset_rms_norm_bwd, (dy, x.detach(), w.detach(), rstd, 1.0))


def test_spec_poisoned_kernel_call_writes_every_output(device):
    """The SPEC's poison call (what the tune checker runs) on the default Triton variant: no NaN left anywhere,
    values equal to the reference."""
    from novatune.ops._backend import use_triton

    gen = torch.Generator().manual_seed(0)
    inputs = SPEC.make_inputs((5, 7, 48), torch.float32, device, gen)
    if not use_triton(inputs["x"]):
        pytest.skip("the Triton kernels need CUDA or TRITON_INTERPRET=1")
    cand = [c for c in SPEC.candidates((35, 48), torch.float32, device) if c.family == "triton"][0]
    dy = torch.randn_like(inputs["x"])
    out = SPEC.poison_call(cand.kernels(), inputs, dy)
    x, w = inputs["x"].clone().requires_grad_(), inputs["weight"].clone().requires_grad_()
    ref = SPEC.reference(x, w, inputs["eps"], inputs["offset"])
    ref.backward(dy)
    assert_close(out["out"], ref, 1e-5, "y")
    assert_close(out["x"], x.grad, 1e-5, "dx")
    assert_close(out["weight"], w.grad, 1e-5, "dw")


@pytest.mark.parametrize("path", ["cpu", "interpreter"])
def test_refusals_on_every_path(path, backend_env):
    """A second-order gradient raises (the CPU path's was 18% off: rstd is saved from the forward); a weight that
    is not (N,) and integer inputs are refused the same on the CPU reference and the kernels."""
    backend_env("TRITON_INTERPRET", "1" if path == "interpreter" else "0")
    g = torch.Generator().manual_seed(22)
    x = torch.randn(3, 37, generator=g).requires_grad_()
    w = (0.5 * torch.randn(37, generator=g)).requires_grad_()
    dy = torch.randn(3, 37, generator=g).requires_grad_()
    dx, dw = torch.autograd.grad(offset_rms_norm(x, w, EPS), (x, w), dy, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        ((dx * dx).sum() + (dw * dw).sum()).backward()
    for bad in (w.detach()[:1], w.detach().view(1, 37)):
        with pytest.raises(ValueError, match=r"offset_rms_norm: weight must have shape \(37,\)"):
            offset_rms_norm(x, bad, EPS)
        with pytest.raises(ValueError, match=r"weight must have shape \(37,\)"):
            offset_rms_norm_fwd(x, bad, EPS, 1.0)
    with pytest.raises(TypeError, match="floating point"):
        offset_rms_norm(torch.arange(8).view(2, 4), torch.zeros(4), EPS)
