"""AdamW with moments in the parameter's dtype and the clipping scale folded in: the Triton kernel against the fp32
reference (novatune/reference/adamw.py), and on a GPU against torch's fused AdamW.

Tolerance against the reference: none. Both evaluate the same fp32 operations in the same order, each rounded to
nearest (the kernel with fused multiply-adds off, division and square root correctly rounded; the reference as
separate torch ops, its square root taken in fp64 and rounded once), and both round the results to the storage
dtype to nearest even. So p, m and v must be equal bit for bit, on odd sizes, with and without the scale and decay.
Against torch's fused AdamW (GPU only): both are measured against the step in fp64, and the kernel must be within the
rounding bound and no further than torch's fused step (whose fp32 coefficients put it further off than the bound).
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


def spacing(t: torch.Tensor) -> torch.Tensor:
    """The distance from |t| to the next larger value of t's dtype (as fp64)."""
    big = torch.nextafter(t.abs(), torch.full_like(t, math.inf))
    return (big.double() - t.abs().double()).clamp_min(torch.finfo(t.dtype).tiny)


def step_difference(before, g, ours, theirs, arith: torch.dtype, *, lr, beta1, beta2, eps, weight_decay, step) -> dict:
    """How far two implementations' results of one AdamW step from the same state are apart, in units of what
    their roundings allow: per tensor (largest |ours - theirs| / bound, fraction of values equal). The bound is one
    spacing of the stored result (the last rounding may go either way) plus a few fp32 roundings of the operands'
    magnitudes: b1 m + (1 - b1) g can cancel (m's own spacing is then far below its operands'), and an update
    carries m's error, scaled by step_size / denom, into p. `arith`: the dtype the compared implementation
    computes in (torch's fused kernel: fp32, some products fp64; its single-tensor path: the parameter's dtype,
    every op rounded to it)."""
    p0, m0, v0 = (t.double() for t in before)
    g = g.double()
    tiny = 4 * torch.finfo(arith).eps
    scale_m = beta1 * m0.abs() + (1 - beta1) * g.abs()
    scale_v = beta2 * v0 + (1 - beta2) * g * g
    denom = scale_v.sqrt() / math.sqrt(1 - beta2 ** step) + eps
    scale_p = p0.abs() * (1 + lr * weight_decay) + 2 * lr / (1 - beta1 ** step) * scale_m / denom
    out = {}
    for name, a, b, scale in (("p", ours[0], theirs[0], scale_p), ("m", ours[1], theirs[1], scale_m),
                              ("v", ours[2], theirs[2], scale_v)):
        diff = (a.double() - b.double()).abs()
        out[name] = (float((diff / (spacing(b) + tiny * scale)).max()), float((diff == 0).double().mean()))
    return out


def _torch_step_beside_kernel(dtype, device, **adamw_kw):
    """Five torch.optim.AdamW steps on a 3M-element parameter; the kernel takes the fifth from the same state.
    Returns (state before the fifth step, its gradient, the kernel's result, torch's result, the hyperparameters)."""
    n = 3 * 2**20 + 5
    gen = torch.Generator().manual_seed(1)
    ref = torch.nn.Parameter((0.02 * torch.randn(n, generator=gen)).to(dtype).to(device))
    opt = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.1, **adamw_kw)
    for _ in range(5):
        g = (1e-3 * torch.randn(n, generator=gen)).to(dtype).to(device)
        st = opt.state[ref]
        before = (ref.detach().clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone()) if st else None
        ref.grad = g.clone()
        opt.step()
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=5)
    ours = tuple(t.clone() for t in before)
    K.adamw_step(*ours, g, **hyper)
    st = opt.state[ref]
    return before, g, ours, (ref.detach(), st["exp_avg"], st["exp_avg_sq"]), hyper


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_kernel_step_within_rounding_of_torch_single_tensor_adamw(dtype, device):
    """torch's single-tensor AdamW (lerp for m, addcdiv for p): another rounding order of the same step."""
    before, g, ours, theirs, hyper = _torch_step_beside_kernel(dtype, device, foreach=False)
    stats = step_difference(before, g, ours, theirs, dtype, **hyper)
    assert all(worst <= 1 for worst, _ in stats.values()), f"(largest difference / bound, fraction equal): {stats}"


def error_against_fp64(before, g, result, *, lr, beta1, beta2, eps, weight_decay, step) -> dict:
    """Per tensor, the largest |result - the step in fp64| in units of the stored truth's spacing plus four fp32
    roundings of the operands' magnitudes (step_difference's bound, with the exact step in place of the other
    implementation)."""
    p0, m0, v0 = (t.double() for t in before)
    g = g.double()
    m = beta1 * m0 + (1 - beta1) * g
    v = beta2 * v0 + (1 - beta2) * g * g
    denom = v.sqrt() / math.sqrt(1 - beta2 ** step) + eps
    p = p0 * (1 - lr * weight_decay) - lr / (1 - beta1 ** step) * m / denom
    tiny = 4 * torch.finfo(torch.float32).eps
    scale_m = beta1 * m0.abs() + (1 - beta1) * g.abs()
    scale_p = p0.abs() * (1 + lr * weight_decay) + 2 * lr / (1 - beta1 ** step) * scale_m / denom
    out = {}
    for name, got, truth, scale in (("p", result[0], p, scale_p), ("m", result[1], m, scale_m), ("v", result[2], v, v)):
        bound = spacing(truth.to(got.dtype)) + tiny * scale
        out[name] = float(((got.double() - truth).abs() / bound).max())
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cuda_kernel_step_as_close_to_fp64_as_torch_fused_adamw(dtype):
    """torch's fused AdamW (what stock trainers run on CUDA) is the yardstick, not the truth: measured in sessions 15
    and 16, its fp32 v sits up to ~24 of step_difference's bounds away from the kernel's, which is the size of a
    (1 - beta2) taken after beta2 is rounded to fp32 (relative 1.3e-5 on the g^2 term). So both are measured against
    the step in fp64: the kernel within the rounding bound, and never further than torch's fused step is."""
    before, g, ours, theirs, hyper = _torch_step_beside_kernel(dtype, "cuda", fused=True)
    ours_err, torch_err = error_against_fp64(before, g, ours, **hyper), error_against_fp64(before, g, theirs, **hyper)
    print(f"{dtype} worst error / bound: kernel {ours_err}, torch fused {torch_err}")
    assert all(ours_err[k] <= max(1.0, torch_err[k]) for k in ours_err), (ours_err, torch_err)
    assert all(e <= 1 for e in ours_err.values()), (ours_err, torch_err)


def test_kernel_within_rounding_of_the_step_in_fp64(device):
    """The kernel's own accuracy, on every device: within the rounding bound of the exact step."""
    for dtype in (torch.bfloat16, torch.float32):
        before = _state(4099, dtype, device, seed=11, step=5)
        g = before[3]
        ours = tuple(t.clone() for t in before[:3])
        hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=5)
        K.adamw_step(*ours, g, **hyper)
        err = error_against_fp64(before[:3], g, ours, **hyper)
        assert all(e <= 1 for e in err.values()), (dtype, err)


def test_a_nan_gradient_gives_nan_not_zero(device):
    """A NaN reaching the update must stay visible (the non-finite checks read the weights and checkpoints): the
    bf16 rounding on the bits would carry a NaN's payload into the sign bit and store +-0 without its own case."""
    for dtype in (torch.bfloat16, torch.float32):
        p, m, v, g = _state(257, dtype, device, seed=5, step=2)
        g[3] = float("nan")
        K.adamw_step(p, m, v, g, **HYPER, weight_decay=0.0, step=2)
        assert torch.isnan(p[3]) and torch.isnan(m[3]) and torch.isnan(v[3]), dtype
        assert torch.isfinite(p[:3]).all() and torch.isfinite(p[4:]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_found_inf_leaves_everything_as_it_is(dtype, device):
    """found_inf nonzero (a non-finite step decided on the device): p, m and v keep their bits, even with a NaN
    gradient and scale; zero: the same step as without the flag."""
    p, m, v, g = _state(1029, dtype, device, seed=9, step=3)
    before = [t.clone() for t in (p, m, v)]
    g_nan = g.clone()
    g_nan[5] = float("nan")
    K.adamw_step(p, m, v, g_nan, torch.tensor(float("nan"), device=device), **HYPER, weight_decay=0.1, step=3,
                 found_inf=torch.tensor(1.0, device=device))
    for a, b in zip((p, m, v), before, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    plain = [t.clone() for t in before]
    K.adamw_step(p, m, v, g, **HYPER, weight_decay=0.1, step=3, found_inf=torch.tensor(0.0, device=device))
    K.adamw_step(*plain, g, **HYPER, weight_decay=0.1, step=3)
    for a, b in zip((p, m, v), plain, strict=True):
        assert torch.equal(a, b)
    ref = [t.clone() for t in before]
    adamw_step_ref(*ref, g, **HYPER, weight_decay=0.1, step=3, found_inf=torch.tensor(1.0))
    assert all(torch.equal(a, b) for a, b in zip(ref, before, strict=True))
    with pytest.raises(ValueError, match="found_inf"):
        K.adamw_step(p, m, v, g, **HYPER, weight_decay=0.1, step=3, found_inf=torch.tensor([0.0, 0.0], device=device))
