"""LoRA linear GEMM sequences (novatune.kernels.lora) against the fp32 reference `lora_linear_ref`.

Inputs are fresh random tensors in the tested dtype; the reference runs in fp32 on the same (rounded) values and
its gradients come from autograd. Tolerances (relative norm error, novatune.measure.numerics):
  fp32: 1e-5 - the same products summed in another order (BLAS blocking), ~1e-6 observed.
  bf16: 8e-3 - every GEMM accumulates in fp32 (the scaling is the GEMMs' alpha), then the chain rounds to bf16
        at most three times on the way to each output (y: x Aᵀ, the LoRA term, the sum; dx: dy B, its product
        with A, the sum; dA: dy B, the product), each rounding <= 2^-9 relative (RMS ~ 2^-10): three of them stay
        well under 8e-3 (<= 3.6e-3 observed).
Outputs are NaN-poisoned before the launchers write them (`out=`, `dx=`).
"""
import pytest
import torch

from novatune.kernels.lora import ORDERS, lora_linear_bwd, lora_linear_fwd
from novatune.measure.numerics import assert_close, poison_
from novatune.reference.lora import lora_linear_ref

TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}
# (tokens, in, out, r): rows 1 / 37 / 4097 with small dims, hidden 127, a real-width input with few rows
SHAPES = [(1, 127, 65, 4), (37, 127, 96, 8), (4097, 64, 48, 16), (3, 2560, 127, 16)]


def _inputs(tokens, n_in, n_out, r, dtype, adapter_dtype=None, bias=True, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ad = adapter_dtype or dtype
    x = torch.randn(tokens, n_in, generator=g).to(dtype)
    w = (torch.randn(n_out, n_in, generator=g) / n_in ** 0.5).to(dtype)
    b = torch.randn(n_out, generator=g).to(dtype) if bias else None
    # A and B at the scale that makes the LoRA term comparable to the base term, so its error is visible
    a = (torch.randn(r, n_in, generator=g) / n_in ** 0.5).to(ad)
    bb = (torch.randn(n_out, r, generator=g) / r ** 0.5).to(ad)
    dy = torch.randn(tokens, n_out, generator=g).to(dtype)
    return tuple(None if t is None else t.to(device) for t in (x, w, b, a, bb, dy))


def _reference(x, w, b, a, bb, s, dy, x_lora=None):
    """fp32 outputs and gradients (x, A, B, bias, W, x_lora) by autograd through lora_linear_ref."""
    leaves = [t.detach().float().requires_grad_(True) if t is not None else None for t in (x, a, bb, b, w, x_lora)]
    x32, a32, b32, bias32, w32, xl32 = leaves
    y = lora_linear_ref(x32, w32, bias32, a32, b32, s, xl32)
    y.backward(dy.float())
    return y.detach(), {k: (t.grad if t is not None else None) for k, t in zip(("x", "a", "b", "bias", "w", "xl"),
                                                                               leaves)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("order", ORDERS)
def test_fwd_bwd_match_reference(shape, dtype, order, device):
    x, w, b, a, bb, dy = _inputs(*shape, dtype, device=device)
    s = 2.0
    ry, rg = _reference(x, w, b, a, bb, s, dy)
    y_buf = poison_(torch.empty(shape[0], shape[2], dtype=dtype, device=device))
    y, xa = lora_linear_fwd(x, w, b, a, bb, s, out=y_buf, order=order)
    assert y.data_ptr() == y_buf.data_ptr() and y.dtype == dtype and xa.shape == (shape[0], shape[3])
    assert_close(y, ry, TOL[dtype], "y")
    dx_buf = poison_(torch.empty_like(x))
    dx, dxl, dw, dbias, da, db = lora_linear_bwd(dy, x, w, a, bb, xa, s, dx=dx_buf, need_dweight=True,
                                                 dbias_dtype=b.dtype)
    assert dx.data_ptr() == dx_buf.data_ptr() and dxl is None
    for name, out, key in (("dx", dx, "x"), ("dA", da, "a"), ("dB", db, "b"), ("dbias", dbias, "bias"),
                           ("dW", dw, "w")):
        assert out.dtype == dtype, name
        assert_close(out, rg[key], TOL[dtype], name)


def test_fp32_adapters_with_bf16_base(device):
    """PEFT keeps adapters in fp32 on a bf16 model (autocast_adapter_dtype): GEMMs in bf16, dA/dB back in fp32."""
    x, w, b, a, bb, dy = _inputs(37, 127, 96, 8, torch.bfloat16, adapter_dtype=torch.float32, bias=False,
                                 device=device)
    ry, rg = _reference(x, w, None, a, bb, 0.5, dy)
    y, xa = lora_linear_fwd(x, w, None, a, bb, 0.5)
    assert y.dtype == torch.bfloat16 and xa.dtype == torch.bfloat16
    assert_close(y, ry, TOL[torch.bfloat16], "y")
    dx, _, dw, dbias, da, db = lora_linear_bwd(dy, x, w, a, bb, xa, 0.5)
    assert dw is None and dbias is None and da.dtype == db.dtype == torch.float32
    for name, out, key in (("dx", dx, "x"), ("dA", da, "a"), ("dB", db, "b")):
        assert_close(out, rg[key], TOL[torch.bfloat16], name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_separate_lora_input(dtype, device):
    """x_lora (the dropped-out x): the base branch sees x, the LoRA branch x_lora; their gradients come apart."""
    x, w, b, a, bb, dy = _inputs(37, 127, 96, 8, dtype, device=device)
    mask = (torch.rand(x.shape, generator=torch.Generator().manual_seed(5)) > 0.3).to(device)
    x_lora = (x.float() * mask / 0.7)  # fp32, as PEFT's cast-then-dropout produces with fp32 adapters
    ry, rg = _reference(x, w, b, a, bb, 2.0, dy, x_lora)
    y, xa = lora_linear_fwd(x, w, b, a, bb, 2.0, x_lora=x_lora)
    assert_close(y, ry, TOL[dtype], "y")
    dx, dxl, _, _, da, db = lora_linear_bwd(dy, x, w, a, bb, xa, 2.0, x_lora=x_lora)
    assert dxl.dtype == torch.float32 and dx.dtype == dtype
    for name, out, key in (("dx", dx, "x"), ("dx_lora", dxl, "xl"), ("dA", da, "a"), ("dB", db, "b")):
        assert_close(out, rg[key], TOL[dtype], name)


def test_need_flags_skip_work():
    x, w, b, a, bb, dy = _inputs(5, 16, 12, 4, torch.float32)
    _, xa = lora_linear_fwd(x, w, b, a, bb, 1.0)
    assert lora_linear_bwd(dy, x, w, a, bb, xa, 1.0, need_dx=False, need_da=False, need_db=False) == (None,) * 6
    dx, _, _, _, da, db = lora_linear_bwd(dy, x, w, a, bb, xa, 1.0, need_dx=False)
    assert dx is None and da is not None and db is not None


def test_shape_and_dtype_errors():
    x, w, b, a, bb, _ = _inputs(5, 16, 12, 4, torch.float32)
    with pytest.raises(ValueError, match="A .* B"):
        lora_linear_fwd(x, w, b, a.t().contiguous(), bb, 1.0)
    with pytest.raises(TypeError, match="base weight"):
        lora_linear_fwd(x.bfloat16(), w, b, a, bb, 1.0)
    with pytest.raises(ValueError, match="order"):
        lora_linear_fwd(x, w, b, a, bb, 1.0, order="fused")


@pytest.mark.gpu
@pytest.mark.parametrize("n_out", [4096, 9728])
def test_real_shapes_on_gpu(n_out):
    """Qwen3-4B projections (4096 tokens x 2560 -> q_proj / gate_proj), r 16, PEFT's fp32 adapters: cuBLAS may
    split the 4096-token reductions of dA / dB (reduced-precision split-K is on by default for bf16), still bf16
    level."""
    x, w, b, a, bb, dy = _inputs(4096, 2560, n_out, 16, torch.bfloat16, adapter_dtype=torch.float32, bias=False,
                                 device="cuda")
    ry, rg = _reference(x, w, None, a, bb, 2.0, dy)
    y, xa = lora_linear_fwd(x, w, None, a, bb, 2.0)
    dx, _, _, _, da, db = lora_linear_bwd(dy, x, w, a, bb, xa, 2.0)
    for name, out, ref in (("y", y, ry), ("dx", dx, rg["x"]), ("dA", da, rg["a"]), ("dB", db, rg["b"])):
        assert_close(out, ref, TOL[torch.bfloat16], name)
