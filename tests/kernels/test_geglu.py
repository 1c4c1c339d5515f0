"""GeGLU (the swiglu kernels with activation="gelu_tanh") against the fp32 reference and torch's own gelu(tanh).

Tolerances (relative-norm error): all math in fp32, one rounding per output element (as test_swiglu.py):
* fp32: 1e-5. The gate is written through the sigmoid (0.5 (1 + tanh z) = sigmoid(2z)), which equals torch's
  tanh form up to a few ulp of the fp32 exp (measured ~1e-7).
* bf16: 8e-3 under the interpreter (its fp32 -> bf16 cast truncates: 2^-7 bound), 4e-3 on a GPU (2^-8).
"""
import pytest
import torch

from novatune.kernels import swiglu as K
from novatune.measure.numerics import assert_close, poison_
from novatune.reference import geglu as R

HAS_CUDA = torch.cuda.is_available()
TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3 if HAS_CUDA else 8e-3}
SHAPES = [(1, 127), (37, 96), (4097, 13), (2, 3, 2304)]


def _inputs(shape, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    g = (3 * torch.randn(shape, generator=gen)).to(dtype).to(device)  # both tails and the negative dip of gelu
    u = torch.randn(shape, generator=gen).to(dtype).to(device)
    dy = torch.randn(shape, generator=gen).to(dtype).to(device)
    return g, u, dy


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_geglu_kernels_match_fp32_reference(shape, dtype, device):
    g, u, dy = _inputs(shape, dtype, device)
    y = K.swiglu_fwd(g, u, out=poison_(torch.empty_like(g)), activation="gelu_tanh")
    dg, du = K.swiglu_bwd(dy, g, u, poison_(torch.empty_like(g)), poison_(torch.empty_like(u)),
                          activation="gelu_tanh")
    gr, ur = g.float().requires_grad_(), u.float().requires_grad_()
    ref = R.hf_geglu(gr, ur)  # torch's gelu(approximate="tanh") in fp32, differentiated by autograd
    ref.backward(dy.float())
    assert_close(y, ref, TOL[dtype], "y")
    assert_close(dg, gr.grad, TOL[dtype], "dgate")
    assert_close(du, ur.grad, TOL[dtype], "dup")


def test_closed_form_backward_matches_autograd():
    g, u, dy = _inputs((5, 77), torch.float32, "cpu", seed=2)
    gr, ur = g.clone().requires_grad_(), u.clone().requires_grad_()
    R.hf_geglu(gr, ur).backward(dy)
    dg, du = R.geglu_bwd_ref(dy, g, u)
    assert_close(dg, gr.grad, 1e-6, "dgate")
    assert_close(du, ur.grad, 1e-6, "dup")


def test_silu_is_the_default_and_an_unknown_activation_raises():
    g, u, _ = _inputs((3, 40), torch.float32, "cpu")
    assert_close(K.swiglu_fwd(g, u), torch.nn.functional.silu(g) * u, 1e-5, "silu")
    with pytest.raises(ValueError, match="activation"):
        K.swiglu_fwd(g, u, activation="relu")
