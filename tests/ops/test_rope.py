"""novatune.ops.apply_rope: custom ops, autograd, and parity with HF's apply_rotary_pos_emb on packed rows.

Tables come from transformers' Qwen3RotaryEmbedding with position_ids that restart mid-row (packed documents),
cast to the activation dtype exactly as HF does, so the reference and HF see the same cos/sin values.

Tolerances (relative norm over the tensor):
* vs the fp32 reference: fp32 1e-6 (two products and a sum); bf16 3e-3 (novatune rounds once from fp32:
  ~1.1e-3 expected); 6e-3 under the Triton interpreter, which truncates fp32 -> bf16 instead of rounding to
  nearest (measured 3.5e-3; see tests/kernels/test_rope.py).
* vs HF eager: fp32 1e-6 (same formula, same order up to the sign placement); bf16 1e-2 (HF rounds
  q*cos, rotate_half(q)*sin and their sum to bf16, three roundings, ~2e-3; the bound is REL_TOL[bf16]).
* grads: HF's autograd of the same formula; the backward is again one rounding for novatune.
"""
import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

from novatune.measure.numerics import assert_close
from novatune.ops._backend import interpreter_on
from novatune.ops.rope import apply_rope, rope_bwd, rope_fwd
from novatune.reference.rope import rope_ref

TOL_REF = {torch.float32: 1e-6, torch.bfloat16: 6e-3 if interpreter_on() else 3e-3}
TOL_HF = {torch.float32: 1e-6, torch.bfloat16: 1e-2}


def _tables(b, s, d, dtype, device):
    """HF's cos/sin for packed rows: positions restart at every document boundary."""
    cfg = Qwen3Config(hidden_size=4 * d, num_attention_heads=4, num_key_value_heads=2, head_dim=d,
                      rope_parameters={"rope_type": "default", "rope_theta": 5e6})
    rotary = Qwen3RotaryEmbedding(cfg).to(device)
    rows = []
    for r in range(b):
        cuts = sorted({0, min(s, 7 + 3 * r), min(s, s // 2 + r + 1), s})   # up to 3 documents, per-row cuts
        rows.append(torch.cat([torch.arange(e - a) for a, e in zip(cuts[:-1], cuts[1:])]))
    pos = torch.stack(rows).to(device)   # (b, s): 0, 1, .., 0, 1, .., 0, 1, ..
    return rotary(torch.zeros(1, device=device, dtype=dtype), pos)


def _inputs(b, hq, hk, s, d, dtype, u, device):
    shape = (lambda h: (b, h, s, d)) if u == 1 else (lambda h: (b, s, h, d))
    q = torch.randn(shape(hq), device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(shape(hk), device=device, dtype=dtype, requires_grad=True)
    cos, sin = _tables(b, s, d, dtype, device)
    return q, k, cos, sin


def _grads(fn, q, k, cos, sin, u, gq, gk):
    q.grad = k.grad = None
    oq, ok = fn(q, k, cos, sin, u)
    torch.autograd.backward([oq, ok], [gq, gk])
    return oq.detach(), ok.detach(), q.grad.clone(), k.grad.clone()


@pytest.mark.parametrize("b,hq,hk,s,d,dtype,u", [
    (2, 4, 2, 37, 64, torch.bfloat16, 1),
    (1, 3, 1, 37, 128, torch.float32, 2),
    (2, 3, 1, 37, 128, torch.bfloat16, 2),
])
def test_packed_vs_hf_and_ref(b, hq, hk, s, d, dtype, u, device):
    torch.manual_seed(0)
    q, k, cos, sin = _inputs(b, hq, hk, s, d, dtype, u, device)
    if u == 2:
        assert cos.shape == (b, s, d)
    gq = torch.randn(q.shape, device=device, dtype=dtype)
    gk = torch.randn(k.shape, device=device, dtype=dtype)
    nq, nk, ndq, ndk = _grads(apply_rope, q, k, cos, sin, u, gq, gk)
    hq_, hk_, hdq, hdk = _grads(apply_rotary_pos_emb, q, k, cos, sin, u, gq, gk)
    rq, rk = rope_ref(q.detach(), k.detach(), cos, sin, u)
    # fp32 reference grads: autograd through rope_ref in fp32
    qf, kf = q.detach().float().requires_grad_(), k.detach().float().requires_grad_()
    _, _, rdq, rdk = _grads(rope_ref, qf, kf, cos, sin, u, gq.float(), gk.float())
    assert nq.dtype == dtype and nq.shape == q.shape and nk.shape == k.shape
    for name, out, ref, hf in [("q", nq, rq, hq_), ("k", nk, rk, hk_), ("dq", ndq, rdq, hdq), ("dk", ndk, rdk, hdk)]:
        assert_close(out, ref, TOL_REF[dtype], f"{name} vs fp32 reference")
        assert_close(out, hf, TOL_HF[dtype], f"{name} vs HF apply_rotary_pos_emb")


def test_transposed_view_and_layouts_agree(device):
    """A (b, s, h, d) projection output passed as HF's transposed view (u=1) gives the same numbers as u=2."""
    torch.manual_seed(0)
    b, s, hq, hk, d = 1, 19, 4, 2, 64
    cos, sin = _tables(b, s, d, torch.bfloat16, device)
    q = torch.randn(b, s, hq, d, device=device, dtype=torch.bfloat16)
    k = torch.randn(b, s, hk, d, device=device, dtype=torch.bfloat16)
    a_q, a_k = apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin, 1)
    b_q, b_k = apply_rope(q, k, cos, sin, 2)
    assert torch.equal(a_q.transpose(1, 2), b_q) and torch.equal(a_k.transpose(1, 2), b_k)
    h_q, _ = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin, 1)
    assert_close(a_q, h_q, TOL_HF[torch.bfloat16])
    assert a_q.stride() == torch.empty_like(q.transpose(1, 2)).stride()


def test_unused_output_grad(device):
    """Only q_embed reaches the loss: k still gets a (zero) gradient and q's is right."""
    torch.manual_seed(0)
    q, k, cos, sin = _inputs(1, 2, 1, 5, 64, torch.float32, 1, device)
    oq, _ = apply_rope(q, k, cos, sin)
    oq.sum().backward()
    _, _, rdq, _ = _grads(rope_ref, q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_(),
                          cos, sin, 1, torch.ones_like(oq), torch.zeros_like(k))
    assert_close(q.grad, rdq, TOL_REF[torch.float32])
    assert k.grad is None or not k.grad.any()


def test_reference_backend(reference_backend):
    """CPU without the interpreter (NOVATUNE_BACKEND=reference forces it): fp32 math cast to the input dtype."""
    reference_backend()
    torch.manual_seed(0)
    q, k, cos, sin = _inputs(2, 4, 2, 9, 64, torch.bfloat16, 2, "cpu")
    oq, ok = apply_rope(q, k, cos, sin, 2)
    rq, rk = rope_ref(q.detach(), k.detach(), cos, sin, 2)
    assert torch.equal(oq, rq.to(torch.bfloat16)) and torch.equal(ok, rk.to(torch.bfloat16))
    (oq.float().sum() + ok.float().square().sum()).backward()
    assert q.grad.dtype == torch.bfloat16 and torch.isfinite(k.grad.float()).all()


@pytest.mark.parametrize("u", [1, 2])
def test_opcheck(u, device):
    torch.manual_seed(0)
    q, k, cos, sin = _inputs(1, 2, 1, 3, 8, torch.float32, u, device)
    torch.library.opcheck(rope_fwd, (q, k, cos, sin, u))
    gq, gk = torch.randn(q.shape, device=device), torch.randn(k.shape, device=device)
    torch.library.opcheck(rope_bwd, (gq, gk, cos, sin, u))


@pytest.mark.parametrize("dtype,u", [(torch.float32, 2), (torch.bfloat16, 1)])
def test_partial_rotary_vs_phi3(dtype, u, device):
    """Phi-4-mini's partial rotary (3/4 of head_dim) through the public op: values and gradients against
    transformers' Phi-3 apply_rotary_pos_emb and the fp32 reference, tables from Phi3RotaryEmbedding on packed
    positions; the registered op passes opcheck on the narrow tables."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_rope

    torch.manual_seed(0)
    b, hq, hk, s, d = 2, 3, 1, 21, 32
    cfg = Phi3Config(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hk,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75})
    pos = torch.cat([torch.arange(8), torch.arange(13)]).expand(b, s).to(device)
    cos, sin = Phi3RotaryEmbedding(cfg).to(device)(torch.zeros(1, device=device, dtype=dtype), pos)
    assert cos.shape == (b, s, 24)
    shape = (lambda h: (b, h, s, d)) if u == 1 else (lambda h: (b, s, h, d))
    q = torch.randn(shape(hq), device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(shape(hk), device=device, dtype=dtype, requires_grad=True)
    gq, gk = torch.randn(q.shape, device=device, dtype=dtype), torch.randn(k.shape, device=device, dtype=dtype)
    nq, nk, ndq, ndk = _grads(apply_rope, q, k, cos, sin, u, gq, gk)
    hq_, hk_, hdq, hdk = _grads(phi3_rope, q, k, cos, sin, u, gq, gk)
    rq, rk = rope_ref(q.detach(), k.detach(), cos, sin, u)
    for name, out, ref, hf in [("q", nq, rq, hq_), ("k", nk, rk, hk_)]:
        assert_close(out, ref, TOL_REF[dtype], f"{name} vs fp32 reference")
        assert_close(out, hf, TOL_HF[dtype], f"{name} vs Phi-3's apply_rotary_pos_emb")
    assert_close(ndq, hdq, TOL_HF[dtype], "dq")
    assert_close(ndk, hdk, TOL_HF[dtype], "dk")
    torch.library.opcheck(rope_fwd, (q.detach(), k.detach(), cos, sin, u))


def test_cos_sin_get_no_grad(device):
    """Documented: cos/sin receive no gradient (HF builds them under no_grad)."""
    q, k, cos, sin = _inputs(1, 2, 1, 3, 8, torch.float32, 1, device)
    cos = cos.clone().requires_grad_(True)
    oq, ok = apply_rope(q, k, cos, sin)
    (oq.sum() + ok.sum()).backward()
    assert cos.grad is None and q.grad is not None


@pytest.mark.parametrize("path", ["cpu", "interpreter"])
def test_bad_args(path, backend_env):
    """One shape contract on both paths: the references would broadcast a table of one position over every token,
    or a batch of tables over one row, where the kernels refuse."""
    backend_env("TRITON_INTERPRET", "1" if path == "interpreter" else "0")
    q, k = torch.randn(1, 2, 4, 64), torch.randn(1, 1, 4, 64)
    with pytest.raises(ValueError, match="rotary dim"):
        apply_rope(q, k, torch.ones(1, 4, 33), torch.ones(1, 4, 33))
    with pytest.raises(ValueError, match="rotary dim"):
        apply_rope(q, k, torch.ones(1, 4, 66), torch.ones(1, 4, 66))
    with pytest.raises(ValueError):
        apply_rope(q, k, torch.ones(1, 4, 64), torch.ones(1, 4, 64), unsqueeze_dim=0)
    with pytest.raises(ValueError, match="cos/sin must be"):  # one position's table for 4 tokens
        apply_rope(q, k, torch.ones(1, 1, 64), torch.ones(1, 1, 64))
    with pytest.raises(ValueError, match="cos/sin must be"):  # 3 rows of tables for 1 row
        apply_rope(q, k, torch.ones(3, 4, 64), torch.ones(3, 4, 64))
    with pytest.raises(ValueError, match="disagree"):
        apply_rope(q, k[:, :, :3], torch.ones(1, 4, 64), torch.ones(1, 4, 64))
    for d in (9, 258):
        with pytest.raises(ValueError, match="even and <= 256"):
            apply_rope(torch.randn(1, 2, 4, d), torch.randn(1, 1, 4, d), torch.ones(1, 4, d), torch.ones(1, 4, d))


@pytest.mark.parametrize("path", ["cpu", "interpreter"])
def test_integer_inputs_are_refused(path, backend_env):
    """Integer q / k were rotated and truncated; also after a float call of the same shapes (the argument check is
    cached per shapes and dtypes)."""
    backend_env("TRITON_INTERPRET", "1" if path == "interpreter" else "0")
    q, k, cos, sin = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8), torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    apply_rope(q, k, cos, sin)
    with pytest.raises(TypeError, match="apply_rope: q, k, cos and sin must be floating point"):
        apply_rope(q.long(), k.long(), cos, sin)
    with pytest.raises(TypeError, match="floating point"):
        apply_rope(q, k, cos.long(), sin.long())


# ---------------------------------------------------------------- eager fast path vs the registered op
def _op_path(q, k, cos, sin, u):
    """The registered op with its registered autograd: what torch.compile traces."""
    return torch.ops.novatune.rope_fwd(q, k, cos, sin, u)


@pytest.mark.parametrize("backend", ["default", "reference"])
@pytest.mark.parametrize("b,hq,hk,s,d,dtype,u", [
    (2, 4, 2, 13, 64, torch.bfloat16, 1),
    (1, 3, 1, 13, 128, torch.float32, 2),
])
def test_eager_function_and_registered_op_agree(b, hq, hk, s, d, dtype, u, backend, device, reference_backend):
    """apply_rope in eager runs the autograd.Function (not the custom op's dispatch) and gives the registered op's
    numbers exactly: outputs and grads, both on the Triton path and on the fp32-reference path."""
    if backend == "reference":
        reference_backend()
        device = "cpu"
    torch.manual_seed(0)
    q, k, cos, sin = _inputs(b, hq, hk, s, d, dtype, u, device)
    gq = torch.randn(q.shape, device=device, dtype=dtype)
    gk = torch.randn(k.shape, device=device, dtype=dtype)
    oq, _ = apply_rope(q, k, cos, sin, u)
    assert type(oq.grad_fn).__name__ == "_RopeFunctionBackward"   # the fast path, not the custom op
    eager = _grads(apply_rope, q, k, cos, sin, u, gq, gk)
    op = _grads(_op_path, q, k, cos, sin, u, gq, gk)
    for name, a, c in zip(("q_embed", "k_embed", "dq", "dk"), eager, op):
        assert a.dtype == c.dtype and a.stride() == c.stride(), name
        assert torch.equal(a, c), name
    # only q_embed reaches the loss: both paths give k a zero (or no) gradient and q the same one
    dqs = []
    for fn in (apply_rope, _op_path):
        q.grad = k.grad = None
        fn(q, k, cos, sin, u)[0].float().square().sum().backward()
        assert k.grad is None or not k.grad.any()
        dqs.append(q.grad)
    assert torch.equal(*dqs)


def test_eager_path_needs_input_grad(device):
    """k frozen (no grad): the Function returns no gradient for it; q's is unchanged."""
    torch.manual_seed(0)
    q, k, cos, sin = _inputs(1, 2, 1, 5, 64, torch.float32, 1, device)
    k = k.detach()
    oq, ok = apply_rope(q, k, cos, sin)
    (oq.sum() + ok.sum()).backward()
    assert k.grad is None and q.grad is not None


def test_torch_compile_traces_registered_op(device):
    """Under torch.compile apply_rope emits the registered op (fake impl + registered autograd); aot_eager keeps
    the test fast. Values equal the eager path's."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    torch.manual_seed(0)
    q, k, cos, sin = _inputs(1, 2, 1, 9, 64, torch.float32, 1, device)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(apply_rope, backend=counter, fullgraph=True)
    gq, gk = torch.randn(q.shape, device=device), torch.randn(k.shape, device=device)
    got = _grads(compiled, q, k, cos, sin, 1, gq, gk)
    want = _grads(apply_rope, q, k, cos, sin, 1, gq, gk)
    targets = [str(n.target) for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert any("novatune.rope_fwd" in t for t in targets), targets
    for a, c in zip(got, want):
        assert torch.equal(a, c)


# ---------------------------------------------------------------- GPU: real shapes (Qwen3-4B, packed 4096)
@pytest.mark.gpu
@pytest.mark.parametrize("u", [1, 2])
def test_real_shapes_vs_hf_gpu(u):
    torch.manual_seed(0)
    q, k, cos, sin = _inputs(1, 32, 8, 4096, 128, torch.bfloat16, u, "cuda")
    gq, gk = torch.randn(q.shape, device="cuda", dtype=q.dtype), torch.randn(k.shape, device="cuda", dtype=k.dtype)
    nq, nk, ndq, ndk = _grads(apply_rope, q, k, cos, sin, u, gq, gk)
    hq_, hk_, hdq, hdk = _grads(apply_rotary_pos_emb, q, k, cos, sin, u, gq, gk)
    rq, rk = rope_ref(q.detach(), k.detach(), cos, sin, u)
    for out, ref, hf in [(nq, rq, hq_), (nk, rk, hk_)]:
        assert_close(out, ref, TOL_REF[torch.bfloat16])
        assert_close(out, hf, TOL_HF[torch.bfloat16])
    assert_close(ndq, hdq, TOL_HF[torch.bfloat16])
    assert_close(ndk, hdk, TOL_HF[torch.bfloat16])
