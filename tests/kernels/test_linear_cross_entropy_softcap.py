"""Final logit soft-capping inside the fused linear cross-entropy (Gemma 2: the loss of 30 * tanh(logits / 30)),
against the fp32 reference that materialises the capped logits, forward and every gradient, outputs poisoned.

Tolerances: as tests/kernels/test_linear_cross_entropy.py (fp32 1e-5: summation order, plus the tanh written
through the sigmoid, ~1e-7 absolute per logit; bf16 1e-2 for gradients, 2e-3 for the loss: the bf16 logits and dz
roundings). The cap is small here (2.0) so that most logits are capped and a dropped cap or a dropped
(1 - tanh^2) factor shows."""
import math

import pytest
import torch

from novatune.kernels import linear_cross_entropy as K
from novatune.measure.numerics import REL_TOL, assert_close, poison_
from novatune.ops import linear_cross_entropy
from novatune.ops._backend import interpreter_on
from novatune.reference import linear_cross_entropy as oracle

LOSS_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-3}
CAP = 2.0


def _inputs(T, H, V, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=gen)
    w = 3 * torch.randn(V, H, generator=gen) / math.sqrt(H)  # logits std ~3: beyond the cap
    y = torch.randint(0, V, (T,), generator=gen)
    y[torch.rand(T, generator=gen) < 0.2] = -100
    return h.to(dtype), w.to(dtype), y


def _ref(h, w, y, cap=CAP):
    hr, wr = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    loss = oracle.linear_cross_entropy_ref(hr, wr, y, softcap=cap)
    loss.backward()
    return loss.detach(), hr.grad, wr.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,H,V,plan", [(37, 64, 1000, {}), (300, 127, 4099, dict(chunk_tokens=64)),
                                        (1, 16, 257, {}), (37, 64, 4099, dict(mode="vocab", vocab_slice=1024)),
                                        (150, 127, 1000, dict(mode="vocab", vocab_slice=384))],
                         ids=["one-chunk", "chunks", "one-token", "vocab", "vocab-ragged"])
@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch"])
def test_soft_capped_loss_and_gradients_match_reference(T, H, V, plan, dtype, use_triton, device):
    if use_triton and device == "cpu" and not interpreter_on():
        pytest.skip("the Triton row kernel needs CUDA or TRITON_INTERPRET=1")
    h, w, y = (t.to(device) for t in _inputs(T, H, V, dtype, seed=T + V))
    if T == 1:
        y[:] = 3
    rows = poison_(torch.empty(T, device=device))
    gh, gw = (poison_(torch.empty(T, H, dtype=dtype, device=device)),
              poison_(torch.empty(V, H, dtype=dtype, device=device)))
    div = (y != -100).sum().float()
    loss, out_rows, out_gh, out_gw, _ = K.linear_cross_entropy_fwd(
        h, w, y, div, **plan, loss_rows=rows, dhidden=gh, dweight=gw, use_triton=use_triton, softcap=CAP)
    rloss, rgh, rgw = _ref(h, w, y)
    assert_close(loss, rloss, LOSS_TOL[dtype], "loss")
    assert_close(out_gh, rgh, REL_TOL[dtype], "grad_hidden")
    assert_close(out_gw, rgw, REL_TOL[dtype], "grad_weight")
    uncapped = K.linear_cross_entropy_fwd(h, w, y, div, grad_hidden=False, grad_weight=False, use_triton=use_triton)
    assert abs(float(uncapped[0] - loss)) > 1e-2, "the cap must change this loss, or the test proves nothing"


def test_functional_caps_and_auto_never_plans_inplace():
    """The public functional with softcap: the same value and gradients as the fp32 reference; mode 'auto' never
    plans 'inplace' (it overwrites the logits the capped gradient needs), which refuses it; big logits still go to
    'vocab' slices."""
    h, w, y = _inputs(97, 16, 130, torch.float32, seed=5)  # tokens >= hidden: "auto" would pick "inplace"
    assert K.plan_mode(97, 130, 16, torch.float32, True)[0] == "inplace"
    assert K.plan_mode(97, 130, 16, torch.float32, True, softcap=CAP)[0] == "tokens"
    assert K.plan_mode(4096, 256000, 2304, torch.bfloat16, True, softcap=30.0)[0] == "vocab"  # Gemma 2 x 4096
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_cross_entropy(hh, ww, y, softcap=CAP)
    loss.backward()
    rloss, rgh, rgw = _ref(h, w, y)
    assert_close(loss, rloss, 1e-5, "loss")
    assert_close(hh.grad, rgh, 1e-5, "grad_hidden")
    assert_close(ww.grad, rgw, 1e-5, "grad_weight")
    with pytest.raises(ValueError, match="no in-place plan|in-place plan overwrites"):
        linear_cross_entropy(h, w, y, mode="inplace", softcap=CAP)
    with pytest.raises(ValueError, match="softcap must be a positive"):
        linear_cross_entropy(h, w, y, softcap=-1.0)


def test_token_stats_come_from_the_capped_logits():
    h, w, y = _inputs(41, 32, 257, torch.float32, seed=7)
    loss, stats = linear_cross_entropy(h, w, y, reduction="sum", softcap=CAP, return_token_stats=True)
    nll, lse, ent, top = oracle.token_stats_ref(torch.tanh((h @ w.t()) / CAP) * CAP, y)
    assert_close(stats.nll, nll, 1e-5, "nll")
    assert_close(stats.lse, lse, 1e-5, "lse")
    assert_close(stats.entropy, ent, 1e-5, "entropy")
    assert_close(loss, nll.sum(), 1e-5, "loss")
