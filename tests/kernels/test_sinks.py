"""The attention sinks' scale kernels (novatune.kernels.sinks) against the fp32 formulas, outputs poisoned.

Tolerances (relative-norm error): out' and dout are one fp32 product rounded once to the tensor's dtype (fp32: 1e-6;
bf16: one rounding to nearest, at most half a spacing, 2^-8 relative -> 4e-3); the sinks' gradient is an fp32 sum
of the same fp32 products in another order -> 1e-5 for both dtypes (the inputs are read exactly). The log-sum-exp
comes in FlashAttention-2's layout, a (tokens, hq) view of an (hq, tokens) tensor, and contiguous.
"""
import pytest
import torch

from novatune.kernels import sinks as KS
from novatune.measure.numerics import assert_close, poison_

TOL = {torch.float32: 1e-6, torch.bfloat16: 4e-3}
SHAPES = [(1, 1, 8), (37, 5, 64), (13, 64, 64), (9, 3, 100)]  # (tokens, hq, d): odd sizes, GPT-OSS's heads


def _inputs(tokens, hq, d, dtype, device, transposed_lse, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = torch.randn(tokens, hq, d, generator=gen).to(dtype).to(device)
    g = torch.randn(tokens, hq, d, generator=gen).to(dtype).to(device)
    lse = 3 * torch.randn(hq, tokens, generator=gen).to(device)
    lse = lse.t() if transposed_lse else lse.t().contiguous()
    sinks = torch.randn(hq, generator=gen).to(dtype).to(device)
    return out, g, lse, sinks


@pytest.mark.parametrize("transposed_lse", [True, False], ids=["lse-view", "lse-contiguous"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_scale_forward_and_backward(shape, dtype, transposed_lse, device):
    out, g, lse, sinks = _inputs(*shape, dtype, device, transposed_lse)
    c = torch.sigmoid(lse - sinks.float()).unsqueeze(-1)
    want = out.float() * c
    sunk = KS.sink_scale_fwd(out, lse, sinks, sunk=poison_(torch.empty_like(out)))
    assert sunk.dtype == dtype
    assert_close(sunk, want, TOL[dtype], "out * c")

    dout, dsinks = KS.sink_scale_bwd(g, sunk, lse, sinks)
    assert dout.dtype == dtype and dsinks.dtype == torch.float32 and dsinks.shape == (shape[1],)
    assert_close(dout, g.float() * c, TOL[dtype], "g * c")
    want_ds = -((1.0 - c.squeeze(-1)) * (g.float() * sunk.float()).sum(-1)).sum(0)
    assert_close(dsinks, want_ds, 1e-5, "d sinks")


def test_a_strided_gradient_is_read_as_its_values(device):
    out, g, lse, sinks = _inputs(7, 4, 16, torch.float32, device, True)
    sunk = KS.sink_scale_fwd(out, lse, sinks)
    strided = torch.randn(16, 4, 7, device=device).permute(2, 1, 0)
    a = KS.sink_scale_bwd(strided, sunk, lse, sinks)
    b = KS.sink_scale_bwd(strided.contiguous(), sunk, lse, sinks)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_wrong_shapes_are_refused_and_strided_inputs_read_as_values(device):
    out, g, lse, sinks = _inputs(5, 4, 8, torch.float32, device, True)
    with pytest.raises(ValueError, match="sinks"):
        KS.sink_scale_fwd(out, lse, sinks[:-1])
    with pytest.raises(ValueError, match="lse"):
        KS.sink_scale_fwd(out, lse[:-1], sinks)
    strided = out.transpose(0, 1).contiguous().transpose(0, 1)  # the right shape, not contiguous: read as values
    assert torch.equal(KS.sink_scale_fwd(strided, lse, sinks), KS.sink_scale_fwd(out, lse, sinks))
    strided_sinks = torch.stack([sinks, sinks], 1)[:, 0]  # stride 2
    assert torch.equal(KS.sink_scale_fwd(out, lse, strided_sinks), KS.sink_scale_fwd(out, lse, sinks))
