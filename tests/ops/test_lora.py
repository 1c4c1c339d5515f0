"""LoRA linear op layer (novatune.ops.lora): autograd (eager Function and registered op) against the fp32
reference, every gradient (x, A, B, trainable bias, unfrozen W, the dropout branch), and opcheck.

Tolerances as in tests/kernels/test_lora.py (the op layer adds no arithmetic): fp32 1e-5 (summation order);
bf16 8e-3 (fp32-accumulated GEMMs, at most three bf16 roundings on the way to each output, each <= 2^-9).
The eager path and the registered op run the same launchers, so they must agree bit for bit.
"""
import pytest
import torch

from novatune.measure.numerics import assert_close
from novatune.ops.lora import lora_linear
from novatune.reference.lora import lora_linear_ref

TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}


def _leaves(lead, n_in, n_out, r, dtype, adapter_dtype=None, bias=True, train_bias=False, train_w=False, seed=0,
            device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ad = adapter_dtype or dtype
    x = torch.randn(*lead, n_in, generator=g).to(device, dtype).requires_grad_(True)
    w = (torch.randn(n_out, n_in, generator=g) / n_in ** 0.5).to(device, dtype).requires_grad_(train_w)
    b = torch.randn(n_out, generator=g).to(device, dtype).requires_grad_(train_bias) if bias else None
    a = (torch.randn(r, n_in, generator=g) / n_in ** 0.5).to(device, ad).requires_grad_(True)
    bb = (torch.randn(n_out, r, generator=g) / r ** 0.5).to(device, ad).requires_grad_(True)
    dy = torch.randn(*lead, n_out, generator=g).to(device, dtype)
    return x, w, b, a, bb, dy


def _grads(fn, tensors, dy):
    for t in tensors:
        if t is not None:
            t.grad = None
    y = fn()
    y.backward(dy)
    return y.detach(), [None if t is None or not t.requires_grad else t.grad for t in tensors]


def _ref_grads(x, w, b, a, bb, s, dy, x_lora_fn=None):
    leaves = [None if t is None else t.detach().float().requires_grad_(t.requires_grad) for t in (x, w, b, a, bb)]
    x32, w32, b32, a32, bb32 = leaves
    return _grads(lambda: lora_linear_ref(x32, w32, b32, a32, bb32, s,
                                          None if x_lora_fn is None else x_lora_fn(x32)), leaves, dy.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("lead,n_in,n_out,r", [((1,), 127, 65, 4), ((37,), 127, 96, 8), ((4097,), 64, 48, 16),
                                               ((2, 37), 127, 96, 8), ((1, 3), 2560, 127, 16)],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_autograd_matches_fp32_reference(lead, n_in, n_out, r, dtype, device):
    x, w, b, a, bb, dy = _leaves(lead, n_in, n_out, r, dtype, device=device)
    y, got = _grads(lambda: lora_linear(x, w, b, a, bb, 2.0), (x, w, b, a, bb), dy)
    ry, ref = _ref_grads(x, w, b, a, bb, 2.0, dy)
    assert y.shape == (*lead, n_out) and y.dtype == dtype
    assert_close(y, ry, TOL[dtype], "y")
    assert got[1] is None and got[2] is None, "frozen W and bias get no gradient"
    for name, i in (("dx", 0), ("dA", 3), ("dB", 4)):
        assert got[i].dtype == dtype
        assert_close(got[i], ref[i], TOL[dtype], name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_trainable_bias_and_weight(dtype, device):
    """LoraConfig(bias="all") trains the base bias; an unfrozen W gets dW = dyᵀ x (computed only then)."""
    x, w, b, a, bb, dy = _leaves((37,), 127, 96, 8, dtype, train_bias=True, train_w=True, device=device)
    _, got = _grads(lambda: lora_linear(x, w, b, a, bb, 0.5), (x, w, b, a, bb), dy)
    _, ref = _ref_grads(x, w, b, a, bb, 0.5, dy)
    for name, i in (("dx", 0), ("dW", 1), ("dbias", 2), ("dA", 3), ("dB", 4)):
        assert_close(got[i], ref[i], TOL[dtype], name)


def test_fp32_adapters_on_bf16_base_and_no_bias(device):
    x, w, _, a, bb, dy = _leaves((2, 37), 127, 96, 8, torch.bfloat16, adapter_dtype=torch.float32, bias=False,
                                 device=device)
    y, got = _grads(lambda: lora_linear(x, w, None, a, bb, 2.0), (x, w, None, a, bb), dy)
    ry, ref = _ref_grads(x, w, None, a, bb, 2.0, dy)
    assert y.dtype == torch.bfloat16 and got[3].dtype == got[4].dtype == torch.float32
    assert_close(y, ry, TOL[torch.bfloat16], "y")
    for name, i in (("dx", 0), ("dA", 3), ("dB", 4)):
        assert_close(got[i], ref[i], TOL[torch.bfloat16], name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_dropout_branch_gradient_flows_through_the_mask(dtype, device):
    """x_lora = dropout(x) built by the caller: dx = dy W + mask/(1-p) * (s (dy B) A), as PEFT's module gives."""
    x, w, b, a, bb, dy = _leaves((37,), 127, 96, 8, dtype, device=device)
    keep = ((torch.rand(x.shape, generator=torch.Generator().manual_seed(3)) > 0.25).float() / 0.75).to(device)

    def x_lora(t):
        return t.float() * keep  # fp32, as PEFT's cast-then-dropout gives with fp32 adapters

    y, got = _grads(lambda: lora_linear(x, w, b, a, bb, 2.0, x_lora=x_lora(x)), (x, w, b, a, bb), dy)
    ry, ref = _ref_grads(x, w, b, a, bb, 2.0, dy, x_lora)
    assert_close(y, ry, TOL[dtype], "y")
    for name, i in (("dx", 0), ("dA", 3), ("dB", 4)):
        assert_close(got[i], ref[i], TOL[dtype], name)


@pytest.mark.parametrize("with_dropout", [False, True])
def test_registered_op_equals_eager_path(with_dropout, device):
    x, w, b, a, bb, dy = _leaves((2, 37), 127, 96, 8, torch.bfloat16, adapter_dtype=torch.float32, train_bias=True,
                                 device=device)
    keep = ((torch.rand(x.shape, generator=torch.Generator().manual_seed(3)) > 0.25).float() / 0.75).to(device)
    xl = (lambda t: t.float() * keep) if with_dropout else (lambda t: None)  # noqa: E731
    y1, g1 = _grads(lambda: lora_linear(x, w, b, a, bb, 2.0, x_lora=xl(x)), (x, b, a, bb), dy)
    y2, g2 = _grads(lambda: torch.ops.novatune.lora_linear_fwd(x, w, b, a, bb, 2.0, xl(x))[0], (x, b, a, bb), dy)
    assert torch.equal(y1, y2)
    for u, v in zip(g1, g2):
        assert torch.equal(u, v)


def test_no_input_grad_skips_dx():
    """Layer 0's projections read embeddings that need no gradient: no dx GEMM (the largest backward GEMM)."""
    x, w, b, a, bb, dy = _leaves((5,), 16, 12, 4, torch.float32)
    x.requires_grad_(False)
    lora_linear(x, w, b, a, bb, 1.0).backward(dy)
    assert x.grad is None and a.grad is not None and bb.grad is not None


def test_opcheck(device):
    """Schema, fake impls, autograd registration and AOT dispatch of both ops: bias / no bias, dropout branch,
    fp32 and bf16-with-fp32-adapters."""
    from torch.library import opcheck

    for dtype, ad in ((torch.float32, None), (torch.bfloat16, torch.float32)):
        x, w, b, a, bb, dy = _leaves((2, 5), 16, 12, 4, dtype, adapter_dtype=ad, train_bias=True, device=device)
        xl = (x.detach().float() * 2).requires_grad_(True)
        # eager against AOT-compiled: the same op on the same values, but the compiled graph may hand the GEMMs
        # other strides, and cuBLAS another kernel with another summation order. With bf16 activations the fp32
        # adapters' gradients come out of bf16 GEMMs: two bf16 spacings (2^-7 relative) on the GPU
        tol = {"atol": 1e-2, "rtol": 2 ** -7 * 2} if dtype == torch.bfloat16 and device == "cuda" else {}
        for bias, x_lora in ((b, None), (None, None), (b, xl)):
            opcheck(torch.ops.novatune.lora_linear_fwd.default, (x, w, bias, a, bb, 2.0, x_lora), **tol)
        y, xa = torch.ops.novatune.lora_linear_fwd(x, w, b, a, bb, 2.0, None)
        for x_lora in (None, xl.detach()):
            for flags in ((True, False, True, True, True), (False, True, False, True, False)):
                opcheck(torch.ops.novatune.lora_linear_bwd.default,
                        (dy, x.detach(), w, b.detach(), a.detach(), bb.detach(), xa.detach(), 2.0, x_lora, *flags),
                        **tol)


@pytest.mark.timing
@pytest.mark.gpu
def test_faster_than_peft_eager_on_gpu():
    """Speed sanity at Qwen3-4B's gate_proj (4096 x 2560 -> 9728, r 16, PEFT's fp32 adapters): the fused op's
    fwd+bwd must not be slower than PEFT's eager expression (bench/bench_lora.py measures by how much)."""
    from novatune.measure.timing import wall_us

    x, w, _, a, bb, dy = _leaves((4096,), 2560, 9728, 16, torch.bfloat16, adapter_dtype=torch.float32, bias=False,
                                 device="cuda")
    F = torch.nn.functional

    def peft_expr(t):  # PEFT's Linear.forward for one adapter: base + B(A(x.to(A.dtype))) * s, cast back
        return (F.linear(t, w) + F.linear(F.linear(t.to(a.dtype), a), bb) * 2.0).to(t.dtype)

    def step(fn):
        def run():
            x.grad = a.grad = bb.grad = None
            fn(x).backward(dy)
        return run

    ours = wall_us(step(lambda t: lora_linear(t, w, None, a, bb, 2.0)))
    theirs = wall_us(step(peft_expr))
    assert ours <= theirs, f"novatune {ours:.0f} µs vs PEFT eager {theirs:.0f} µs"


def _second_order(fn, inputs):
    """The backward of fn's gradients (create_graph=True; dy itself in a graph, so autograd records the backward):
    what a gradient penalty computes. torch.autograd.grad(..., allow_unused=True) would return None instead."""
    out = fn(*inputs)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).requires_grad_(True)
    grads = torch.autograd.grad(out, inputs, dy, create_graph=True)
    sum((g * g).sum() for g in grads).backward()


def test_double_backward_raises_instead_of_being_wrong():
    """The backward reads xa = x Aᵀ saved from the forward, so a second-order gradient through it would miss that
    dependence (it came back silently wrong: 0.9 relative error in x, 1.0 in A). Both paths refuse it."""
    x, w, _, a, bb, _ = _leaves((3,), 37, 29, 4, torch.float32, bias=False, seed=11)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        _second_order(lambda x, a, bb: lora_linear(x, w, None, a, bb, 0.5), [x, a, bb])
    with pytest.raises(RuntimeError, match="no autograd formula"):
        _second_order(lambda x, a, bb: torch.ops.novatune.lora_linear_fwd(x, w, None, a, bb, 0.5, None)[0],
                      [x, a, bb])


@pytest.mark.parametrize("which", ["weight", "bias", "lora_a", "lora_b", "x_lora"])
def test_operand_on_another_device_raises(which):
    """A meta (not materialised) base weight made the big GEMM a silent no-op; every operand is checked by name."""
    x, w, b, a, bb, _ = _leaves((3,), 37, 29, 4, torch.float32, seed=12)
    args = {"weight": w, "bias": b, "lora_a": a, "lora_b": bb, "x_lora": x.detach() * 2}
    args[which] = args[which].detach().to("meta")
    with pytest.raises(ValueError, match=f"{which} is on meta but x on cpu"):
        lora_linear(x, args["weight"], args["bias"], args["lora_a"], args["lora_b"], 1.0, x_lora=args["x_lora"])


@pytest.mark.parametrize("shape", [(16,), (1,), (29, 1)])
def test_bias_of_another_shape_raises(shape):
    """The bias must be (out,): a (1,) one broadcast silently, a wrong length raised deep in the GEMM."""
    x, w, _, a, bb, _ = _leaves((3,), 37, 29, 4, torch.float32, bias=False, seed=13)
    with pytest.raises(ValueError, match=r"bias must be \(29,\)"):
        lora_linear(x, w, torch.zeros(shape), a, bb, 1.0)
