"""AdamW with moments in the parameter's dtype and the clipping scale folded in: the Triton kernel against the fp32
reference (novatune/reference/adamw.py), and on a GPU against torch's fused AdamW.

Tolerance against the reference: none. Both evaluate the same fp32 operations in the same order, each rounded to
nearest (the kernel with fused multiply-adds off, division and square root correctly rounded; the reference as
separate torch ops, its square root taken in fp64 and rounded once), and both round the results to the storage
dtype to nearest even. So p, m and v must be equal bit for bit, on odd sizes, with and without the scale and decay.
Against torch's fused AdamW (GPU only): torch evaluates some products in fp64 and may fuse multiply-adds, so a stored
value may differ in its last bit; measured, not assumed.
"""
import math

import pytest
import torch

from novatune.kernels import adamw as K
from novatune.reference.adamw import adamw_step_ref

HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8)


def _state(n, dtype, device, seed, step):
    gen = torch.Generator().manual_seed(seed)
    p = (0.02 * torch.randn(n, generator=gen)).to(dtype).to(device)
    # moments of a run `step` steps in (zero at step 1, as torch's state starts)
    m = (1e-3 * torch.randn(n, generator=gen) * (step > 1)).to(dtype).to(device)
    v = (1e-6 * torch.rand(n, generator=gen) * (step > 1)).to(dtype).to(device)
    g = (1e-3 * torch.randn(n, generator=gen)).to(dtype).to(device)
    return p, m, v, g


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("n", [1, 1023, 4099])
@pytest.mark.parametrize("step,weight_decay,with_scale", [(1, 0.0, False), (7, 0.1, True), (3, 0.0, True)])
def test_kernel_equals_reference_bit_for_bit(n, dtype, step, weight_decay, with_scale, device):
    ours = _state(n, dtype, device, seed=n + step, step=step)
    ref = [t.clone() for t in ours]
    scale = torch.tensor(0.37, device=device) if with_scale else None
    grad_before = ours[3].clone()
    K.adamw_step(*ours, scale, **HYPER, weight_decay=weight_decay, step=step)
    adamw_step_ref(*ref, scale, **HYPER, weight_decay=weight_decay, step=step)
    for name, a, b in zip("pmv", ours[:3], ref[:3], strict=True):
        assert torch.equal(a, b), (name, (a.float() - b.float()).abs().max())
    assert torch.equal(ours[3], grad_before)  # the gradient is read, never scaled in place
    assert not torch.equal(ours[0], _state(n, dtype, device, seed=n + step, step=step)[0])  # the update landed


def test_the_scale_is_the_clipping_coefficient(device):
    """A scale s gives what clip_grad_norm_'s scaled gradient s * g gives (fp32: the one rounding of s * g is the
    same on both sides)."""
    p, m, v, g = _state(1000, torch.float32, device, seed=3, step=4)
    clipped = [t.clone() for t in (p, m, v)]
    s = torch.tensor(0.25, device=device)
    K.adamw_step(p, m, v, g, s, **HYPER, weight_decay=0.01, step=4)
    K.adamw_step(*clipped, g * s, None, **HYPER, weight_decay=0.01, step=4)
    for a, b in zip((p, m, v), clipped, strict=True):
        assert torch.equal(a, b)


def test_bad_inputs_raise(device):
    p, m, v, g = _state(16, torch.float32, device, seed=0, step=1)
    with pytest.raises(ValueError, match="one shape, dtype and device"):
        K.adamw_step(p, m, v, g[:8], **HYPER, weight_decay=0.0, step=1)
    with pytest.raises(ValueError, match="one shape, dtype and device"):
        K.adamw_step(p, m.double(), v, g, **HYPER, weight_decay=0.0, step=1)
    with pytest.raises(ValueError, match="one-element fp32"):
        K.adamw_step(p, m, v, g, torch.tensor([1.0, 2.0], device=device), **HYPER, weight_decay=0.0, step=1)
    with pytest.raises(TypeError, match="bf16 or fp32"):
        K.adamw_step(*(t.half() for t in (p, m, v, g)), **HYPER, weight_decay=0.0, step=1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cuda_kernel_tracks_torch_fused_adamw(dtype):
    """One step from the same state, torch.optim.AdamW(fused=True) beside the kernel, on a 3M-element parameter
    whose state comes from four earlier torch steps: every stored value within one spacing of its dtype of torch's,
    and nearly all of them equal. (Over several steps the moments' last-bit differences feed later updates, so the
    two runs drift apart by a few spacings: the same bound applies per step, measured here.)"""
    n = 3 * 2**20 + 5
    gen = torch.Generator().manual_seed(1)
    ref = torch.nn.Parameter((0.02 * torch.randn(n, generator=gen)).to(dtype).cuda())
    opt = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.1, fused=True)
    for _ in range(5):
        g = (1e-3 * torch.randn(n, generator=gen)).to(dtype).cuda()
        st = opt.state[ref]
        before = (ref.detach().clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone()) if st else None
        ref.grad = g.clone()
        opt.step()
    p, m, v = before
    K.adamw_step(p, m, v, g, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=5)
    st = opt.state[ref]
    stats = {}
    for name, ours, theirs in (("p", p, ref.detach()), ("m", m, st["exp_avg"]), ("v", v, st["exp_avg_sq"])):
        big = torch.nextafter(theirs.abs(), torch.full_like(theirs, math.inf))
        spacing = (big.float() - theirs.abs().float()).clamp_min(torch.finfo(dtype).tiny)
        diff = (ours.float() - theirs.float()).abs()
        stats[name] = (float((diff / spacing).max()), float((diff == 0).float().mean()))
    assert all(worst <= 1 and equal >= 0.99 for worst, equal in stats.values()), \
        f"(largest difference in spacings, fraction equal) per tensor: {stats}"
