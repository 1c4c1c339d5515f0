"""AdamW with a Kahan-compensated weight update: the Triton kernel against the fp32 reference, and the
compensation's invariant (w + c is the exact sum of the updates), which is what makes bf16 updates not vanish.

Tolerances. m, v: the same fp32 formulas, contraction off in the kernel; the reference's CPU add_(alpha=) may fuse
-> 1e-6 relative, or one fp32 spacing at the state's scale where b1 m + (1 - b1) g cancels. w: one
round-to-nearest of an fp32 sum that agrees to a few fp32 ulps (sqrt, division) -> within one spacing of the
reference's w (fp32 weights: 1e-6 relative). w + c: the compensation absorbs whichever rounding w took; c is
stored in the weight's dtype, |c| <= one spacing of w, storing it costs <= 2^-9 |c|, and w and the reference's w
may sit either side of a power of two (spacings 2x apart) -> |(w + c) - ref| <= 2^-6 spacing(w) with margin,
against a whole spacing without the compensation.
"""
import math

import pytest
import torch

from novatune.kernels import adamw_kahan as K
from novatune.reference.adamw_kahan import adamw_kahan_step_ref

HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


def spacing(w: torch.Tensor) -> torch.Tensor:
    """The distance from |w| to the next larger value of w's dtype."""
    big = torch.nextafter(w.abs(), torch.full_like(w, math.inf))
    return (big.float() - w.abs().float()).clamp_min(torch.finfo(w.dtype).tiny)


def _state(n, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    w = (0.02 * torch.randn(n, generator=gen)).to(dtype).to(device)
    c = (spacing(w).cpu() * (torch.rand(n, generator=gen) - 0.5)).to(dtype).to(device) if dtype != torch.float32 \
        else None
    m = (1e-3 * torch.randn(n, generator=gen)).to(device)
    v = (1e-6 * torch.rand(n, generator=gen)).to(device)
    g = (1e-3 * torch.randn(n, generator=gen)).to(dtype).to(device)
    return w, c, m, v, g


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("n", [1, 1023, 4097])
@pytest.mark.parametrize("step", [1, 7])
def test_kernel_matches_reference(n, dtype, step, device):
    ours = _state(n, dtype, device, seed=n)
    ref = [t.clone() if t is not None else None for t in ours]
    before = ours[0].float() + (ours[1].float() if ours[1] is not None else 0.0)
    K.adamw_kahan_step(*ours, **HYPER, step=step)
    adamw_kahan_step_ref(*ref, **HYPER, step=step)
    w, c, m, v, _ = ours
    rw, rc, rm, rv, _ = ref
    # atol: one fp32 spacing at the state's scale (m ~ 1e-3, v ~ 1e-6): b1 m + (1 - b1) g can cancel
    torch.testing.assert_close(m, rm, rtol=1e-6, atol=1.2e-10)
    torch.testing.assert_close(v, rv, rtol=1e-6, atol=1.2e-13)
    # the update u: the same correctly rounded operations on both sides, except that torch's CUDA kernels may fuse
    # b m + (1 - b) g into one FMA where the kernel rounds twice (m and v then differ by an ulp, u by ~1.5):
    # 4 fp32 ulps of |u|, which matters where w + u cancels
    u = rw.float() + (rc.float() if rc is not None else 0.0) - before
    slack = 4 * torch.finfo(torch.float32).eps * u.abs()
    gap = spacing(rw)
    if dtype == torch.float32:
        # fp32 weights take w + u directly: one rounding of a sum that agrees to the slack
        assert ((w - rw).abs() <= 1e-6 * rw.abs() + 1e-9 + slack).all(), (w - rw).abs().max()
    else:
        assert ((w.float() - rw.float()).abs() <= gap + slack).all()
    if c is not None:
        held, want = w.float() + c.float(), rw.float() + rc.float()
        assert ((held - want).abs() <= gap / 64 + slack).all(), (held - want).abs().max()


def test_compensation_keeps_updates_below_half_a_spacing(device):
    # weights near 1.0 (bf16 spacing 2^-7 = 0.0078) and a constant gradient: every Adam update is -lr = -1e-4, 39x
    # smaller than half a spacing, so a plain bf16 addition never moves w. With the compensation w + c follows the
    # exact sum w0 - 100 lr, up to the storage of c: after each step |c| <= half a spacing and storing it in bf16
    # costs <= 2^-9 of that, so after N steps |w + c - exact| <= N spacing / 1024 (here 7.6e-4 against a total
    # update of 1e-2; a constant update is the worst case, as the storage errors then share a sign).
    n, steps = 257, 100
    w0 = (1.0 + 0.004 * torch.rand(n, generator=torch.Generator().manual_seed(0))).to(torch.bfloat16).to(device)
    w, c = w0.clone(), torch.zeros_like(w0)
    m = torch.zeros(n, device=device)
    v = torch.zeros(n, device=device)
    g = torch.full((n,), 0.5, dtype=torch.bfloat16, device=device)
    plain = torch.nn.Parameter(w0.clone())
    opt = torch.optim.AdamW([plain], lr=1e-4, eps=1e-8, weight_decay=0.0)
    for step in range(1, steps + 1):
        K.adamw_kahan_step(w, c, m, v, g, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=step)
        plain.grad = g.clone()
        opt.step()
    want = w0.double() - steps * 1e-4
    assert torch.equal(plain.detach(), w0)  # stock bf16 AdamW: the update vanished every step
    err = (w.double() + c.double() - want).abs()
    assert (err <= steps * 2**-7 / 1024).all(), err.max()
    assert ((w.double() - want).abs() <= spacing(w).double()).all()  # w moved by the one spacing 0.01 amounts to
    assert (w < w0).all()
