"""SwiGLU op layer (novatune.ops.swiglu): custom ops, autograd, the reference backend, and the fused MLP against
a stock Hugging Face Qwen3MLP.

Tolerances: as in tests/kernels/test_swiglu.py - every output is computed in fp32 from the same inputs as the
fp32 reference and rounded once, so fp32 -> 1e-5; bf16 -> 4e-3 where the rounding is round-to-nearest (GPU
kernels, and the CPU reference path via torch's .to) and 8e-3 under TRITON_INTERPRET (it truncates fp32 -> bf16).
The MLP comparisons are fp32 end to end (identical matmuls on inputs differing by a few fp32 ulp) -> 1e-5.
"""
import copy

import pytest
import torch

from novatune.measure.numerics import assert_close
from novatune.ops.swiglu import NovaSwiGLUMLP, swiglu, swiglu_gate_up, swiglu_gate_up_mlp, swiglu_mlp
from novatune.reference.swiglu import swiglu_ref

HAS_CUDA = torch.cuda.is_available()
BF16_RNE, BF16_TRUNC = 4e-3, 8e-3


def _tol(dtype, triton_path=True):
    if dtype == torch.float32:
        return 1e-5
    return BF16_RNE if (HAS_CUDA or not triton_path) else BF16_TRUNC


def _leaf_inputs(shape, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    g = (3 * torch.randn(shape, generator=gen)).to(dtype).to(device).requires_grad_(True)
    u = torch.randn(shape, generator=gen).to(dtype).to(device).requires_grad_(True)
    dy = torch.randn(shape, generator=gen).to(dtype).to(device)
    return g, u, dy


def _fp32_reference(g, u, dy):
    """Autograd of silu(g) * u in fp32 on the same (possibly bf16) values."""
    g32 = g.detach().float().requires_grad_(True)
    u32 = u.detach().float().requires_grad_(True)
    y32 = torch.nn.functional.silu(g32) * u32
    y32.backward(dy.float())
    return y32.detach(), g32.grad, u32.grad


def _check_autograd(shape, dtype, device, tol):
    g, u, dy = _leaf_inputs(shape, dtype, device)
    y = swiglu(g, u)
    y.backward(dy)
    ry, rdg, rdu = _fp32_reference(g, u, dy)
    assert y.dtype == dtype and g.grad.dtype == dtype and u.grad.dtype == dtype
    assert_close(y, ry, tol, "y")
    assert_close(g.grad, rdg, tol, "dgate")
    assert_close(u.grad, rdu, tol, "dup")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(1, 127), (37, 127), (4097, 127), (3, 2560), (2, 37, 127), (1, 3, 2560)],
                         ids=lambda s: "x".join(map(str, s)))
def test_autograd_matches_fp32_reference(shape, dtype, device):
    _check_autograd(shape, dtype, device, _tol(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_reference_backend(dtype, reference_backend):
    """NOVATUNE_BACKEND=reference (and CPU without the interpreter): fp32 math cast back to the input dtype."""
    reference_backend()
    _check_autograd((2, 37, 127), dtype, "cpu", _tol(dtype, triton_path=False))


def test_opcheck(device):
    """Schema, fake impl, autograd registration and AOT dispatch of both ops (small shapes, both dtypes)."""
    for dtype in (torch.float32, torch.bfloat16):
        g, u, dy = _leaf_inputs((5, 37), dtype, device)
        torch.library.opcheck(torch.ops.novatune.swiglu_fwd.default, (g, u))
        torch.library.opcheck(torch.ops.novatune.swiglu_bwd.default, (dy, g.detach(), u.detach()))
    g, u, _ = _leaf_inputs((2, 3, 17), torch.float32, device)  # 3-D
    torch.library.opcheck(torch.ops.novatune.swiglu_fwd.default, (g, u))


def test_non_contiguous_and_output_layout(device):
    g, u, dy = _leaf_inputs((127, 37), torch.float32, device)
    gt, ut = g.t(), u.t()  # strided views
    y = swiglu(gt, ut)
    assert y.is_contiguous() and y.shape == (37, 127)
    y.backward(dy.t())
    ry, rdg, rdu = _fp32_reference(gt, ut, dy.t())
    assert_close(y, ry, 1e-5, "y")
    assert_close(g.grad.t(), rdg, 1e-5, "dgate")
    assert_close(u.grad.t(), rdu, 1e-5, "dup")


def test_argument_checks(device):
    a = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match="same shape"):
        swiglu(a, torch.randn(4, 9, device=device))
    # mixed dtypes promote like eager PyTorch
    y = swiglu(a, a.to(torch.bfloat16))
    assert y.dtype == torch.float32
    assert_close(y, swiglu_ref(a, a.to(torch.bfloat16)), 1e-5, "mixed")


@pytest.mark.parametrize("path", ["cpu", "interpreter"])
def test_integer_inputs_are_refused(path, backend_env):
    """silu of integers was computed and truncated to int64 (swiglu([[1, 2]], [[3, 4]]) -> [[2, 7]]); an integer
    gate with a float up would be promoted away. Both paths, both entry points."""
    backend_env("TRITON_INTERPRET", "1" if path == "interpreter" else "0")
    ints = torch.randint(-3, 4, (3, 6))
    with pytest.raises(TypeError, match="swiglu: inputs must be floating point"):
        swiglu(ints, ints)
    with pytest.raises(TypeError, match="floating point"):
        swiglu(ints, torch.randn(3, 6))
    with pytest.raises(TypeError, match="swiglu_gate_up: inputs must be floating point"):
        swiglu_gate_up(ints)


# ---- eager fast path vs the registered op ----------------------------------------------------------------

@pytest.mark.parametrize("backend", ["default", "reference"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_eager_function_and_registered_op_agree(dtype, backend, device, reference_backend):
    """swiglu in eager runs the autograd.Function (not the custom op's dispatch) and gives the registered op's
    numbers exactly (y, dgate, dup), on the Triton path and on the fp32-reference path."""
    if backend == "reference":
        reference_backend()
        device = "cpu"
    g, u, dy = _leaf_inputs((2, 37, 127), dtype, device)
    y1 = swiglu(g, u)
    assert type(y1.grad_fn).__name__ == "_SwiGLUFunctionBackward"   # the fast path, not the custom op
    dg1, du1 = torch.autograd.grad(y1, (g, u), dy)
    y2 = torch.ops.novatune.swiglu_fwd(g, u)
    dg2, du2 = torch.autograd.grad(y2, (g, u), dy)
    for name, a, b in [("y", y1, y2), ("dgate", dg1, dg2), ("dup", du1, du2)]:
        assert a.dtype == b.dtype and a.stride() == b.stride(), name
        assert torch.equal(a, b), name


def test_eager_path_needs_input_grad(device):
    """up frozen: the Function returns no gradient for it; gate's is the full-path one."""
    g, u, dy = _leaf_inputs((5, 37), torch.float32, device)
    u = u.detach()
    swiglu(g, u).backward(dy)
    assert u.grad is None
    _, rdg, _ = _fp32_reference(g, u, dy)
    assert_close(g.grad, rdg, 1e-5, "dgate")


def test_torch_compile_traces_registered_op(device):
    """Under torch.compile swiglu emits the registered op (fake impl + registered autograd); aot_eager keeps the
    test fast. Values equal the eager path's."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    g, u, dy = _leaf_inputs((3, 37), torch.float32, device)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(swiglu, backend=counter, fullgraph=True)
    y = compiled(g, u)
    dg, du = torch.autograd.grad(y, (g, u), dy)
    targets = [str(n.target) for gm in counter.graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert any("novatune.swiglu_fwd" in t for t in targets), targets
    y_e = swiglu(g, u)
    dg_e, du_e = torch.autograd.grad(y_e, (g, u), dy)
    for a, b in [(y, y_e), (dg, dg_e), (du, du_e)]:
        assert torch.equal(a, b)


# ---- the fused MLP against stock HF ----------------------------------------------------------------------

def _tiny_qwen3_mlp(seed=0):
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

    torch.manual_seed(seed)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=160, hidden_act="silu", num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128)
    return Qwen3MLP(cfg).float()


def _fwd_bwd(fn, module, x, dy):
    x = x.clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    out = fn(module, x)
    out.backward(dy)
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.requires_grad}
    return out.detach(), x.grad, grads


def _compare_mlps(stock, ours_fn, device):
    stock = stock.to(device)
    nova = copy.deepcopy(stock)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, 64, generator=gen).to(device)  # (batch, seq, hidden): 3-D as in a model
    dy = torch.randn(2, 7, 64, generator=gen).to(device)
    out_s, dx_s, g_s = _fwd_bwd(lambda m, t: m(t), stock, x, dy)
    out_n, dx_n, g_n = _fwd_bwd(ours_fn, nova, x, dy)
    assert_close(out_n, out_s, 1e-5, "mlp output")
    assert_close(dx_n, dx_s, 1e-5, "mlp dx")
    assert g_s.keys() == g_n.keys() and g_s
    for name in g_s:
        assert_close(g_n[name], g_s[name], 1e-5, f"grad {name}")


def test_swiglu_mlp_matches_hf_qwen3_mlp(device):
    _compare_mlps(_tiny_qwen3_mlp(), lambda m, t: swiglu_mlp(t, m.gate_proj, m.up_proj, m.down_proj), device)


def test_nova_swiglu_mlp_module_shares_weights(device):
    stock = _tiny_qwen3_mlp()
    wrapped = NovaSwiGLUMLP.from_module(stock)
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in stock.named_parameters()]
    assert wrapped.gate_proj.weight is stock.gate_proj.weight  # shared, not copied
    _compare_mlps(stock, lambda m, t: NovaSwiGLUMLP.from_module(m)(t), device)
    with pytest.raises(TypeError, match="not a gated MLP"):
        NovaSwiGLUMLP.from_module(torch.nn.Linear(4, 4))


def test_swiglu_mlp_with_peft_lora(device):
    """LoRA-wrapped projections are called, not read: adapter grads match stock PEFT."""
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"],
                          init_lora_weights=False)  # random B so the adapters change the output
    stock = peft.inject_adapter_in_model(cfg, _tiny_qwen3_mlp())
    assert any("lora_" in n for n, p in stock.named_parameters() if p.requires_grad)
    _compare_mlps(stock, lambda m, t: swiglu_mlp(t, m.gate_proj, m.up_proj, m.down_proj), device)


# ---- fused [gate | up] (Phi-3) ---------------------------------------------------------------------------

@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype,shape", [(torch.float32, (37, 2 * 127)), (torch.bfloat16, (2, 19, 2 * 48)),
                                         (torch.float32, (1, 1, 2))])
def test_swiglu_gate_up_autograd_matches_fp32_reference(dtype, shape, inplace, device):
    """One [gate | up] tensor (what Phi-3's gate_up_proj returns): values and its gradient against autograd of
    silu(gate) * up on its halves in fp32; with inplace_backward the gradient is written over the input."""
    gen = torch.Generator().manual_seed(0)
    leaf = (3 * torch.randn(shape, generator=gen)).to(dtype).to(device).requires_grad_(True)
    gate_up = leaf * 1  # a non-leaf, as a projection output is (autograd does not let a leaf be overwritten)
    dy = torch.randn(shape[:-1] + (shape[-1] // 2,), generator=gen).to(dtype).to(device)
    y = swiglu_gate_up(gate_up, inplace_backward=inplace)
    y.backward(dy)
    ref = leaf.detach().float().requires_grad_(True)
    g32, u32 = ref.chunk(2, dim=-1)
    ry = torch.nn.functional.silu(g32) * u32
    ry.backward(dy.float())
    assert y.dtype == dtype and leaf.grad.dtype == dtype and y.shape == ry.shape
    assert_close(y, ry, _tol(dtype), "y")
    assert_close(leaf.grad, ref.grad, _tol(dtype), "dgate_up")
    if inplace:
        assert torch.equal(gate_up.detach(), leaf.grad), "the gradient was written over gate_up"
    with pytest.raises(ValueError, match="even"):
        swiglu_gate_up(torch.randn(3, 5, device=device))


def test_swiglu_gate_up_mlp_matches_hf_phi3_mlp(device):
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3MLP

    torch.manual_seed(0)
    stock = Phi3MLP(Phi3Config(hidden_size=64, intermediate_size=80, num_attention_heads=4, vocab_size=128)).float()
    _compare_mlps(stock, lambda m, t: swiglu_gate_up_mlp(t, m.gate_up_proj, m.down_proj), device)


# ---- GPU only ------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_real_shape_autograd():
    _check_autograd((4096, 9728), torch.bfloat16, "cuda", BF16_RNE)


@pytest.mark.gpu
def test_gpu_compiled_mlp_matches_eager():
    """torch.compile(fullgraph=True) traces the custom ops through their fake impls and gives the same values."""
    mlp = _tiny_qwen3_mlp().cuda()

    def fn(m, t):
        return swiglu_mlp(t, m.gate_proj, m.up_proj, m.down_proj)

    compiled = torch.compile(fn, fullgraph=True)
    _compare_mlps(mlp, compiled, "cuda")


# ---- in-place backward (the fused MLP's path) ---------------------------------------------------------------

def _mlp_grads(inplace: bool, dtype, device):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 64, generator=gen).to(dtype).to(device).requires_grad_(True)
    wg = (0.3 * torch.randn(127, 64, generator=gen)).to(dtype).to(device).requires_grad_(True)
    wu = (0.3 * torch.randn(127, 64, generator=gen)).to(dtype).to(device).requires_grad_(True)
    dy = torch.randn(37, 127, generator=gen).to(dtype).to(device)
    gate, up = x @ wg.T, x @ wu.T
    ptrs = {"gate": gate.data_ptr(), "up": up.data_ptr()}
    seen = {}
    gate.register_hook(lambda g: seen.__setitem__("dgate", g.data_ptr()))
    up.register_hook(lambda g: seen.__setitem__("dup", g.data_ptr()))
    y = swiglu(gate, up, inplace_backward=inplace)
    y.backward(dy)
    return (y.detach(), x.grad, wg.grad, wu.grad), ptrs, seen


@pytest.mark.parametrize("backend", ["default", "reference"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_inplace_backward_same_numbers_in_gate_up_memory(dtype, backend, device, reference_backend):
    """inplace_backward gives bit-identical y and gradients (the same kernel, other destinations), and the
    gradients reaching gate/up ARE gate's/up's memory (the point: no two new activation-sized buffers)."""
    if backend == "reference":
        reference_backend()
        device = "cpu"
    ref, _, _ = _mlp_grads(False, dtype, device)
    got, ptrs, seen = _mlp_grads(True, dtype, device)
    for name, a, b in zip(("y", "dx", "dwg", "dwu"), got, ref):
        assert torch.equal(a, b), name
    assert seen == {"dgate": ptrs["gate"], "dup": ptrs["up"]}


def test_inplace_backward_refuses_a_second_backward(device):
    x = torch.randn(5, 16, device=device, requires_grad=True)
    gate, up = x * 1.5, x - 0.25  # non-leaf, owned by the op like projection outputs
    y = swiglu(gate, up, inplace_backward=True)
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="cannot run twice"):
        y.sum().backward()


def test_inplace_backward_breaks_other_savers_loudly(device):
    """Another node that saved gate (created earlier, so its backward runs after ours) must fail on the version
    check, not silently read gradients."""
    x = torch.randn(5, 16, device=device, requires_grad=True)
    gate, up = x * 1.5, x - 0.25
    p = gate.pow(2)  # saves gate
    y = swiglu(gate, up, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (y.sum() + p.sum()).backward()


def test_swiglu_mlp_inplace_matches_out_of_place(device):
    torch.manual_seed(0)
    lin = [torch.nn.Linear(32, 127, bias=False), torch.nn.Linear(32, 127, bias=False),
           torch.nn.Linear(127, 32, bias=False)]
    lin = [m.to(device) for m in lin]
    x = torch.randn(3, 37, 32, device=device)
    grads = []
    for inplace in (True, False):
        for m in lin:
            m.zero_grad(set_to_none=True)
        swiglu_mlp(x, *lin, inplace_backward=inplace).square().sum().backward()
        grads.append([m.weight.grad.clone() for m in lin])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["same_tensor", "leaves", "views_of_leaves"])
def test_inplace_backward_leaves_shared_or_user_tensors_alone(case, device):
    """inplace_backward writes gradients over gate and up only when the op owns them: swiglu(h, h) (one buffer for
    both gradients) and leaves (a user's tensors, whose values must survive the backward) take the out-of-place
    backward, with gradients equal to autograd of silu(gate) * up in fp32."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(7, 33, generator=gen).to(device)
    if case == "same_tensor":
        leaf = x.clone().requires_grad_(True)
        h = leaf * 1
        swiglu(h, h, inplace_backward=True).sum().backward()
        ref = x.clone().requires_grad_(True)
        (torch.nn.functional.silu(ref) * ref).sum().backward()
        assert_close(leaf.grad, ref.grad, _tol(torch.float32), "d(silu(h) * h)")
    else:
        gate, up = x.clone().requires_grad_(True), (x.flip(0) * 0.5).requires_grad_(True)
        kept = gate.detach().clone(), up.detach().clone()
        args = (gate, up) if case == "leaves" else (gate.view(7, 3, 11), up.view(7, 3, 11))
        swiglu(*args, inplace_backward=True).sum().backward()
        assert torch.equal(gate.detach(), kept[0]) and torch.equal(up.detach(), kept[1]), "a leaf was overwritten"
        g32, u32 = kept[0].clone().requires_grad_(True), kept[1].clone().requires_grad_(True)
        (torch.nn.functional.silu(g32) * u32).sum().backward()
        assert_close(gate.grad, g32.grad, _tol(torch.float32), "dgate")
        assert_close(up.grad, u32.grad, _tol(torch.float32), "dup")
