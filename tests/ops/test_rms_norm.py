"""novatune.ops.rms_norm / NovaRMSNorm: registered ops, autograd, and agreement with transformers' Qwen3RMSNorm.

Tolerances as in tests/kernels/test_rms_norm.py: fp32 1e-5 (summation order only), bf16 1e-2 (REL_TOL: one or two
bf16 roundings of the output, ~2e-3 measured). Against HF's bf16 module the forward is compared bit for bit
(CPU reference path) or as bit-identical but for rare 1-2 ulp flips (kernels: see _assert_bf16_matches_hf).
"""
import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from novatune.measure.numerics import assert_close, poison_
from novatune.ops.rms_norm import NovaRMSNorm, rms_norm, rms_norm_bwd, rms_norm_fwd
from novatune.reference.rms_norm import rms_norm_ref

EPS = 1e-6
DTYPES = [torch.bfloat16, torch.float32]


def _pair(n, dtype, device, seed=0):
    """An HF Qwen3RMSNorm and a NovaRMSNorm with the same non-trivial weight."""
    g = torch.Generator().manual_seed(seed)
    hf = Qwen3RMSNorm(n, eps=EPS).to(device, dtype)
    with torch.no_grad():
        hf.weight.copy_(1.0 + 0.5 * torch.randn(n, generator=g))
    nova = NovaRMSNorm(n, eps=EPS).to(device, dtype)
    nova.load_state_dict(hf.state_dict())
    return hf, nova


def _fwd_bwd(mod, x, dy):
    x = x.detach().clone().requires_grad_()
    mod.zero_grad(set_to_none=True)
    y = mod(x)
    y.backward(dy)
    return y.detach(), x.grad, mod.weight.grad


def _assert_bf16_matches_hf(y, y_hf):
    """Bit-identical except where rstd differs in its last fp32 bit (row sums added in another order, or CUDA's
    approximate rsqrt on HF's side): then round(x * rstd) to bf16 can flip by 1 ulp near a rounding boundary, and
    y = w * n by up to 2 ulps (|w| > 1). Simulated with rstd off by 1 fp32 ulp: 2e-5 of elements, max 2 ulps."""
    ulps = (y.view(torch.int16).int() - y_hf.view(torch.int16).int()).abs()  # same-sign bf16 values
    assert int(ulps.max()) <= 2 and float((ulps > 0).float().mean()) < 1e-3, (int(ulps.max()), int((ulps > 0).sum()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_module_vs_fp32_reference(dtype, device):
    """Kernels (interpreter on CPU) through the public module, 3-D input, fwd and both grads."""
    hf, nova = _pair(128, dtype, device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 37, 128, generator=g).to(device, dtype)
    dy = torch.randn(3, 37, 128, generator=g).to(device, dtype)
    y, dx, dw = _fwd_bwd(nova, x, dy)
    ref32 = NovaRMSNorm(128, EPS).to(device)
    ref32.weight.data.copy_(nova.weight.float())
    xr = x.float().requires_grad_()
    yr = rms_norm_ref(xr, ref32.weight, EPS)
    yr.backward(dy.float())
    assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == dtype
    assert_close(y, yr, name="y")
    assert_close(dx, xr.grad, name="dx")
    assert_close(dw, ref32.weight.grad, name="dw")


def test_kernel_matches_hf_bf16(device):
    hf, nova = _pair(2560, torch.bfloat16, device)
    x = torch.randn(5, 2560).to(device, torch.bfloat16)
    with torch.no_grad():
        y_hf, y = hf(x), nova(x)
    assert y.dtype == y_hf.dtype
    _assert_bf16_matches_hf(y, y_hf)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_reference_path_is_hf_exact(dtype, backend_env):
    """Plain CPU (no interpreter): the reference path runs HF's op sequence -> identical forward; grads close."""
    backend_env("TRITON_INTERPRET", "0")
    hf, nova = _pair(127, dtype, "cpu")
    x = torch.randn(2, 37, 127).to(dtype)
    dy = torch.randn(2, 37, 127).to(dtype)
    y_hf, dx_hf, dw_hf = _fwd_bwd(hf, x, dy)
    y, dx, dw = _fwd_bwd(nova, x, dy)
    assert torch.equal(y, y_hf)
    # HF's autograd rounds its intermediates (dy * w, the dw products) to bf16; ours stays in fp32 until the end
    assert_close(dx, dx_hf, name="dx")
    assert_close(dw, dw_hf, name="dw")


def test_fp32_weight_bf16_input(device):
    """HF with fp32 norm weights on bf16 activations: output promoted to fp32, dx bf16, dw fp32."""
    hf, nova = _pair(128, torch.float32, device)
    x = torch.randn(37, 128).to(device, torch.bfloat16)
    dy = torch.randn(37, 128).to(device, torch.float32)
    y_hf, dx_hf, dw_hf = _fwd_bwd(hf, x, dy)
    y, dx, dw = _fwd_bwd(nova, x, dy)
    assert y.dtype == torch.float32 and dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    assert_close(y, y_hf, tol=1e-5, name="y")  # same bf16-rounded normalised value times the same fp32 weight
    assert_close(dx, dx_hf, name="dx")  # bf16 output
    assert_close(dw, dw_hf, tol=1e-5, name="dw")  # fp32 sums of identical products, different order


def test_custom_op_and_eager_paths_agree(device):
    """torch.ops.novatune.rms_norm_fwd (+ registered autograd) gives the eager Function's numbers exactly."""
    w = (1.0 + 0.5 * torch.randn(128)).to(device, torch.bfloat16).requires_grad_()
    x = torch.randn(37, 128).to(device, torch.bfloat16).requires_grad_()
    dy = torch.randn(37, 128).to(device, torch.bfloat16)
    y1 = rms_norm(x, w, EPS)
    dx1, dw1 = torch.autograd.grad(y1, (x, w), dy)
    y2, rstd = torch.ops.novatune.rms_norm_fwd(x, w, EPS)
    dx2, dw2 = torch.autograd.grad(y2, (x, w), dy)
    assert not rstd.requires_grad or rstd.grad_fn is not None
    for a, b in [(y1, y2), (dx1, dx2), (dw1, dw2)]:
        assert torch.equal(a, b)


def test_torch_compile_traces_registered_op(device):
    """Dynamo sees the custom op (fake impl + registered autograd); aot_eager keeps the test fast."""
    w = (1.0 + 0.5 * torch.randn(64)).to(device).requires_grad_()
    x = torch.randn(4, 7, 64).to(device).requires_grad_()
    compiled = torch.compile(rms_norm, backend="aot_eager", fullgraph=True)
    y = compiled(x, w, EPS)
    dx, dw = torch.autograd.grad(y.sum(), (x, w))
    yr = rms_norm_ref(x, w, EPS)
    rdx, rdw = torch.autograd.grad(yr.sum(), (x, w))
    assert_close(y, yr, tol=1e-5, name="y")
    assert_close(dx, rdx, tol=1e-5, name="dx")
    assert_close(dw, rdw, tol=1e-5, name="dw")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_opcheck(dtype, device):
    x = torch.randn(3, 5, 32).to(device, dtype).requires_grad_()
    w = (1.0 + 0.5 * torch.randn(32)).to(device, dtype).requires_grad_()
    torch.library.opcheck(rms_norm_fwd, (x, w, EPS))
    y, rstd = rms_norm_fwd(x.detach(), w.detach(), EPS)
    dy = poison_(torch.empty_like(y)).normal_()
    torch.library.opcheck(rms_norm_bwd, (dy, x.detach(), w.detach(), rstd))


def test_module_api_is_hf_compatible():
    nova = NovaRMSNorm(2560, eps=1e-5)
    assert isinstance(nova.weight, torch.nn.Parameter) and nova.weight.shape == (2560,)
    assert nova.variance_epsilon == 1e-5
    assert repr(nova) == "NovaRMSNorm((2560,), eps=1e-05)"
    hf = Qwen3RMSNorm(2560, eps=1e-5)
    hf.load_state_dict(nova.state_dict())  # same keys both ways
    shared = NovaRMSNorm.from_module(hf)
    assert shared.weight is hf.weight and shared.variance_epsilon == 1e-5
    with pytest.raises(ValueError):
        NovaRMSNorm.from_module(torch.nn.Linear(4, 4))


def test_package_exports_the_function():
    """`novatune.ops.rms_norm` is the function (ARCHITECTURE.md), not the submodule of the same name."""
    import novatune.ops

    assert novatune.ops.rms_norm is rms_norm and novatune.ops.NovaRMSNorm is NovaRMSNorm


# ----------------------------------------------------------------------------------------------- refusals
PATHS = ["cpu", "interpreter"]


@pytest.mark.parametrize("path", PATHS)
def test_double_backward_raises_instead_of_being_wrong(path, backend_env):
    """The backward reads rstd saved from the forward: on the CPU path a second-order gradient missed its
    dependence on x (23% off, silently). The eager Function is once-differentiable on every path."""
    backend_env("TRITON_INTERPRET", "1" if path == "interpreter" else "0")
    g = torch.Generator().manual_seed(21)
    x = torch.randn(3, 37, generator=g).requires_grad_()
    w = (1.0 + 0.5 * torch.randn(37, generator=g)).requires_grad_()
    dy = torch.randn(3, 37, generator=g).requires_grad_()  # in a graph: autograd records the backward
    dx, dw = torch.autograd.grad(rms_norm(x, w, EPS), (x, w), dy, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        ((dx * dx).sum() + (dw * dw).sum()).backward()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("w_shape", [(1,), (1, 37), (36,), (38,), ()], ids=str)
def test_weight_shape_is_refused_on_every_path(w_shape, path, backend_env):
    """Only an (N,) weight: the kernel refused others by `assert` only (gone under python -O, then it read past a
    (1,) weight) and the CPU reference broadcast (1,) and (1, N) weights silently. Both paths and the registered op
    raise the same ValueError."""
    backend_env("TRITON_INTERPRET", "1" if path == "interpreter" else "0")
    x = torch.randn(3, 37)
    w = torch.full(w_shape, 2.0)
    with pytest.raises(ValueError, match=r"weight must have shape \(37,\)"):
        rms_norm(x, w, EPS)
    with pytest.raises(ValueError, match=r"weight must have shape \(37,\)"):
        rms_norm_fwd(x, w, EPS)


@pytest.mark.parametrize("path", PATHS)
def test_integer_or_misplaced_inputs_are_refused(path, backend_env):
    """Integer x was normalised and truncated to integers (values 0 / 1); a meta weight is on another device."""
    backend_env("TRITON_INTERPRET", "1" if path == "interpreter" else "0")
    with pytest.raises(TypeError, match="floating point"):
        rms_norm(torch.tensor([[1, 2, 3, 4]]), torch.ones(4), EPS)
    with pytest.raises(TypeError, match="floating point"):
        rms_norm(torch.randn(2, 4), torch.ones(4, dtype=torch.int32), EPS)
    with pytest.raises(ValueError, match="weight is on meta"):
        rms_norm(torch.randn(2, 4), torch.ones(4, device="meta"), EPS)


# ----------------------------------------------------------------------------------------------- GPU, real shapes
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 4096, 2560), (1, 4096, 32, 128)], ids=["hidden", "qk_norm"])
def test_module_matches_hf_real_shapes_gpu(shape):
    n = shape[-1]
    hf, nova = _pair(n, torch.bfloat16, "cuda")
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    y_hf, dx_hf, dw_hf = _fwd_bwd(hf, x, dy)
    y, dx, dw = _fwd_bwd(nova, x, dy)
    _assert_bf16_matches_hf(y, y_hf)
    assert_close(dx, dx_hf, name="dx")
    # HF's bf16 dw sums bf16-rounded products; both are within bf16 noise of the fp32 math
    assert_close(dw, dw_hf, name="dw")
