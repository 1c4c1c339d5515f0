"""Attention logit soft-capping (Gemma 2: scores -> cap * tanh(scores / cap) after the scale, before the mask) in
the backends that can apply it, against a dense fp64 oracle written as HF's eager attention computes it.

Tolerances as tests/attention/test_backends.py: fp32 vs fp64 1e-5 (summation order only); bf16 GPU kernels 1e-2
forward, 2e-2 gradients (P and dS kept in bf16 for the second matmul of each pass)."""
import pytest
import torch
from test_backends import oracle as document_oracle

from novatune.attention import BackendUnavailable, PackedBatch, backends, last_choice, varlen_attention
from novatune.measure.numerics import assert_close

ROWS = [[5, 1, 19, 3], [28]]
CAP = 2.0  # small enough that most scores of these inputs are capped (the test would notice a dropped cap)


def packed_of(rows, device="cpu"):
    pos = torch.tensor([[p for n in row for p in range(n)] for row in rows])
    return PackedBatch.from_position_ids(pos, device=device)


def qkv(T, hq=4, hk=2, d=16, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple((3 * torch.randn(T, h, d, generator=g)).to(device=device, dtype=dtype).requires_grad_()
                 for h in (hq, hk, hk))


def oracle(q, k, v, pb, scale, cap, window=None):
    return document_oracle(q, k, v, pb, scale, window, softcap=cap)


@pytest.mark.parametrize("window", [None, 6])
def test_reference_backend_soft_caps_forward_and_gradients(window):
    pb = packed_of(ROWS)
    q, k, v = qkv(pb.total_tokens)
    scale = 0.3
    out = varlen_attention(q, k, v, pb, scale=scale, window=window, softcap=CAP)
    assert last_choice().backend == "reference" and "soft-capping" in last_choice().detail
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = oracle(q64, k64, v64, pb, scale, CAP, window)
    assert_close(out, ref, 1e-5, "out")
    uncapped = varlen_attention(q, k, v, pb, scale=scale, window=window)
    assert (uncapped - out).abs().max() > 1e-2, "the cap must change these scores, or the test proves nothing"
    go = torch.randn_like(ref)
    (out * go).sum().backward()
    (ref * go).sum().backward()
    for name, a, b in (("dq", q, q64), ("dk", k, k64), ("dv", v, v64)):
        assert_close(a.grad, b.grad, 1e-5, name)


def test_auto_on_cpu_skips_backends_that_cannot_cap_and_says_why():
    pb = packed_of(ROWS)
    q, k, v = qkv(pb.total_tokens)
    varlen_attention(q, k, v, pb, softcap=CAP)
    choice = last_choice()
    assert choice.backend == "reference"
    assert dict(choice.skipped)["sdpa_docs"].startswith("the sdpa_docs backend cannot soft-cap")


@pytest.mark.parametrize("backend", ["sdpa_docs", "sdpa", "varlen"])
def test_explicit_backend_that_cannot_cap_raises(backend):
    pb = packed_of(ROWS)
    q, k, v = qkv(pb.total_tokens)
    with pytest.raises(BackendUnavailable, match="soft-cap"):
        varlen_attention(q, k, v, pb, backend=backend, softcap=CAP)
    with pytest.raises(ValueError, match="softcap must be a positive"):
        varlen_attention(q, k, v, pb, softcap=0.0)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [None, 6])
def test_flex_score_mod_soft_caps_on_cpu(window):
    """flex's layout with the soft-cap score_mod, through eager flex on the CPU (forward only); the compiled CUDA
    kernel and its gradients: the GPU test below."""
    pb = packed_of(ROWS)
    q, k, v = (t.detach() for t in qkv(pb.total_tokens))
    out = backends._flex(q, k, v, pb, 0.3, window=window, compiled=False, softcap=CAP)
    assert_close(out, oracle(q, k, v, pb, 0.3, CAP, window), 1e-5, "flex(eager) capped out")


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 257])
def test_gpu_flex_soft_cap_matches_reference(window, monkeypatch):
    """Gemma 2's shapes: 8 query / 4 kv heads of 256, cap 50, scale 256^-0.5, bf16. (A backend an earlier test
    broke is forgotten first: this test sees flex's own outcome and, if it falls back, why.)"""
    monkeypatch.setattr(backends, "_BROKEN", {})
    pb = packed_of([[700, 300, 1200, 50, 900, 646, 300]], "cuda")
    q, k, v = qkv(pb.total_tokens, 8, 4, 256, torch.bfloat16, "cuda")
    out = varlen_attention(q, k, v, pb, scale=256 ** -0.5, window=window, softcap=50.0)
    assert last_choice().backend == "flex", "; ".join(f"{n}: {why}" for n, why in last_choice().skipped)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = varlen_attention(qf, kf, vf, pb, scale=256 ** -0.5, backend="reference", window=window, softcap=50.0)
    assert_close(out, ref, 1e-2, "flex capped out")
    go = torch.randn_like(ref)
    (out.float() * go).sum().backward()
    (ref * go).sum().backward()
    for name, a, b in (("dq", q, qf), ("dk", k, kf), ("dv", v, vf)):
        assert_close(a.grad, b.grad, 2e-2, name)
