"""novatune.kernels.rope: the Triton launchers against the fp32 reference (interpreter on CPU).

Tolerances. The kernel computes in fp32 and rounds once, and the reference uses the very same (possibly bf16)
cos/sin values, so:
* fp32: each output is x1*c1 - x2*s1 (two products and a sum, ~2 ulp) -> relative-norm error ~1e-7; 1e-6.
* bf16: one rounding of the output, unit roundoff 2^-9 relative per element, ~1.1e-3 in relative norm for
  uniformly spread rounding errors (GPU: round-to-nearest-even); 3e-3 leaves margin without letting a second
  rounding or a wrong sign through (a sign error in one half gives an error of order 1). The Triton interpreter
  (CPU CI) converts fp32 -> bf16 by *truncation* (triton/runtime/interpreter.py passes no rounding mode), which
  doubles the error (measured 3.5e-3), so there the bound is 6e-3.
Tables here are random angles with *different* halves, so the test also pins the general formula (c1 != c2).
The interpreter runs one program per token at ~5 ms each: shapes are kept to a few hundred tokens in total.
"""
import pytest
import torch

from novatune.kernels.rope import rope_bwd, rope_fwd
from novatune.measure.numerics import assert_close, poison_
from novatune.ops._backend import interpreter_on
from novatune.reference.rope import rope_bwd_ref, rope_ref

TOL = {torch.float32: 1e-6, torch.bfloat16: 6e-3 if interpreter_on() else 3e-3}


def _make(b, hq, hk, s, d, dtype, u, device, table_batch=None, rotary_dim=None):
    shape = (lambda h: (b, h, s, d)) if u == 1 else (lambda h: (b, s, h, d))
    q = torch.randn(shape(hq), device=device, dtype=dtype)
    k = torch.randn(shape(hk), device=device, dtype=dtype)
    ang = torch.rand(table_batch or b, s, rotary_dim or d, device=device) * 6.3   # general tables: halves differ
    return q, k, ang.cos().to(dtype), ang.sin().to(dtype)


def _check(q, k, cos, sin, u, dtype, **kw):
    qo, ko = poison_(torch.empty_like(q)), poison_(torch.empty_like(k))
    out = rope_fwd(q, k, cos, sin, u, q_out=qo, k_out=ko, **kw)
    assert out[0] is qo and out[1] is ko
    rq, rk = rope_ref(q, k, cos, sin, u)
    assert_close(qo, rq, TOL[dtype], "q_embed")
    assert_close(ko, rk, TOL[dtype], "k_embed")
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    dq, dk = poison_(torch.empty_like(q)), poison_(torch.empty_like(k))
    rope_bwd(gq, gk, cos, sin, u, dq=dq, dk=dk, **kw)
    rdq, rdk = rope_bwd_ref(gq, gk, cos, sin, u)
    assert_close(dq, rdq, TOL[dtype], "dq")
    assert_close(dk, rdk, TOL[dtype], "dk")


CASES = [  # (b, hq, hk, s, d, dtype, unsqueeze_dim)
    (1, 3, 1, 37, 64, torch.float32, 1),
    (2, 4, 2, 37, 128, torch.bfloat16, 2),
    (1, 4, 2, 129, 128, torch.bfloat16, 1),
    (2, 3, 1, 1, 64, torch.bfloat16, 2),
    (2, 4, 2, 1, 128, torch.float32, 1),
    (1, 3, 1, 129, 64, torch.float32, 2),
]


@pytest.mark.parametrize("b,hq,hk,s,d,dtype,u", CASES)
def test_fwd_bwd_vs_ref(b, hq, hk, s, d, dtype, u, device):
    torch.manual_seed(0)
    _check(*_make(b, hq, hk, s, d, dtype, u, device), u, dtype)


PARTIAL = [  # (b, hq, hk, s, d, rotary_dim, dtype, unsqueeze_dim): Phi-4-mini's 3/4, odd sizes, a narrow band
    (1, 3, 1, 37, 32, 24, torch.float32, 2),
    (2, 4, 2, 19, 64, 48, torch.bfloat16, 1),
    (2, 3, 1, 1, 16, 12, torch.bfloat16, 2),
    (1, 5, 1, 23, 96, 2, torch.float32, 1),
]


@pytest.mark.parametrize("b,hq,hk,s,d,r,dtype,u", PARTIAL)
def test_partial_rotary_vs_ref(b, hq, hk, s, d, r, dtype, u, device):
    """Tables narrower than head_dim: the first r features rotate, the other d - r are copied bit for bit in both
    directions (poisoned outputs: every element written)."""
    torch.manual_seed(0)
    q, k, cos, sin = _make(b, hq, hk, s, d, dtype, u, device, rotary_dim=r)
    _check(q, k, cos, sin, u, dtype)
    qo, ko = rope_fwd(q, k, cos, sin, u, q_out=poison_(torch.empty_like(q)), k_out=poison_(torch.empty_like(k)))
    assert torch.equal(qo[..., r:], q[..., r:]) and torch.equal(ko[..., r:], k[..., r:])
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    dq, dk = rope_bwd(gq, gk, cos, sin, u)
    assert torch.equal(dq[..., r:], gq[..., r:]) and torch.equal(dk[..., r:], gk[..., r:])


def test_partial_reference_is_phi3_formula():
    """The oracle's partial rotary is transformers' Phi-3 apply_rotary_pos_emb (the stock formula), and its
    backward is the oracle's transpose."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    torch.manual_seed(0)
    q, k, cos, sin = _make(2, 3, 1, 9, 32, torch.float32, 1, "cpu", rotary_dim=24)
    hq, hk = apply_rotary_pos_emb(q, k, cos, sin)
    rq, rk = rope_ref(q, k, cos, sin, 1)
    assert_close(rq, hq, 1e-7, "q")
    assert_close(rk, hk, 1e-7, "k")
    q.requires_grad_(True)
    k.requires_grad_(True)
    rq, rk = rope_ref(q, k, cos, sin, 1)
    gq, gk = torch.randn_like(rq), torch.randn_like(rk)
    torch.autograd.backward([rq, rk], [gq, gk])
    dq, dk = rope_bwd_ref(gq, gk, cos, sin, 1)
    assert_close(q.grad, dq, 1e-7, "dq")
    assert_close(k.grad, dk, 1e-7, "dk")


def test_ref_matches_autograd():
    """rope_bwd_ref is the transpose of rope_ref (what every backward test relies on)."""
    torch.manual_seed(0)
    q, k, cos, sin = _make(2, 3, 1, 5, 16, torch.float64, 1, "cpu")
    q.requires_grad_(True)
    k.requires_grad_(True)
    rq, rk = rope_ref(q, k, cos, sin, 1)
    gq, gk = torch.randn_like(rq), torch.randn_like(rk)
    torch.autograd.backward([rq, rk], [gq, gk])
    dq, dk = rope_bwd_ref(gq, gk, cos, sin, 1)
    assert torch.allclose(q.grad, dq.double()) and torch.allclose(k.grad, dk.double())


@pytest.mark.parametrize("u", [1, 2])
def test_strided_views_of_projection(u, device):
    """q/k as views of one fused (b, s, (hq+2hk)*d) projection: non-dense, read in place through strides."""
    torch.manual_seed(0)
    b, s, hq, hk, d, dtype = 2, 7, 4, 2, 64, torch.bfloat16
    qkv = torch.randn(b, s, (hq + 2 * hk) * d, device=device, dtype=dtype)
    q = qkv[..., : hq * d].view(b, s, hq, d)
    k = qkv[..., hq * d:(hq + hk) * d].view(b, s, hk, d)
    if u == 1:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    assert not q.is_contiguous()
    ang = torch.rand(b, s, d, device=device) * 6.3
    _check(q, k, ang.cos().to(dtype), ang.sin().to(dtype), u, dtype)
    qo, _ = rope_fwd(q, k, ang.cos().to(dtype), ang.sin().to(dtype), u)
    assert qo.stride() == torch.empty_like(q).stride()   # dense, input's stride order


def test_head_split_and_warps(device):
    """Force the split-heads path (used on GPUs for short sequences) and a non-default warp count."""
    torch.manual_seed(0)
    q, k, cos, sin = _make(1, 4, 2, 7, 64, torch.bfloat16, 1, device)
    _check(q, k, cos, sin, 1, torch.bfloat16, split=2, num_warps=2)
    q, k, cos, sin = _make(1, 3, 1, 5, 64, torch.float32, 2, device)
    _check(q, k, cos, sin, 2, torch.float32, split=4)   # more splits than k heads: empty k blocks


@pytest.mark.parametrize("d", [96, 256, 2])
def test_head_dims(d, device):
    """half not a power of 2 (masked tail), the largest supported d, and the smallest."""
    torch.manual_seed(0)
    _check(*_make(1, 2, 1, 5, d, torch.float32, 1, device), 1, torch.float32)


def test_broadcast_tables(device):
    """cos/sin (1, s, d) broadcast over batch (batch stride 0), and 2-d (s, d) tables."""
    torch.manual_seed(0)
    q, k, cos, sin = _make(2, 3, 1, 11, 64, torch.bfloat16, 2, device, table_batch=1)
    _check(q, k, cos, sin, 2, torch.bfloat16)
    qo, ko = rope_fwd(q, k, cos[0], sin[0], 2)
    rq, rk = rope_ref(q, k, cos, sin, 2)
    assert_close(qo, rq, TOL[torch.bfloat16])
    assert_close(ko, rk, TOL[torch.bfloat16])


def test_config_cache_reads_layout_per_call(device):
    """The launch config is cached per shape, strides are not: the same shapes in another layout (views of a fused
    projection; tables whose last dim is strided; cos broadcast over the batch while sin is not) are read right,
    and same-shape calls reuse the cached config."""
    from novatune.kernels import rope as R

    torch.manual_seed(0)
    b, hq, hk, s, d, dtype = 2, 4, 2, 5, 64, torch.float32
    q, k, cos, sin = _make(b, hq, hk, s, d, dtype, 2, device)
    _check(q, k, cos, sin, 2, dtype)
    n_configs = len(R._CONFIGS)
    qkv = torch.randn(b, s, (hq + 2 * hk) * d, device=device, dtype=dtype)
    q2, k2 = qkv[..., : hq * d].view(b, s, hq, d), qkv[..., hq * d:(hq + hk) * d].view(b, s, hk, d)
    ang = torch.rand(b, d, s, device=device).transpose(1, 2) * 6.3   # (b, s, d) with last stride s
    cos2, sin2 = ang.cos(), ang.sin()
    assert cos2.stride(-1) != 1 and not q2.is_contiguous()
    _check(q2, k2, cos2, sin2, 2, dtype)
    assert len(R._CONFIGS) == n_configs
    _check(q, k, cos[:1], sin, 2, dtype)   # one table broadcast, the other not: tables materialised


def test_rejects_bad_args(device):
    q, k, cos, sin = _make(1, 2, 1, 4, 64, torch.float32, 1, device)
    with pytest.raises(ValueError):
        rope_fwd(q, k, cos, sin, 3)
    with pytest.raises(ValueError):   # odd rotary width
        rope_fwd(q, k, cos[..., :31], sin[..., :31], 1)
    with pytest.raises(ValueError):   # tables wider than head_dim
        rope_fwd(q[..., :32], k[..., :32], cos, sin, 1)
    with pytest.raises(ValueError):
        rope_fwd(q[..., :63], k[..., :63], cos[..., :63], sin[..., :63], 1)


# ---------------------------------------------------------------- GPU: real shapes (Qwen3-4B)
@pytest.mark.gpu
@pytest.mark.parametrize("u", [1, 2])
def test_real_shapes_gpu(u):
    torch.manual_seed(0)
    q, k, cos, sin = _make(1, 32, 8, 4096, 128, torch.bfloat16, u, "cuda")
    _check(q, k, cos, sin, u, torch.bfloat16)


@pytest.mark.timing
@pytest.mark.gpu
def test_speed_sanity_gpu():
    """fwd+bwd at the real shape moves >= 50% of the copy rate (target 70%, measured by bench/bench_rope.py)."""
    from novatune.measure.timing import copy_bandwidth_gbps, kernel_us

    q, k, cos, sin = _make(1, 32, 8, 4096, 128, torch.bfloat16, 1, "cuda")
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    us = kernel_us(lambda: (rope_fwd(q, k, cos, sin, 1), rope_bwd(gq, gk, cos, sin, 1)))
    nbytes = 2 * 2 * (q.numel() + k.numel()) * 2 + 2 * 2 * cos.numel() * 2
    floor_us = nbytes / copy_bandwidth_gbps() / 1e3
    assert floor_us / us >= 0.5, f"{us:.1f} us vs floor {floor_us:.1f} us"
