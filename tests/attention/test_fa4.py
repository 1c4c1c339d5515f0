"""The fa4 attention backend (novatune/attention/fa4.py): why it refuses, its glue to flash-attn-4's varlen entry
point, the backward's verdict, and on a GPU its values against the fp32 reference.

CPU: `flash_attn_varlen_func` is replaced by a stand-in with its contract (varlen q/k/v, cu_seqlens for queries and
keys, a longest-document bound, causal + (left, right) window, GQA with separate head counts, returns (out, lse)),
built from the reference backend with torch autograd. What is checked is the glue: the one offsets tensor, the
bound, the scale, the window as FlashAttention's (window - 1, 0). Values against the reference: 1e-6 (fp32 both).

GPU (-m gpu; skipped, saying why, where the package is absent): bf16 at the headline shapes (GQA 32/8, head_dim
128, 4096-token rows with odd document lengths, 1-token documents included) against the fp32 reference from the
same bf16 values: 1e-2 on the output (one bf16 rounding), 2e-2 on each gradient (P and dS in bf16 for the second
matmul of each pass, as in FlashAttention-2: the other GPU attention tests use the same bounds).
"""
from types import SimpleNamespace

import pytest
import torch
from test_cudnn import GPU_ROWS, ROWS, _poison_allocator, forward_keeps_documents_apart, make_qkv, packed_of

from novatune.attention import BackendUnavailable, PackedBatch, backends, last_choice, varlen_attention, why_unavailable
from novatune.attention import fa4 as F
from novatune.attention.self_check import CHECK_WINDOW
from novatune.measure.numerics import assert_close

REAL_BACKWARD_WHY_NOT = F.backward_why_not


@pytest.fixture(autouse=True)
def fresh_verdicts():
    F.gradient_self_check.cache_clear()
    F._DIRECT.clear()
    yield
    F.gradient_self_check.cache_clear()
    F._DIRECT.clear()


def stand_in(seen, dq_factor=1.0):
    """flash_attn_varlen_func on the CPU: its contract, the values of the reference backend (dq scaled by
    `dq_factor`, to play a wrong backward)."""

    class ScaleDq(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q):
            return q.view_as(q)

        @staticmethod
        def backward(ctx, g):
            return g * dq_factor

    def flash_attn_varlen_func(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                               causal, window_size):
        assert cu_seqlens_q is cu_seqlens_k and max_seqlen_q == max_seqlen_k and causal
        assert cu_seqlens_q.dtype == torch.int32
        pb = PackedBatch.from_cu_seqlens(cu_seqlens_q.cpu())
        assert max_seqlen_q >= pb.max_seqlen
        left, right = window_size
        assert right in (None, 0)
        seen["calls"] = seen.get("calls", 0) + 1
        seen.update(max=max_seqlen_q, scale=softmax_scale, window=window_size, hk=k.shape[1])
        out = varlen_attention(ScaleDq.apply(q), k, v, pb, scale=softmax_scale, backend="reference",
                               window=None if left is None else left + 1)
        return out, torch.zeros(q.shape[1], q.shape[0])

    return flash_attn_varlen_func


def use_stand_in(monkeypatch, seen, dq_factor=1.0, version="9.9.9"):
    """The public entry point only (a version outside FAST_FORWARD)."""
    monkeypatch.setattr(F, "_package", lambda: (stand_in(seen, dq_factor), version, "", None))


def as_if_on(monkeypatch, capability=(9, 0)):
    """fa4_why_not's device questions answered as on a CUDA GPU of this capability (the tensors stay on the CPU)."""
    monkeypatch.setattr(F, "_capability", lambda device: capability)
    monkeypatch.setattr(F.torch.cuda, "is_current_stream_capturing", lambda: False)


def cuda_like(t):
    return SimpleNamespace(device=torch.device("cuda", 0), dtype=t.dtype, shape=t.shape, requires_grad=t.requires_grad)


# --------------------------------------------------------------------------------------------------------- glue
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("hq,hk", [(4, 2), (3, 3)])
def test_glue_against_the_reference(monkeypatch, window, hq, hk):
    seen = {}
    use_stand_in(monkeypatch, seen)
    pb = packed_of(ROWS)
    q, k, v = make_qkv(pb.total_tokens, hq, hk, 16, torch.float32)
    scale = 0.3
    out = F.fa4_attention(q, k, v, pb, scale, window)
    assert seen["max"] == pb.max_seqlen and seen["scale"] == scale and seen["hk"] == hk
    assert seen["window"] == ((None, None) if window is None else (window - 1, 0))
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = varlen_attention(qr, kr, vr, pb, scale=scale, backend="reference", window=window)
    assert_close(out, ref, 1e-6, name="out")
    go = torch.randn_like(ref)
    out.backward(go)
    ref.backward(go)
    for name, a, b in (("dq", q, qr), ("dk", k, kr), ("dv", v, vr)):
        assert_close(a.grad, b.grad, 1e-6, name=name)


@pytest.mark.parametrize("path", ["public", "direct"])
def test_a_patched_model_runs_attention_fa4(monkeypatch, path):
    """patch(model, attention="fa4") reaches this backend from the model's own attention forward (q, k, v views of
    its projections, GQA 4/2): the same loss and gradients as attention="reference" in fp32, through the package's
    public entry point or (a FAST_FORWARD version) the recorded and directly called forward, three steps."""
    import sys
    from pathlib import Path

    import novatune

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "patch"))
    from tiny_models import packed_batch, tiny_model

    seen, fake = {}, FakeInterface()
    if path == "public":
        use_stand_in(monkeypatch, seen)
    else:
        use_fake_interface(monkeypatch, fake)
        monkeypatch.setattr(F, "_MIN_PACKED_ROWS", 1)
    monkeypatch.setattr(backends, "fa4_why_not", lambda *a: None)
    ids, pos, lab = packed_batch([[13, 1, 30], [44]])
    results = {}
    for attention in ("fa4", "reference"):
        model = tiny_model("qwen3")
        rep = novatune.patch(model, attention=attention)
        for _ in range(3):
            model.zero_grad()
            loss = model(input_ids=ids, position_ids=pos, labels=lab, use_cache=False).loss
            assert last_choice().backend == attention  # (the stand-in's backward runs the reference backend)
            loss.backward()
            results.setdefault(attention, []).append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        rep.revert()
    if path == "public":
        assert seen["calls"] >= 1 and seen["hk"] == 2
    else:
        assert "called directly in 1 configuration(s)" in F.fa4_detail(), F.fa4_detail()
    for (got_loss, got), (want_loss, want) in zip(results["fa4"], results["reference"]):
        assert_close(got_loss, want_loss, 1e-5, name="loss")
        for g, w in zip(got, want):
            assert_close(g, w, 1e-4, name="grad")


# ------------------------------------------------------------------------------- the direct compiled forward
class FakeInterface:
    """flash_attn.cute.interface as the backend uses it on a FAST_FORWARD version: `_flash_attn_fwd` looks its
    compiled kernel up in `_flash_attn_fwd.compile_cache` (compiling on a miss) and calls it with the tensors and
    settings in the package's order; the kernel writes the reference attention into `out` (and the log-sum-exp);
    `_flash_attn_bwd` returns the reference gradients. `extra`: another tensor the kernel takes (a scheduler aid);
    `drift`: what a direct call adds to its output (a kernel whose replay differs)."""

    AUX = object()

    def __init__(self, extra=None, drift=0.0):
        self.extra, self.drift, self.calls, self.kernel_calls, self.in_package = extra, drift, 0, 0, False

        def _flash_attn_fwd(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                            causal, window_size_left, window_size_right, return_lse):
            assert cu_seqlens_q is cu_seqlens_k and max_seqlen_q == max_seqlen_k and causal and window_size_right in (
                None, 0) and not q.requires_grad
            self.calls += 1
            key = (q.dtype, q.shape[1:], k.shape[1:], window_size_left, return_lse)
            cache = _flash_attn_fwd.compile_cache
            if key not in cache:
                cache[key] = self.kernel
            out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype)
            lse = torch.empty(q.shape[1], q.shape[0]) if return_lse else None
            self.in_package = True
            cache[key](q, k, v, out, lse, softmax_scale, cu_seqlens_q, cu_seqlens_k, None, None, None,
                       window_size_left, window_size_right, None, None, self.AUX, self.extra, None)
            self.in_package = False
            return out, lse, None, None, None

        _flash_attn_fwd.compile_cache = {}
        self._flash_attn_fwd = _flash_attn_fwd

    def kernel(self, q, k, v, out, lse, scale, cu, cu_k, su_q, su_k, pages, wl, wr, sink, sparse, aux, extra, _):
        assert cu is cu_k and aux is self.AUX and (extra is None or extra is self.extra)
        self.kernel_calls += 1
        pb = PackedBatch.from_cu_seqlens(cu.cpu())
        ref = varlen_attention(q, k, v, pb, scale=scale, backend="reference", window=None if wl is None else wl + 1)
        out.copy_(ref + (0.0 if self.in_package else self.drift))
        if lse is not None:
            lse.fill_(0.5)

    def _flash_attn_bwd(self, q, k, v, out, dout, lse, scale, causal, softcap, *, window_size_left,
                        window_size_right, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        assert causal and softcap == 0.0 and cu_seqlens_q is cu_seqlens_k and lse is not None
        assert bool((lse == 0.5).all())  # the log-sum-exp this forward wrote, saved for the backward
        pb = PackedBatch.from_cu_seqlens(cu_seqlens_q.cpu())
        w = None if window_size_left is None else window_size_left + 1
        assert_close(out, varlen_attention(q, k, v, pb, scale=scale, backend="reference", window=w), 1e-6,
                     name="the saved output")
        qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
        w = None if window_size_left is None else window_size_left + 1
        with torch.enable_grad():  # a backward runs with gradients off
            ref = varlen_attention(qr, kr, vr, pb, scale=scale, backend="reference", window=w)
            return torch.autograd.grad(ref, (qr, kr, vr), dout)


def use_fake_interface(monkeypatch, fake, version=F.FAST_FORWARD[0]):
    monkeypatch.setattr(F, "_package", lambda: (stand_in({}), version, "", fake))
    monkeypatch.setattr(F, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(F, "_MIN_PACKED_ROWS", 8)


def test_the_compiled_forward_is_recorded_checked_then_called_directly(monkeypatch):
    fake = FakeInterface()
    use_fake_interface(monkeypatch, fake)
    pb = packed_of(ROWS)
    q, k, v = make_qkv(pb.total_tokens, 4, 2, 16, torch.float32)
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = varlen_attention(qr, kr, vr, pb, scale=0.25, backend="reference")
    go = torch.randn_like(ref)
    ref.backward(go)
    package_calls = []
    for step in range(3):
        for t in (q, k, v):
            t.grad = None
        out = F.fa4_attention(q, k, v, pb, 0.25)
        package_calls.append(fake.calls)
        assert_close(out, ref, 1e-6, name=f"out, call {step}")
        out.backward(go)
        for name, a, b in (("dq", q, qr), ("dk", k, kr), ("dv", v, vr)):
            assert_close(a.grad, b.grad, 1e-6, name=f"{name}, call {step}")
    # call 1: the package (recorded); call 2: direct, then the package once more to compare; call 3: direct only
    assert package_calls == [1, 2, 2] and fake.kernel_calls == 4
    assert type(fake._flash_attn_fwd.compile_cache) is dict  # the recorder is gone
    assert "called directly in 1 configuration(s)" in F.fa4_detail(), F.fa4_detail()
    with torch.no_grad():  # no log-sum-exp wanted: another configuration, recorded on its own
        F.fa4_attention(q, k, v, pb, 0.25)
    assert fake.calls == 3


def test_batches_the_package_treats_differently_take_its_path(monkeypatch):
    fake = FakeInterface()
    use_fake_interface(monkeypatch, fake)
    monkeypatch.setattr(F, "_MAX_DOCS", 3)  # ROWS holds 9 documents
    pb = packed_of(ROWS)
    q, k, v = (t.detach() for t in make_qkv(pb.total_tokens, 4, 2, 16, torch.float32))
    for _ in range(3):
        F.fa4_attention(q, k, v, pb, 0.25)
    assert fake.calls == 3 and not F._DIRECT
    monkeypatch.setattr(F, "_MAX_DOCS", 256)
    monkeypatch.setattr(F, "_MIN_PACKED_ROWS", 2 * pb.max_seqlen)  # the longest document's rows fit one tile
    F.fa4_attention(q, k, v, pb, 0.25)
    assert fake.calls == 4 and not F._DIRECT
    monkeypatch.setattr(F, "_MIN_PACKED_ROWS", 8)
    monkeypatch.setattr(F, "_capability", lambda device: (10, 0))  # Blackwell passes per-batch scalars: not replayed
    F.fa4_attention(q, k, v, pb, 0.25)
    assert fake.calls == 5 and not F._DIRECT


def test_a_recording_that_raises_leaves_the_package_as_it_was(monkeypatch):
    fake = FakeInterface()
    use_fake_interface(monkeypatch, fake)

    def broken(*args):
        raise RuntimeError("no kernel for this configuration")

    fake.kernel = broken
    pb = packed_of(ROWS)
    q, k, v = (t.detach() for t in make_qkv(pb.total_tokens, 4, 2, 16, torch.float32))
    with pytest.raises(RuntimeError, match="no kernel"):
        F.fa4_attention(q, k, v, pb, 0.25)
    assert type(fake._flash_attn_fwd.compile_cache) is dict and not F._DIRECT


def test_aliased_inputs_are_never_replayed(monkeypatch):
    """k and v one tensor in the recorded call: a later call with two tensors could not be told apart."""
    fake = FakeInterface()
    use_fake_interface(monkeypatch, fake)
    pb = packed_of(ROWS)
    q, k, v = (t.detach() for t in make_qkv(pb.total_tokens, 4, 2, 16, torch.float32))
    for _ in range(3):
        assert_close(F.fa4_attention(q, k, k, pb, 0.25),
                     varlen_attention(q, k, k, pb, scale=0.25, backend="reference"), 1e-6, name="out")
    assert fake.calls == 3 and "one tensor is k and v" in F.fa4_detail(), F.fa4_detail()


@pytest.mark.parametrize("case", ["extra tensor", "replay differs"])
def test_a_configuration_that_cannot_be_replayed_stays_on_the_package_path(monkeypatch, case):
    fake = FakeInterface(extra=torch.zeros(7)) if case == "extra tensor" else FakeInterface(drift=1.0)
    use_fake_interface(monkeypatch, fake)
    pb = packed_of(ROWS)
    q, k, v = (t.detach() for t in make_qkv(pb.total_tokens, 4, 2, 16, torch.float32))
    ref = varlen_attention(q, k, v, pb, scale=0.25, backend="reference")
    for _ in range(3):
        assert_close(F.fa4_attention(q, k, v, pb, 0.25), ref, 1e-6, name="out")
    why = F.fa4_detail()
    assert "called directly in 0 configuration(s)" in why, why
    assert ("not q, k, v, out or lse" if case == "extra tensor" else "differed from the package's own call") in why


# ---------------------------------------------------------------------------------------------------- refusals
def test_why_unavailable_names_each_reason(monkeypatch):
    pb = packed_of(ROWS)
    q, k, _ = make_qkv(pb.total_tokens, 4, 2, 64, torch.bfloat16)
    assert "CUDA-only" in why_unavailable("fa4", q, k, pb)
    as_if_on(monkeypatch, (8, 0))
    assert "sm80" in F.fa4_why_not(cuda_like(q), cuda_like(k), pb, None)
    as_if_on(monkeypatch, (9, 0))
    monkeypatch.setattr(F, "_package", lambda: (None, "", "flash-attn-4 is not usable (ModuleNotFoundError: x)", None))
    why = F.fa4_why_not(cuda_like(q), cuda_like(k), pb, None)
    assert "ModuleNotFoundError" in why and "pip install flash-attn-4" in why and "backend='flash'" in why, why
    use_stand_in(monkeypatch, {})
    monkeypatch.setattr(F, "backward_why_not", lambda q, k, window=None: None)
    assert F.fa4_why_not(cuda_like(q), cuda_like(k), pb, None) is None
    assert F.fa4_why_not(cuda_like(q), cuda_like(k), pb, 128) is None  # a window is the kernel's own
    q32, k32, _ = make_qkv(pb.total_tokens, 4, 2, 64, torch.float32)
    assert "fp16/bf16" in F.fa4_why_not(cuda_like(q32), cuda_like(k32), pb, None)
    for d in (16, 48, 288):  # below the validated sizes (16: measured wrong gradients), not a multiple of 32, above
        qd, kd, _ = make_qkv(pb.total_tokens, 4, 2, d, torch.bfloat16)
        assert f"head_dim {d}" in F.fa4_why_not(cuda_like(qd), cuda_like(kd), pb, None)
    static = PackedBatch.graph_static(pb.cu_seqlens, pb.max_seqlen, pb.batch, pb.seq_len)
    assert "graph capture" in F.fa4_why_not(cuda_like(q), cuda_like(k), static, None)


def test_soft_capping_and_sinks_are_refused():
    pb = packed_of(ROWS)
    q, k, _ = make_qkv(pb.total_tokens, 4, 2, 16, torch.bfloat16)
    assert "cannot soft-cap" in why_unavailable("fa4", q, k, pb, softcap=True)
    assert "cannot add attention sinks" in why_unavailable("fa4", q, k, pb, sinks=True)


# ------------------------------------------------------------------------------------- the backward's verdict
def test_a_measured_stack_decides_without_a_check(monkeypatch):
    seen = {}
    use_stand_in(monkeypatch, seen, version="4.0.0b36")
    as_if_on(monkeypatch, (9, 0))
    q, k, _ = make_qkv(40, 4, 2, 16, torch.bfloat16)
    key = ("4.0.0b36", (9, 0), 16, torch.bfloat16, True, False)  # version, GPU, head_dim, dtype, GQA, window
    monkeypatch.setattr(F, "MEASURED_BACKWARD", {key: "a wrong dk (relative error 3.1)"})
    why = F.backward_why_not(cuda_like(q), cuda_like(k))
    assert "flash-attn-4 4.0.0b36, sm90, head_dim 16, bfloat16" in why and "relative error 3.1" in why, why
    assert "backend='flash'" in why, why
    monkeypatch.setattr(F, "MEASURED_BACKWARD", {key: None})
    assert F.backward_why_not(cuda_like(q), cuda_like(k)) is None
    assert "calls" not in seen and F.gradient_self_check.cache_info().currsize == 0  # no check ran


def test_an_unmeasured_stack_checks_its_gradients_once(monkeypatch):
    seen = {}
    use_stand_in(monkeypatch, seen)
    as_if_on(monkeypatch)
    q, k, _ = make_qkv(40, 4, 2, 16, torch.float32)  # CPU tensors: the check runs on their device
    assert F.backward_why_not(q, k) is None
    assert seen["calls"] == 1 and seen["hk"] == 2
    assert F.backward_why_not(q, k) is None and seen["calls"] == 1  # cached for the process
    use_stand_in(monkeypatch, seen, version="9.9.10")  # another package version checks again
    assert F.backward_why_not(q, k) is None and seen["calls"] == 2
    assert F.backward_why_not(q, k, window=512) is None and seen["calls"] == 3  # a window: its own kernel, checked
    assert seen["window"] == (CHECK_WINDOW - 1, 0)  # with a window shorter than the check's longest documents
    q2, k2, _ = make_qkv(40, 4, 4, 16, torch.float32)  # no grouped heads: another kernel, checked
    assert F.backward_why_not(q2, k2) is None and seen["calls"] == 4


def test_a_gradient_for_v_alone_is_checked_too(monkeypatch):
    """fa4_why_not sees q and k only: a call where only v wants a gradient is checked inside the backend."""
    use_stand_in(monkeypatch, {}, dq_factor=1.5, version="9.9.9")
    monkeypatch.setattr(F, "backward_why_not", lambda q, k, window=None: "its gradient self-check measured dq 0.5")
    pb = packed_of(ROWS)
    q, k, v = (t.detach() for t in make_qkv(pb.total_tokens, 4, 2, 64, torch.float32))
    with torch.no_grad():
        F.fa4_attention(q, k, v.requires_grad_(), pb, 0.25)  # no gradient wanted: nothing to check
    with pytest.raises(RuntimeError, match="dq 0.5"):
        F.fa4_attention(q, k, v, pb, 0.25)


def test_a_wrong_gradient_is_refused_with_the_measured_error(monkeypatch):
    pb = packed_of(ROWS)
    use_stand_in(monkeypatch, {}, dq_factor=1.5)
    as_if_on(monkeypatch)
    q, k, v = make_qkv(pb.total_tokens, 4, 2, 16, torch.float32)
    why = F.backward_why_not(q, k)
    assert "(flash-attn-4 9.9.9, sm90, head_dim 16, float32) does not match the fp32 reference" in why, why
    assert "dq relative error 0.5 (limit 0.02)" in why and "train with backend='flash'" in why, why
    # through the backend choice (bf16, as a model calls it): the same refusal; forward-only calls still run
    monkeypatch.setattr(backends, "fa4_why_not",
                        lambda q, k, packed, window: F.fa4_why_not(cuda_like(q), cuda_like(k), packed, window))
    monkeypatch.setattr(F, "gradient_self_check", lambda *a: "its gradient self-check measured dq relative error 0.5")
    qb, kb, vb = make_qkv(pb.total_tokens, 4, 2, 64, torch.bfloat16)
    with pytest.raises(BackendUnavailable, match="dq relative error 0.5"):
        varlen_attention(qb, kb, vb, pb, backend="fa4")
    with torch.no_grad():
        assert why_unavailable("fa4", qb, kb, pb) is None


def test_a_check_that_raises_refuses_with_the_error(monkeypatch):
    def broken(*a, **kw):
        raise RuntimeError("DSLRuntimeError: no kernel for this config")

    monkeypatch.setattr(F, "_package", lambda: (broken, "9.9.9", "", None))
    as_if_on(monkeypatch)
    q, k, _ = make_qkv(40, 4, 2, 16, torch.float32)
    assert "self-check raised RuntimeError: DSLRuntimeError" in F.backward_why_not(q, k)


# ---------------------------------------------------------------------------------------------------------- GPU
def _gpu_or_skip():
    fn, _, missing, _ = F._package()
    if fn is None:  # the package travels separately (its CUDA runtime is large): say what went untested
        pytest.skip(f"flash-attn-4 unavailable here: {missing}")
    major = torch.cuda.get_device_capability()[0]
    if major not in F.CAPABILITIES:
        pytest.skip(f"sm{major}x: FlashAttention-4's own kernels target {F.CAPABILITIES}")


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 512])
def test_gpu_fa4_matches_the_fp32_reference(window):
    """Three training calls of one configuration: the package's path (recorded), the direct call checked against the
    package's, the direct call alone: each output and gradient against the fp32 reference."""
    _gpu_or_skip()
    pb = packed_of(GPU_ROWS, "cuda")
    q, k, v = make_qkv(pb.total_tokens, 32, 8, 128, torch.bfloat16, "cuda")
    assert why_unavailable("fa4", q, k, pb, window) is None, why_unavailable("fa4", q, k, pb, window)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = varlen_attention(qf, kf, vf, pb, backend="reference", window=window)  # fp32 math on the same bf16 values
    go = torch.randn_like(ref)
    (ref * go).sum().backward()
    for call in range(3):
        for t in (q, k, v):
            t.grad = None
        _poison_allocator(q, q, k, v)
        out = varlen_attention(q, k, v, pb, backend="fa4", window=window)
        assert last_choice().backend == "fa4" and "GQA native" in last_choice().detail, last_choice()
        assert_close(out, ref, 1e-2, name=f"fa4 out, call {call}")
        _poison_allocator(q, k, v)
        (out.float() * go).sum().backward()
        for name, a, b in (("dq", q, qf), ("dk", k, kf), ("dv", v, vf)):
            assert torch.isfinite(a.grad).all(), name
            assert_close(a.grad, b.grad, 2e-2, name=f"fa4 {name}, call {call}")
    if F._package()[1] in F.FAST_FORWARD:
        assert "called directly in" in last_choice().detail and "in 0 configuration" not in last_choice().detail, (
            last_choice().detail)


@pytest.mark.gpu
def test_gpu_direct_forward_is_the_package_forward_bit_for_bit():
    _gpu_or_skip()
    if F._package()[1] not in F.FAST_FORWARD:
        pytest.skip(f"flash-attn-4 {F._package()[1]} is not in FAST_FORWARD: its public path runs")
    pb = packed_of(GPU_ROWS, "cuda")
    q, k, v = (t.detach() for t in make_qkv(pb.total_tokens, 32, 8, 128, torch.bfloat16, "cuda"))
    fn = F._package()[0]
    want = fn(q, k, v, cu_seqlens_q=pb.cu_seqlens, cu_seqlens_k=pb.cu_seqlens, max_seqlen_q=pb.max_seqlen,
              max_seqlen_k=pb.max_seqlen, softmax_scale=128 ** -0.5, causal=True)[0]
    with torch.no_grad():
        for _ in range(3):
            _poison_allocator(want)
            assert torch.equal(F.fa4_attention(q, k, v, pb, 128 ** -0.5), want)
    assert any(isinstance(d, F._Direct) and d.checked for d in F._DIRECT.values()), F._DIRECT


@pytest.mark.gpu
def test_gpu_fa4_keeps_documents_apart():
    """Changing one document's q, k and v changes no other document's output, bit for bit (the forward has no
    atomics); a gradient given to one document's outputs only reaches that document's q, k and v, and one given to
    every other output never reaches it: exactly zero there (the backward adds dK, dV and dQ with atomics, so
    gradients are compared by where they are zero, not bit for bit between runs)."""
    _gpu_or_skip()
    pb, q, k, v, a, b = forward_keeps_documents_apart("fa4")
    inside = torch.zeros(pb.total_tokens, 1, 1, dtype=torch.bool, device="cuda")
    inside[a:b] = True
    go = torch.randn_like(q)
    for given, silent in ((inside, ~inside), (~inside, inside)):
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        varlen_attention(qg, kg, vg, pb, backend="fa4").backward(go * given)
        for name, t in (("dq", qg), ("dk", kg), ("dv", vg)):
            assert not torch.any(t.grad * silent), f"{name} reached tokens outside the document given a gradient"
            assert torch.any(t.grad * given), name


@pytest.mark.gpu
def test_gpu_gradient_self_check_passes_and_auto_takes_fa4(monkeypatch):
    _gpu_or_skip()
    monkeypatch.setattr(F, "MEASURED_BACKWARD", {})
    pb = packed_of(GPU_ROWS, "cuda")
    q, k, v = make_qkv(pb.total_tokens, 32, 8, 128, torch.bfloat16, "cuda")
    assert F.backward_why_not(q, k) is None and F.backward_why_not(q, k, window=512) is None
    assert F.gradient_self_check.cache_info().currsize == 2  # the real check ran, with and without a window
    monkeypatch.setitem(backends.AUTO_ORDER, "cuda", ["fa4", "flash"])
    out = varlen_attention(q, k, v, pb)
    assert last_choice().backend == "fa4", last_choice()
    out.float().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
