"""Packed-row attention backends against a dense masked fp64 oracle: forward, gradients, document isolation.

Tolerances (relative norm, novatune.measure.numerics): fp32 backends vs the fp64 oracle 1e-5 (reductions in another
order); bf16 inputs 1e-2 (the output and each gradient are rounded to bf16 once or twice, unit roundoff 3.9e-3).
GPU kernels in bf16 (FlashAttention-2, FlexAttention) keep P and dS in bf16 for the second matmul of each pass: 2e-2
for their gradients.
"""
import pytest
import torch

import novatune.ops
from novatune.attention import AUTO_ORDER, BackendUnavailable, PackedBatch, backends, last_choice, varlen_attention
from novatune.measure.numerics import assert_close

ROWS = [[5, 1, 1, 20, 3], [30], [2, 27, 1]]  # docs of length 1, a one-doc row, a last doc of length 1


def packed_of(rows, device="cpu"):
    pos = torch.tensor([[p for n in row for p in range(n)] for row in rows])
    return PackedBatch.from_position_ids(pos, device=device)


def make_qkv(T, hq, hk, d, dtype, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda h: torch.randn(T, h, d, generator=g).to(device=device, dtype=dtype).requires_grad_()  # noqa: E731
    return mk(hq), mk(hk), mk(hk)


def oracle(q, k, v, pb, scale=None, window=None, softcap=None):
    """Dense fp64 attention with the document-causal mask (and HF's sliding window: key j visible from query i iff
    j > i - window); GQA by indexing kv head h // G; `softcap`: scores -> cap * tanh(score / cap) (HF's order)."""
    q, k, v = (t.double() for t in (q, k, v))
    T, hq, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    head = torch.arange(hq, device=q.device) // (hq // k.shape[1])
    doc = torch.repeat_interleave(torch.arange(pb.num_docs), torch.tensor(pb.lengths)).to(q.device)
    i = torch.arange(T, device=q.device)
    allowed = (doc[:, None] == doc[None, :]) & (i[:, None] >= i[None, :])
    if window is not None:
        allowed &= i[None, :] > i[:, None] - window
    s = torch.einsum("ihd,jhd->hij", q, k[:, head]) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hij,jhd->ihd", p, v[:, head])


def check_fwd_bwd(backend, rows, hq, hk, d, dtype, device="cpu", tol=None, grad_tol=None, fn=None, window=None):
    pb = packed_of(rows, device)
    q, k, v = make_qkv(pb.total_tokens, hq, hk, d, dtype, device)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, pb) if fn else varlen_attention(q, k, v, pb, backend=backend, window=window)
    ref = oracle(q64, k64, v64, pb, window=window)
    assert out.shape == (pb.total_tokens, hq, d) and out.dtype == dtype
    assert_close(out, ref, tol, name=f"{backend} out")
    go = torch.randn_like(ref)
    (out.float() * go.to(out.device).float()).sum().backward()
    (ref * go).sum().backward()
    for name, a, b in (("dq", q, q64), ("dk", k, k64), ("dv", v, v64)):
        assert a.grad.dtype == dtype
        assert_close(a.grad, b.grad, grad_tol or tol, name=f"{backend} {name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [16, 64])
@pytest.mark.parametrize("hq,hk", [(4, 2), (3, 1)])
def test_reference_matches_dense_oracle(hq, hk, d, dtype):
    check_fwd_bwd("reference", ROWS, hq, hk, d, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hk", [(4, 2), (3, 1), (2, 2)])
def test_sdpa_docs_matches_dense_oracle(hq, hk, dtype):
    check_fwd_bwd("sdpa_docs", ROWS, hq, hk, 16, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_one_doc_rows_matches_reference(dtype):
    rows = [[24], [24], [24]]
    check_fwd_bwd("sdpa", rows, 4, 2, 16, dtype)
    pb = packed_of(rows)
    q, k, v = make_qkv(pb.total_tokens, 4, 2, 16, dtype, seed=1)
    assert_close(varlen_attention(q, k, v, pb, backend="sdpa"), varlen_attention(q, k, v, pb, backend="reference"))


@pytest.mark.parametrize("window", [1, 4, 7])
@pytest.mark.parametrize("backend", ["reference", "sdpa_docs"])
def test_sliding_window_matches_dense_oracle(backend, window):
    """Documents of 20, 27 and 30 tokens are longer than every window; fp32 and bf16, GQA."""
    for dtype in (torch.float32, torch.bfloat16):
        check_fwd_bwd(backend, ROWS, 4, 2, 16, dtype, window=window)


def test_sliding_window_changes_the_result_and_is_dropped_when_no_document_is_longer():
    pb = packed_of(ROWS)
    q, k, v = (t.detach() for t in make_qkv(pb.total_tokens, 4, 2, 16, torch.float32))
    full = varlen_attention(q, k, v, pb, backend="reference")
    assert (varlen_attention(q, k, v, pb, backend="reference", window=4) - full).abs().max() > 1e-2
    assert torch.equal(varlen_attention(q, k, v, pb, backend="reference", window=pb.max_seqlen), full)
    with pytest.raises(BackendUnavailable, match="sliding window"):
        varlen_attention(*(t[:48] for t in (q, k, v)), packed_of([[24], [24]]), backend="sdpa", window=5)
    varlen_attention(q, k, v, pb, window=5)
    assert last_choice().backend != "sdpa"


def test_window_is_normalised_once_per_call(monkeypatch):
    """One attention call (one layer) makes its window effective once, whatever number of backends `auto`
    asks; the public why_unavailable still normalises what it is given."""
    seen = []
    real = backends._effective_window
    monkeypatch.setattr(backends, "_effective_window", lambda w, pb: seen.append(w) or real(w, pb))
    pb = packed_of(ROWS)
    q, k, v = (t.detach() for t in make_qkv(pb.total_tokens, 4, 2, 16, torch.float32))
    varlen_attention(q, k, v, pb, window=5)
    assert seen == [5]
    seen.clear()
    varlen_attention(q, k, v, pb, backend="reference", window=5)
    assert seen == [5]
    with pytest.raises(ValueError, match=">= 1 key"):
        backends.why_unavailable("reference", q, k, pb, window=0)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_sliding_window_on_cpu():
    pb = packed_of(ROWS)
    q, k, v = (t.detach() for t in make_qkv(pb.total_tokens, 4, 2, 16, torch.float32))
    out = backends._flex(q, k, v, pb, 16 ** -0.5, window=5, compiled=False)
    assert_close(out, oracle(q, k, v, pb, window=5), name="flex(eager) windowed out")


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_blockmask_math_on_cpu():
    """The flex backend's layout, GQA mapping and document mask, run through eager (uncompiled) flex on the CPU
    (forward only: flex has no CPU backward); the compiled CUDA kernel and its gradients: the GPU test below."""
    pb = packed_of(ROWS)
    q, k, v = (t.detach() for t in make_qkv(pb.total_tokens, 4, 2, 16, torch.float32))
    out = backends._flex(q, k, v, pb, 16 ** -0.5, compiled=False)
    assert out.shape == q.shape
    assert_close(out, oracle(q, k, v, pb), name="flex(eager) out")


@pytest.mark.parametrize("backend", ["reference", "sdpa_docs"])
def test_documents_are_isolated(backend):
    """Changing every token of one document changes no other document's output, bit for bit."""
    pb = packed_of(ROWS)
    q, k, v = (t.detach() for t in make_qkv(pb.total_tokens, 4, 2, 16, torch.float32))
    base = varlen_attention(q, k, v, pb, backend=backend)
    a, b = pb.cu_seqlens_cpu[3].item(), pb.cu_seqlens_cpu[4].item()  # the 20-token document of row 0
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for t in (q2, k2, v2):
        t[a:b] = torch.randn_like(t[a:b])
    out = varlen_attention(q2, k2, v2, pb, backend=backend)
    assert torch.equal(out[:a], base[:a]) and torch.equal(out[b:], base[b:])
    assert not torch.equal(out[a:b], base[a:b])


def test_auto_on_cpu_records_the_choice():
    pb = packed_of(ROWS)
    q, k, v = make_qkv(pb.total_tokens, 4, 2, 16, torch.float32)
    out = novatune.ops.varlen_attention(q, k, v, pb)
    c = last_choice()
    assert c.backend == "sdpa_docs" and c.requested == "auto" and c.skipped[0][0] == "sdpa"
    assert_close(out, oracle(q, k, v, pb))
    one = packed_of([[30], [30], [30]])
    varlen_attention(q, k, v, one)
    assert last_choice().backend == "sdpa" and not last_choice().skipped


def test_auto_order_is_replaceable_and_failures_fall_back(monkeypatch):
    pb = packed_of(ROWS)
    q, k, v = (t.detach() for t in make_qkv(pb.total_tokens, 4, 2, 16, torch.float32))
    monkeypatch.setitem(AUTO_ORDER, "cpu", ["reference"])
    varlen_attention(q, k, v, pb)
    assert last_choice().backend == "reference"

    def broken(*a):
        raise RuntimeError("kernel exploded")

    monkeypatch.setitem(AUTO_ORDER, "cpu", ["sdpa_docs"])
    monkeypatch.setitem(backends._IMPLS, "sdpa_docs", broken)
    monkeypatch.setattr(backends, "_BROKEN", {})
    out = varlen_attention(q, k, v, pb)
    c = last_choice()
    assert c.backend == "reference" and "FELL BACK" in c.reason and "kernel exploded" in c.skipped[0][1]
    assert_close(out, oracle(q, k, v, pb))
    with pytest.raises(RuntimeError, match="exploded"):  # explicit: no silent fallback
        varlen_attention(q, k, v, pb, backend="sdpa_docs")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error path")
@pytest.mark.parametrize("backend", ["varlen", "flex"])
def test_explicit_gpu_backend_on_cpu_raises(backend):
    pb = packed_of(ROWS)
    q, k, v = make_qkv(pb.total_tokens, 4, 2, 16, torch.bfloat16)
    with pytest.raises(BackendUnavailable, match="CUDA"):
        varlen_attention(q, k, v, pb, backend=backend)


def test_explicit_sdpa_on_multi_doc_rows_and_bad_inputs_raise():
    pb = packed_of(ROWS)
    q, k, v = make_qkv(pb.total_tokens, 4, 2, 16, torch.float32)
    with pytest.raises(BackendUnavailable, match="several documents"):
        varlen_attention(q, k, v, pb, backend="sdpa")
    with pytest.raises(ValueError, match="unknown attention backend"):
        varlen_attention(q, k, v, pb, backend="fa3")
    with pytest.raises(ValueError, match="tokens"):
        varlen_attention(q[:-1], k[:-1], v[:-1], pb)
    with pytest.raises(ValueError, match="multiple"):
        varlen_attention(q[:, :3], k, v, pb)


@pytest.mark.parametrize("bad", ["k fp32 for bf16 q", "v bf16", "integer q", "k on meta"])
def test_malformed_inputs_raise_before_any_backend_and_mark_none_broken(bad, monkeypatch):
    """A malformed call under "auto" made the backend that rejected it (sdpa_docs) broken for the whole process,
    so every later valid call silently ran the slow reference. It now raises before a backend runs; the next
    valid call still takes sdpa_docs, nothing skipped but sdpa (several documents per row)."""
    monkeypatch.setattr(backends, "_BROKEN", {})
    pb = packed_of(ROWS)
    q, k, v = (t.detach() for t in make_qkv(pb.total_tokens, 4, 2, 16, torch.float32, seed=7))
    args = {"k fp32 for bf16 q": (q.bfloat16(), k, v), "v bf16": (q, k, v.bfloat16()),
            "integer q": (q.long(), k.long(), v.long()), "k on meta": (q, k.to("meta"), v)}[bad]
    with pytest.raises((TypeError, ValueError), match="dtype|device"):
        varlen_attention(*args, pb)
    assert not backends._BROKEN
    out = varlen_attention(q, k, v, pb)
    c = last_choice()
    assert c.backend == "sdpa_docs" and [n for n, _ in c.skipped] == ["sdpa"]
    assert_close(out, oracle(q, k, v, pb))


def test_autocast_casts_q_k_v_to_one_dtype_as_sdpa_does():
    """Under autocast q / k may come out of fp32-weight norms while v is bf16: cast to the autocast dtype first (as
    SDPA would), so the call runs rather than raising the mixed-dtype error."""
    pb = packed_of(ROWS)
    q, k, v = (t.detach() for t in make_qkv(pb.total_tokens, 4, 2, 16, torch.float32, seed=8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = varlen_attention(q, k, v.bfloat16(), pb)
    assert out.dtype == torch.bfloat16 and last_choice().backend == "sdpa_docs"
    assert_close(out, oracle(q, k, v, pb), 1e-2)


# ---------------------------------------------------------------------------------------------------- GPU
GPU_ROWS = [[700, 300, 1200, 50, 900, 646, 300]]  # 4096 tokens, 7 documents


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 257])
@pytest.mark.parametrize("backend", ["varlen", "flex"])
def test_gpu_backend_matches_reference(backend, window):
    pb = packed_of(GPU_ROWS, "cuda")
    q, k, v = make_qkv(pb.total_tokens, 32, 8, 128, torch.bfloat16, "cuda")
    out = varlen_attention(q, k, v, pb, backend=backend, window=window)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = varlen_attention(qf, kf, vf, pb, backend="reference", window=window)  # fp32 math, same bf16 values
    assert_close(out, ref, 1e-2, name=f"{backend} out")
    go = torch.randn_like(ref)
    (out.float() * go).sum().backward()
    (ref * go).sum().backward()
    for name, a, b in (("dq", q, qf), ("dk", k, kf), ("dv", v, vf)):
        assert_close(a.grad, b.grad, 2e-2, name=f"{backend} {name}")
    print(last_choice())


@pytest.mark.gpu
def test_gpu_auto_and_sdpa_one_doc():
    pb = packed_of(GPU_ROWS, "cuda")
    q, k, v = make_qkv(pb.total_tokens, 32, 8, 128, torch.bfloat16, "cuda")
    out = varlen_attention(q, k, v, pb)
    assert last_choice().backend in ("fa4", "flash", "varlen", "flex"), last_choice()
    assert_close(out, varlen_attention(q.float(), k.float(), v.float(), pb, backend="reference"), 1e-2)
    one = packed_of([[2048], [2048]], "cuda")
    out = varlen_attention(q, k, v, one)
    assert last_choice().backend == "sdpa"
    assert_close(out, varlen_attention(q.float(), k.float(), v.float(), one, backend="reference"), 1e-2)
