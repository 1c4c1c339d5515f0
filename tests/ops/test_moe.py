"""novatune.ops.moe: routing, the expert sort, grouped GEMMs and the expert MLP against fp32 references and against
Hugging Face's own router and experts modules.

Tolerances (relative-norm error against the fp32 per-expert oracle):
* fp32: grouped GEMMs and the fp32 combine differ from the oracle in summation order only -> 1e-5.
* bf16: the op rounds h, the activation, y and the output to bf16 as stock does (4 chained roundings of 2^-9
  each, plus bf16 GEMM operands) -> 2e-2 for outputs and gradients (measured ~5e-3).
Routing is compared bit for bit (the same torch calls as stock, ties included).
"""
import pytest
import torch
import transformers

from novatune.measure.numerics import assert_close
from novatune.ops import moe as M
from novatune.ops._backend import interpreter_on
from novatune.ops.moe_routing import route
from novatune.reference import moe as R

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _tied_inputs(t, e, h, seed):
    """x and a router weight whose experts 1 and 3 have identical rows: their logits tie exactly for every token."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen)
    w = torch.randn(e, h, generator=gen)
    w[3] = w[1]
    return x, w


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_moe_no_norm", "mixtral", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_route_equals_hf_routers_bit_for_bit_with_ties(family, dtype):
    e, k, h = 7, 3, 16
    if family.startswith("qwen3_moe"):
        cfg = transformers.Qwen3MoeConfig(hidden_size=h, num_experts=e, num_experts_per_tok=k,
                                          norm_topk_prob=family == "qwen3_moe")
        router = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(cfg)
        kw = dict(scoring="softmax_topk", renormalize=cfg.norm_topk_prob)
    elif family == "mixtral":
        cfg = transformers.MixtralConfig(hidden_size=h, num_local_experts=e, num_experts_per_tok=k)
        router = transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter(cfg)
        kw = dict(scoring="softmax_topk", renormalize=True, weights_dtype=torch.float32)
    else:
        cfg = transformers.GptOssConfig(hidden_size=h, num_local_experts=e, num_experts_per_tok=k)
        router = transformers.models.gpt_oss.modeling_gpt_oss.GptOssTopKRouter(cfg)
        kw = dict(scoring="topk_softmax", softmax_fp32=False)
    x, w = _tied_inputs(11, e, h, 0)
    with torch.no_grad():
        router.weight.copy_(w)
        if family == "gpt_oss":
            router.bias.zero_()
    router, x = router.to(dtype), x.to(dtype)
    logits, ref_w, ref_ids = router(x)
    got_w, got_ids = route(logits, k, **kw)
    assert torch.equal(got_ids, ref_ids) and got_w.dtype == ref_w.dtype and torch.equal(got_w, ref_w)
    oracle_w, oracle_ids = R.route_ref(logits, k, **kw)
    assert torch.equal(got_ids, oracle_ids) and torch.equal(got_w, oracle_w)


ROUTE_RECIPES = {"qwen3_moe": dict(renormalize=True), "qwen3_moe_no_norm": dict(),
                 "mixtral": dict(renormalize=True, weights_dtype=torch.float32),
                 "gpt_oss": dict(scoring="topk_softmax", softmax_fp32=False),
                 "topk_softmax_fp32": dict(scoring="topk_softmax")}


@pytest.mark.parametrize("recipe", sorted(ROUTE_RECIPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t,e,k", [(13, 7, 3), (5, 128, 8), (1, 3, 1)], ids=lambda v: str(v))
def test_route_trains_through_its_one_kernel_backward(t, e, k, dtype, recipe, device):
    """route with a gradient (the one-kernel backward): the same weights and ids as the plain recipe bit for bit,
    and the logits' gradient of autograd through it in fp32 (bf16: one rounding of the output and of dw, the
    bf16 softmax of GPT-OSS's recipe -> 1e-2)."""
    kw = ROUTE_RECIPES[recipe]
    gen = torch.Generator().manual_seed(t * e)
    logits = (2 * torch.randn(t, e, generator=gen)).to(dtype).to(device).requires_grad_()
    w, ids = route(logits, k, **kw)
    assert "RouteFunction" in type(w.grad_fn).__name__, "the one-kernel backward is the path under test"
    plain_w, plain_ids = R.route_ref(logits.detach(), k, **kw)
    assert torch.equal(ids, plain_ids) and torch.equal(w, plain_w)
    ref_logits = logits.detach().float().requires_grad_()
    ref_w, _ = R.route_ref(ref_logits, k, **{**kw, "weights_dtype": torch.float32})
    dw = torch.randn(t, k, generator=gen).to(w.dtype).to(device)
    (got,) = torch.autograd.grad(w, logits, dw)
    (ref,) = torch.autograd.grad(ref_w, ref_logits, dw.float())
    assert got.dtype == dtype
    if k == 1 and kw.get("renormalize", kw.get("scoring") == "topk_softmax"):
        # the one weight is constant 1: no gradient (both are rounding noise)
        assert got.abs().max() <= 1e-6 and ref.abs().max() <= 1e-6
        return
    assert_close(got, ref, 1e-5 if dtype == torch.float32 else 1e-2, "dlogits")


@pytest.mark.parametrize("e,key", [(7, torch.uint8), (256, torch.uint8), (300, torch.int16)])
def test_sort_by_expert_invariants(e, key):
    gen = torch.Generator().manual_seed(0)
    t, k = 17, 3
    ids = torch.randint(0, e - 2, (t, k), generator=gen)  # the last two experts receive no token
    r = M.sort_by_expert(ids, e)
    flat = ids.reshape(-1)
    assert r.ends.dtype == torch.int32 and r.expert.dtype == M.sort_key_dtype(e) == key
    assert torch.equal(r.ends, torch.bincount(flat, minlength=e).cumsum(0).int())
    assert torch.equal(r.expert_index(), flat.sort().values)
    assert torch.equal(r.order[r.pos], torch.arange(t * k).view(t, k)), "row pos[t, k] holds pair (t, k)"
    assert torch.equal(r.expert_index()[r.pos.reshape(-1)], flat)
    for g in range(e):  # stable: inside a group, tokens keep their order
        pairs = r.order[r.expert == g]
        assert torch.equal(pairs, pairs.sort().values)


@pytest.mark.parametrize("kdim,ndim", [(16, 24), (13, 7)], ids=["aligned-native", "odd-cpu-loop"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_mm_and_weight_grad_with_empty_groups(kdim, ndim, dtype):
    gen = torch.Generator().manual_seed(1)
    counts = [3, 0, 5, 0, 1]  # experts 1 and 3 receive no row
    ends = torch.tensor(counts).cumsum(0).int()
    s, e = sum(counts), len(counts)
    a = torch.randn(s, kdim, generator=gen).to(dtype)
    b = torch.randn(e, kdim, ndim, generator=gen).to(dtype)
    dy = torch.randn(s, ndim, generator=gen).to(dtype)
    out, outer = M.grouped_mm(a, b, ends), M.grouped_outer(a, dy, ends)
    start = 0
    for g, n in enumerate(counts):
        sl = slice(start, start + n)
        assert_close(out[sl], a[sl].float() @ b[g].float(), TOL[dtype] / 4, f"group {g}")
        ref = a[sl].float().T @ dy[sl].float()
        if n == 0:
            assert torch.equal(outer[g], torch.zeros_like(outer[g])), "an expert without rows gets a zero gradient"
        else:
            assert_close(outer[g], ref, TOL[dtype] / 4, f"outer {g}")
        start += n


CASES = {  # name: (tokens, hidden, intermediate, experts, top-k, transposed, interleaved, bias)
    "qwen3-layout E5": (13, 64, 32, 5, 2, False, False, False),
    "odd hidden E7 top3": (11, 37, 19, 7, 3, False, False, False),
    "gpt-oss layout E5": (9, 32, 16, 5, 2, True, True, True),
    "one token top1": (1, 16, 8, 3, 1, False, False, False),
    "300 experts (int16 sort keys)": (7, 16, 8, 300, 2, False, False, False),
}


def _experts_inputs(case, dtype, seed=0):
    t, h, i, e, k, tr, il, bias = case
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e - 1, generator=gen)[:k] for _ in range(t)])  # expert e-1 never chosen
    x = torch.randn(t, h, generator=gen).to(dtype)
    w = torch.rand(t, k, generator=gen)
    gu = (torch.randn(e, h, 2 * i, generator=gen) if tr else torch.randn(e, 2 * i, h, generator=gen)) / h ** 0.5
    dn = (torch.randn(e, i, h, generator=gen) if tr else torch.randn(e, h, i, generator=gen)) / i ** 0.5
    gb = torch.randn(e, 2 * i, generator=gen) if bias else None
    db = torch.randn(e, h, generator=gen) if bias else None
    tensors = [x, w, gu.to(dtype), dn.to(dtype), None if gb is None else gb.to(dtype), None if db is None else
               db.to(dtype)]
    return ids, [None if v is None else v.requires_grad_() for v in tensors], dict(transposed=tr, interleaved=il)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_moe_experts_forward_and_gradients_match_per_expert_oracle(name, dtype):
    ids, tensors, layout = _experts_inputs(CASES[name], dtype)
    out = M.moe_experts(tensors[0], ids, *tensors[1:], **layout)
    assert out.dtype == dtype and out.shape == tensors[0].shape
    ref_in = [None if v is None else v.detach().float().requires_grad_() for v in tensors]
    ref = R.experts_ref(ref_in[0], ids, *ref_in[1:], **layout)
    assert_close(out, ref, TOL[dtype], "out")
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    live = [j for j, v in enumerate(tensors) if v is not None]
    grads = torch.autograd.grad(out, [tensors[j] for j in live], dout.to(dtype))
    refs = torch.autograd.grad(ref, [ref_in[j] for j in live], dout)
    names = ["x", "weights", "gate_up", "down", "gate_up_bias", "down_bias"]
    for j, g, rg in zip(live, grads, refs):
        assert g.dtype == tensors[j].dtype, names[j]
        assert_close(g, rg, TOL[dtype], names[j])
    e = tensors[2].shape[0]
    assert torch.equal(grads[2][e - 1], torch.zeros_like(grads[2][e - 1])), "an unused expert gets zero gradient"


def test_moe_experts_equals_hf_grouped_mm_module():
    """The stock experts module (transformers' grouped_mm implementation) and the op on the same weights."""
    cfg = transformers.Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=5, num_experts_per_tok=2)
    cfg._experts_implementation = "grouped_mm"
    experts = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(cfg)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=gen) / 6)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=gen) / 4)
    x = torch.randn(10, 32, generator=gen)
    w, ids = route(torch.randn(10, 5, generator=gen), 2, renormalize=True)
    ref = experts(x, ids, w)
    assert_close(M.moe_experts(x, ids, w, experts.gate_up_proj, experts.down_proj), ref, 1e-5, "vs HF module")
    assert_close(R.hf_grouped_mm_experts(x, ids, w, experts.gate_up_proj, experts.down_proj), ref, 1e-5, "stock")


def test_moe_experts_rejects_bad_shapes():
    x = torch.randn(4, 8)
    ids, w = torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2)
    with pytest.raises(ValueError, match="do not match"):
        M.moe_experts(x, ids, w, torch.randn(3, 10, 9), torch.randn(3, 8, 5))
    with pytest.raises(ValueError, match="activation"):
        M.moe_experts(x, ids, w, torch.randn(3, 10, 8), torch.randn(3, 8, 5), activation="gelu")


@pytest.mark.skipif(not interpreter_on(), reason="runs the Triton kernels on CPU tensors: the interpreter is set "
                    "before triton compiles anything, on machines without a GPU (CI)")
@pytest.mark.parametrize("name,activation", [("qwen3-layout E5", "silu"), ("gpt-oss layout E5", "silu"),
                                             ("gpt-oss layout E5", "gpt_oss")])
def test_registered_op_opcheck_and_same_values_as_eager(name, activation, backend_env):
    """Schema, fake impls, autograd registration and AOT dispatch of the registered ops (what torch.compile and
    FSDP2 trace), and the registered path gives the eager path's numbers exactly (same implementations). On the
    Triton path (interpreter) GPT-OSS's activation folds its gate_up bias into h inside the op: the op declares no
    mutation, which opcheck checks (h is the op's own fresh tensor)."""
    backend_env("TRITON_INTERPRET", "1")
    ids, tensors, layout = _experts_inputs(CASES[name], torch.float32)
    x, w, gu, dn, gb, db = tensors
    empty = torch.empty(0)
    args = (x, w, gu, dn, empty if gb is None else gb, empty if db is None else db, ids, layout["transposed"],
            layout["interleaved"], activation)
    torch.library.opcheck(torch.ops.novatune.moe_experts_fwd.default, args)
    out = torch.ops.novatune.moe_experts_fwd(*args)[0]
    live = [v for v in tensors if v is not None]
    grads = torch.autograd.grad(out, live, torch.ones_like(out))
    eager = M.moe_experts(x, ids, w, gu, dn, gb, db, **layout, activation=activation)
    eager_grads = torch.autograd.grad(eager, live, torch.ones_like(eager))
    assert torch.equal(out, eager)
    for g, e in zip(grads, eager_grads):
        assert torch.equal(g, e)


def _clamped_glu(h, interleaved):
    """A gated activation of another family's shape (GPT-OSS-like clamped SwiGLU), in fp32."""
    gate, up = R.split_gate_up(h.float(), interleaved)
    gate, up = gate.clamp(max=1.5), up.clamp(-1.5, 1.5)
    return (up + 1) * gate * torch.sigmoid(1.702 * gate)


def _clamped_routed_bwd(da, h, w_pairs, order, interleaved):
    w = w_pairs[order].float()[:, None]  # row r's routing weight
    with torch.enable_grad():  # called inside the op's backward, where autograd is off
        h32 = h.float().detach().requires_grad_()
        a = _clamped_glu(h32, interleaved)
        (dh,) = torch.autograd.grad(a, h32, w * da.float())
    return dh.to(h.dtype), (w * a.detach()).to(h.dtype), (a.detach() * da.float()).sum(-1)


def test_an_added_activation_runs_through_the_op(monkeypatch):
    """ACTIVATIONS is the extension point for another family's gate: an entry (fwd, routed_bwd) is all the op needs;
    here a clamped SwiGLU on the GPT-OSS layout (transposed, interleaved, biases) against the oracle."""
    monkeypatch.setitem(M.ACTIVATIONS, "clamped", (lambda h, il: _clamped_glu(h, il).to(h.dtype),
                                                   _clamped_routed_bwd))
    ids, tensors, layout = _experts_inputs(CASES["gpt-oss layout E5"], torch.float32)
    out = M.moe_experts(tensors[0], ids, *tensors[1:], **layout, activation="clamped")
    ref_in = [v.detach().requires_grad_() for v in tensors]
    ref = R.experts_ref(ref_in[0], ids, *ref_in[1:], **layout, activation=_clamped_glu)
    assert_close(out, ref, 1e-5, "out")
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    for g, rg, name in zip(torch.autograd.grad(out, tensors, dout), torch.autograd.grad(ref, ref_in, dout),
                           ["x", "weights", "gate_up", "down", "gate_up_bias", "down_bias"]):
        assert_close(g, rg, 1e-5, name)


def test_the_implementation_checker_passes_the_op():
    """The registered contract (SPEC in novatune.ops.registry) and the public checker: values bounded by stock's own
    error on the same inputs, dtypes, strides, aliasing, unchanged inputs, fresh outputs, repeats. The bound is a
    per-case statistic relative to stock: on the routing weights' gradient (a dot product with cancellation over
    the hidden size, rows of only K elements) a single element can exceed it for either implementation, so the
    seeds are fixed (over 40 random cases the op's largest error there is 0.65x stock's on average)."""
    from novatune.ops.registry import OPS
    from novatune.tune.check import check_implementation

    assert OPS["moe_experts"] is M.SPEC
    for seed in (0, 1):
        verdict = check_implementation(M.moe_experts, op="moe_experts", seed=seed, repeats=2)
        assert verdict.passed, str(verdict)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gpt_oss_activation_against_the_oracle(dtype):
    """The `gpt_oss` entry (the clamped SwiGLU op at alpha 1.702, limit 7.0) through the expert op on GPT-OSS's
    layout (transposed, interleaved, biases), inputs scaled so both clamps are active on some elements, against the
    fp32 per-expert oracle with the clamped SwiGLU reference. fp32: 1e-5 (summation order); bf16: 3e-2 (h and
    the activation rounded to bf16 between the grouped GEMMs, as the stock module rounds them)."""
    from novatune.reference.clamped_swiglu import clamped_swiglu_ref

    ids, tensors, layout = _experts_inputs(CASES["gpt-oss layout E5"], dtype)
    with torch.no_grad():
        tensors[2].mul_(12.0)  # gate_up weights: |h| reaches past the limit 7
    out = M.moe_experts(tensors[0], ids, *tensors[1:], **layout, activation="gpt_oss")
    ref_in = [v.detach().float().requires_grad_() for v in tensors]
    ref = R.experts_ref(ref_in[0], ids, *ref_in[1:], **layout,
                        activation=lambda h, il: clamped_swiglu_ref(h.float()))
    h = ref_in[0].detach() @ ref_in[2].detach()[0] + ref_in[4].detach()[0]  # (T, 2I) of expert 0, interleaved
    assert float(h[:, 0::2].max()) > 7.0 and float(h[:, 1::2].abs().max()) > 7.0, "a clamp is never active"
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert_close(out.float(), ref, tol, "out")
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    for g, rg, name in zip(torch.autograd.grad(out, tensors, dout), torch.autograd.grad(ref, ref_in, dout.float()),
                           ["x", "weights", "gate_up", "down", "gate_up_bias", "down_bias"]):
        assert_close(g.float(), rg, tol, name)


_VIEWS = {"view", "_unsafe_view", "reshape", "alias", "t", "transpose", "permute", "expand", "as_strided", "slice",
          "select", "unsqueeze", "squeeze", "empty", "empty_like", "empty_strided", "new_empty", "detach"}
_HOST_READS = {"_local_scalar_dense", "nonzero", "item", "is_nonzero", "equal"}


@pytest.mark.skipif(not interpreter_on(), reason="counts the CUDA code path on the CPU, through the Triton "
                    "interpreter (on a GPU machine: bench/experiments/exp_moe_host.py --device cuda)")
def test_moe_block_host_work(monkeypatch):
    """The MoE step is host-bound on a GPU, so the launches of one block are part of its contract: a patched
    Qwen3-MoE block's forward and backward on the Triton path (interpreted) issue exactly these Triton launches
    and grouped GEMMs, only these aten ops that launch a kernel (ops inside a launch or a grouped GEMM not
    counted), and no op that reads a device value on the host (a sync on a GPU)."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime.interpreter import InterpretedFunction

    import novatune

    state = {"paused": 0, "launches": Counter(), "ops": Counter()}

    def opaque(kind, fn):
        def wrapped(*args, **kwargs):
            state["launches"][kind] += 1
            state["paused"] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                state["paused"] -= 1
        return wrapped

    run = InterpretedFunction.run
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *a, **kw: opaque(self.__name__, run)(self, *a, **kw))
    monkeypatch.setattr(M, "grouped_mm", opaque("grouped_mm", M.grouped_mm))
    monkeypatch.setattr(M, "grouped_outer", opaque("grouped_outer", M.grouped_outer))
    # the expert ids' range check, counted if it ran (it must not: see below)
    monkeypatch.setattr(M, "_check_ids", opaque("_check_ids", M._check_ids))

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not state["paused"] and name not in _VIEWS:
                state["ops"][name] += 1
            return func(*args, **(kwargs or {}))

    cfg = transformers.Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=7, num_experts_per_tok=3,
                                      norm_topk_prob=True, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, vocab_size=64)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).train()
    novatune.patch(model)
    block = model.model.layers[0].mlp
    x = torch.randn(1, 11, 64, dtype=torch.bfloat16, requires_grad=True)
    with Ops():
        out = block(x)
    fwd_ops, fwd_launches = dict(state["ops"]), dict(state["launches"])
    state["ops"].clear()
    state["launches"].clear()
    dout = torch.randn_like(out)
    with Ops():
        out.backward(dout)
    bwd_ops, bwd_launches = dict(state["ops"]), dict(state["launches"])
    # no range check of the ids: the patched block's ids are its router's top-k (ids_from_router)
    assert fwd_launches == {"_gather_rows_kernel": 1, "grouped_mm": 2, "_glu_fwd_kernel": 1, "_combine_kernel": 1}
    assert bwd_launches == {"_gather_rows_kernel": 2, "grouped_mm": 2, "grouped_outer": 2, "_glu_routed_bwd_kernel": 1,
                            "_combine_kernel": 1, "_route_bwd_kernel": 1}
    # router: linear, softmax (on the CPU a cast first; CUDA's softmax casts in its kernel), top-k, sum, division,
    # cast; experts: the ids' cast to the one-byte sort key, the sort. Backward: the router's two GEMMs and the
    # add of its input gradient to the experts'.
    allowed_fwd = {"mm": 1, "_to_copy": 3, "_softmax": 1, "topk": 1, "sum": 1, "div": 1, "sort": 1}
    assert all(n <= allowed_fwd.get(op, 0) for op, n in fwd_ops.items()), fwd_ops
    assert all(n <= {"mm": 2, "add": 1}.get(op, 0) for op, n in bwd_ops.items()), bwd_ops
    assert not _HOST_READS & (set(fwd_ops) | set(bwd_ops))
    assert x.grad is not None and block.gate.weight.grad is not None


def test_expert_id_check_on_a_device_queues_an_assert():
    """Off the host the range check never reads the ids (a sync per layer on a GPU): four elementwise / reduction
    ops and torch._assert_async, queued with the kernels (meta tensors stand in for a device here)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    ids = torch.empty(11, 3, dtype=torch.long, device="meta")
    with Ops():
        M._check_ids(ids, 7)
    assert ops == ["ge", "lt", "bitwise_and", "all", "_assert_async"] and not _HOST_READS & set(ops)


def _moe_args(seed, t=5, h=16, i=8, e=4, k=2):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=gen)
    return x, ids, w, torch.randn(e, 2 * i, h, generator=gen) / 4, torch.randn(e, h, i, generator=gen) / 3


@pytest.mark.parametrize("path", ["cpu", "interpreter"])
@pytest.mark.parametrize("bad", [4, -1, 300], ids=lambda b: f"id{b}")
def test_expert_ids_outside_the_experts_raise(bad, path, backend_env):
    """An id >= E or < 0 read and wrote out of bounds (and the one-byte sort keys wrapped 300 onto expert 44)
    without an error; on the host it is a ValueError naming the range, for the LoRA variant too."""
    from novatune.ops.moe_lora import moe_experts_lora

    backend_env("TRITON_INTERPRET", "1" if path == "interpreter" else "0")
    x, ids, w, gu, dn = _moe_args(41)
    ids[2, 1] = bad
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 4\)"):
        M.moe_experts(x, ids, w, gu, dn)
    lora = (torch.randn(4, 2, 16), torch.randn(4, 16, 2), 0.5)
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 4\)"):
        moe_experts_lora(x, ids, w, gu, dn, gate_up_lora=lora)


@pytest.mark.parametrize("what", ["down (E, H-1, I)", "down (E, H, I+1)", "gate_up 2-D", "gate_up odd 2I",
                                  "gate_up_bias (E, 2I-1)", "down_bias (E, H+1)", "transposed down", "float ids"])
def test_expert_weight_shapes_are_checked(what):
    """Each mismatch names the expected shape (a down projection of H-1 rows silently returned (T, H-1); a 2-D
    gate_up raised an IndexError)."""
    x, ids, w, gu, dn = _moe_args(42)  # T 5, H 16, I 8, E 4
    gb, db, kw = None, None, {}
    if what == "down (E, H-1, I)":
        dn, want = dn[:, :-1], r"down must be \(4, 16, 8\)"
    elif what == "down (E, H, I+1)":
        dn, want = torch.randn(4, 16, 9), r"down must be \(4, 16, 8\)"
    elif what == "gate_up 2-D":
        gu, want = gu[0], "must be 3-D"
    elif what == "gate_up odd 2I":
        gu, want = gu[:, :-1], "2I = 15 even"
    elif what == "gate_up_bias (E, 2I-1)":
        gb, want = torch.zeros(4, 15), r"gate_up_bias must be \(4, 16\)"
    elif what == "down_bias (E, H+1)":
        db, want = torch.zeros(4, 17), r"down_bias must be \(4, 16\)"
    elif what == "transposed down":
        gu, dn, kw, want = gu.transpose(1, 2), dn, {"transposed": True}, r"down must be \(4, 8, 16\)"
    else:
        ids, want = ids.float(), "ids must be integer"
    with pytest.raises((ValueError, TypeError), match=want):
        M.moe_experts(x, ids, w, gu, dn, gb, db, **kw)


def test_double_backward_raises_instead_of_being_wrong():
    """The backward recomputes from h saved in the forward, so a second-order gradient would miss its dependence
    (x's came back 100% off, silently): the eager Function is once-differentiable."""
    x, ids, w, gu, dn = _moe_args(43)
    leaves = [t.clone().requires_grad_() for t in (x, w, gu, dn)]
    out = M.moe_experts(leaves[0], ids, *leaves[1:])
    grads = torch.autograd.grad(out, leaves, torch.randn(out.shape).requires_grad_(), create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        sum((g * g).sum() for g in grads).backward()


@pytest.mark.parametrize("top_k", [0, 5])
def test_route_refuses_a_top_k_outside_the_experts(top_k):
    with pytest.raises(ValueError, match=r"top_k=.* must be in \[1, 4\]"):
        route(torch.randn(6, 4), top_k)


@pytest.mark.skipif(not interpreter_on(), reason="runs the Triton kernels on CPU tensors: the interpreter is set "
                    "before triton compiles anything, on machines without a GPU (CI)")
def test_gpt_oss_gate_up_bias_joins_the_activation_on_the_triton_path(backend_env, monkeypatch):
    """On the Triton path GPT-OSS's gate_up bias is added inside the clamped activation's pass (and written back for
    the backward): the kernel is called with the bias, and the op still equals the fp32 per-expert oracle (fp32:
    1e-5, summation order), gradients included."""
    from novatune.kernels import clamped_swiglu as KC
    from novatune.reference.clamped_swiglu import clamped_swiglu_ref

    backend_env("TRITON_INTERPRET", "1")
    seen: list[bool] = []
    real = KC.clamped_swiglu_fwd
    monkeypatch.setattr(KC, "clamped_swiglu_fwd", lambda *a, **kw: seen.append(kw.get("bias") is not None)
                        or real(*a, **kw))
    ids, tensors, layout = _experts_inputs(CASES["gpt-oss layout E5"], torch.float32)
    out = M.moe_experts(tensors[0], ids, *tensors[1:], **layout, activation="gpt_oss")
    assert seen and all(seen), "the forward folds the bias into the activation's launch"
    ref_in = [v.detach().float().requires_grad_() for v in tensors]
    ref = R.experts_ref(ref_in[0], ids, *ref_in[1:], **layout, activation=lambda h, il: clamped_swiglu_ref(h))
    assert_close(out, ref, 1e-5, "out")
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    for g, rg, name in zip(torch.autograd.grad(out, tensors, dout), torch.autograd.grad(ref, ref_in, dout),
                           ["x", "weights", "gate_up", "down", "gate_up_bias", "down_bias"]):
        assert_close(g, rg, 1e-5, name)
