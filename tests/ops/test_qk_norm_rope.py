"""novatune.ops.qk_norm_rope: registered ops, autograd, and parity with HF Qwen3 (q_norm/k_norm + RoPE) on packed rows.

Tables come from transformers' Qwen3RotaryEmbedding with position_ids restarting mid-row (packed documents), cast
to the activation dtype as HF does. Weights are non-trivial (1 + 0.5 N(0, 1)). Tolerances:
* forward vs HF (Qwen3RMSNorm + apply_rotary_pos_emb(unsqueeze_dim=2)), bf16: elementwise, in units of
  |a| + |b| (a = qn * cos, b = rotate_half(qn) * sin, HF's qn). Where our rstd equals HF's, n and w * n are HF's
  bits; HF then rounds a, b and a + b (three bf16 roundings, unit roundoff 2^-8 each), novatune rounds the exact
  a + b once: |ours - HF| <= 3 * 2^-8 (|a| + |b|) < 2^-6 (|a| + |b|) (measured 0.0078). Where rstd differs in its
  last bits (another summation order; on CUDA torch.rsqrt is not even correctly rounded), n can flip by one ulp next
  to a rounding boundary, qn then moves by <= 2^-6 |qn| and the bound is 2^-5 (|a| + |b|) (measured 0.0158 on
  Qwen3's shape: a flip exceeded the former blanket 2^-6 by 1.6e-4 on the H200). Plus REL_TOL (1e-2) on the whole
  tensor. fp32: 1e-5 (same math, other order).
* vs novatune's rms_norm + apply_rope composition (run on its CPU reference path here - its kernels have their own
  tests, and the interpreter's per-token RoPE programs would dominate the run time; on the GPU, its kernels):
  the same rounding sequence, so rows whose rstd agrees are bit-identical; elsewhere n may flip by one ulp, which
  moves an output by <= 2^-5 (|a| + |b|) - many ulps of y where a and b cancel (56 ulps at Qwen3's shape under the
  interpreter), so the bound is never in ulps of y; < 1% of the elements differ. Grads: REL_TOL (the composition
  rounds dqn to bf16 between its two backward ops).
* grads (q, k, both weights) vs HF autograd and the pure fp32 math: REL_TOL (bf16 1e-2, fp32 1e-5).
"""
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding, apply_rotary_pos_emb

from novatune.measure.numerics import REL_TOL, assert_close, poison_
from novatune.ops import _backend
from novatune.ops.qk_norm_rope import qk_norm_rope, qk_norm_rope_bwd, qk_norm_rope_fwd
from novatune.ops.rms_norm import rms_norm
from novatune.ops.rope import apply_rope
from novatune.reference.qk_norm_rope import qk_norm_rope_ref

EPS = 1e-6


def _tables(b, s, d, dtype, device):
    """HF's cos/sin for packed rows: positions restart at every document boundary (per-row cuts)."""
    cfg = Qwen3Config(hidden_size=4 * d, num_attention_heads=4, num_key_value_heads=2, head_dim=d,
                      rope_parameters={"rope_type": "default", "rope_theta": 5e6})
    rotary = Qwen3RotaryEmbedding(cfg).to(device)
    rows = []
    for r in range(b):
        cuts = sorted({0, min(s, 7 + 3 * r), min(s, s // 2 + r + 1), s})
        rows.append(torch.cat([torch.arange(e - a) for a, e in zip(cuts[:-1], cuts[1:])]))
    pos = torch.stack(rows).to(device)  # (b, s): 0, 1, .., 0, 1, .., 0, 1, ..
    return rotary(torch.zeros(1, device=device, dtype=dtype), pos)  # (b, s, d) each


def _setup(b, s, hq, hk, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    norms = []
    for _ in range(2):
        m = Qwen3RMSNorm(d, eps=EPS).to(device, dtype)
        with torch.no_grad():
            m.weight.copy_(1.0 + 0.5 * torch.randn(d, generator=g))
        norms.append(m)
    q = torch.randn(b, s, hq, d, generator=g).to(device, dtype)
    k = (3.0 * torch.randn(b, s, hk, d, generator=g)).to(device, dtype)
    gq = torch.randn(b, s, hq, d, generator=g).to(device, dtype)
    gk = torch.randn(b, s, hk, d, generator=g).to(device, dtype)
    cos, sin = _tables(b, s, d, dtype, device)
    return norms, q, k, gq, gk, cos, sin


def _fwd_bwd(fn, q, k, wq, wk, gq, gk):
    """fn(q, k, wq, wk) -> (q_out, k_out); returns outputs and the grads of q, k, wq, wk (fresh leaves)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, wq, wk)]
    oq, ok = fn(*leaves)
    torch.autograd.backward([oq, ok], [gq.to(oq.dtype), gk.to(ok.dtype)])
    return [oq.detach(), ok.detach()], [t.grad for t in leaves]


def _fused(cos, sin):
    return lambda q, k, wq, wk: qk_norm_rope(q, k, wq, wk, EPS, cos, sin)


def _hf(cos, sin):
    def fn(q, k, wq, wk):
        # transformers' own Qwen3RMSNorm.forward on the weight leaves (it reads only weight and variance_epsilon)
        qn = Qwen3RMSNorm.forward(SimpleNamespace(weight=wq, variance_epsilon=EPS), q)
        kn = Qwen3RMSNorm.forward(SimpleNamespace(weight=wk, variance_epsilon=EPS), k)
        return apply_rotary_pos_emb(qn, kn, cos, sin, unsqueeze_dim=2)
    return fn


def _composition(cos, sin):
    return lambda q, k, wq, wk: apply_rope(rms_norm(q, wq, EPS), rms_norm(k, wk, EPS), cos, sin, unsqueeze_dim=2)


def _hf_rstd(x):
    """HF's Qwen3RMSNorm rstd (b, s, h) fp32: its own ops, on x's device."""
    return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS).squeeze(-1)


def _fused_rstd(q, k, wq, wk, cos, sin):
    """rstd_q, rstd_k of the fused op (same implementation as the eager path)."""
    return torch.ops.novatune.qk_norm_rope_fwd(q, k, wq, wk, EPS, cos, sin)[2:]


def _mag(qn, cos, sin):
    """|a| + |b| elementwise: a = qn * cos, b = rotate_half(qn) * sin, in fp32."""
    c, s = cos.unsqueeze(2).float(), sin.unsqueeze(2).float()
    x1, x2 = qn.float().chunk(2, dim=-1)
    return (qn.float() * c).abs() + (torch.cat((-x2, x1), dim=-1) * s).abs()


def _assert_fwd_matches_hf(out, hf_out, qn, cos, sin, flipped=None):
    """Elementwise bound of the module docstring; qn is HF's normalised (b, s, h, d) tensor; flipped (b, s, h) bool:
    rows where our rstd differs from HF's (None: none)."""
    if out.dtype != torch.bfloat16:
        assert_close(out, hf_out, 1e-5, "forward vs HF")
        return
    mag = _mag(qn, cos, sin)
    diff = (out.float() - hf_out.float()).abs()
    scale = torch.full_like(mag, 2.0 ** -6)
    if flipped is not None:
        scale = torch.where(flipped.unsqueeze(-1).expand_as(mag), 2.0 ** -5, scale)
    worst = float((diff - scale * mag).max())
    assert worst <= 0, (f"forward vs HF: |diff| exceeds its bound (2^-6 (|a| + |b|), 2^-5 where rstd differs) "
                        f"by {worst:.3e}")
    assert float((diff > 0).float().mean()) < 0.3
    assert_close(out, hf_out, REL_TOL[torch.bfloat16], "forward vs HF")


def _assert_same_sequence(out, comp, name, qn_comp, cos, sin, flipped):
    """Forward vs the rms_norm + apply_rope composition: identical in rows whose rstd agrees (flipped (b, s, h) False);
    elsewhere a one-ulp flip of n: |diff| <= 2^-5 (|a| + |b|) (from the composition's qn), never a bound in ulps."""
    if out.dtype != torch.bfloat16:
        assert_close(out, comp, 1e-6, f"{name} vs rms_norm + apply_rope")
        return
    differ = out != comp
    n_bad = int((differ & ~flipped.unsqueeze(-1).expand_as(differ)).sum())
    assert n_bad == 0, f"{name} vs rms_norm + apply_rope: {n_bad} elements differ in rows whose rstd agrees"
    assert float(differ.float().mean()) < 1e-2, f"{name} vs rms_norm + apply_rope: {int(differ.sum())} elements differ"
    if bool(differ.any()):
        excess = float(((out.float() - comp.float()).abs() - 2.0 ** -5 * _mag(qn_comp, cos, sin))[differ].max())
        assert excess <= 0, f"{name} vs rms_norm + apply_rope: |diff| exceeds 2^-5 (|a| + |b|) by {excess:.3e}"


def _composition_fwd(q, k, wq, wk):
    """(qn, rstd) of the composition's two rms_norm calls, on whatever path they take here."""
    return torch.ops.novatune.rms_norm_fwd(q, wq, EPS), torch.ops.novatune.rms_norm_fwd(k, wk, EPS)


CASES = [  # (b, s, hq, hk, d, dtype)
    (2, 37, 4, 2, 64, torch.bfloat16),
    (1, 129, 3, 1, 128, torch.bfloat16),
    (2, 37, 3, 1, 128, torch.float32),
]


@pytest.mark.parametrize("b,s,hq,hk,d,dtype", CASES, ids=str)
def test_packed_vs_hf_composition_and_fp32(b, s, hq, hk, d, dtype, device, monkeypatch):
    (nq, nk), q, k, gq, gk, cos, sin = _setup(b, s, hq, hk, d, dtype, device)
    wq, wk = nq.weight.detach(), nk.weight.detach()
    (oq, ok), grads = _fwd_bwd(_fused(cos, sin), q, k, wq, wk, gq, gk)
    (hq_, hk_), hf_grads = _fwd_bwd(_hf(cos, sin), q, k, wq, wk, gq, gk)
    with monkeypatch.context() as m:
        m.setenv("NOVATUNE_BACKEND", "reference")
        _backend.reset()
        (cq, ck), comp_grads = _fwd_bwd(_composition(cos, sin), q, k, wq, wk, gq, gk)
        (cnq, crq), (cnk, crk) = _composition_fwd(q, k, wq, wk)
    _backend.reset()
    # the pure fp32 math on the same values
    (fq, fk), f_grads = _fwd_bwd(lambda *t: qk_norm_rope_ref(*t, EPS, cos, sin),
                                 q.float(), k.float(), wq.float(), wk.float(), gq.float(), gk.float())
    assert oq.dtype == dtype and oq.shape == q.shape and ok.shape == k.shape and oq.is_contiguous()
    rq, rk = _fused_rstd(q, k, wq, wk, cos, sin)
    with torch.no_grad():
        _assert_fwd_matches_hf(oq, hq_, nq(q), cos, sin, rq != _hf_rstd(q))
        _assert_fwd_matches_hf(ok, hk_, nk(k), cos, sin, rk != _hf_rstd(k))
    tol = REL_TOL[dtype]
    for name, out, comp, f32, qn_c, flipped in [("q_out", oq, cq, fq, cnq, rq != crq),
                                                ("k_out", ok, ck, fk, cnk, rk != crk)]:
        _assert_same_sequence(out, comp, name, qn_c, cos, sin, flipped)
        assert_close(out, f32, tol, f"{name} vs fp32 math")
    for i, name in enumerate(["dq", "dk", "dq_weight", "dk_weight"]):
        assert grads[i].dtype == dtype
        assert_close(grads[i], hf_grads[i], tol, f"{name} vs HF autograd")
        assert_close(grads[i], comp_grads[i], tol, f"{name} vs rms_norm + apply_rope")
        assert_close(grads[i], f_grads[i], tol, f"{name} vs fp32 math")


def test_custom_op_and_eager_paths_agree(device):
    """torch.ops.novatune.qk_norm_rope_fwd (+ registered autograd) gives the eager Function's numbers exactly."""
    (nq, nk), q, k, gq, gk, cos, sin = _setup(1, 9, 4, 2, 64, torch.bfloat16, device)
    wq, wk = nq.weight.detach(), nk.weight.detach()
    eager = _fwd_bwd(_fused(cos, sin), q, k, wq, wk, gq, gk)
    registered = _fwd_bwd(lambda *t: torch.ops.novatune.qk_norm_rope_fwd(*t[:4], EPS, cos, sin)[:2],
                          q, k, wq, wk, gq, gk)
    for a, b in zip(eager[0] + eager[1], registered[0] + registered[1]):
        assert torch.equal(a, b)


def test_unused_output_and_frozen_weights(device):
    """Only q_out reaches the loss: dk is zero and k_weight's grad zero, on both paths; frozen weights get none."""
    (nq, nk), q, k, _, _, cos, sin = _setup(1, 5, 4, 2, 64, torch.float32, device)
    for fwd in (lambda *t: qk_norm_rope(*t[:4], EPS, cos, sin),
                lambda *t: torch.ops.novatune.qk_norm_rope_fwd(*t[:4], EPS, cos, sin)[:2]):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, nq.weight, nk.weight)]
        fwd(*leaves)[0].square().sum().backward()
        assert torch.equal(leaves[1].grad, torch.zeros_like(k))
        assert torch.equal(leaves[3].grad, torch.zeros_like(nk.weight))
        assert leaves[0].grad.abs().sum() > 0 and leaves[2].grad.abs().sum() > 0
    ql, kl = q.clone().requires_grad_(), k.clone().requires_grad_()
    oq, ok = qk_norm_rope(ql, kl, nq.weight.detach(), nk.weight.detach(), EPS, cos, sin)
    (oq.sum() + ok.sum()).backward()
    assert ql.grad is not None and kl.grad is not None


def test_torch_compile_traces_registered_op(device):
    """Dynamo sees the custom op (fake impl + registered autograd); aot_eager keeps the test fast."""
    (nq, nk), q, k, gq, gk, cos, sin = _setup(1, 7, 4, 2, 64, torch.float32, device)
    compiled = torch.compile(qk_norm_rope, backend="aot_eager", fullgraph=True)
    got = _fwd_bwd(lambda *t: compiled(*t[:4], EPS, cos, sin), q, k, nq.weight, nk.weight, gq, gk)
    ref = _fwd_bwd(lambda *t: qk_norm_rope_ref(*t[:4], EPS, cos, sin), q, k, nq.weight, nk.weight, gq, gk)
    for a, b in zip(got[0] + got[1], ref[0] + ref[1]):
        assert_close(a, b, 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_opcheck(dtype, device):
    (nq, nk), q, k, gq, gk, cos, sin = _setup(1, 3, 2, 1, 32, dtype, device)
    args = (q.requires_grad_(), k.requires_grad_(), nq.weight.detach().requires_grad_(),
            nk.weight.detach().requires_grad_(), EPS, cos, sin)
    torch.library.opcheck(qk_norm_rope_fwd, args)
    _, _, rq, rk = qk_norm_rope_fwd(*(a.detach() if torch.is_tensor(a) else a for a in args))
    gq, gk = poison_(torch.empty_like(gq)).normal_(), poison_(torch.empty_like(gk)).normal_()
    torch.library.opcheck(qk_norm_rope_bwd, (gq, gk, q.detach(), k.detach(), nq.weight.detach(), nk.weight.detach(),
                                             rq, rk, cos, sin))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cpu_reference_path(dtype, backend_env):
    """Plain CPU (interpreter off): the reference path, which the kernels match (same rounding sequence)."""
    (nq, nk), q, k, gq, gk, cos, sin = _setup(2, 11, 4, 2, 64, dtype, "cpu")
    wq, wk = nq.weight.detach(), nk.weight.detach()
    kernel = _fwd_bwd(_fused(cos, sin), q, k, wq, wk, gq, gk)  # interpreter (conftest) -> the Triton kernels
    backend_env("TRITON_INTERPRET", "0")
    ref = _fwd_bwd(_fused(cos, sin), q, k, wq, wk, gq, gk)
    (hq_, hk_), hf_grads = _fwd_bwd(_hf(cos, sin), q, k, wq, wk, gq, gk)
    with torch.no_grad():
        _assert_fwd_matches_hf(ref[0][0], hq_, nq(q), cos, sin)
        _assert_fwd_matches_hf(ref[0][1], hk_, nk(k), cos, sin)
    for a, b in zip(ref[1], hf_grads):
        assert_close(a, b, REL_TOL[dtype])
    # kernels vs reference path: identical rounding sequence (see tests/kernels/test_qk_norm_rope.py)
    for a, b in zip(kernel[0] + kernel[1], ref[0] + ref[1]):
        assert_close(a, b, {torch.float32: 1e-6, torch.bfloat16: 4e-3}[dtype])


def test_rejects_bad_args():
    (nq, nk), q, k, _, _, cos, sin = _setup(1, 5, 4, 2, 64, torch.float32, "cpu")
    with pytest.raises(ValueError):
        qk_norm_rope(q.transpose(1, 2)[:, :, :5], k, nq.weight, nk.weight, EPS, cos, sin)
    with pytest.raises(ValueError):
        qk_norm_rope(q, k, nq.weight[:32], nk.weight, EPS, cos, sin)
    with pytest.raises(ValueError):
        qk_norm_rope(q, k, nq.weight, nk.weight, EPS, cos[..., :32], sin[..., :32])
    with pytest.raises(ValueError, match="share"):  # one position's table for 5 tokens (the reference broadcasts)
        qk_norm_rope(q, k, nq.weight, nk.weight, EPS, cos[:, :1], sin[:, :1])
    with pytest.raises(ValueError, match="share"):
        qk_norm_rope(q, k[:, :4], nq.weight, nk.weight, EPS, cos, sin)


@pytest.mark.parametrize("path", ["cpu", "interpreter"])
def test_double_backward_raises_and_integers_are_refused(path, backend_env):
    """rstd_q / rstd_k are saved from the forward: the CPU path's second-order gradients were silently wrong (48%
    off in q); the eager Function is once-differentiable. Integer inputs raise a TypeError."""
    backend_env("TRITON_INTERPRET", "1" if path == "interpreter" else "0")
    (nq, nk), q, k, _, _, cos, sin = _setup(1, 5, 3, 1, 8, torch.float32, "cpu", seed=23)
    q, k = q.requires_grad_(), k.requires_grad_()
    qo, ko = qk_norm_rope(q, k, nq.weight, nk.weight, EPS, cos, sin)
    dq_out, dk_out = (torch.randn(t.shape).requires_grad_() for t in (qo, ko))
    grads = torch.autograd.grad((qo, ko), (q, k, nq.weight, nk.weight), (dq_out, dk_out), create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        sum((g * g).sum() for g in grads).backward()
    with pytest.raises(TypeError, match="floating point"):
        qk_norm_rope(q.detach().long(), k.detach(), nq.weight, nk.weight, EPS, cos, sin)


# ----------------------------------------------------------------------------------------------- GPU, real shapes
@pytest.mark.gpu
def test_real_shape_vs_hf_and_composition_gpu():
    """Qwen3-4B: q (1, 4096, 32, 128), k (1, 4096, 8, 128) bf16. Forward bit-identical to novatune's rms_norm +
    apply_rope in rows whose rstd agrees (elsewhere rare one-ulp flips of n, bounded by |a| + |b|); HF within the
    elementwise bound (2^-5 (|a| + |b|) in rows where torch's CUDA rstd differs from ours)."""
    (nq, nk), q, k, gq, gk, cos, sin = _setup(1, 4096, 32, 8, 128, torch.bfloat16, "cuda")
    wq, wk = nq.weight.detach(), nk.weight.detach()
    (oq, ok), grads = _fwd_bwd(_fused(cos, sin), q, k, wq, wk, gq, gk)
    (hq_, hk_), hf_grads = _fwd_bwd(_hf(cos, sin), q, k, wq, wk, gq, gk)
    (cq, ck), comp_grads = _fwd_bwd(_composition(cos, sin), q, k, wq, wk, gq, gk)
    (cnq, crq), (cnk, crk) = _composition_fwd(q, k, wq, wk)
    rq, rk = _fused_rstd(q, k, wq, wk, cos, sin)
    with torch.no_grad():
        _assert_fwd_matches_hf(oq, hq_, nq(q), cos, sin, rq != _hf_rstd(q))
        _assert_fwd_matches_hf(ok, hk_, nk(k), cos, sin, rk != _hf_rstd(k))
    for name, out, comp, qn_c, flipped in [("q_out", oq, cq, cnq, rq != crq), ("k_out", ok, ck, cnk, rk != crk)]:
        _assert_same_sequence(out, comp, name, qn_c, cos, sin, flipped)
    for a, b, c in zip(grads, hf_grads, comp_grads):
        assert_close(a, b)
        assert_close(a, c)
