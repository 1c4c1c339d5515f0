"""The "flash" attention backend (novatune/attention/flash.py): aten's FlashAttention-2 ops from a plain autograd
Function, the same kernels and arguments as torch's varlen_attn without its custom-op wrapper.

On the CPU a stand-in for the two aten ops (their contract, computed by the fp32 reference math of sinks.py) checks
the glue: window translation, the log-sum-exp layout both ways, the same cu_seqlens tensor for q and k, a
contiguous d_out, the forward's own out and log-sum-exp handed to the backward; values and gradients against the
independent oracle (reference/attention.py), fp32 (1e-5: the same math in another order). On the GPU the backend
is compared with torch's varlen_attn, which runs the same kernels: outputs and gradients bit for bit.
"""
from types import SimpleNamespace

import pytest
import torch

from novatune.attention import PackedBatch, last_choice, varlen_attention
from novatune.attention import flash as F
from novatune.attention import sinks as S
from novatune.measure.numerics import assert_close

ROWS = [[5, 1, 1, 20, 3], [30], [2, 27, 1]]  # length-1 documents, a one-document row, documents past a window


def packed_of(rows, device="cpu"):
    pos = torch.tensor([[p for n in row for p in range(n)] for row in rows])
    return PackedBatch.from_position_ids(pos, device=device)


def flash_stand_in(seen: dict):
    """aten._flash_attention_forward / _backward on the CPU, with the contract flash.py relies on."""

    def window_of(is_causal, left, right):
        assert right == 0 and (is_causal == (left == -1)), (is_causal, left, right)
        return None if is_causal else left + 1

    def docs(cu):
        return PackedBatch.from_cu_seqlens(cu.tolist())

    def fwd(q, k, v, cu_q, cu_k, max_q, max_k, dropout, is_causal, debug, *, scale, window_size_left,
            window_size_right):
        pb = docs(cu_q)
        assert cu_q is cu_k and cu_q.dtype == torch.int32 and dropout == 0.0 and not debug
        assert max_q == max_k and max_q >= pb.max_seqlen
        out, lse = S._reference_fwd(q, k, v, pb, scale, window_of(is_causal, window_size_left, window_size_right))
        seen["lse"] = lse.t().contiguous()  # (hq, tokens), as FlashAttention-2's varlen forward lays it out
        seen["fwd_out"] = out
        return out, seen["lse"], torch.zeros(2), torch.empty(0), torch.empty(0)

    def bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout, is_causal, rng, unused, *, scale,
            window_size_left, window_size_right):
        assert lse.shape == (q.shape[1], q.shape[0]) and lse.is_contiguous() and dout.is_contiguous()
        assert cu_q is cu_k and dropout == 0.0
        seen["out"], seen["bwd_lse"] = out, lse
        return S._reference_bwd(dout, q, k, v, out, lse.t(), docs(cu_q), scale,
                                window_of(is_causal, window_size_left, window_size_right))

    return SimpleNamespace(_flash_attention_forward=fwd, _flash_attention_backward=bwd)


def oracle(q, k, v, pb, scale, window):
    """fp32 autograd oracle: per document, masked softmax over the keys j <= i with i - j < window, GQA by
    repeating K/V to the query heads (shares no code with the stand-in's reference math)."""
    hq, hk = q.shape[1], k.shape[1]
    outs, a = [], 0
    for n in pb.host_lengths():
        qd = q[a:a + n].transpose(0, 1)
        kd = k[a:a + n].transpose(0, 1).repeat_interleave(hq // hk, 0)
        vd = v[a:a + n].transpose(0, 1).repeat_interleave(hq // hk, 0)
        i = torch.arange(n, device=q.device)
        seen = (i[:, None] >= i[None, :]) & ((i[:, None] - i[None, :] < window) if window else True)
        s = (qd @ kd.transpose(1, 2) * scale).masked_fill(~seen, float("-inf"))
        outs.append((torch.softmax(s, -1) @ vd).transpose(0, 1))
        a += n
    return torch.cat(outs, 0)


def _inputs(pb, hq, hk, d, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(pb.total_tokens, h, d, generator=g).to(device=device, dtype=dtype).requires_grad_()
            for h in (hq, hk, hk)]


@pytest.mark.parametrize("window", [None, 4, 7])
@pytest.mark.parametrize("hq,hk", [(4, 2), (3, 3)])
def test_flash_glue_against_the_oracle_with_a_cpu_stand_in(monkeypatch, window, hq, hk):
    seen = {}
    monkeypatch.setattr(F, "_aten", flash_stand_in(seen))
    pb = packed_of(ROWS)
    q, k, v = _inputs(pb, hq, hk, 16, torch.float32, "cpu", seed=hq + (window or 0))
    scale = 0.3
    out = F.flash_attention(q, k, v, pb, scale, window)
    ref_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = oracle(*ref_in, pb, scale, window)
    assert_close(out, ref, 1e-5, name="out")
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    (out * go).sum().backward()
    (ref * go).sum().backward()
    for name, a, b in (("dq", q, ref_in[0]), ("dk", k, ref_in[1]), ("dv", v, ref_in[2])):
        assert_close(a.grad, b.grad, 1e-5, name=name)
    # the backward receives the forward's own output and log-sum-exp buffers, not copies
    assert seen["out"].data_ptr() == seen["fwd_out"].data_ptr()
    assert seen["bwd_lse"].data_ptr() == seen["lse"].data_ptr()


def test_flash_refuses_a_second_order_gradient(monkeypatch):
    monkeypatch.setattr(F, "_aten", flash_stand_in({}))
    pb = packed_of([[3, 2], [5]])
    q, k, v = _inputs(pb, 2, 2, 8, torch.float32, "cpu", seed=3)
    out = F.flash_attention(q, k, v, pb, 0.5)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn(out.shape).requires_grad_(), create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        sum((g * g).sum() for g in grads).backward()


def test_the_flash_backend_says_why_it_cannot_run_on_the_cpu():
    pb = packed_of([[4, 4]])
    q, k, v = _inputs(pb, 2, 1, 8, torch.float32, "cpu", seed=1)
    with pytest.raises(Exception, match="flash.*unavailable"):
        varlen_attention(q, k, v, pb, backend="flash")
    varlen_attention(q, k, v, pb)  # auto never picks it on the CPU
    assert last_choice().backend != "flash"


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("hq,hk,d", [(8, 2, 64), (4, 4, 128)])
def test_flash_equals_torch_varlen_bit_for_bit_on_cuda(window, hq, hk, d):
    """The same kernels with the same arguments as torch's varlen_attn: equal outputs and gradients, in bf16, on
    packed rows with documents longer and shorter than the window, GQA; through the dispatcher."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pb = packed_of([[5, 1, 1, 200, 33, 60], [300], [2, 270, 1, 27]], device="cuda")
    results = {}
    # FlashAttention-2's backward adds dq up with atomics unless deterministic algorithms are on (aten hands the
    # flag to the kernel): with it, two calls of the same kernels are bit for bit repeatable
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for backend in ("varlen", "flash"):
            q, k, v = _inputs(pb, hq, hk, d, torch.bfloat16, "cuda", seed=11)
            out = varlen_attention(q, k, v, pb, backend=backend, window=window)
            assert last_choice().backend == backend
            out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to("cuda", out.dtype))
            results[backend] = (out.detach(), q.grad, k.grad, v.grad)
    finally:
        torch.use_deterministic_algorithms(before)
    for name, a, b in zip(("out", "dq", "dk", "dv"), results["varlen"], results["flash"], strict=True):
        assert torch.equal(a, b), name
    ref_q, ref_k, ref_v = (t.detach().float() for t in _inputs(pb, hq, hk, d, torch.bfloat16, "cuda", seed=11))
    assert_close(results["flash"][0], oracle(ref_q, ref_k, ref_v, pb, d ** -0.5, window), 2e-2, name="out")
