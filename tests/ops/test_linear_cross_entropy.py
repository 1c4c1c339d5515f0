"""novatune.ops.linear_cross_entropy: the registered op, autograd, reductions, gradient accumulation, tied weights.

Tolerances as in tests/kernels/test_linear_cross_entropy.py: fp32 1e-5 (summation order only); bf16 1e-2 for
gradients (bf16 logits and dL/dz, then a bf16 GEMM output), 2e-3 for the loss (row errors average out). The same
for every plan (mode="tokens" / "vocab" / "inplace"): mode="vocab" is forced with small vocab_slice values, so that
1000 columns make 3 slices (the last one ragged); mode="inplace" needs tokens >= hidden, so its tests use H = 16.
"""
import math

import pytest
import torch
from torch import nn

from novatune.kernels import linear_cross_entropy as K
from novatune.kernels import linear_cross_entropy_lowmem as L
from novatune.measure.numerics import REL_TOL, assert_close

# Imported from the module: `from novatune.ops import linear_cross_entropy` returns the submodule today (the lazy
# package __getattr__ loses to the submodule attribute the import system sets; reported to the lead).
from novatune.ops.linear_cross_entropy import (
    NovaLinearCrossEntropy,
    linear_cross_entropy,
)
from novatune.reference.linear_cross_entropy import linear_cross_entropy_ref

LOSS_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-3}
DTYPES = [torch.bfloat16, torch.float32]
IDS = ["bf16", "fp32"]
VOCAB = {"mode": "vocab", "vocab_slice": 384}  # 1000 columns -> slices of 384, 384, 232
PLANS = {"auto": {}, "vocab": VOCAB}


def _inputs(shape, H, V, dtype, device, seed=0, ignore_frac=0.25):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(*shape, H, generator=gen)
    w = 2 * torch.randn(V, H, generator=gen) / math.sqrt(H)
    y = torch.randint(0, V, shape, generator=gen)
    y[torch.rand(shape, generator=gen) < ignore_frac] = -100
    h = h.to(dtype).to(device).requires_grad_(True)
    w = w.to(dtype).to(device).requires_grad_(True)
    return h, w, y.to(device)


def _ref_grads(h, w, y, **kw):
    hr = h.detach().float().requires_grad_(True)
    wr = w.detach().float().requires_grad_(True)
    loss = linear_cross_entropy_ref(hr, wr, y, **kw)
    loss.backward()
    return loss.detach(), hr.grad, wr.grad


def _check(h, w, loss, ref, dtype):
    rloss, rgh, rgw = ref
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert_close(loss, rloss, LOSS_TOL[dtype], "loss")
    assert h.grad.dtype == dtype and w.grad.dtype == dtype
    assert_close(h.grad, rgh, REL_TOL[dtype], "grad_hidden")
    assert_close(w.grad, rgw, REL_TOL[dtype], "grad_weight")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("mode", ["mean", "sum", "normalizer_int", "normalizer_tensor"])
def test_reductions_match_reference(mode, dtype, device):
    h, w, y = _inputs((2, 37), 127, 1000, dtype, device)  # leading dims (batch, seq)
    kw = {"reduction": mode} if mode in ("mean", "sum") else {
        "normalizer": 123 if mode == "normalizer_int" else torch.tensor(123.0, device=device)}
    loss = linear_cross_entropy(h, w, y, **kw)
    loss.backward()
    _check(h, w, loss, _ref_grads(h, w, y, **kw), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("mode", ["mean", "normalizer_tensor"])
def test_vocab_mode_reductions(mode, dtype, device):
    """mode="vocab" through the op and autograd, leading dims (batch, seq), 3 slices."""
    h, w, y = _inputs((2, 37), 127, 1000, dtype, device, seed=9)
    kw = {"reduction": "mean"} if mode == "mean" else {"normalizer": torch.tensor(123.0, device=device)}
    loss = linear_cross_entropy(h, w, y, **kw, **VOCAB)
    loss.backward()
    _check(h, w, loss, _ref_grads(h, w, y, **kw), dtype)


def test_backward_allocates_no_zero_gradients(device):
    """Only the loss is used: the backward must not be handed materialised zero gradients for the op's other
    outputs (a (V, H) zeros for dweight set the e2e step's memory peak, 0.72 GiB at Qwen3-4B x 4096 tokens)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    h, w, y = _inputs((9,), 64, 1000, torch.float32, device)
    loss = linear_cross_entropy(h, w, y)
    with Record() as rec:
        loss.backward()
    assert h.grad is not None and w.grad is not None
    assert not [op for op in rec.ops if "zeros" in op or "fill" in op], rec.ops


@pytest.mark.parametrize("plan", ["tokens", "vocab"])
def test_chunked_and_upstream_grad(plan, device):
    """Forced multi-chunk / multi-slice path through the op, and a non-unit grad_output (loss * 3 / 7) scaling
    every grad."""
    dtype = torch.bfloat16
    h, w, y = _inputs((61,), 64, 1000, dtype, device, seed=3)
    loss = linear_cross_entropy(h, w, y, **({"chunk_tokens": 16} if plan == "tokens" else VOCAB))
    (loss * 3 / 7).backward()
    rloss, rgh, rgw = _ref_grads(h, w, y)
    _check(h, w, loss, (rloss, rgh * 3 / 7, rgw * 3 / 7), dtype)


@pytest.mark.parametrize("plan", ["auto", "vocab"])
def test_gradient_accumulation_is_exact(plan, device):
    """4 micro-batches with normalizer = target tokens of all 4: losses and grads SUM to one big batch's mean.
    fp32, 1e-5: only summation order differs. The per-micro-batch mean (the trl #2175 bug) must not match."""
    kw = PLANS[plan]
    dtype, H, V = torch.float32, 64, 1000
    gen = torch.Generator().manual_seed(7)
    h_all, w, y_all = _inputs((4, 29), H, V, dtype, device, seed=7)
    # unequal target counts per micro-batch, so averaging micro-batch means is visibly wrong
    for i in range(4):
        y_all[i, torch.rand(29, generator=gen).to(device) < 0.15 * i] = -100
    n_items = (y_all != -100).sum()  # HF's num_items_in_batch (a device tensor)

    big = linear_cross_entropy(h_all, w, y_all, **kw)  # reduction mean over the large batch
    g_h_big, g_w_big = torch.autograd.grad(big, (h_all, w))

    total, g_h, g_w, naive_w = 0.0, [], torch.zeros_like(w), torch.zeros_like(w)
    for i in range(4):
        loss = linear_cross_entropy(h_all[i], w, y_all[i], normalizer=n_items, **kw)
        gh, gw = torch.autograd.grad(loss, (h_all, w))
        total, g_h, g_w = total + loss, g_h + [gh], g_w + gw
        if plan == "auto":  # the control needs one plan only
            naive_w += torch.autograd.grad(linear_cross_entropy(h_all[i], w, y_all[i], **kw) / 4, w)[0]
    assert_close(total, big, 1e-5, "accumulated loss")
    assert_close(sum(g_h), g_h_big, 1e-5, "accumulated grad_hidden")
    assert_close(g_w, g_w_big, 1e-5, "accumulated grad_weight")
    if plan == "auto":
        assert (naive_w - g_w_big).norm() / g_w_big.norm() > 1e-3  # the test can tell the bug from the fix


@pytest.mark.parametrize("plan", ["auto", "vocab"])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_tied_embedding(dtype, plan, device):
    """lm_weight is the embedding's Parameter: its gradient is the lookup's plus the lm_head's."""
    V, H, T = 1000, 64, 37
    gen = torch.Generator().manual_seed(5)
    emb = nn.Embedding(V, H).to(dtype).to(device)
    ids = torch.randint(0, V, (T,), generator=gen).to(device)
    y = torch.randint(0, V, (T,), generator=gen).to(device)
    scale = torch.linspace(0.5, 2.0, H, dtype=dtype, device=device)

    loss = linear_cross_entropy(emb(ids) * scale, emb.weight, y, **PLANS[plan])
    loss.backward()

    w_ref = emb.weight.detach().float().requires_grad_(True)
    rloss = linear_cross_entropy_ref(nn.functional.embedding(ids, w_ref) * scale.float(), w_ref, y)
    rloss.backward()
    assert_close(loss, rloss.detach(), LOSS_TOL[dtype], "loss")
    assert_close(emb.weight.grad, w_ref.grad, REL_TOL[dtype], "tied weight grad")


def test_autocast(device):
    """Under autocast, hidden and weight are cast as F.linear would be; grads reach the fp32 originals."""
    h, w, y = _inputs((37,), 64, 1000, torch.float32, device)
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = linear_cross_entropy(h, w, y)
    loss.backward()
    rloss, rgh, rgw = _ref_grads(h.to(torch.bfloat16), w.to(torch.bfloat16), y)
    assert h.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    assert_close(loss, rloss, LOSS_TOL[torch.bfloat16], "loss")
    assert_close(h.grad, rgh, REL_TOL[torch.bfloat16], "grad_hidden")
    assert_close(w.grad, rgw, REL_TOL[torch.bfloat16], "grad_weight")


@pytest.mark.parametrize("plan", ["auto", "vocab"])
def test_all_ignored(plan, device):
    h, w, y = _inputs((9,), 64, 1000, torch.float32, device)
    y = torch.full_like(y, -100)
    loss = linear_cross_entropy(h, w, y, **PLANS[plan])  # mean: 0/0 -> NaN, like F.cross_entropy
    assert torch.isnan(loss)
    loss.backward()
    assert (h.grad == 0).all() and (w.grad == 0).all()
    h.grad = w.grad = None
    loss = linear_cross_entropy(h, w, y, reduction="sum", **PLANS[plan])
    loss.backward()
    assert loss.item() == 0.0 and (h.grad == 0).all() and (w.grad == 0).all()


def test_no_grad_computes_loss_only(device):
    h, w, y = _inputs((37,), 64, 1000, torch.bfloat16, device)
    with torch.no_grad():
        eval_loss = linear_cross_entropy(h, w, y)
    train_loss = linear_cross_entropy(h, w, y)
    assert eval_loss.grad_fn is None and torch.equal(eval_loss, train_loss.detach())
    # the op returns empty gradient outputs when none is requested (no (V, H) buffer allocated)
    div = (y != -100).sum().float()
    out = torch.ops.novatune.linear_cross_entropy(h.detach(), w.detach(), y, div, None, -100, False, False, False, 0)
    assert [t.numel() for t in out[1:]] == [0, 0, 0, 0, 0, 0]  # no gradients, no token statistics
    # only the weight requires grad (frozen trunk): no grad_hidden buffer, weight grad still right
    h2 = h.detach()
    linear_cross_entropy(h2, w, y).backward()
    assert_close(w.grad, _ref_grads(h2, w, y)[2], REL_TOL[torch.bfloat16], "grad_weight")


@pytest.mark.parametrize("plan", ["auto", "vocab"])
def test_bias(plan, device):
    dtype = torch.float32
    h, w, y = _inputs((37,), 64, 1000, dtype, device)
    b = torch.randn(1000, device=device, dtype=dtype, requires_grad=True)
    loss = linear_cross_entropy(h, w, y, bias=b, **PLANS[plan])
    loss.backward()
    br = b.detach().clone().requires_grad_(True)
    hr, wr = h.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    rloss = linear_cross_entropy_ref(hr, wr, y, bias=br)
    rloss.backward()
    assert_close(loss, rloss.detach(), 1e-5, "loss")
    for got, want, name in ((h.grad, hr.grad, "grad_hidden"), (w.grad, wr.grad, "grad_weight"),
                            (b.grad, br.grad, "grad_bias")):
        assert_close(got, want, 1e-5, name)


def test_second_backward_raises(device):
    """The backward scales the saved gradients in place: a retain_graph second pass must fail loudly."""
    h, w, y = _inputs((9,), 64, 1000, torch.float32, device)
    loss = linear_cross_entropy(h, w, y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        loss.backward()


@pytest.mark.parametrize("plan", ["tokens", "vocab"])
def test_reference_backend(plan, device, reference_backend):
    """NOVATUNE_BACKEND=reference (and the CPU without the interpreter): the chunked / sliced fp32 PyTorch path."""
    reference_backend()
    dtype = torch.bfloat16
    h, w, y = _inputs((2, 33), 127, 4099, dtype, device)
    loss = linear_cross_entropy(h, w, y, **({"chunk_tokens": 16} if plan == "tokens" else
                                            {"mode": "vocab", "vocab_slice": 1024}))
    loss.backward()
    _check(h, w, loss, _ref_grads(h, w, y), dtype)


def test_module_and_errors(device):
    h, w, y = _inputs((5,), 64, 1000, torch.float32, device)
    assert torch.equal(NovaLinearCrossEntropy(reduction="sum")(h, w, y), linear_cross_entropy(h, w, y, reduction="sum"))
    with pytest.raises(ValueError, match="none"):
        linear_cross_entropy(h, w, y, reduction="none")
    with pytest.raises(ValueError, match="labels"):
        linear_cross_entropy(h, w, y[:4])
    with pytest.raises(ValueError, match="lm_weight"):
        linear_cross_entropy(h, w[:, :10], y)
    with pytest.raises(TypeError, match="dtype"):
        linear_cross_entropy(h, w.to(torch.bfloat16), y)
    with pytest.raises(ValueError, match="bias"):
        linear_cross_entropy(h, w, y, bias=torch.zeros(3, device=device))
    with pytest.raises(ValueError, match="mode"):
        linear_cross_entropy(h, w, y, mode="rows")
    with pytest.raises(ValueError, match="chunk_tokens"):
        linear_cross_entropy(h, w, y, mode="vocab", chunk_tokens=16)
    with pytest.raises(ValueError, match="vocab_slice"):
        linear_cross_entropy(h, w, y, mode="tokens", vocab_slice=256)
    with pytest.raises(ValueError, match="mode"):
        NovaLinearCrossEntropy(mode="rows")
    assert torch.equal(NovaLinearCrossEntropy(mode="vocab")(h, w, y), linear_cross_entropy(h, w, y, mode="vocab"))


def test_auto_mode_picks_vocab(device, monkeypatch):
    """auto: vocab slices once the full logits exceed AUTO_LOGITS_BYTES and grad_W is wanted (shrunk here so a
    small problem crosses it; the slice budget too, for 3 slices); token chunks without grad_W."""
    calls = []
    for name in ("_fwd_vocab", "_fwd_tokens"):
        real = getattr(K, name)
        monkeypatch.setattr(K, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    monkeypatch.setattr(K, "AUTO_LOGITS_BYTES", 37 * 1000 * 4 - 1)
    monkeypatch.setattr(K, "VOCAB_SLICE_BYTES", 37 * 4 * 384)  # -> _VOCAB_MIN_SLICE
    monkeypatch.setattr(K, "_VOCAB_MIN_SLICE", 256)
    monkeypatch.setattr(K, "_VOCAB_ALIGN", 128)  # 384 columns: 3 slices
    h, w, y = _inputs((37,), 64, 1000, torch.float32, device, seed=12)
    loss = linear_cross_entropy(h, w, y)
    loss.backward()
    assert calls == ["_fwd_vocab"]
    _check(h, w, loss, _ref_grads(h, w, y), torch.float32)
    linear_cross_entropy(h.detach(), w.detach(), y)  # nothing to accumulate: token chunks
    assert calls == ["_fwd_vocab", "_fwd_tokens"]


def test_opcheck(device):
    h, w, y = _inputs((37,), 64, 1000, torch.float32, device)
    div = (y != -100).sum().float()
    torch.library.opcheck(torch.ops.novatune.linear_cross_entropy.default,
                          (h, w, y, div, None, -100, True, True, False, 16))
    b = torch.randn(1000, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.novatune.linear_cross_entropy.default,
                          (h.detach(), w, y, div, b, -100, False, True, True, 0))
    n = 9  # the vocab plan (3 slices) on fewer rows: opcheck runs the op a dozen times under the interpreter
    torch.library.opcheck(torch.ops.novatune.linear_cross_entropy.default,
                          (h[:n].detach().requires_grad_(True), w, y[:n], div, b, -100, True, True, True, 0, "vocab",
                           384))
    torch.library.opcheck(torch.ops.novatune.linear_cross_entropy_scale_.default,
                          (torch.randn(64, 37, device=device), torch.tensor(0.5, device=device)))


@pytest.mark.parametrize("plan", ["auto", "vocab"])
def test_torch_compile_aot_eager(plan, device):
    """Traced by AOTAutograd (the in-place backward op is functionalised): same loss and grads as eager."""
    h, w, y = _inputs((37,), 64, 1000, torch.float32, device)
    _check_compiled_matches_eager(h, w, y, PLANS[plan])


def _check_compiled_matches_eager(h, w, y, kw):
    """torch.compile (aot_eager, fullgraph) of the functional: the same loss and gradients (x2 upstream) as eager."""
    fn = torch.compile(lambda a, b, c: linear_cross_entropy(a, b, c, **kw), backend="aot_eager", fullgraph=True)
    loss = fn(h, w, y)
    gh, gw = torch.autograd.grad(loss * 2, (h, w))
    eloss = linear_cross_entropy(h, w, y, **kw)
    egh, egw = torch.autograd.grad(eloss * 2, (h, w))
    assert_close(loss, eloss, 1e-6, "loss")
    assert_close(gh, egh, 1e-6, "grad_hidden")
    assert_close(gw, egw, 1e-6, "grad_weight")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["auto", "tokens", "vocab"])
def test_qwen3_4b_shape_gpu(mode):
    """4096 x 2560 -> 151936 bf16 through the op (autograd, bf16 logits) against the fp32 reference; auto is
    the inplace plan at this shape."""
    h, w, y = _inputs((1, 4096), 2560, 151936, torch.bfloat16, "cuda", ignore_frac=0.1)
    loss = linear_cross_entropy(h, w, y, mode=mode)
    loss.backward()
    _check(h, w, loss, _ref_grads(h, w, y), torch.bfloat16)


@pytest.mark.gpu
def test_qwen3_4b_grad_accumulation_gpu():
    """Real shape, 4 micro-batches of 1024 with num_items_in_batch: bf16 grads match one 4096 batch."""
    h, w, y = _inputs((4, 1024), 2560, 151936, torch.bfloat16, "cuda", ignore_frac=0.1)
    n = (y != -100).sum()
    gw_big = torch.autograd.grad(linear_cross_entropy(h, w, y), w)[0].float()
    gw = sum(torch.autograd.grad(linear_cross_entropy(h[i], w, y[i], normalizer=n), w)[0].float() for i in range(4))
    assert_close(gw, gw_big, REL_TOL[torch.bfloat16], "accumulated grad_weight")


# ---------------------------------------------------------------- mode="inplace" (needs T >= H: H = 16 below)

INPLACE = {"mode": "inplace", "vocab_slice": 64}  # 37 tokens x 16 -> 1000: temp block, direct blocks, B's rows


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("red", ["mean", "sum", "normalizer_tensor"])
def test_inplace_mode_reductions(red, dtype, device):
    """Through the op and autograd, leading dims (batch, seq), a non-unit grad_output (scaled in place)."""
    h, w, y = _inputs((2, 37), 16, 1000, dtype, device, seed=19)
    kw = {"reduction": red} if red != "normalizer_tensor" else {"normalizer": torch.tensor(61.0, device=device)}
    loss = linear_cross_entropy(h, w, y, **kw, **INPLACE)
    (loss * 3 / 7).backward()
    rloss, rgh, rgw = _ref_grads(h, w, y, **kw)
    _check(h, w, loss, (rloss, rgh * 3 / 7, rgw * 3 / 7), dtype)


def test_inplace_gradient_accumulation_is_exact(device):
    """As test_gradient_accumulation_is_exact, every call in mode "inplace" (29 tokens >= H = 16)."""
    dtype, H, V = torch.float32, 16, 1000
    gen = torch.Generator().manual_seed(8)
    h_all, w, y_all = _inputs((4, 29), H, V, dtype, device, seed=8)
    for i in range(4):
        y_all[i, torch.rand(29, generator=gen).to(device) < 0.15 * i] = -100
    n_items = (y_all != -100).sum()
    big = linear_cross_entropy(h_all, w, y_all, **INPLACE)
    g_h_big, g_w_big = torch.autograd.grad(big, (h_all, w))
    total, g_h, g_w = 0.0, torch.zeros_like(h_all), torch.zeros_like(w)
    for i in range(4):
        loss = linear_cross_entropy(h_all[i], w, y_all[i], normalizer=n_items, **INPLACE)
        gh, gw = torch.autograd.grad(loss, (h_all, w))
        total, g_h, g_w = total + loss, g_h + gh, g_w + gw
    assert_close(total, big, 1e-5, "accumulated loss")
    assert_close(g_h, g_h_big, 1e-5, "accumulated grad_hidden")
    assert_close(g_w, g_w_big, 1e-5, "accumulated grad_weight")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_inplace_tied_embedding_bias_and_all_ignored(dtype, device):
    """Tied lm_head (grad = lookup's + lm_head's), then a bias, then all labels ignored, in mode "inplace"."""
    V, H, T = 1000, 16, 37
    gen = torch.Generator().manual_seed(6)
    emb = nn.Embedding(V, H).to(dtype).to(device)
    ids = torch.randint(0, V, (T,), generator=gen).to(device)
    y = torch.randint(0, V, (T,), generator=gen).to(device)
    scale = torch.linspace(0.5, 2.0, H, dtype=dtype, device=device)
    loss = linear_cross_entropy(emb(ids) * scale, emb.weight, y, **INPLACE)
    loss.backward()
    w_ref = emb.weight.detach().float().requires_grad_(True)
    rloss = linear_cross_entropy_ref(nn.functional.embedding(ids, w_ref) * scale.float(), w_ref, y)
    rloss.backward()
    assert_close(loss, rloss.detach(), LOSS_TOL[dtype], "loss")
    assert_close(emb.weight.grad, w_ref.grad, REL_TOL[dtype], "tied weight grad")

    h, w, y = _inputs((T,), H, V, dtype, device, seed=7)
    b = torch.randn(V, generator=gen).to(dtype).to(device).requires_grad_(True)
    loss = linear_cross_entropy(h, w, y, bias=b, **INPLACE)
    loss.backward()
    hr, wr, br = (t.detach().float().requires_grad_(True) for t in (h, w, b))
    rloss = linear_cross_entropy_ref(hr, wr, y, bias=br)
    rloss.backward()
    assert_close(loss, rloss.detach(), LOSS_TOL[dtype], "loss (bias)")
    for got, want, name in ((h.grad, hr.grad, "grad_hidden"), (w.grad, wr.grad, "grad_weight"),
                            (b.grad, br.grad, "grad_bias")):
        assert_close(got, want, REL_TOL[dtype], name)

    h.grad = w.grad = None
    y = torch.full_like(y, -100)
    loss = linear_cross_entropy(h, w, y, reduction="sum", **INPLACE)
    loss.backward()
    assert loss.item() == 0.0 and (h.grad == 0).all() and (w.grad == 0).all()


def test_inplace_auto_reference_backend_and_errors(device, monkeypatch, reference_backend):
    """auto picks "inplace" when grad_W is wanted and T >= H (not without grads); the fp32 reference backend runs
    the same plan; chunk_tokens does not go with it."""
    calls = []
    for name in ("_fwd_inplace", "_fwd_tokens", "_fwd_vocab"):
        real = getattr(K, name)
        monkeypatch.setattr(K, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    h, w, y = _inputs((37,), 16, 1000, torch.float32, device, seed=23)
    loss = linear_cross_entropy(h, w, y)
    loss.backward()
    with torch.no_grad():
        linear_cross_entropy(h, w, y)
    assert calls == ["_fwd_inplace", "_fwd_tokens"]
    _check(h, w, loss, _ref_grads(h, w, y), torch.float32)

    reference_backend()
    hb, wb, yb = _inputs((2, 33), 16, 4099, torch.bfloat16, device, seed=24)
    loss = linear_cross_entropy(hb, wb, yb, mode="inplace", vocab_slice=100)
    loss.backward()
    _check(hb, wb, loss, _ref_grads(hb, wb, yb), torch.bfloat16)
    with pytest.raises(ValueError, match="chunk_tokens"):
        linear_cross_entropy(h, w, y, mode="inplace", chunk_tokens=16)


def test_inplace_opcheck_and_compile(device):
    h, w, y = _inputs((37,), 16, 1000, torch.float32, device, seed=25)
    div = (y != -100).sum().float()
    b = torch.randn(1000, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.novatune.linear_cross_entropy.default,
                          (h, w, y, div, b, -100, True, True, True, 0, "inplace", 64))
    _check_compiled_matches_eager(h, w, y, INPLACE)


@pytest.mark.parametrize("bad", [1000, 100_000, -1, -5])
def test_out_of_range_label_raises_like_cross_entropy(bad):
    """A label outside [0, V) that is not ignore_index raises IndexError, as F.cross_entropy does (no NaN loss)."""
    h, w, y = _inputs((2, 5), 16, 1000, torch.float32, "cpu", seed=3)
    y[1, 2] = bad
    with pytest.raises(IndexError, match=f"Target {bad} is out of bounds"):
        torch.nn.functional.cross_entropy((h @ w.T).reshape(-1, 1000), y.reshape(-1))
    with pytest.raises(IndexError, match=f"Target {bad} is out of bounds"):
        linear_cross_entropy(h, w, y)


def test_ignore_index_labels_are_not_out_of_range():
    """ignore_index (the default -100, or a custom negative one) is not a range error; the loss stays finite."""
    h, w, y = _inputs((2, 5), 16, 1000, torch.float32, "cpu", seed=4)
    y[y == -100] = -7
    y[0, :2] = -7
    loss = linear_cross_entropy(h, w, y, ignore_index=-7)
    ref = torch.nn.functional.cross_entropy((h @ w.T).reshape(-1, 1000).float(), y.reshape(-1), ignore_index=-7)
    assert torch.isfinite(loss) and abs(loss.item() - ref.item()) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("plan", ["auto", "vocab"])
def test_token_stats_come_with_the_loss_unchanged(plan, dtype, device):
    """return_token_stats=True: (loss, TokenStats) shaped like the labels, no gradient through the statistics, the
    loss and every gradient bit-identical to the plain call; values as reference.token_stats_ref computes them from
    the logits the op uses (tolerances: tests/kernels/test_linear_cross_entropy.py's token-statistics test)."""
    from novatune.ops._backend import use_triton
    from novatune.reference.linear_cross_entropy import token_stats_ref

    h, w, y = _inputs((2, 19), 32, 1000, dtype, device)
    plain = linear_cross_entropy(h, w, y, **PLANS[plan])
    g_plain = torch.autograd.grad(plain, (h, w))
    loss, st = linear_cross_entropy(h, w, y, return_token_stats=True, **PLANS[plan])
    assert torch.equal(loss, plain)
    for a, b in zip(torch.autograd.grad(loss, (h, w)), g_plain):
        assert torch.equal(a, b)
    assert all(t.shape == y.shape and not t.requires_grad for t in st) and st.argmax.dtype == torch.int64
    h2, w2 = h.detach().reshape(-1, 32), w.detach()
    logits = (h2 @ w2.T).float() if use_triton(h2) else h2.float() @ w2.float().T
    want = token_stats_ref(logits, y.reshape(-1))
    tol = 2e-5 * max(1.0, float(logits.abs().max()))
    for name, got, ref in zip(("nll", "lse", "entropy"), st[:3], want[:3]):
        assert float((got.reshape(-1) - ref).abs().max()) <= tol, name
    assert torch.equal(st.argmax.reshape(-1), want[3])


def test_opcheck_with_token_stats(device):
    h, w, y = _inputs((23,), 16, 300, torch.float32, device)
    div = (y != -100).sum().float()
    torch.library.opcheck(torch.ops.novatune.linear_cross_entropy.default,
                          (h, w, y, div, None, -100, True, True, False, 0, "auto", 0, True))


# ----------------------------------------------------------------------------------------------- audit fixes
EDGE_PLANS = {"inplace": INPLACE, "auto": {}, "tokens": {"mode": "tokens", "chunk_tokens": 16}, "vocab": VOCAB}


@pytest.mark.parametrize("path", ["cpu", "interpreter"])
@pytest.mark.parametrize("plan", sorted(EDGE_PLANS))
def test_ignored_tokens_with_huge_logits_contribute_exactly_zero(plan, path, backend_env, monkeypatch):
    """Ignored tokens (padding, prompt) whose logits exceed exp's fp32 range (~88) give exactly zero gradient rows
    and no NaN anywhere, on the plain CPU path and the kernels' (mode "inplace"'s CPU path overflowed exp and made
    every dh / dW entry NaN through inf * 0). Scratch memory poisoned with NaN: a row left unwritten would show."""
    backend_env("TRITON_INTERPRET", "1" if path == "interpreter" else "0")
    monkeypatch.setattr(L, "_POISON_SCRATCH", True)
    gen = torch.Generator().manual_seed(31)
    T, H, V = 37, 16, 1000  # T >= H: "auto" plans "inplace"
    h = torch.randn(T, H, generator=gen)
    w = 2 * torch.randn(V, H, generator=gen) / math.sqrt(H)
    y = torch.randint(0, V, (T,), generator=gen)
    big = torch.randperm(T, generator=gen)[:3]
    h[big] *= 300  # logits of several hundred
    y[big] = -100
    y[torch.rand(T, generator=gen) < 0.2] = -100
    h, w = h.requires_grad_(), w.requires_grad_()
    loss = linear_cross_entropy(h, w, y, **EDGE_PLANS[plan])
    loss.backward()
    assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()
    assert (h.grad[big] == 0).all(), "an ignored token's gradient row is exactly zero"
    _check(h, w, loss, _ref_grads(h, w, y), torch.float32)


@pytest.mark.parametrize("path", ["cpu", "interpreter"])
@pytest.mark.parametrize("lead", [(0,), (2, 0)], ids=["T0", "2x0"])
def test_zero_tokens_give_empty_gradients(lead, path, backend_env):
    """No tokens (an empty micro-batch): loss 0 ("sum"), torch.autograd.grad returns a gradient of hidden's own
    (empty) shape and a zero lm_head gradient, as F.cross_entropy does (it raised: dhidden came back as None)."""
    backend_env("TRITON_INTERPRET", "1" if path == "interpreter" else "0")
    h = torch.randn(*lead, 8, requires_grad=True)
    w = torch.randn(11, 8, requires_grad=True)
    y = torch.zeros(lead, dtype=torch.long)
    loss = linear_cross_entropy(h, w, y, reduction="sum")
    gh, gw = torch.autograd.grad(loss, (h, w))
    assert loss.item() == 0.0 and gh.shape == h.shape and gw.shape == w.shape and (gw == 0).all()


def test_weight_on_another_device_raises():
    """A meta (not materialised) lm_head or bias is refused by name; it returned a garbage loss."""
    h, w, y = _inputs((9,), 8, 11, torch.float32, "cpu", seed=32)
    with pytest.raises(ValueError, match="lm_weight is on meta"):
        linear_cross_entropy(h, w.detach().to("meta"), y)
    with pytest.raises(ValueError, match="bias is on meta"):
        linear_cross_entropy(h, w, y, bias=torch.zeros(11, device="meta"))


@pytest.mark.parametrize("kw", [{"chunk_tokens": -1}, {"chunk_tokens": 0}, {"mode": "vocab", "vocab_slice": 0},
                                {"mode": "inplace", "vocab_slice": -3}], ids=str)
def test_non_positive_split_sizes_raise(kw):
    h, w, y = _inputs((9,), 8, 11, torch.float32, "cpu", seed=33)
    with pytest.raises(ValueError, match="must be a positive int"):
        linear_cross_entropy(h, w, y, **kw)
    with pytest.raises(ValueError, match="must be positive"):  # the kernels' planner, for direct callers
        K.plan_mode(9, 11, 8, torch.float32, True, kw.get("mode", "tokens"), kw.get("chunk_tokens"),
                    kw.get("vocab_slice"))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("plan", ["auto", "vocab"])
def test_accumulating_backward_adds_the_weight_gradient_into_grad(plan, dtype, tied, device, monkeypatch):
    """Under gradient accumulation (lm_head's weight a Parameter whose .grad exists, which an embedding lookup may
    also read: tied), the backward adds grad_W times grad_output into .grad in one pass and returns nothing for it;
    the first micro-batch still hands autograd its gradient.
    Checked against the fp32 reference of every micro-batch (REL_TOL of the dtype, as the single-call tests), and
    in fp32 against autograd's own accumulation of the same gradients (1e-6: summation order only)."""
    from novatune.kernels import linear_cross_entropy as K

    calls = []
    real = K.linear_cross_entropy_bwd_into
    monkeypatch.setattr(K, "linear_cross_entropy_bwd_into", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    h_all, w0, y_all = _inputs((3, 29), 16, 1000, dtype, device, seed=9)
    ids = torch.randint(0, 1000, (3, 7), generator=torch.Generator().manual_seed(1)).to(device)
    w = torch.nn.Parameter(w0.detach().clone())
    scales = [(i + 1) / 7 for i in range(3)]

    def loss_of(i, weight, head):
        loss = linear_cross_entropy(h_all[i], head, y_all[i], **PLANS[plan]) * scales[i]
        if tied:  # the embedding's part of the tied gradient, through the Parameter itself
            loss = loss + torch.nn.functional.embedding(ids[i], weight).float().square().mean()
        return loss

    want = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    for i in range(3):  # autograd.grad: never the accumulating path
        want += torch.autograd.grad(loss_of(i, w, w), w)[0].float()
    assert calls == []
    for i in range(3):
        loss_of(i, w, w).backward()
    # micro-batches 2 and 3 (tied: the lookup's part waits in autograd's buffer for the weight, not in .grad)
    assert calls == [1, 1]
    assert w.grad.dtype == dtype and h_all.grad is not None
    ref = torch.zeros_like(want)
    for i in range(3):
        ref += _ref_grads(h_all[i], w, y_all[i])[2] * scales[i]
        if tied:
            wf = w.detach().float().requires_grad_(True)
            torch.nn.functional.embedding(ids[i], wf).square().mean().backward()
            ref += wf.grad
    assert_close(w.grad, ref, REL_TOL[dtype], "accumulated grad_weight against the fp32 reference")
    if dtype == torch.float32:
        assert_close(w.grad, want, 1e-6, "accumulated grad_weight against autograd's accumulation")
    else:
        assert_close(w.grad.float(), want, 8e-3, "accumulated grad_weight against autograd's accumulation")


def test_accumulating_backward_leaves_a_hooked_weight_to_autograd(device, monkeypatch):
    """A weight with a hook (here a post-accumulate one) gets its gradient through autograd as without the path."""
    from novatune.kernels import linear_cross_entropy as K

    monkeypatch.setattr(K, "linear_cross_entropy_bwd_into", lambda *a, **kw: pytest.fail("took the hooked weight"))
    h_all, w0, y_all = _inputs((2, 29), 16, 1000, torch.float32, device, seed=10)
    w = torch.nn.Parameter(w0.detach().clone())
    seen = []
    w.register_post_accumulate_grad_hook(lambda p: seen.append(1))
    for i in range(2):
        linear_cross_entropy(h_all[i], w, y_all[i]).backward()
    assert seen == [1, 1]
    want = sum(_ref_grads(h_all[i], w, y_all[i])[2] for i in range(2))
    assert_close(w.grad, want, REL_TOL[torch.float32], "grad_weight")
