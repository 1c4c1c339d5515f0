"""novatune.ops.linear: F.linear's values and gradients, the weight gradient added into .grad by the GEMM only
where autograd would add it there itself, and project()'s choice of path (fp32 on the CPU: the same GEMM either
way, so the sums agree to fp32 rounding)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import novatune.ops.linear as L
from novatune.ops.linear import linear, project

TOL = dict(rtol=1e-5, atol=1e-5)  # fp32: the same products, summed in another order at most


def _pair(in_f, out_f, bias, seed=0):
    torch.manual_seed(seed)
    a = nn.Linear(in_f, out_f, bias=bias)
    b = nn.Linear(in_f, out_f, bias=bias)
    b.load_state_dict(a.state_dict())
    return a, b


@pytest.fixture
def taken(monkeypatch):
    """Records whether each backward took the in-GEMM path."""
    seen: list[bool] = []
    real = L.accumulates_into_grad

    def spy(p):
        seen.append(real(p))
        return seen[-1]

    monkeypatch.setattr(L, "accumulates_into_grad", spy)
    return seen


@pytest.mark.parametrize("shape,in_f,out_f,bias", [((3, 5), 37, 23, True), ((7,), 16, 9, False),
                                                   ((2, 1, 3), 5, 1, True)])
def test_accumulated_gradients_equal_autograd_over_micro_batches(shape, in_f, out_f, bias, taken):
    ours, ref = _pair(in_f, out_f, bias)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(*shape, in_f, generator=gen)
        w_out = torch.randn(*shape, out_f, generator=gen)  # a random output gradient
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        y1, y2 = project(ours, x1), ref(x2)
        torch.testing.assert_close(y1, y2, rtol=0, atol=0)
        (y1 * w_out).sum().backward()
        (y2 * w_out).sum().backward()
        torch.testing.assert_close(x1.grad, x2.grad, **TOL)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, **TOL)
    if bias:
        torch.testing.assert_close(ours.bias.grad, ref.bias.grad, **TOL)
    assert taken == [False, True, True]  # no .grad on the first micro-batch: returned to autograd


def test_grad_tensor_is_written_in_place(taken):
    ours, _ = _pair(8, 6, False)
    ours.weight.grad = torch.randn(6, 8)  # poisoned start: any value is simply accumulated onto
    start, ptr = ours.weight.grad.clone(), ours.weight.grad.data_ptr()
    x = torch.randn(4, 8)
    dy = torch.randn(4, 6)
    (project(ours, x) * dy).sum().backward()
    assert taken == [True] and ours.weight.grad.data_ptr() == ptr
    torch.testing.assert_close(ours.weight.grad, start + dy.t() @ x, **TOL)


def test_a_tensor_hook_sees_the_gradient(taken):
    ours, _ = _pair(8, 6, True)
    ours.weight.grad = torch.zeros(6, 8)
    got = []
    ours.weight.register_hook(lambda g: got.append(g.clone()))
    x, dy = torch.randn(4, 8), torch.randn(4, 6)
    (project(ours, x) * dy).sum().backward()
    assert taken == [False]
    torch.testing.assert_close(got[0], dy.t() @ x, **TOL)
    torch.testing.assert_close(ours.weight.grad, dy.t() @ x, **TOL)


def test_autograd_grad_returns_the_gradient_and_leaves_grad_alone(taken):
    ours, _ = _pair(8, 6, False)
    ours.weight.grad = torch.ones(6, 8)
    x, dy = torch.randn(4, 8), torch.randn(4, 6)
    (dw,) = torch.autograd.grad((project(ours, x) * dy).sum(), [ours.weight])
    torch.testing.assert_close(dw, dy.t() @ x, **TOL)
    assert torch.equal(ours.weight.grad, torch.ones(6, 8)) and taken == [False]


def test_double_backward_through_create_graph(taken):
    torch.manual_seed(2)
    w = nn.Parameter(torch.randn(5, 4, dtype=torch.float64))
    w.grad = torch.zeros_like(w)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad(linear(x, w).pow(2).sum(), [x], create_graph=True)
    (ref,) = torch.autograd.grad(F.linear(x, w).pow(2).sum(), [x], create_graph=True)
    torch.testing.assert_close(gx, ref)
    gx.sum().backward()
    w_ref = w.detach().clone().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    (g2,) = torch.autograd.grad(F.linear(x2, w_ref).pow(2).sum(), [x2], create_graph=True)
    g2.sum().backward()
    torch.testing.assert_close(w.grad, w_ref.grad)
    assert taken[0] is False  # the create_graph pass (grad mode on in the backward) returns its gradient


def test_project_calls_wrapped_or_hooked_modules_as_modules():
    class Wrapped(nn.Linear):  # a LoRA- or quantisation-style subclass: its own forward must run
        def forward(self, x):
            return super().forward(x) + 1.0

    x = torch.randn(2, 4)
    w = Wrapped(4, 3)
    torch.testing.assert_close(project(w, x), F.linear(x, w.weight, w.bias) + 1.0)
    hooked = nn.Linear(4, 3)
    calls = []
    hooked.register_forward_hook(lambda m, a, out: calls.append(1))
    project(hooked, x)
    assert calls == [1]
    frozen = nn.Linear(4, 3).requires_grad_(False)
    torch.testing.assert_close(project(frozen, x), frozen(x))
    assert project(nn.Linear(4, 3), x, wgrad_in_place=False).grad_fn.name() != "_LinearFunctionBackward"
    assert project(nn.Linear(4, 3), x).grad_fn.name() == "_LinearFunctionBackward"


def test_under_autocast_it_is_f_linear():
    """Under autocast the projection is F.linear itself (autocast casts inside it; this Function's backward would
    meet a bf16 dy and an fp32 weight): fp32 weights, bf16 autocast, an existing .grad, as HF Trainer(bf16=True)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16)
    layer.weight.grad = torch.zeros_like(layer.weight)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = L.project(layer, x)
        want = F.linear(x, layer.weight, layer.bias)
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)
    y.float().sum().backward()
    assert layer.weight.grad.abs().sum() > 0
