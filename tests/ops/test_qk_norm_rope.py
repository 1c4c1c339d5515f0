"""novatune.ops.qk_norm_rope: registered ops, autograd, and parity with HF Qwen3 (q_norm/k_norm + RoPE) on packed rows.

Tables come from transformers' Qwen3RotaryEmbedding with position_ids restarting mid-row (packed documents), cast
to the activation dtype as HF does. Weights are non-trivial (1 + 0.5 N(0, 1)). Tolerances:
* forward vs HF (Qwen3RMSNorm + apply_rotary_pos_emb(unsqueeze_dim=2)), bf16: elementwise. n and w * n are HF's
  bits; HF then rounds a = qn * cos, b = rotate_half(qn) * sin and a + b (three bf16 roundings, unit roundoff 2^-8
  each), novatune rounds the exact a + b once, so |ours - HF| <= 3 * 2^-8 * (|a| + |b|); 2^-6 leaves room for the
  rare n that flips by one ulp when rstd differs in its last fp32 bit. Measured: 0.0078 max, ~13% of elements
  differ (by one rounding). Plus REL_TOL (1e-2) on the whole tensor. fp32: 1e-5 (same math, other order).
* vs novatune's rms_norm + apply_rope composition (run on its CPU reference path here - its kernels have their own
  tests, and the interpreter's per-token RoPE programs would dominate the run time; on the GPU, its kernels):
  the same rounding sequence, so the forward is bit-identical except where rstd differs in its last fp32 bit
  (torch sums the whole row, the kernel the two halves): n flips by one bf16 ulp there, the output by <= 2 ulps,
  in well under 1% of elements. Grads: REL_TOL (the composition rounds dqn to bf16 between its two backward ops).
* grads (q, k, both weights) vs HF autograd and the pure fp32 math: REL_TOL (bf16 1e-2, fp32 1e-5).
"""
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding, apply_rotary_pos_emb

from novatune.harness.numerics import REL_TOL, assert_close, poison_
from novatune.kernels.qk_norm_rope import qk_norm_rope_ref
from novatune.ops.qk_norm_rope import qk_norm_rope, qk_norm_rope_bwd, qk_norm_rope_fwd
from novatune.ops.rms_norm import rms_norm
from novatune.ops.rope import apply_rope

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


def _assert_fwd_matches_hf(out, hf_out, qn, cos, sin):
    """Elementwise bound of the module docstring; qn is HF's normalised (b, s, h, d) tensor."""
    if out.dtype != torch.bfloat16:
        assert_close(out, hf_out, 1e-5, "forward vs HF")
        return
    c, s = cos.unsqueeze(2).float(), sin.unsqueeze(2).float()
    x1, x2 = qn.float().chunk(2, dim=-1)
    mag = (qn.float() * c).abs() + (torch.cat((-x2, x1), dim=-1) * s).abs()
    diff = (out.float() - hf_out.float()).abs()
    worst = float((diff - 2.0 ** -6 * mag).max())
    assert worst <= 0, f"forward vs HF: |diff| exceeds 2^-6 (|a| + |b|) by {worst:.3e}"
    assert float((diff > 0).float().mean()) < 0.3
    assert_close(out, hf_out, REL_TOL[torch.bfloat16], "forward vs HF")


def _assert_same_sequence(out, comp, name):
    """Forward vs the rms_norm + apply_rope composition: identical but for rare rstd-last-bit flips."""
    if out.dtype != torch.bfloat16:
        assert_close(out, comp, 1e-6, f"{name} vs rms_norm + apply_rope")
        return
    differ = out != comp
    ulps = (out.view(torch.int16).int() - comp.view(torch.int16).int()).abs()[differ]
    assert float(differ.float().mean()) < 1e-2 and (ulps.numel() == 0 or int(ulps.max()) <= 2), (
        f"{name} vs rms_norm + apply_rope: {int(differ.sum())} elements differ, max {ulps.max()} ulps")


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
        (cq, ck), comp_grads = _fwd_bwd(_composition(cos, sin), q, k, wq, wk, gq, gk)
    # the pure fp32 math on the same values
    (fq, fk), f_grads = _fwd_bwd(lambda *t: qk_norm_rope_ref(*t, EPS, cos, sin),
                                 q.float(), k.float(), wq.float(), wk.float(), gq.float(), gk.float())
    assert oq.dtype == dtype and oq.shape == q.shape and ok.shape == k.shape and oq.is_contiguous()
    with torch.no_grad():
        _assert_fwd_matches_hf(oq, hq_, nq(q), cos, sin)
        _assert_fwd_matches_hf(ok, hk_, nk(k), cos, sin)
    tol = REL_TOL[dtype]
    for name, out, comp, f32 in [("q_out", oq, cq, fq), ("k_out", ok, ck, fk)]:
        _assert_same_sequence(out, comp, name)
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
        assert torch.equal(leaves[1].grad, torch.zeros_like(k)) and torch.equal(leaves[3].grad, torch.zeros(64))
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
def test_cpu_reference_path(dtype, monkeypatch):
    """Plain CPU (interpreter off): the reference path, which the kernels match (same rounding sequence)."""
    (nq, nk), q, k, gq, gk, cos, sin = _setup(2, 11, 4, 2, 64, dtype, "cpu")
    wq, wk = nq.weight.detach(), nk.weight.detach()
    kernel = _fwd_bwd(_fused(cos, sin), q, k, wq, wk, gq, gk)  # interpreter (conftest) -> the Triton kernels
    monkeypatch.setenv("TRITON_INTERPRET", "0")
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


# ----------------------------------------------------------------------------------------------- GPU, real shapes
@pytest.mark.gpu
def test_real_shape_vs_hf_and_composition_gpu():
    """Qwen3-4B: q (1, 4096, 32, 128), k (1, 4096, 8, 128) bf16. Forward bit-identical to novatune's rms_norm +
    apply_rope except where rstd's last bit differs (rare one-ulp flips of n); HF within the elementwise bound."""
    (nq, nk), q, k, gq, gk, cos, sin = _setup(1, 4096, 32, 8, 128, torch.bfloat16, "cuda")
    wq, wk = nq.weight.detach(), nk.weight.detach()
    (oq, ok), grads = _fwd_bwd(_fused(cos, sin), q, k, wq, wk, gq, gk)
    (hq_, hk_), hf_grads = _fwd_bwd(_hf(cos, sin), q, k, wq, wk, gq, gk)
    (cq, ck), comp_grads = _fwd_bwd(_composition(cos, sin), q, k, wq, wk, gq, gk)
    with torch.no_grad():
        _assert_fwd_matches_hf(oq, hq_, nq(q), cos, sin)
        _assert_fwd_matches_hf(ok, hk_, nk(k), cos, sin)
    for name, out, comp in [("q_out", oq, cq), ("k_out", ok, ck)]:
        _assert_same_sequence(out, comp, name)
    for a, b, c in zip(grads, hf_grads, comp_grads):
        assert_close(a, b)
        assert_close(a, c)
