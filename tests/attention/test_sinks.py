"""Attention sinks over packed rows (novatune/attention/sinks.py) against autograd through GPT-OSS's own formula
(the sink appended as a score column, dropped after the softmax), one document at a time, in fp32.

The reference backward starts from NaN-filled gradient buffers, so a token it misses fails the comparison.
The oracle and the implementation share no code: the oracle is reference/attention.py's appended-column softmax
with autograd; the implementation is plain attention + log-sum-exp, out * sigmoid(L - s) and the hand-derived
backward (FlashAttention's backward fed d_out = c g and out' = out * c).

Tolerances (relative norm): fp32 inputs 1e-5 (the same math in another order: logsumexp then exp instead of a
softmax over n + 1 columns); bf16 inputs 1e-2 for out, dq, dk, dv (each rounded to bf16 once or twice: unit
roundoff 3.9e-3), 2e-2 for the sinks' gradient (a sum over every token of products of bf16-rounded g and out').
The CUDA path (FlashAttention-2 in bf16 keeps P and dS in bf16 for its second matmuls) gets 2e-2 on every gradient.
"""
import pytest
import torch

from novatune.attention import BackendUnavailable, PackedBatch, last_choice, sink_attention, varlen_attention
from novatune.measure.numerics import assert_close
from novatune.reference.attention import attention_sinks_ref

ROWS = [[5, 1, 1, 20, 3], [30], [2, 27, 1]]  # documents of length 1, a one-document row, documents past the window


def packed_of(rows, device="cpu"):
    pos = torch.tensor([[p for n in row for p in range(n)] for row in rows])
    return PackedBatch.from_position_ids(pos, device=device)


def inputs(pb, hq, hk, d, dtype, device="cpu", seed=0, sink_scale=2.0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    q, k, v = mk(pb.total_tokens, hq, d), mk(pb.total_tokens, hk, d), mk(pb.total_tokens, hk, d)
    # sinks from -4 to +4: some heads barely use the sink, some send most of the mass to it
    sinks = sink_scale * mk(hq)
    return [t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v, sinks)]


def check(fn, rows, hq, hk, d, dtype, window=None, device="cpu", tol=None, grad_tol=None, sink_tol=None, seed=0):
    pb = packed_of(rows, device)
    q, k, v, s = inputs(pb, hq, hk, d, dtype, device, seed)
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v, s)]
    out = fn(q, k, v, s, pb, window)
    ref = attention_sinks_ref(*ref_in[:3], ref_in[3], pb, window)
    assert out.shape == (pb.total_tokens, hq, d) and out.dtype == dtype
    assert_close(out, ref, tol, name="out")
    go = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    (out.float() * go).sum().backward()
    (ref * go).sum().backward()
    for name, a, b, t in (("dq", q, ref_in[0], grad_tol), ("dk", k, ref_in[1], grad_tol),
                          ("dv", v, ref_in[2], grad_tol), ("dsinks", s, ref_in[3], sink_tol or grad_tol)):
        assert a.grad.dtype == dtype, name
        assert_close(a.grad, b.grad, t, name=name)
    return out


def via_dispatch(backend):
    return lambda q, k, v, s, pb, window: varlen_attention(q, k, v, pb, backend=backend, window=window, sinks=s)


@pytest.mark.parametrize("window", [None, 4, 7])
@pytest.mark.parametrize("hq,hk", [(4, 2), (3, 1), (2, 2)])
def test_sinks_fp32_match_appended_column_formula(hq, hk, window):
    check(via_dispatch("reference"), ROWS, hq, hk, 16, torch.float32, window=window)


@pytest.mark.parametrize("window", [None, 5])
def test_sinks_bf16(window):
    check(via_dispatch("reference"), ROWS, 4, 2, 16, torch.bfloat16, window=window, sink_tol=2e-2)


def test_sinks_change_the_result_and_their_gradient_is_not_zero():
    pb = packed_of(ROWS)
    q, k, v, s = inputs(pb, 4, 2, 16, torch.float32)
    plain = varlen_attention(q, k, v, pb, backend="reference")
    sunk = varlen_attention(q, k, v, pb, backend="reference", sinks=s)
    assert (plain - sunk).abs().max() > 1e-2
    sunk.sum().backward()
    assert bool((s.grad.abs() > 0).all())
    # a sink of -inf is no sink at all
    none = varlen_attention(q, k, v, pb, backend="reference", sinks=torch.full_like(s, float("-inf")))
    assert_close(none, plain, 1e-6, name="sink -inf")


def test_sinks_keep_documents_apart():
    """Changing one document's tokens changes no output or gradient outside that document."""
    pb = packed_of([[9, 14, 6]])
    q, k, v, s = (t.detach() for t in inputs(pb, 4, 2, 8, torch.float32))
    base = varlen_attention(q, k, v, pb, backend="reference", sinks=s, window=5)
    k2, v2 = k.clone(), v.clone()
    k2[9:23] += 3.0
    v2[9:23] -= 2.0
    moved = varlen_attention(q, k2, v2, pb, backend="reference", sinks=s, window=5)
    assert torch.equal(base[:9], moved[:9]) and torch.equal(base[23:], moved[23:])
    assert (base[9:23] - moved[9:23]).abs().max() > 1e-3


def test_backends_without_sinks_refuse_or_are_skipped():
    pb = packed_of(ROWS)
    q, k, v, s = (t.detach() for t in inputs(pb, 4, 2, 16, torch.float32))
    for name in ("sdpa_docs", "flex", "sdpa"):
        with pytest.raises(BackendUnavailable, match="sink"):
            varlen_attention(q, k, v, pb, backend=name, sinks=s)
    out = varlen_attention(q, k, v, pb, sinks=s)  # auto on the CPU: sdpa and sdpa_docs skipped, reference runs
    choice = last_choice()
    assert choice.backend == "reference" and "sinks" in choice.detail
    assert any(n == "sdpa_docs" and "sinks" in why for n, why in choice.skipped)
    assert_close(out, attention_sinks_ref(q, k, v, s, pb), 1e-5, name="auto out")
    with pytest.raises(ValueError, match="one logit per query head"):
        varlen_attention(q, k, v, pb, backend="reference", sinks=s[:3])


def test_flash_is_refused_off_cuda_with_a_reason():
    pb = packed_of(ROWS)
    q, k, v, s = (t.detach() for t in inputs(pb, 4, 2, 16, torch.float32))
    with pytest.raises(BackendUnavailable, match="CUDA"):
        varlen_attention(q, k, v, pb, backend="varlen", sinks=s)
    with pytest.raises(ValueError, match="implementation"):
        sink_attention(q, k, v, s, pb, 0.25, impl="nope")


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 6, 128])
@pytest.mark.parametrize("hq,hk,d", [(8, 2, 64), (4, 4, 128)])
def test_sinks_flash_cuda_vs_fp32_reference(hq, hk, d, window):
    """The CUDA path (aten FlashAttention-2 + log-sum-exp) in bf16 against the fp32 oracle, documents longer and
    shorter than the window, GQA; a 4097-token row as well."""
    rows = [[5, 1, 1, 200, 33, 60], [300], [2, 270, 1, 27]] if window != 128 else [[4097]]  # equal-length rows
    out = check(via_dispatch("varlen"), rows, hq, hk, d, torch.bfloat16, window=window, device="cuda",
                grad_tol=2e-2, sink_tol=2e-2)
    assert last_choice().backend == "varlen"
    assert torch.isfinite(out).all()


def test_flash_glue_with_a_cpu_stand_in_for_the_aten_ops(monkeypatch):
    """The CUDA path's plumbing on the CPU: aten's FlashAttention ops replaced by a stand-in with their contract
    (tests/attention/test_flash.py: varlen over cu_seqlens, log-sum-exp laid out (hq, tokens), causal or a
    (left, right) window, the backward taking out and the log-sum-exp back), built from the reference math. What is
    checked is the glue: the window translation, the log-sum-exp layout both ways, and that the backward receives
    the sunk output."""
    from novatune.attention import flash as F
    from tests.attention.test_flash import flash_stand_in

    seen = {}
    monkeypatch.setattr(F, "_aten", flash_stand_in(seen))
    for window in (None, 6):
        out = check(lambda q, k, v, s, pb_, w: sink_attention(q, k, v, s, pb_, 16 ** -0.5, w, impl="flash"),
                    ROWS, 4, 2, 16, torch.float32, window=window)
        assert torch.equal(seen["out"], out.detach()), "the backward must see the sunk output"


def test_double_backward_raises_instead_of_being_wrong():
    """The backward reads the sunk output and log-sum-exp saved from the forward: a second-order gradient missed
    their dependence (dq 38% off, dk 67%, silently). The Function is once-differentiable."""
    pb = packed_of([[3, 2], [5]])
    q, k, v, s = inputs(pb, 2, 2, 4, torch.float32, seed=9)
    out = sink_attention(q, k, v, s, pb, 0.5)
    grads = torch.autograd.grad(out, (q, k, v, s), torch.randn(out.shape).requires_grad_(), create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        sum((g * g).sum() for g in grads).backward()
