"""Gemma's RMSNorm (the rms_norm kernels with offset and one rounding) vs the fp32 reference, under the Triton
interpreter on the CPU, forward and both gradients, outputs poisoned before the call.

Reference: offset_rms_norm_ref on fp32 copies of the inputs, differentiated by autograd (the pure-fp32 math).
Tolerances (relative norm error, novatune.measure.numerics):
* fp32: 1e-5 - only the summation order of the row reduction and of dw over rows differs (~1e-7).
* bf16: 1e-2 (REL_TOL) - y and dx carry one bf16 rounding each (their store, <= 2^-9 relative), dw its store;
  the math is fp32 throughout (~3e-3 measured).
"""
import pytest
import torch

from novatune.kernels.rms_norm import rms_norm_bwd, rms_norm_fwd
from novatune.measure.numerics import REL_TOL, assert_close, poison_
from novatune.ops._backend import interpreter_on
from novatune.reference.rms_norm import offset_rms_norm_bwd_ref, offset_rms_norm_ref, rms_norm_ref

EPS = 1e-6
SHAPES = [(1, 127), (37, 96), (3, 2304), (4097, 16)]  # odd rows/cols, Gemma 2's hidden, many rows of a head


def _inputs(shape, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(device, dtype)
    w = (0.5 * torch.randn(shape[-1], generator=g)).to(device, dtype)  # zero-centred, as Gemma stores it
    dy = torch.randn(shape, generator=g).to(device, dtype)
    return x, w, dy


def _fp32(x, w, dy, offset):
    xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    y, rstd = offset_rms_norm_ref(xr, wr, EPS, offset, return_rstd=True)
    y.backward(dy.float())
    return y.detach(), rstd, xr.grad, wr.grad


def _kernels(x, w, dy, offset):
    y, rstd, dx, dw = (poison_(torch.empty_like(x)), poison_(torch.empty(x.shape[:-1], device=x.device)),
                       poison_(torch.empty_like(x)), poison_(torch.empty_like(w)))
    rms_norm_fwd(x, w, EPS, out=y, rstd=rstd, offset=offset, round_normalised=False)
    rms_norm_bwd(dy, x, w, rstd, dx=dx, dw=dw, offset=offset, round_normalised=False)
    return y, rstd, dx, dw


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [1.0, 0.0])
def test_offset_rms_norm_kernels_match_fp32_reference(shape, dtype, offset, device):
    x, w, dy = _inputs(shape, dtype, device)
    tol = 1e-5 if dtype == torch.float32 else REL_TOL[torch.bfloat16]
    y, rstd, dx, dw = _kernels(x, w, dy, offset)
    ry, rrstd, rdx, rdw = _fp32(x, w, dy, offset)
    assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == dtype
    assert_close(y, ry, tol, "y")
    assert_close(rstd, rrstd.detach(), 1e-5, "rstd")
    assert_close(dx, rdx, tol, "dx")
    assert_close(dw, rdw, tol, "dw")


@pytest.mark.skipif(not interpreter_on(), reason="CPU tensors through the Triton interpreter (the GPU's row sums "
                    "may differ from torch's by an fp32 ulp)")
def test_bf16_forward_is_hf_gemma_bit_for_bit_and_differs_from_llama_rounding():
    """One rounding after (1 + w) in fp32: the kernel (interpreter) gives HF's Gemma numbers exactly; Llama's order
    (round the normalised value, then multiply) gives other bf16 numbers - the test would notice a swapped
    rounding."""
    x, w, _ = _inputs((37, 96), torch.bfloat16, seed=3)
    y, *_ = _kernels(x, w, torch.zeros_like(x), 1.0)
    assert torch.equal(y, offset_rms_norm_ref(x, w, EPS, 1.0))
    assert not torch.equal(y, rms_norm_ref(x, (1.0 + w.float()).to(torch.bfloat16), EPS).to(torch.bfloat16))


def test_closed_form_backward_reference_matches_autograd():
    x, w, dy = _inputs((13, 40), torch.float32, seed=1)
    _, rstd, rdx, rdw = _fp32(x, w, dy, 1.0)
    dx, dw = offset_rms_norm_bwd_ref(dy, x, w, rstd.detach(), 1.0)
    assert_close(dx, rdx, 1e-5, "dx")
    assert_close(dw, rdw, 1e-5, "dw")
