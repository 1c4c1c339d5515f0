"""Fused linear cross-entropy (novatune.kernels.linear_cross_entropy) against the fp32 reference.

Tolerances (relative-norm error, novatune.measure.numerics):
* fp32: the logits, softmax and GEMMs are fp32; only summation order differs -> 1e-5 (REL_TOL; measured
  <= 1.2e-7 over the shape matrix below).
* bf16: the logits chunk is bf16 (like HF's logits before .float()) and dL/dz is rounded to bf16 before the two
  gradient GEMMs; each is one rounding, 2^-8 relative on a GPU, 2^-7 under TRITON_INTERPRET (it truncates
  fp32 -> bf16). The gradients carry ~3 such roundings (logits, dz, GEMM output): measured <= 4.6e-3 under the
  interpreter (the GEMM-output rounding alone, the fp32 torch path, gives 1.7e-3) -> 1e-2 (REL_TOL). The loss
  only sees the logit rounding, which averages out over rows (measured <= 6.4e-5) -> 2e-3.
* mode="vocab" adds no rounding to the loss (fp32 statistics merged across slices) and, for bf16 grad_hidden,
  one rounding of each slice's partial product on the CPU (no fp32-output addmm there; on CUDA the GEMM
  accumulates into fp32 directly): measured <= 5.7e-3 for the gradients under the interpreter, <= 1.5e-4 for
  the loss (the same as one token chunk gives on those inputs) -> the same tolerances. Slice-by-slice vs
  whole-vocab statistics: measured <= 4e-8 -> 1e-6 (fp32 summation order only).
* mode="inplace": the same roundings (bf16 logits, bf16 dL/dz, one GEMM-output rounding per grad_W row block;
  grad_h from two half partials summed in fp32 on the CPU): measured <= 6.5e-3 for the gradients and <= 2.8e-4
  for the loss under the interpreter over INPLACE_CASES -> the same tolerances; fp32 <= 2.8e-7. Its loss rows vs
  one token chunk's: <= 8e-8 -> 1e-6.
"""
import math

import pytest
import torch

from novatune.kernels import linear_cross_entropy as K
from novatune.kernels import linear_cross_entropy_lowmem as L
from novatune.measure.numerics import REL_TOL, assert_close, poison_
from novatune.reference import linear_cross_entropy as oracle

DTYPES = [torch.bfloat16, torch.float32]
IDS = ["bf16", "fp32"]
LOSS_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-3}


def _inputs(T, H, V, dtype, device, seed=0, ignore_frac=0.2):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=gen)
    # logits std ~2: peaked enough that the softmax tail and the label term both matter
    w = 2 * torch.randn(V, H, generator=gen) / math.sqrt(H)
    y = torch.randint(0, V, (T,), generator=gen)
    y[torch.rand(T, generator=gen) < ignore_frac] = -100
    return h.to(dtype).to(device), w.to(dtype).to(device), y.to(device)


def _ref(h, w, y, reduction="mean", normalizer=None, bias=None):
    """fp32 reference loss and gradients (autograd through F.cross_entropy on fp32 logits)."""
    hr = h.detach().float().requires_grad_(True)
    wr = w.detach().float().requires_grad_(True)
    br = None if bias is None else bias.detach().float().requires_grad_(True)
    loss = oracle.linear_cross_entropy_ref(hr, wr, y, -100, reduction, normalizer, br)
    loss.backward()
    return loss.detach(), hr.grad, wr.grad, (None if br is None else br.grad)


def _divisor(y, device):
    return (y != -100).sum().to(torch.float32).to(device)


def _check(out, ref, dtype):
    """Loss and gradients (hidden, weight, and bias when the reference has one) against the fp32 reference."""
    loss, _, gh, gw, gb = out
    rloss, rgh, rgw, rgb = ref
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert_close(loss, rloss, LOSS_TOL[dtype], "loss")
    assert gh.dtype == dtype and gw.dtype == dtype
    assert_close(gh, rgh, REL_TOL[dtype], "grad_hidden")
    assert_close(gw, rgw, REL_TOL[dtype], "grad_weight")
    if rgb is not None:
        assert_close(gb, rgb, REL_TOL[dtype], "grad_bias")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("V", [1000, 4099])
@pytest.mark.parametrize("H", [64, 127])
@pytest.mark.parametrize("T", [1, 37, 300])
def test_fwd_matches_reference(T, H, V, dtype, device):
    h, w, y = _inputs(T, H, V, dtype, device, seed=T + H + V, ignore_frac=0.0 if T == 1 else 0.2)
    rows = poison_(torch.empty(T, dtype=torch.float32, device=device))
    gh = poison_(torch.empty(T, H, dtype=dtype, device=device))
    gw = poison_(torch.empty(V, H, dtype=dtype, device=device))
    out = K.linear_cross_entropy_fwd(h, w, y, _divisor(y, device), loss_rows=rows, dhidden=gh, dweight=gw)
    assert out[1] is rows and out[2] is gh and out[3] is gw  # written in place, every element (no NaN left)
    _check(out, _ref(h, w, y), dtype)
    ref_rows = torch.nn.functional.cross_entropy(h.float() @ w.float().t(), y, reduction="none")
    assert_close(rows, ref_rows, LOSS_TOL[dtype] * 5, "loss rows")  # per-row: no averaging over rows


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("T,chunk", [(37, 16), (300, 64), (150, 7)])
def test_multi_chunk(T, chunk, dtype, device):
    """Several chunks: fp32 accumulation of grad_weight across them (bf16: the CPU's indirect path - partial in
    bf16, summed in fp32; on CUDA the direct addmm-into-fp32 path). 22 chunks of 7 must not lose precision."""
    H, V = 127, 4099
    h, w, y = _inputs(T, H, V, dtype, device, seed=chunk)
    gw = poison_(torch.empty(V, H, dtype=dtype, device=device))
    out = K.linear_cross_entropy_fwd(h, w, y, _divisor(y, device), chunk_tokens=chunk, dweight=gw)
    assert out[3] is gw
    _check(out, _ref(h, w, y), dtype)
    single = K.linear_cross_entropy_fwd(h, w, y, _divisor(y, device), grad_hidden=False, grad_weight=False)
    assert_close(out[0], single[0], 1e-6, "loss: chunked vs one chunk")  # same rows, same kernel


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_gpu_tiling(dtype, device, monkeypatch):
    """The CUDA tiling (one row per program, several vocab blocks with a masked tail) under any backend."""
    monkeypatch.setattr(K, "_TILE_OVERRIDE", (1, 1024))
    h, w, y = _inputs(37, 64, 4099, dtype, device, seed=11)
    _check(K.linear_cross_entropy_fwd(h, w, y, _divisor(y, device), chunk_tokens=16), _ref(h, w, y), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_bias(dtype, device):
    T, H, V = 37, 64, 1000
    h, w, y = _inputs(T, H, V, dtype, device)
    b = torch.randn(V, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    gb = poison_(torch.empty(V, dtype=dtype, device=device))
    out = K.linear_cross_entropy_fwd(h, w, y, _divisor(y, device), bias=b, grad_bias=True,
                                    chunk_tokens=16, dbias=gb)
    assert out[4] is gb
    _check(out, _ref(h, w, y, bias=b), dtype)


def test_ignored_rows_and_invalid_labels(device):
    T, H, V = 37, 64, 1000
    h, w, y = _inputs(T, H, V, torch.float32, device)
    # all ignored: rows 0, gradients exactly 0; mean -> 0/0 = NaN (F.cross_entropy's value), sum -> 0
    y_all = torch.full_like(y, -100)
    rows = poison_(torch.empty(T, device=device))
    loss, _, gh, gw, _ = K.linear_cross_entropy_fwd(h, w, y_all, _divisor(y_all, device), loss_rows=rows)
    assert torch.isnan(loss) and torch.isnan(_ref(h, w, y_all)[0])
    assert (rows == 0).all() and (gh == 0).all() and (gw == 0).all()
    loss, *_ = K.linear_cross_entropy_fwd(h, w, y_all, torch.ones((), device=device))
    assert loss.item() == 0.0
    # a label outside [0, V) that is not ignore_index -> a NaN row (visible without a host-side check)
    y_bad = y.clone()
    y_bad[3] = V
    _, rows, *_ = K.linear_cross_entropy_fwd(h, w, y_bad, _divisor(y_bad, device), grad_hidden=False,
                                             grad_weight=False)
    assert torch.isnan(rows[3]) and torch.isfinite(rows[torch.arange(T, device=device) != 3]).all()


def test_loss_only(device):
    """No gradient requested: loss identical, no gradient buffers."""
    h, w, y = _inputs(37, 64, 1000, torch.bfloat16, device)
    full = K.linear_cross_entropy_fwd(h, w, y, _divisor(y, device))
    only = K.linear_cross_entropy_fwd(h, w, y, _divisor(y, device), grad_hidden=False, grad_weight=False)
    assert only[2] is None and only[3] is None
    assert torch.equal(only[0], full[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_torch_path_matches_reference(dtype):
    """use_triton=False: the CPU reference path, same chunk loop in fp32 (bf16 inputs are only read)."""
    T, H, V = 300, 127, 4099
    h, w, y = _inputs(T, H, V, dtype, "cpu")
    gh = poison_(torch.empty(T, H, dtype=dtype))
    out = K.linear_cross_entropy_fwd(h, w, y, _divisor(y, "cpu"), chunk_tokens=64, dhidden=gh, use_triton=False)
    assert out[2] is gh
    loss, _, gh, gw, _ = out
    rloss, rgh, rgw, _ = _ref(h, w, y)
    assert_close(loss, rloss, 1e-5, "loss")  # fp32 math on the (exactly representable) bf16 inputs
    assert_close(gh, rgh, REL_TOL[dtype], "grad_hidden")  # only the final cast to the input dtype
    assert_close(gw, rgw, REL_TOL[dtype], "grad_weight")


@pytest.mark.parametrize("g", [0.37, 1.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_bwd_scales_in_place(dtype, g, device):
    """In place, fp32 math; g == 1 (decided on the device) leaves the buffer bit-identical."""
    x = torch.randn(1000, 37).to(dtype).to(device)
    y = x.clone()
    K.linear_cross_entropy_bwd(torch.tensor(g, device=device), y, None)
    assert_close(y, x.float() * g, REL_TOL[dtype], "scaled")
    if g == 1.0:
        assert torch.equal(y, x)


def test_plan_chunk_tokens():
    V, H, bf16 = 151936, 2560, torch.bfloat16
    # Qwen3-4B, 4096 tokens: one chunk (1.24 GB of bf16 logits) beats chunks + a 1.56 GB fp32 accumulator
    assert K.plan_chunk_tokens(4096, V, H, bf16, grad_weight=True) == 4096
    # 16384 tokens: 5 GB of logits -> chunks within the budget
    c = K.plan_chunk_tokens(16384, V, H, bf16, grad_weight=True)
    assert c < 16384 and c * V * 2 <= K.CHUNK_LOGITS_BYTES + 64 * V * 2
    # no weight gradient (eval) or fp32 weight (no accumulator needed): the budget alone decides
    for dt, grad in ((bf16, False), (torch.float32, True)):
        c = K.plan_chunk_tokens(4096, V, H, dt, grad_weight=grad)
        assert c < 4096 and c * V * (dt.itemsize) <= K.CHUNK_LOGITS_BYTES + 64 * V * dt.itemsize
    assert K.plan_chunk_tokens(1, V, H, bf16, True) == 1
    assert K.plan_chunk_tokens(0, V, H, bf16, True) == 1


def test_zero_tokens(device):
    h, w, y = _inputs(0, 64, 1000, torch.bfloat16, device)
    gw = poison_(torch.empty(1000, 64, dtype=torch.bfloat16, device=device))
    loss, rows, gh, gw, _ = K.linear_cross_entropy_fwd(h, w, y, torch.ones((), device=device), dweight=gw)
    assert loss.item() == 0.0 and rows.numel() == 0 and gh.shape == (0, 64) and (gw == 0).all()


def test_fp32_addmm_probe_cpu():
    assert K.fp32_addmm_available(torch.device("cpu"), torch.bfloat16) is False


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [None, 1024])
def test_qwen3_4b_shape_gpu(chunk):
    """Real shape 4096 x 2560 -> 151936 bf16, against the fp32 reference; chunk=1024 takes the fp32-accumulator
    path (direct addmm into fp32 where this torch supports it)."""
    T, H, V = 4096, 2560, 151936
    h, w, y = _inputs(T, H, V, torch.bfloat16, "cuda")
    out = K.linear_cross_entropy_fwd(h, w, y, _divisor(y, "cuda"), chunk_tokens=chunk)
    _check(out, _ref(h, w, y), torch.bfloat16)
    print("fp32 addmm direct:", K.fp32_addmm_available(torch.device("cuda"), torch.bfloat16))


@pytest.mark.gpu
def test_qwen3_4b_memory_gpu():
    """Extra memory of the fused forward (which also produces the gradients) stays below what HF's float logits
    alone take (T x V x 4 = 2.49 GB)."""
    T, H, V = 4096, 2560, 151936
    h, w, y = _inputs(T, H, V, torch.bfloat16, "cuda")
    div = _divisor(y, "cuda")
    K.linear_cross_entropy_fwd(h, w, y, div)  # warm-up (Triton compile, cuBLAS workspace)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = K.linear_cross_entropy_fwd(h, w, y, div)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < T * V * 4, f"peak extra {extra / 2**30:.2f} GiB"
    del out


# ---------------------------------------------------------------- mode="vocab": two passes over vocab slices


def _labels_in_every_slice(y, V, Vc):
    """Labels on both edges of every slice (first / last column, V - 1 on the ragged tail), rows 0.."""
    edges = sorted({c for s in range(0, V, Vc) for c in (s, min(s + Vc, V) - 1)})
    k = min(len(edges), y.numel())
    y[:k] = torch.tensor(edges[:k], device=y.device)
    return y


VOCAB_CASES = [  # T, H, V, Vc: ragged last slices of 232 and 3 columns, one slice (no recompute), 1 token
    (1, 64, 1000, 384), (37, 127, 1000, 384), (37, 64, 4099, 1024), (300, 127, 4099, 2048), (37, 127, 1000, 1000)]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("T,H,V,Vc", VOCAB_CASES, ids=[f"{t}x{h}x{v}/{c}" for t, h, v, c in VOCAB_CASES])
def test_vocab_matches_reference(T, H, V, Vc, dtype, device):
    h, w, y = _inputs(T, H, V, dtype, device, seed=T + V + Vc, ignore_frac=0.0 if T == 1 else 0.2)
    y = _labels_in_every_slice(y, V, Vc)
    y[-1] = -100 if T > 1 else y[-1]
    rows = poison_(torch.empty(T, dtype=torch.float32, device=device))
    gh = poison_(torch.empty(T, H, dtype=dtype, device=device))
    gw = poison_(torch.empty(V, H, dtype=dtype, device=device))
    out = K.linear_cross_entropy_fwd(h, w, y, _divisor(y, device), mode="vocab", vocab_slice=Vc, loss_rows=rows,
                                     dhidden=gh, dweight=gw)
    assert out[1] is rows and out[2] is gh and out[3] is gw  # written in place, every element (no NaN left)
    _check(out, _ref(h, w, y), dtype)
    ref_rows = torch.nn.functional.cross_entropy(h.float() @ w.float().t(), y, reduction="none")
    assert_close(rows, ref_rows, LOSS_TOL[dtype] * 5, "loss rows")
    if T > 1:
        assert rows[-1].item() == 0.0  # the ignored row
    # the same logits (same GEMMs), statistics merged slice by slice instead of in one row sweep
    tok = K.linear_cross_entropy_fwd(h, w, y, _divisor(y, device), mode="tokens", grad_hidden=False,
                                     grad_weight=False)
    assert_close(rows, tok[1], 1e-6, "loss rows: vocab vs tokens")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_vocab_gpu_tiling_and_bias(dtype, device, monkeypatch):
    """The CUDA tiling (one row per program, several blocks per slice, masked tails) and the bias gradient
    (column sums of each slice's dL/dz)."""
    monkeypatch.setattr(K, "_TILE_OVERRIDE", (1, 256))
    T, H, V, Vc = 23, 64, 1000, 384  # one program per row under the interpreter: fewer rows
    h, w, y = _inputs(T, H, V, dtype, device, seed=13)
    y = _labels_in_every_slice(y, V, Vc)
    b = torch.randn(V, generator=torch.Generator().manual_seed(2)).to(dtype).to(device)
    gb = poison_(torch.empty(V, dtype=dtype, device=device))
    out = K.linear_cross_entropy_fwd(h, w, y, _divisor(y, device), bias=b, grad_bias=True,
                                    mode="vocab", vocab_slice=Vc, dbias=gb)
    assert out[4] is gb
    _check(out, _ref(h, w, y, bias=b), dtype)


def _check_ignored_and_bad_labels(h, w, y, dev, kw, **bad_kw):
    """All labels ignored: mean NaN (0/0), sum 0, loss rows and gradients exactly 0 (rows poisoned first). Labels V
    and -7 (out of range): NaN loss rows there, finite elsewhere. Returns the out-of-range call's outputs."""
    T, V = y.numel(), w.shape[0]
    y_all = torch.full_like(y, -100)
    rows = poison_(torch.empty(T, device=dev))
    loss, _, gh, gw, _ = K.linear_cross_entropy_fwd(h, w, y_all, _divisor(y_all, dev), loss_rows=rows, **kw)
    assert torch.isnan(loss) and (rows == 0).all() and (gh == 0).all() and (gw == 0).all()
    assert K.linear_cross_entropy_fwd(h, w, y_all, torch.ones((), device=dev), **kw)[0].item() == 0.0
    y_bad = y.clone()
    y_bad[3], y_bad[5] = V, -7
    out = K.linear_cross_entropy_fwd(h, w, y_bad, _divisor(y_bad, dev), **kw, **bad_kw)
    rows = out[1]
    ok = torch.ones(T, dtype=torch.bool, device=dev)
    ok[[3, 5]] = False
    assert torch.isnan(rows[3]) and torch.isnan(rows[5]) and torch.isfinite(rows[ok]).all()
    return out


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch"])
def test_vocab_ignored_invalid_and_partial_grads(use_triton, device):
    """All ignored (mean NaN, sum 0, zero gradients), an out-of-range label (NaN row), loss only (pass 2
    skipped, bit-identical loss), one gradient at a time - through the kernel and the fp32 torch path (the
    torch path with bf16 inputs: tests/ops test_reference_backend)."""
    T, H, V, Vc = 37, 64, 1000, 512  # 2 slices (3 and a ragged tail: test_vocab_matches_reference)
    dev = device if use_triton else "cpu"
    h, w, y = _inputs(T, H, V, torch.float32, dev, seed=4)
    kw = {"mode": "vocab", "vocab_slice": Vc, "use_triton": use_triton}
    _check_ignored_and_bad_labels(h, w, y, dev, kw, grad_hidden=False, grad_weight=False)

    full = K.linear_cross_entropy_fwd(h, w, y, _divisor(y, dev), **kw)
    only = K.linear_cross_entropy_fwd(h, w, y, _divisor(y, dev), grad_hidden=False, grad_weight=False, **kw)
    assert only[2] is None and only[3] is None and torch.equal(only[0], full[0])
    w_only = K.linear_cross_entropy_fwd(h, w, y, _divisor(y, dev), grad_hidden=False, **kw)
    h_only = K.linear_cross_entropy_fwd(h, w, y, _divisor(y, dev), grad_weight=False, **kw)
    assert w_only[2] is None and h_only[3] is None
    assert_close(w_only[3], full[3], 1e-6, "grad_weight alone")
    assert_close(h_only[2], full[2], 1e-6, "grad_hidden alone")
    _, rgh, rgw, _ = _ref(h, w, y)
    assert_close(full[2], rgh, 1e-5, "grad_hidden")
    assert_close(full[3], rgw, 1e-5, "grad_weight")


def test_vocab_zero_tokens(device):
    h, w, y = _inputs(0, 64, 1000, torch.bfloat16, device)
    gw = poison_(torch.empty(1000, 64, dtype=torch.bfloat16, device=device))
    loss, rows, gh, gw, _ = K.linear_cross_entropy_fwd(h, w, y, torch.ones((), device=device), mode="vocab",
                                                       vocab_slice=384, dweight=gw)
    assert loss.item() == 0.0 and rows.numel() == 0 and gh.shape == (0, 64) and (gw == 0).all()


def test_plan_vocab_slice_and_mode():
    V, H, bf16 = 151936, 2560, torch.bfloat16
    # Qwen3-4B, 4096 tokens: 10 balanced slices of 15232 columns (multiple of 128), 119 MiB each
    vc = K.plan_vocab_slice(4096, V, bf16)
    assert vc == 15232 and vc % 128 == 0 and 4096 * vc * 2 <= K.VOCAB_SLICE_BYTES and math.ceil(V / vc) == 10
    assert K.plan_mode(4096, V, H, bf16, True, "vocab") == ("vocab", vc)  # (the default is "inplace" there)
    for T in (1024, 16384, 65536):  # still within the budget, or at the minimum width
        vc = K.plan_vocab_slice(T, V, bf16)
        assert vc % 128 == 0 and (T * vc * 2 <= K.VOCAB_SLICE_BYTES or vc <= K._VOCAB_MIN_SLICE + 127)
        assert K.plan_mode(T, V, H, bf16, True)[0] == "vocab"
    assert K.plan_vocab_slice(8, 1000, bf16) == 1000  # small: one slice
    # small logits (<= AUTO_LOGITS_BYTES): one token chunk, whatever is wanted
    assert K.plan_mode(256, V, H, bf16, True) == ("tokens", 256)
    # no weight gradient (eval, frozen lm_head): token chunks within the frozen head's budget (one 64-row
    # alignment step over at most), no recompute; so are whole logits between that budget and the auto one
    mode, c = K.plan_mode(4096, V, H, bf16, False)
    assert mode == "tokens" and c < 4096 and c * V * 2 <= K.FROZEN_HEAD_LOGITS_BYTES + 64 * V * 2
    assert (K.FROZEN_HEAD_LOGITS_BYTES // (V * 2)) < 800 < (K.AUTO_LOGITS_BYTES // (V * 2))
    mode, c = K.plan_mode(800, V, H, bf16, False)
    assert mode == "tokens" and c < 800 and c * V * 2 <= K.FROZEN_HEAD_LOGITS_BYTES + 64 * V * 2
    # explicit choices
    assert K.plan_mode(4096, V, H, bf16, True, "tokens") == ("tokens", 4096)  # the colleague's plan
    assert K.plan_mode(4096, V, H, bf16, True, chunk_tokens=512) == ("tokens", 512)
    assert K.plan_mode(64, V, H, bf16, True, vocab_slice=5000) == ("vocab", 5000)
    assert K.plan_mode(64, V, H, bf16, True, "vocab") == ("vocab", V)
    with pytest.raises(ValueError, match="mode"):
        K.plan_mode(64, V, H, bf16, True, "rows")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["vocab", "tokens", "inplace"])
def test_qwen3_4b_modes_gpu(mode):
    """Real shape in each mode against the fp32 reference; the vocab mode's peak: grad_W + one slice + grad_h
    (+ its fp32 accumulator), never the full logits; the inplace mode's: the logits (holding grad_W) + small."""
    T, H, V = 4096, 2560, 151936
    h, w, y = _inputs(T, H, V, torch.bfloat16, "cuda")
    div = _divisor(y, "cuda")
    _check(K.linear_cross_entropy_fwd(h, w, y, div, mode=mode), _ref(h, w, y), torch.bfloat16)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = K.linear_cross_entropy_fwd(h, w, y, div, mode=mode)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    print(f"{mode}: peak extra {extra / 2**30:.3f} GiB")
    if mode == "vocab":
        vc = K.plan_vocab_slice(T, V, torch.bfloat16)
        expect = V * H * 2 + T * vc * 2 + T * H * (2 + 4)
        assert extra <= expect + 16 * 2**20, f"peak extra {extra / 2**30:.3f} GiB > {expect / 2**30:.3f}"
    if mode == "inplace":  # A + B (~ the bf16 logits), the temp block, fp32 grad_h + grad_h; grad_W is A
        ld, rows_a, blocks = K.inplace_layout(T, V, H, K.plan_inplace_block(V, H, torch.bfloat16))
        tmp = max(b - a for a, b, direct in blocks if not direct)
        expect = (V * H + (V - rows_a) * ld) * 2 + tmp * H * 2 + T * H * (4 + 2)
        assert extra <= expect + 16 * 2**20, f"peak extra {extra / 2**30:.3f} GiB > {expect / 2**30:.3f}"
    del out


# ---------------------------------------------------------------- mode="inplace": transposed logits, grad_W over them

INPLACE_CASES = [  # T, H, V, tmp_rows -> (ld, rows_a, blocks): see inplace_layout
    (37, 16, 1000, 8),  # ld 48 (padded rows), 1 temp block, direct blocks growing x3, B's rows 333..999
    (300, 32, 4099, 64),  # ld 304, temp [0, 64), direct [64, 431), B
    (32, 32, 1000, 128),  # T == H, ld == T: rows_a == V (B empty), 8 temp blocks, the last ragged
    (37, 37, 1000, 100),  # T == H, padded: 4 temp blocks, then direct ones
    (64, 16, 3, 1),  # V*H < ld: rows_a == 0, every row in B
    (300, 127, 1000, 256),  # odd H
]
INPLACE_IDS = [f"{t}x{h}x{v}/{r}" for t, h, v, r in INPLACE_CASES]


def _labels_on_block_edges(y, T, V, H, R):
    """Labels on both edges of every block (rows_a's sides included), rows 0.."""
    blocks = K.inplace_layout(T, V, H, R)[2]
    edges = sorted({c for a, b, _ in blocks for c in (a, b - 1)})
    k = min(len(edges), y.numel())
    y[:k] = torch.tensor(edges[:k], device=y.device)
    return y


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("T,H,V,R", INPLACE_CASES, ids=INPLACE_IDS)
def test_inplace_matches_reference(T, H, V, R, dtype, device, monkeypatch):
    """Loss, loss rows and both gradients against the fp32 reference, with every buffer poisoned: the caller's
    outputs (dweight becomes A) and, through _POISON_SCRATCH, B, the temp, the fp32 accumulator, the partials."""
    monkeypatch.setattr(L, "_POISON_SCRATCH", True)
    h, w, y = _inputs(T, H, V, dtype, device, seed=T + H + V + R)
    y = _labels_on_block_edges(y, T, V, H, R)
    y[-1] = -100
    rows = poison_(torch.empty(T, dtype=torch.float32, device=device))
    gh = poison_(torch.empty(T, H, dtype=dtype, device=device))
    gw = poison_(torch.empty(V, H, dtype=dtype, device=device))
    out = K.linear_cross_entropy_fwd(h, w, y, _divisor(y, device), mode="inplace", vocab_slice=R, loss_rows=rows,
                                     dhidden=gh, dweight=gw)
    assert out[1] is rows and out[2] is gh and out[3] is gw  # written in place, every element (no NaN left)
    _check(out, _ref(h, w, y), dtype)
    ref_rows = torch.nn.functional.cross_entropy(h.float() @ w.float().t(), y, reduction="none")
    assert_close(rows, ref_rows, LOSS_TOL[dtype] * 5, "loss rows")
    assert rows[-1].item() == 0.0  # the ignored row
    if dtype == torch.float32:  # the same statistics as one token chunk, up to summation order
        tok = K.linear_cross_entropy_fwd(h, w, y, _divisor(y, device), mode="tokens", grad_hidden=False,
                                         grad_weight=False)
        assert_close(rows, tok[1], 1e-6, "loss rows: inplace vs tokens")
    # without a preallocated dweight, grad_W is A: a standalone allocation of exactly V x H (autograd steals it)
    gw2 = K.linear_cross_entropy_fwd(h, w, y, _divisor(y, device), mode="inplace", vocab_slice=R)[3]
    assert gw2._base is None and gw2.is_contiguous() and gw2.untyped_storage().nbytes() == V * H * dtype.itemsize
    assert torch.equal(gw2, gw)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_inplace_gpu_tiling_and_bias(dtype, device, monkeypatch):
    """Small sweep tiles: several token blocks (masked tail, padding columns), several row splits per piece; and
    the bias (added by the logits GEMM) with its gradient (row sums of dL/dz^T)."""
    monkeypatch.setattr(L, "_COLS_TILE_OVERRIDE", (8, 16, 7))
    monkeypatch.setattr(L, "_POISON_SCRATCH", True)
    T, H, V, R = 37, 16, 1000, 8
    h, w, y = _inputs(T, H, V, dtype, device, seed=17)
    y = _labels_on_block_edges(y, T, V, H, R)
    b = torch.randn(V, generator=torch.Generator().manual_seed(3)).to(dtype).to(device)
    gb = poison_(torch.empty(V, dtype=dtype, device=device))
    out = K.linear_cross_entropy_fwd(h, w, y, _divisor(y, device), bias=b, grad_bias=True,
                                    mode="inplace", vocab_slice=R, dbias=gb)
    assert out[4] is gb
    _check(out, _ref(h, w, y, bias=b), dtype)


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch"])
def test_inplace_ignored_invalid_and_partial_grads(use_triton, device, monkeypatch):
    """All ignored (mean NaN, sum 0, zero gradients), out-of-range labels (NaN rows), grad_W alone - through the
    kernels and the fp32 torch path; loss only and no grad_W take the token-chunk path (no (T, V) buffer)."""
    T, H, V, R = 37, 16, 1000, 8
    dev = device if use_triton else "cpu"
    h, w, y = _inputs(T, H, V, torch.float32, dev, seed=4)
    kw = {"mode": "inplace", "vocab_slice": R, "use_triton": use_triton}
    _, _, gh, gw, _ = _check_ignored_and_bad_labels(h, w, y, dev, kw)
    assert torch.isfinite(gh).all() and torch.isfinite(gw).all()  # as the other modes: softmax, no -1 term

    calls = []
    for name in ("_fwd_inplace", "_fwd_tokens"):
        real = getattr(K, name)
        monkeypatch.setattr(K, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    full = K.linear_cross_entropy_fwd(h, w, y, _divisor(y, dev), **kw)
    only = K.linear_cross_entropy_fwd(h, w, y, _divisor(y, dev), grad_hidden=False, grad_weight=False, **kw)
    h_only = K.linear_cross_entropy_fwd(h, w, y, _divisor(y, dev), grad_weight=False, **kw)
    w_only = K.linear_cross_entropy_fwd(h, w, y, _divisor(y, dev), grad_hidden=False, **kw)
    assert calls == ["_fwd_inplace", "_fwd_tokens", "_fwd_tokens", "_fwd_inplace"]
    assert only[2] is None and only[3] is None and h_only[3] is None and w_only[2] is None
    assert_close(only[0], full[0], 1e-6, "loss only")
    assert_close(h_only[2], full[2], 1e-6, "grad_hidden alone")
    assert_close(w_only[3], full[3], 1e-6, "grad_weight alone")
    _, rgh, rgw, _ = _ref(h, w, y)
    assert_close(full[2], rgh, 1e-5, "grad_hidden")
    assert_close(full[3], rgw, 1e-5, "grad_weight")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_inplace_falls_back_below_hidden(dtype, device, monkeypatch):
    """T < H: the logits (T*V) cannot hold grad_W (V*H) -> mode "tokens" (one chunk here), same numbers."""
    calls = []
    for name in ("_fwd_inplace", "_fwd_tokens"):
        real = getattr(K, name)
        monkeypatch.setattr(K, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    T, H, V = 37, 64, 1000
    h, w, y = _inputs(T, H, V, dtype, device, seed=21)
    out = K.linear_cross_entropy_fwd(h, w, y, _divisor(y, device), mode="inplace")
    assert calls == ["_fwd_tokens"]
    _check(out, _ref(h, w, y), dtype)
    with pytest.raises(ValueError, match="tokens >= hidden"):
        K.inplace_layout(T, V, H, 128)


def _simulate_placement(T, H, V, R, layout=None):
    """Independent element-level replay of step 4 (lowmem docstring): tag every element of A and B with the row
    whose logits it holds, replay the blocks in order and check that each block's rows are intact when read, that
    no write hits a live row, that a direct write misses its own rows, and that A ends up written exactly once."""
    ld, rows_a, blocks = layout or K.inplace_layout(T, V, H, R)
    assert ld >= T and ld - T < L._LD_ALIGN and ld % L._LD_ALIGN == 0
    assert rows_a * ld <= V * H and (rows_a == V or (rows_a + 1) * ld > V * H)  # A holds every row it can
    free = -1
    a_tag = torch.full((V * H,), free, dtype=torch.int64)
    b_tag = torch.full(((V - rows_a) * ld,), free, dtype=torch.int64)
    rows_of = torch.arange(V, dtype=torch.int64)
    a_tag[: rows_a * ld].view(rows_a, ld)[:, :T] = rows_of[:rows_a, None]
    b_tag.view(V - rows_a, ld)[:, :T] = rows_of[rows_a:, None]
    writes = torch.zeros(V * H, dtype=torch.int64)
    done = -2
    for a, b, direct in blocks:
        src = (a_tag[: rows_a * ld].view(rows_a, ld)[a:b, :T] if b <= rows_a
               else b_tag.view(V - rows_a, ld)[a - rows_a: b - rows_a, :T])
        assert torch.equal(src, rows_of[a:b, None].expand(b - a, T)), f"rows {a}:{b} overwritten before use"
        dst = a_tag[a * H: b * H]
        live = (dst >= b)  # logits of later rows
        assert not live.any(), f"block {(a, b)} overwrites live rows"
        if direct:
            assert not ((dst >= a) & (dst < b)).any(), f"direct block {(a, b)} overlaps its own rows"
        else:
            assert b - a <= R
        a_tag[a * H: b * H] = done
        writes[a * H: b * H] += 1
    assert (writes == 1).all() and (a_tag == done).all()
    return blocks


def test_inplace_placement_invariant():
    """The layout for many (T, H, V, tmp_rows), replayed element by element; plus interval checks (the layout's
    own asserts) at real sizes."""
    n = 0
    for T in (16, 17, 31, 37, 64, 100, 129):
        for H in (1, 7, 16, 31, 64):
            if H > T:
                continue
            for V in (1, 2, 3, 50, 257, 1000):
                for R in (1, 5, 64, 128, 10**6):
                    _simulate_placement(T, H, V, R)
                    n += 1
    assert n > 500
    # the replay has teeth: layouts that break (a), (c) or (b) are caught
    ld, rows_a, blocks = K.inplace_layout(37, 1000, 16, 8)
    for bad in (blocks[::-1], [(a, b, True) for a, b, _ in blocks], blocks[:-1] + [(blocks[-1][0], 999, True)]):
        with pytest.raises(AssertionError):
            _simulate_placement(37, 16, 1000, 8, layout=(ld, rows_a, bad))
    bf16 = torch.bfloat16
    for T, H, V in ((4096, 2560, 151936), (2560, 2560, 151936), (4095, 2560, 151936), (8192, 4096, 128256),
                    (65536, 5120, 152064), (5000, 4096, 32000)):
        R = K.plan_inplace_block(V, H, bf16)
        ld, rows_a, blocks = K.inplace_layout(T, V, H, R)
        assert R * H * 2 <= L.INPLACE_TEMP_BYTES and ld % 16 == 0
        assert (V * H + (V - rows_a) * ld) - T * V <= (ld - T + 1) * V  # A + B ~ the logits
    # Qwen3-4B x 4096: 2 temp blocks of 3200 rows (16 MiB), 7 direct ones (B's included)
    ld, rows_a, blocks = K.inplace_layout(4096, 151936, 2560, 3200)
    assert (ld, rows_a) == (4096, 94960) and [d for *_, d in blocks] == [False] * 2 + [True] * 7


def test_plan_inplace_mode():
    V, H, bf16 = 151936, 2560, torch.bfloat16
    assert K.plan_inplace_block(V, H, bf16) == 3200  # 16 MiB of temp
    assert K.plan_mode(4096, V, H, bf16, True) == ("inplace", 3200)  # the default at the headline shape
    assert K.plan_mode(6000, V, H, bf16, True)[0] == "inplace"  # (T - H) * V * 2 <= 1 GiB up to ~6093 tokens
    assert K.plan_mode(6200, V, H, bf16, True)[0] == "vocab"
    assert K.plan_mode(2048, V, H, bf16, True)[0] == "vocab"  # T < H
    assert K.plan_mode(4096, V, H, bf16, False)[0] == "tokens"  # no grad_W: token chunks
    assert K.plan_mode(4096, V, H, bf16, True, "inplace", vocab_slice=1000) == ("inplace", 1000)
    assert K.plan_mode(1024, V, H, bf16, True, "inplace") == ("tokens", 1024)  # T < H: the tokens plan
    mode, c = K.plan_mode(4096, V, H, bf16, False, "inplace")  # loss only / frozen lm_head: token chunks
    assert mode == "tokens" and c * V * 2 <= K.FROZEN_HEAD_LOGITS_BYTES + 64 * V * 2
    assert K.plan_mode(64, 1000, 16, torch.float32, True) == ("inplace", 1000)  # small problems too (T >= H)


# ----------------------------------------------------------------------------------------------- token statistics
# (lse, entropy, first argmax) from the loss's own pass over the logits, every plan, the Triton kernels (GPU tiling
# too) and the CPU path. Compared with reference.token_stats_ref on the logits the plan computes from: the input
# dtype's logits read in fp32 for the kernels (what TRL computes its statistics from), fp32 logits for the CPU path
# (it computes in fp32). Then the math is the same in another order: lse and entropy to 2e-5 absolute (fp32 sums of
# up to 1000 terms of magnitude <= ~30: a few ulps of 30, and entropy = lse - E[z] cancels to that absolute level),
# the argmax exactly (the same logits; duplicated weight rows make exact ties: the first index wins).
STATS_PLANS = [("tokens", {"chunk_tokens": 16}), ("tokens", {}), ("vocab", {"vocab_slice": 384}),
               ("inplace", {"vocab_slice": 256})]


@pytest.mark.parametrize("tiling", ["interpreter", "gpu"])
@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("mode,kw", STATS_PLANS, ids=[f"{m}{'/' + str(k) if k else ''}" for m, k in STATS_PLANS])
def test_token_stats_match_the_logits_they_come_from(mode, kw, dtype, use_triton, tiling, device, monkeypatch):
    if tiling == "gpu":
        if not use_triton:
            pytest.skip("the CPU path has no tiling")
        monkeypatch.setattr(K, "_TILE_OVERRIDE", (1, 128))
        monkeypatch.setattr(L, "_COLS_TILE_OVERRIDE", (32, 16, 3))
    T, H, V = 37, 16, 1000  # inplace needs T >= H; 1000 columns: 3 vocab slices, 4 row splits in the sweep
    h, w, y = _inputs(T, H, V, dtype, device)
    # exact ties at each token's largest logit: token 5's max at columns 12 and 731 (other slices / row splits),
    # token 6's at 399 and 400 (one block); the first index is the argmax. The hidden states are eighths: a logit
    # of a duplicated column is then a sum of exact dyadic products, equal in every dtype and summation order, so
    # the ties stay exact (in rows 5 and 6 and in any other row whose largest logit falls on a duplicated column)
    # where the plan computes each vocab slice in its own GEMM (on the GPU each may reduce in its own order)
    gen = torch.Generator().manual_seed(1)
    h = (torch.randint(-8, 9, (T, H), generator=gen) / 8).to(dtype).to(device)
    w[12] = w[731] = 2 * h[5]
    w[399] = w[400] = 2 * h[6]
    stats = tuple(poison_(torch.empty(T, device=device, dtype=d)) for d in (torch.float32, torch.float32, torch.int64))
    loss, rows, *_ = K.linear_cross_entropy_fwd(h, w, y, _divisor(y, device), mode=mode, use_triton=use_triton,
                                                token_stats=stats, **kw)
    logits = (h @ w.T).float() if use_triton else h.float() @ w.float().T
    nll, lse, ent, top = oracle.token_stats_ref(logits, y)
    keep = y != -100
    assert_close(stats[0], lse, 2e-5 * float(lse.abs().max()), "lse")  # rel-norm; ignored rows: exactly 0
    assert float((stats[1] - ent).abs().max()) <= 2e-5 * max(1.0, float(logits.abs().max()))
    assert torch.equal(stats[2], top), (stats[2][stats[2] != top], top[stats[2] != top])
    assert [int(top[5]), int(top[6])] == [12 if keep[5] else -1, 399 if keep[6] else -1]  # the ties are real
    assert float((rows - nll).abs().max()) <= 2e-5 * max(1.0, float(logits.abs().max()))  # -log p(label)
    assert torch.equal(stats[0][~keep], torch.zeros_like(stats[0][~keep])) and bool((stats[2][~keep] == -1).all())
    plain, *_ = K.linear_cross_entropy_fwd(h, w, y, _divisor(y, device), mode=mode, use_triton=use_triton, **kw)
    assert torch.equal(loss, plain)  # asking for the statistics changes nothing else


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["inplace", "tokens", "vocab"])
def test_qwen3_4b_token_stats_gpu(mode):
    """The token statistics at the real shape (TRL's headline call: 4096 tokens, Qwen3-4B's vocab) against TRL's
    formulas on the bf16 logits: lse and entropy within 2e-5 x max|z| absolute (fp32 sums of 151936 terms in another
    order), the argmax the largest reference logit up to one bf16 step (the plans' logits GEMMs may round a
    near-tie differently; exact ties keep the first index in every plan, tested on the CPU)."""
    T, H, V = 4096, 2560, 151936
    h, w, y = _inputs(T, H, V, torch.bfloat16, "cuda")
    stats = tuple(poison_(torch.empty(T, device="cuda", dtype=d)) for d in (torch.float32, torch.float32, torch.int64))
    # with gradients: "inplace" is planned only when grad_W is wanted
    _, rows, *_ = K.linear_cross_entropy_fwd(h, w, y, _divisor(y, "cuda"), mode=mode, token_stats=stats)
    keep = y != -100
    for a in range(0, T, 1024):  # the reference in row blocks: 1024 x V fp32 logits at a time
        z = (h[a:a + 1024] @ w.T).float()
        nll, lse, ent, top = oracle.token_stats_ref(z, y[a:a + 1024])
        tol = 2e-5 * float(z.abs().max())
        assert float((stats[0][a:a + 1024] - lse).abs().max()) <= tol
        assert float((stats[1][a:a + 1024] - ent).abs().max()) <= tol
        assert float((rows[a:a + 1024] - nll).abs().max()) <= tol
        k = keep[a:a + 1024]
        got = stats[2][a:a + 1024][k]
        best = z[k].amax(1)
        assert bool((z[k].gather(1, got.unsqueeze(1)).squeeze(1) >= best - best.abs() * 2.0 ** -7).all())
