"""novatune.ops.moe_experts_lora: LoRA on the routed experts inside the grouped GEMMs, against the fp32 oracle
that forms each adapted weight W_e + s * B_e A_e (reference.moe.lora_weight_ref) and runs the per-expert MLP.

Tolerances (relative-norm error against the fp32 oracle):
* fp32: grouped GEMMs in another summation order, the adapter as two thin GEMMs instead of one folded weight
  -> 1e-5 (measured ~3e-7).
* bf16: as the base op (tests/ops/test_moe.py: 2e-2), plus the adapter's output and its (S, r) products rounded to
  bf16 once each (2^-9 relative on a term smaller than the base's).
"""
import pytest
import torch

from novatune.measure.numerics import assert_close
from novatune.ops import moe as M
from novatune.ops import moe_lora as L
from novatune.reference import moe as R

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
CASES = {  # name: (tokens, hidden, intermediate, experts, top-k, rank, transposed, interleaved, bias, activation)
    "qwen3 layout E5 r4": (13, 64, 32, 5, 2, 4, False, False, False, "silu"),
    "odd sizes E7 top3 r3": (11, 37, 19, 7, 3, 3, False, False, False, "silu"),
    "gpt-oss layout E5 r2": (9, 32, 16, 5, 2, 2, True, True, True, "gpt_oss"),
    "one token top1 r1": (1, 16, 8, 3, 1, 1, False, False, False, "silu"),
    "aligned sizes E5 r3": (13, 64, 32, 5, 2, 3, False, False, False, "silu"),  # odd rank, CUDA-friendly rows
}
NAMES = ("x", "weights", "gate_up A", "gate_up B", "down A", "down B", "gate_up_bias", "down_bias")


def _inputs(case, dtype, seed=0):
    t, h, i, e, k, r, tr, il, bias, act = case
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e - 1, generator=gen)[:k] for _ in range(t)])  # expert e-1 never chosen
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    gu = (rnd(e, h, 2 * i) if tr else rnd(e, 2 * i, h)) / h ** 0.5
    dn = (rnd(e, i, h) if tr else rnd(e, h, i)) / i ** 0.5
    # B away from PEFT's zero init, so the adapters change the result
    trainable = [rnd(t, h), torch.rand(t, k, generator=gen), rnd(e, r, h) / h ** 0.5, rnd(e, 2 * i, r) / r ** 0.5,
                 rnd(e, r, i) / i ** 0.5, rnd(e, h, r) / r ** 0.5,
                 rnd(e, 2 * i) * 0.1 if bias else None, rnd(e, h) * 0.1 if bias else None]
    trainable = [None if v is None else v.to(dtype).requires_grad_() for v in trainable]
    return ids, trainable, gu.to(dtype), dn.to(dtype), dict(transposed=tr, interleaved=il, activation=act)


def _oracle_act(activation):
    if activation == "silu":
        return R.glu_ref
    return lambda h, interleaved: M._gpt_oss_glu_fwd(h, interleaved).float()  # its own oracle: test_clamped_swiglu


def _run(ids, tensors, gu, dn, layout, sides=("gate_up", "down"), scalings=(2.0, 0.5)):
    x, w, ga, gb, da, db, gub, dnb = tensors
    return L.moe_experts_lora(x, ids, w, gu, dn, gub, dnb,
                              gate_up_lora=(ga, gb, scalings[0]) if "gate_up" in sides else None,
                              down_lora=(da, db, scalings[1]) if "down" in sides else None, **layout)


def _oracle(ids, tensors, gu, dn, layout, sides=("gate_up", "down"), scalings=(2.0, 0.5)):
    x, w, ga, gb, da, db, gub, dnb = tensors
    tr = layout["transposed"]
    gu_eff = R.lora_weight_ref(gu, ga, gb, scalings[0], tr) if "gate_up" in sides else gu.float()
    dn_eff = R.lora_weight_ref(dn, da, db, scalings[1], tr) if "down" in sides else dn.float()
    f = lambda v: None if v is None else v.float()  # noqa: E731
    return R.experts_ref(x.float(), ids, w.float(), gu_eff, dn_eff, f(gub), f(dnb), transposed=tr,
                         interleaved=layout["interleaved"], activation=_oracle_act(layout["activation"]))


def _check(case, dtype, sides=("gate_up", "down")):
    ids, tensors, gu, dn, layout = _inputs(case, dtype)
    out = _run(ids, tensors, gu, dn, layout, sides)
    assert out.dtype == dtype and out.shape == tensors[0].shape
    ref_in = [None if v is None else v.detach().float().requires_grad_() for v in tensors]
    ref = _oracle(ids, ref_in, gu, dn, layout, sides)
    assert_close(out, ref, TOL[dtype], "out")
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    live = [j for j, v in enumerate(tensors) if v is not None and (j < 2 or j > 5 or NAMES[j].split()[0] in sides)]
    grads = torch.autograd.grad(out, [tensors[j] for j in live], dout.to(dtype))
    refs = torch.autograd.grad(ref, [ref_in[j] for j in live], dout)
    for j, g, rg in zip(live, grads, refs):
        assert g.dtype == tensors[j].dtype, NAMES[j]
        assert_close(g, rg, TOL[dtype], NAMES[j])
        if j in (2, 3, 4, 5):
            e = g.shape[0]
            assert torch.equal(g[e - 1], torch.zeros_like(g[e - 1])), f"{NAMES[j]}: an unused expert gets zero"
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_lora_experts_forward_and_gradients_match_the_adapted_weight_oracle(name, dtype):
    _check(CASES[name], dtype)


@pytest.mark.parametrize("side", ["gate_up", "down"])
def test_one_adapted_projection(side):
    """One wrapped weight only (PEFT targets each parameter separately): the other stays the frozen base."""
    _check(CASES["gpt-oss layout E5 r2"], torch.float32, sides=(side,))
    _check(CASES["qwen3 layout E5 r4"], torch.float32, sides=(side,))


def test_rank_padding_adds_nothing(monkeypatch, reference_backend):
    """torch's path on CUDA pads the rank with zeros (r=3 -> 8), forced here on the CPU: same values and
    gradients."""
    reference_backend()
    monkeypatch.setattr(L, "rank_multiple", lambda t: 8)
    _check(CASES["odd sizes E7 top3 r3"], torch.float32)
    _check(CASES["odd sizes E7 top3 r3"], torch.bfloat16)


def test_peft_factor_gradients_are_written_in_their_dtype(device):
    """PEFT's fp32 storage (lora_A (r*E, in), lora_B (out, r*E) seen as (E, out, r)) on bf16 weights: on the
    Triton path the factor gradients come out of their kernel in fp32 (no bf16 result cast afterwards: no
    factor-sized dtype cast in the backward), and the leaves' gradients match the oracle's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    # CUDA's grouped GEMM needs 16-byte row strides (hidden 37 has none): an aligned case there, odd sizes here
    case = CASES["odd sizes E7 top3 r3" if device == "cpu" else "aligned sizes E5 r3"]
    ids, tensors, gu, dn, layout = _inputs(case, torch.bfloat16)
    ids, gu, dn = ids.to(device), gu.to(device), dn.to(device)
    tensors = [None if v is None else v.detach().to(device).requires_grad_() for v in tensors]
    e, r = gu.shape[0], case[5]
    leaves, views = [], []
    for j in (2, 4):  # A (E, r, in) from lora_A (r*E, in); B (E, out, r) from lora_B (out, r*E)
        a = tensors[j].detach().float().reshape(e * r, -1).requires_grad_()
        b = tensors[j + 1].detach().float().permute(1, 2, 0).reshape(-1, r * e).requires_grad_()
        leaves += [a, b]
        views += [a.view(e, r, -1), b.view(b.shape[0], r, e).permute(2, 0, 1)]
    sizes = {v.numel() for v in views}

    class Casts(TorchDispatchMode):
        seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if (func.overloadpacket.__name__ == "_to_copy" and isinstance(out, torch.Tensor)
                    and out.dtype == torch.float32 and out.numel() in sizes):
                Casts.seen.append(tuple(out.shape))
            return out

    x, w = tensors[:2]
    out = L.moe_experts_lora(x, ids, w, gu, dn, gate_up_lora=(views[0], views[1], 2.0),
                             down_lora=(views[2], views[3], 0.5), **layout)
    with Casts():
        out.float().square().sum().backward()
    if M.use_triton(x):
        assert Casts.seen == []
    ref_in = [x.detach().float(), w.detach().float(), *[v.detach() for v in views], None, None]
    ref_in[2:6] = [v.requires_grad_() for v in ref_in[2:6]]
    ref = _oracle(ids, ref_in, gu, dn, layout)
    ref.square().sum().backward()
    for leaf, view, name in zip(leaves, ref_in[2:6], NAMES[2:6]):
        assert leaf.grad.dtype == torch.float32
        assert_close(leaf.grad, view.grad.reshape(leaf.shape) if name.endswith("A") else
                     view.grad.permute(1, 2, 0).reshape(leaf.shape), TOL[torch.bfloat16], name)


def test_frozen_base_gets_no_gradient_and_fp32_adapters_on_bf16_weights():
    """PEFT's setup: bf16 frozen expert weights, fp32 adapters. The GEMMs run in bf16 (the adapters cast, as PEFT
    casts them before forming its delta); the adapters' gradients come back fp32; the base gets none."""
    ids, tensors, gu, dn, layout = _inputs(CASES["qwen3 layout E5 r4"], torch.bfloat16)
    tensors[2:6] = [v.detach().float().requires_grad_() for v in tensors[2:6]]
    out = _run(ids, tensors, gu, dn, layout)
    out.float().square().sum().backward()
    assert gu.grad is None and dn.grad is None and not gu.requires_grad
    assert all(v.grad is not None and v.grad.dtype == torch.float32 for v in tensors[2:6])
    ref_in = [None if v is None else v.detach().float() for v in tensors]
    assert_close(out, _oracle(ids, ref_in, gu, dn, layout), TOL[torch.bfloat16], "out")


def test_without_adapters_it_is_the_base_op():
    ids, tensors, gu, dn, layout = _inputs(CASES["qwen3 layout E5 r4"], torch.float32)
    x, w = tensors[:2]
    got = L.moe_experts_lora(x, ids, w, gu, dn, **layout)
    assert torch.equal(got, M.moe_experts(x, ids, w, gu, dn, **layout))


def test_bad_factor_shapes_name_the_mismatch():
    ids, tensors, gu, dn, layout = _inputs(CASES["qwen3 layout E5 r4"], torch.float32)
    x, w, ga, gb = tensors[:4]
    with pytest.raises(ValueError, match="do not match the weight"):
        L.moe_experts_lora(x, ids, w, gu, dn, down_lora=(ga, gb, 1.0), **layout)  # gate_up's factors on down
    with pytest.raises(ValueError, match=r"\(E, r, in\)"):
        L.moe_experts_lora(x, ids, w, gu, dn, gate_up_lora=(ga[1:], gb, 1.0), **layout)


@pytest.mark.parametrize("factor_dtype", [torch.float32, torch.bfloat16], ids=["fp32-factors", "bf16-factors"])
@pytest.mark.parametrize("path", ["triton", "torch"])
def test_factors_are_cast_and_laid_out_in_one_pass_each(factor_dtype, path, reference_backend, device):
    """PEFT's B is a permuted view of its (out, r * E) storage and its factors are often fp32: the padded factors
    for the bf16 GEMMs come from one pass per factor (cast and layout together), not a cast and then a copy. On
    the Triton path B's pass is one kernel reading the storage in its own order (no torch copy at all)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    if path == "torch":
        reference_backend()
    elif not M.use_triton(torch.zeros(1, device=device)):
        pytest.skip("the Triton path needs CUDA or the CPU interpreter")

    class Copies(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("_to_copy", "clone", "copy_", "contiguous"):
                Copies.n += 1
            return func(*args, **(kwargs or {}))

    e, r, i, o = 3, 8, 16, 12
    a = torch.randn(e * r, i).to(factor_dtype).view(e, r, i).to(device)
    b = torch.randn(o, r * e).to(factor_dtype).view(o, r, e).permute(2, 0, 1).to(device)
    with Copies():
        pa, pb = L._pad_rank(a, b, torch.bfloat16)
    assert pa.is_contiguous() and pb.is_contiguous() and pa.dtype == pb.dtype == torch.bfloat16
    assert torch.equal(pa, a.to(torch.bfloat16)) and torch.equal(pb, b.to(torch.bfloat16))
    a_casts = 1 if factor_dtype == torch.float32 else 0
    if path == "triton" and device == "cpu":
        return  # Triton's CPU interpreter copies every argument in and out itself: only the GPU counts
    assert Copies.n == a_casts + (1 if path == "torch" else 0), "one pass per factor that needs one"


def test_double_backward_raises_and_bad_ids_are_refused():
    """h and u A^T are saved from the forward, so a second-order gradient would miss their dependence: the
    Function is once-differentiable. Expert ids outside [0, E) raise before anything is read."""
    ids, tensors, gu, dn, layout = _inputs(CASES["odd sizes E7 top3 r3"], torch.float32, seed=5)
    x, w, ga, gb, da, db = tensors[:6]
    out = L.moe_experts_lora(x, ids, w, gu, dn, gate_up_lora=(ga, gb, 0.5), down_lora=(da, db, 2.0), **layout)
    leaves = [x, w, ga, gb, da, db]
    grads = torch.autograd.grad(out, leaves, torch.randn(out.shape).requires_grad_(), create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        sum((g * g).sum() for g in grads).backward()
    bad = ids.clone()
    bad[0, 0] = 7
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 7\)"):
        L.moe_experts_lora(x, bad, w, gu, dn, gate_up_lora=(ga, gb, 0.5), **layout)


@pytest.mark.parametrize("name", ["qwen3 layout E5 r4", "gpt-oss layout E5 r2"])
@pytest.mark.parametrize("adapters", [True, False], ids=["lora", "base-op"])
def test_an_unread_output_gives_the_same_gradients(name, adapters, monkeypatch):
    """output_unread (a recompute whose result only roots the backward): the down projection and combine are
    skipped (counted), the output is uninitialised, and every gradient equals the full forward's bit for bit (the
    backward never reads the expert outputs)."""
    downs = []
    real = M._linear
    monkeypatch.setattr(M, "_linear", lambda a, w, *rest: downs.append(w) or real(a, w, *rest))
    ids, tensors, gu, dn, layout = _inputs(CASES[name], torch.float32)
    x, w, ga, gb, da, db, gub, dnb = tensors
    live = [v for v in (tensors if adapters else [x, w, gub, dnb]) if v is not None]
    dout = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))

    def grads(unread):
        if adapters:
            out = L.moe_experts_lora(x, ids, w, gu, dn, gub, dnb, gate_up_lora=(ga, gb, 2.0),
                                     down_lora=(da, db, 0.5), output_unread=unread, **layout)
        else:
            out = M.moe_experts(x, ids, w, gu, dn, gub, dnb, output_unread=unread, **layout)
        # the decoder layer's residual add: the only consumer a family declaring output_feeds_residual has
        return torch.autograd.grad(x.detach() + out, live, dout)

    unread = grads(True)
    assert [w is dn for w in downs] == [False]  # the gate/up projection only
    for g, ref in zip(unread, grads(False)):
        assert torch.equal(g, ref)
    assert [w is dn for w in downs] == [False, False, True]
