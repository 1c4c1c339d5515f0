"""novatune.ops.moe_wgrad: the experts' weight gradients added into .grad (moe_experts(..., wgrad_in_place=True):
by column slices on the torch path, inside the grouped GEMM on the Triton path) give the .grad that autograd's own
accumulation gives, and only where autograd would have accumulated there; anywhere else the gradient is returned as
without the option.

Equality: each element is the same dot product over the expert's rows as the whole gradient's (fp32 on the CPU:
exactly the same numbers or summation order only, 1e-6 relative), added once to the same accumulated .grad.
"""
import functools

import pytest
import torch

from novatune.measure.numerics import assert_close
from novatune.ops import moe as M
from novatune.ops._backend import interpreter_on
from novatune.ops.grad_accumulation import accumulates_into_grad
from novatune.ops.moe_routing import route
from novatune.ops.moe_wgrad import SLICES, column_slices
from tests.ops.test_moe import CASES, _experts_inputs


def _record_in_place(monkeypatch) -> list:
    """The out dims of every weight gradient the op adds into .grad itself, in call order."""
    seen = []
    real = M._dweight

    def recording(x, dy, r, transposed, into):
        if into is not None:
            seen.append(2 if transposed else 1)
        return real(x, dy, r, transposed, into)

    monkeypatch.setattr(M, "_dweight", recording)
    return seen


def _params(tensors):
    """The inputs with the expert weights as nn.Parameters (what a model holds)."""
    out = list(tensors)
    out[2], out[3] = (torch.nn.Parameter(t.detach().clone()) for t in tensors[2:4])
    return out


def _accumulate(case, micro_batches, wgrad_in_place, seed=0, dtype=torch.float32):
    """Gradient accumulation over `micro_batches` of fresh inputs for the same expert weights; the weights' .grad."""
    ids, tensors, layout = _experts_inputs(case, dtype, seed)
    params = _params(tensors)
    for mb in range(micro_batches):
        ids, inputs, _ = _experts_inputs(case, dtype, seed + 100 + mb)
        inputs[2:4] = params[2:4]
        out = M.moe_experts(inputs[0], ids, *inputs[1:], **layout, wgrad_in_place=wgrad_in_place)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(mb))).sum().backward()
    return params[2].grad, params[3].grad, inputs


@pytest.mark.skipif(not interpreter_on(), reason="runs the Triton kernels on CPU tensors: the interpreter is set "
                    "before triton compiles anything, on machines without a GPU (CI)")
@pytest.mark.parametrize("name", ["qwen3-layout E5", "gpt-oss layout E5"])
def test_bf16_aligned_expert_weights_take_the_tma_form(name, monkeypatch, backend_env):
    """bf16 expert weights whose rows are 16-byte aligned: the op adds their gradients through the TMA form of the
    kernel (here in the interpreter), and the accumulated .grad is autograd's within bf16 rounding: each of the two
    accumulating micro-batches rounds once where autograd rounds twice (dW, then the sum), so elements differ by at
    most a spacing or two (2^-8 relative each); 8e-3 of the norm."""
    from novatune.kernels import moe_wgrad as W

    backend_env("TRITON_INTERPRET", "1")
    want = _accumulate(CASES[name], 3, wgrad_in_place=False, dtype=torch.bfloat16)
    ran = []
    real = W._launch_tma
    monkeypatch.setattr(W, "_launch_tma", lambda *args: ran.append(1) or real(*args))
    got = _accumulate(CASES[name], 3, wgrad_in_place=True, dtype=torch.bfloat16)
    assert len(ran) == 4  # micro-batches 2 and 3, both weights
    for what, a, b in (("gate_up", got[0], want[0]), ("down", got[1], want[1])):
        assert a.dtype == torch.bfloat16
        assert_close(a, b, 8e-3, what)


@pytest.mark.parametrize("triton", [False, True], ids=["slices", "in-GEMM kernel"])
@pytest.mark.parametrize("name", ["qwen3-layout E5", "gpt-oss layout E5", "odd hidden E7 top3"])
def test_in_place_accumulation_equals_autograds(name, triton, monkeypatch, backend_env):
    """On the torch path the gradient is added by column slices; on the Triton path (here the CPU interpreter)
    inside the grouped GEMM (novatune.kernels.moe_wgrad), the same fp32 dot products in another summation order."""
    backend_env("TRITON_INTERPRET", "1" if triton else "0")  # CPU tensors: the interpreter, or the torch path
    want = _accumulate(CASES[name], 3, wgrad_in_place=False)
    added = _record_in_place(monkeypatch)
    kernel_calls = []
    real_kernel = M.grouped_outer_accumulate
    monkeypatch.setattr(M, "grouped_outer_accumulate", lambda *a, **kw: kernel_calls.append(1) or real_kernel(*a, **kw))
    got = _accumulate(CASES[name], 3, wgrad_in_place=True)
    out_dim = 2 if CASES[name][5] else 1
    assert added == [out_dim] * 4  # micro-batches 2 and 3, both weights
    assert len(kernel_calls) == (4 if triton else 0)
    for what, a, b in (("gate_up", got[0], want[0]), ("down", got[1], want[1])):
        assert_close(a, b, 1e-6, what)
    # the other inputs' gradients are returned as usual
    assert got[2][0].grad is not None and got[2][1].grad is not None


def test_the_first_micro_batch_is_returned_and_later_ones_are_added_in_place(monkeypatch):
    """Micro-batch 1 has no .grad to add into (autograd keeps the returned tensor); from micro-batch 2 on the
    backward adds by slices and returns None for the weights."""
    calls = _record_in_place(monkeypatch)
    case = CASES["qwen3-layout E5"]
    ids, tensors, layout = _experts_inputs(case, torch.float32)
    params = _params(tensors)
    for mb in range(2):
        out = M.moe_experts(params[0], ids, *params[1:], **layout, wgrad_in_place=True)
        out.sum().backward()
        assert len(calls) == 2 * mb, calls  # gate_up (out dim 1) and down, both from the second micro-batch
    assert calls == [1, 1]


def test_hooks_keep_the_gradient_returned():
    """A tensor hook or a post-accumulate hook on the weight sees the whole gradient, as without the option."""
    case = CASES["qwen3-layout E5"]
    ids, tensors, layout = _experts_inputs(case, torch.float32)
    params = _params(tensors)
    got = {}
    params[2].register_hook(lambda g: got.setdefault("gate_up", g.clone()))
    params[3].register_post_accumulate_grad_hook(lambda p: got.update(down=p.grad.clone()))
    for p in params[2:4]:
        p.grad = torch.zeros_like(p)
    M.moe_experts(params[0], ids, *params[1:], **layout, wgrad_in_place=True).sum().backward()
    assert "gate_up" in got and torch.equal(got["gate_up"], params[2].grad)
    assert "down" in got and torch.equal(got["down"], params[3].grad)


def test_a_create_graph_backward_gets_the_gradient_returned(monkeypatch):
    """Under create_graph autograd replaces .grad by .grad + g (a graph of its own) instead of adding in place:
    the op returns the gradient there, whatever its own backward's no_grad says."""
    added = _record_in_place(monkeypatch)
    case = CASES["qwen3-layout E5"]
    ids, tensors, layout = _experts_inputs(case, torch.float32)
    params = _params(tensors)
    start = [torch.full_like(p, 0.5) for p in params[2:4]]
    for p, g in zip(params[2:4], start):
        p.grad = g
    M.moe_experts(params[0], ids, *params[1:], **layout, wgrad_in_place=True).sum().backward(create_graph=True)
    assert added == []
    assert all(torch.all(g == 0.5) for g in start), "the earlier .grad tensors were not written"
    ref = M.moe_experts(params[0], ids, *params[1:], **layout)
    want = torch.autograd.grad(ref.sum(), params[2:4])
    for p, w in zip(params[2:4], want):
        assert_close(p.grad.detach(), w + 0.5, 1e-6, "grad")


def test_autograd_grad_and_backward_inputs_leave_grad_alone():
    case = CASES["qwen3-layout E5"]
    ids, tensors, layout = _experts_inputs(case, torch.float32)
    params = _params(tensors)
    for p in params[2:4]:
        p.grad = torch.full_like(p, 7.0)
    out = M.moe_experts(params[0], ids, *params[1:], **layout, wgrad_in_place=True)
    dgu, ddn = torch.autograd.grad(out.sum(), params[2:4])
    assert torch.all(params[2].grad == 7.0) and torch.all(params[3].grad == 7.0)
    ref = M.moe_experts(params[0], ids, *params[1:], **layout)
    rgu, rdn = torch.autograd.grad(ref.sum(), params[2:4])
    assert torch.equal(dgu, rgu) and torch.equal(ddn, rdn)
    out = M.moe_experts(params[0], ids, *params[1:], **layout, wgrad_in_place=True)
    out.sum().backward(inputs=[params[0]])
    assert torch.all(params[2].grad == 7.0) and params[0].grad is not None


class _Probe(torch.autograd.Function):
    """Identity whose backward records accumulates_into_grad's decision for its input parameter."""
    decided: dict = {}

    @staticmethod
    def forward(ctx, w):
        ctx.param = w
        return w * 1.0

    @staticmethod
    def backward(ctx, g):
        _Probe.decided["in_place"] = accumulates_into_grad(ctx.param)
        return g


def _decision(p: torch.nn.Parameter, **backward_kwargs) -> bool:
    _Probe.decided.clear()
    _Probe.apply(p).sum().backward(**backward_kwargs)
    return _Probe.decided["in_place"]


def test_accumulates_into_grad_conditions():
    p = torch.nn.Parameter(torch.randn(3, 8, 4))
    assert not accumulates_into_grad(p)  # outside a backward: the engine check refuses

    def decide(setup) -> bool:
        p.grad = torch.zeros_like(p)
        setup()
        return _decision(p)

    assert decide(lambda: None)
    assert not decide(lambda: setattr(p, "grad", None))                                   # nothing to add into
    assert not decide(lambda: setattr(p, "grad", torch.zeros(3, 8, 4).to_sparse()))        # not dense
    handle = p.register_hook(lambda g: g)
    assert not decide(lambda: None)
    handle.remove()
    assert decide(lambda: None)
    p.grad = torch.zeros_like(p)
    assert not _decision(p, create_graph=True)  # the backward runs in grad mode: autograd adds out of place
    p.grad = None
    assert not accumulates_into_grad(torch.randn(3, requires_grad=True))                  # not a Parameter
    assert not accumulates_into_grad(None)


@pytest.mark.parametrize("width,elem", [(1536, 2), (2048, 2), (37, 4), (8, 2), (3, 4)])
def test_column_slices_cover_the_width_at_aligned_offsets(width, elem):
    sl = column_slices(width, elem)
    assert sl[0][0] == 0 and sl[-1][1] == width and len(sl) <= SLICES
    assert all(a[1] == b[0] for a, b in zip(sl, sl[1:]))
    assert all((lo * elem) % 16 == 0 for lo, _ in sl)


@pytest.mark.parametrize("option", [None, True, False], ids=["default", "on", "off"])
def test_the_patch_option_reaches_the_experts(option):
    """On by default; the report says so on every experts entry, and False turns it off."""
    import novatune
    from tests.patch.tiny_models import tiny_model

    model = tiny_model("qwen3_moe")
    report = novatune.patch(model) if option is None else novatune.patch(model, moe_wgrad_in_place=option)
    want = option is not False
    experts = [m for m in model.modules() if getattr(m, "_novatune_wgrad_in_place", None) is not None]
    assert experts and all(m._novatune_wgrad_in_place is want for m in experts)
    details = [e.detail for e in report.entries if e.kind == "moe_experts"]
    assert details and all(("weight gradients added into .grad" in d) is want for d in details)


def test_an_initialised_process_group_keeps_the_gradient_returned(tmp_path):
    """DDP's and FSDP's hooks on the gradient accumulators are invisible from Python: with a process group up,
    the gradient goes back to autograd."""
    import torch.distributed as dist

    p = torch.nn.Parameter(torch.randn(2, 8, 4))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        p.grad = torch.zeros_like(p)
        assert _decision(p) is False
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_cuda_bf16_at_qwen3_moe_layer_shapes_same_grad_and_a_lower_peak():
    """One Qwen3-30B-A3B expert layer (H 2048, I 768, E 128, top-8, 4096 tokens), bf16, two accumulated
    micro-batches: the .grad equals autograd's within bf16 rounding (on CUDA the addition runs inside the grouped
    GEMM, one rounding instead of two), and the second backward's peak drops by most of the gate/up gradient
    (0.75 GiB of fresh gradient no longer written)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    t, h, i, e, k = 4096, 2048, 768, 128, 8
    gen = torch.Generator().manual_seed(0)
    gu0 = (torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5).to("cuda", torch.bfloat16)
    dn0 = (torch.randn(e, h, i, generator=gen) / i ** 0.5).to("cuda", torch.bfloat16)
    batches = []
    for mb in range(2):
        g = torch.Generator().manual_seed(10 + mb)
        logits = torch.randn(t, e, generator=g)
        w, ids = route(logits, k, renormalize=True)
        batches.append((torch.randn(t, h, generator=g).to("cuda", torch.bfloat16), ids.cuda(), w.cuda()))
    grads, peaks = {}, {}
    for in_place in (False, True):
        gu, dn = torch.nn.Parameter(gu0.clone()), torch.nn.Parameter(dn0.clone())
        for mb, (x, ids, w) in enumerate(batches):
            out = M.moe_experts(x, ids, w, gu, dn, wgrad_in_place=in_place)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            out.float().square().mean().backward()
            torch.cuda.synchronize()
            if mb == 1:
                peaks[in_place] = (torch.cuda.max_memory_allocated() - base) / 2**30
            del out
        grads[in_place] = (gu.grad.float(), dn.grad.float())
    for a, b, name in zip(grads[True], grads[False], ("gate_up", "down")):
        assert_close(a, b, 1e-2, name)
    assert peaks[False] - peaks[True] > 0.4, peaks


def _experts_call(x, w, *, gu, dn, ids, layout, in_place):
    return M.moe_experts(x, ids, w, gu, dn, **layout, wgrad_in_place=in_place)


@pytest.mark.parametrize("reentrant", [False, True])
def test_under_activation_checkpointing_the_parameters_grad_is_written(monkeypatch, reentrant):
    """Checkpointed layers recompute the forward in the backward, and non-reentrant checkpointing hands the saved
    weights back as detached copies: the gradient still reaches the parameters' .grad, equal to autograd's."""
    from torch.utils.checkpoint import checkpoint

    added = _record_in_place(monkeypatch)
    case = CASES["qwen3-layout E5"]
    result = {}
    for in_place in (False, True):
        ids, tensors, layout = _experts_inputs(case, torch.float32)
        params = _params(tensors)
        # the weights reach the function as a module's parameters do: not through checkpoint's inputs, which
        # reentrant checkpointing detaches
        run = functools.partial(_experts_call, gu=params[2], dn=params[3], ids=ids, layout=layout, in_place=in_place)
        for mb in range(2):
            out = checkpoint(run, params[0], params[1], use_reentrant=reentrant)
            (out * (mb + 1)).sum().backward()
        result[in_place] = (params[2].grad, params[3].grad)
    assert added == [1, 1]  # the second micro-batch, both weights
    for a, b, name in zip(result[True], result[False], ("gate_up", "down")):
        assert_close(a, b, 1e-6, name)


@pytest.mark.parametrize("name", ["qwen3-layout E5", "gpt-oss layout E5"])
def test_the_last_backward_records_the_squares_the_norm_then_reads(name, device, monkeypatch, backend_env):
    """Under grad_norm.final_gradient_squares (the trainer's last backward) the in-GEMM addition also records the
    stored gradient's sums of squares; total_norm uses them and its value is torch's get_total_norm of the same
    gradients (bf16: within one spacing, the per-tensor sums differ in order only); a gradient changed in place
    after the kernel (version bumped) is read again instead; outside the context nothing is recorded, and an
    addition made after a record invalidates it. CPU: the interpreter; CUDA: the compiled kernels (TMA form)."""
    from novatune.ops import grad_norm as G

    if device == "cpu":
        backend_env("TRITON_INTERPRET", "1")
    monkeypatch.setattr(G, "_records", {})  # this test's records only (they are process-wide)
    case, dtype = CASES[name], torch.bfloat16

    def inputs(seed):
        ids, tensors, layout = _experts_inputs(case, dtype, seed)
        return ids.to(device), [None if t is None else t.detach().to(device).requires_grad_() for t in tensors], layout

    _, tensors, layout = inputs(0)
    params = _params(tensors)
    for mb in range(3):
        ids, micro, _ = inputs(100 + mb)
        micro[2:4] = params[2:4]
        out = M.moe_experts(micro[0], ids, *micro[1:], **layout, wgrad_in_place=True)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(mb)).to(device)
        loss = (out.float() * dout).sum()
        if mb < 2:
            loss.backward()
            assert not G._records
        else:
            with G.final_gradient_squares():
                loss.backward()
    grads = [params[2].grad, params[3].grad, micro[0].grad]
    assert {id(g) for g in grads[:2]} == set(G._records)
    reads = []
    real = G.K.norms
    monkeypatch.setattr(G.K, "norms", lambda ts, given=None: reads.append(given) or real(ts, given))

    def one_spacing(want):
        return float(torch.nextafter(want, torch.full_like(want, float("inf"))) - want)

    want = torch.nn.utils.get_total_norm(grads, 2.0)
    got = G.total_norm(grads)
    assert abs(float(got) - float(want)) <= one_spacing(want)
    assert reads and sum(g is not None for g in reads[0]) == 2 and not G._records  # a record serves one norm
    G.record_squares(grads[0], torch.zeros(3, device=device))  # wrong on purpose: must not count once changed
    grads[0].mul_(2)
    want = torch.nn.utils.get_total_norm(grads, 2.0)
    got = G.total_norm(grads)
    assert abs(float(got) - float(want)) <= one_spacing(want)
    assert reads[-1] == [None, None, None]
    # a later in-GEMM addition (the next step's micro-batch into a gradient kept) bumps the version itself
    G.record_squares(grads[0], torch.zeros(3, device=device))
    ids, micro, _ = inputs(200)
    micro[2:4] = params[2:4]
    M.moe_experts(micro[0], ids, *micro[1:], **layout, wgrad_in_place=True).float().sum().backward()
    assert G._recorded(grads[0]) is None
