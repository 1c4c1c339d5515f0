"""novatune.ops.geglu / geglu_mlp: registered ops (opcheck), the eager path equal to the registered op, the in-place
backward, and agreement with transformers' Gemma MLP (gelu_pytorch_tanh).

Tolerances as tests/kernels/test_geglu.py: fp32 1e-5, bf16 1e-2 (one rounding per output, interpreter truncation
included)."""
import pytest
import torch

from novatune.measure.numerics import REL_TOL, assert_close
from novatune.ops import geglu, geglu_mlp
from novatune.reference.geglu import hf_geglu


def _leaf(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate = (3 * torch.randn(shape, generator=g)).to(device, dtype).requires_grad_()
    up = torch.randn(shape, generator=g).to(device, dtype).requires_grad_()
    dy = torch.randn(shape, generator=g).to(device, dtype)
    return gate, up, dy


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_autograd_matches_fp32_reference(dtype, inplace, device):
    g, u, dy = _leaf((2, 37, 96), dtype, device)
    gr, ur = g.detach().float().requires_grad_(), u.detach().float().requires_grad_()
    ref = hf_geglu(gr, ur)
    ref.backward(dy.float())
    # fresh gate/up from an op, as the MLP's projections give them (in place: the op writes its gradients there)
    y = geglu(g * 1, u * 1, inplace_backward=inplace)
    y.backward(dy)
    tol = 1e-5 if dtype == torch.float32 else REL_TOL[dtype]
    assert_close(y, ref, tol, "y")
    assert_close(g.grad, gr.grad, tol, "dgate")
    assert_close(u.grad, ur.grad, tol, "dup")


def test_eager_and_registered_op_agree(device):
    g, u, dy = _leaf((5, 33), torch.bfloat16, device)
    y1 = geglu(g, u)
    d1 = torch.autograd.grad(y1, (g, u), dy)
    y2 = torch.ops.novatune.geglu_fwd(g, u)
    d2 = torch.autograd.grad(y2, (g, u), dy)
    assert torch.equal(y1, y2) and all(torch.equal(a, b) for a, b in zip(d1, d2))


def test_opcheck(device):
    g, u, dy = _leaf((3, 40), torch.float32, device)
    torch.library.opcheck(torch.ops.novatune.geglu_fwd.default, (g, u))
    torch.library.opcheck(torch.ops.novatune.geglu_bwd.default, (dy, g.detach(), u.detach()))


def test_geglu_mlp_matches_hf_gemma2_mlp(device):
    import transformers
    from transformers.models.gemma2.modeling_gemma2 import Gemma2MLP

    cfg = transformers.Gemma2Config(hidden_size=48, intermediate_size=80)
    torch.manual_seed(0)
    mlp = Gemma2MLP(cfg).to(device)
    x = torch.randn(2, 9, 48, device=device, requires_grad=True)
    ref = mlp(x)
    grads_ref = torch.autograd.grad(ref.sum(), (x, *mlp.parameters()))
    y = geglu_mlp(x, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    grads = torch.autograd.grad(y.sum(), (x, *mlp.parameters()))
    assert_close(y, ref, 1e-5, "y")
    for a, b in zip(grads, grads_ref):
        assert_close(a, b, 1e-5, "grad")


def test_integer_inputs_are_refused():
    ints = torch.randint(-3, 4, (3, 6))
    with pytest.raises(TypeError, match="geglu: inputs must be floating point"):
        geglu(ints, ints)
