"""NF4 dequantisation (novatune/kernels/nf4.py): the Triton kernel equals the fp32 reference bit for bit, the
round trip stays inside the stated bound, odd sizes, poisoned outputs, bf16/fp16/fp32 outputs, and bitsandbytes'
own quantised state dequantises to exactly bnb's `dequantize_4bit`.

Exact equality (not a tolerance) is the right check for the kernel: both sides compute the same fp32 products in
the same order with the same roundings (module docstring), so any difference is a bug (wrong nibble, block or
scale), never noise. The round-trip bound is derived in the module docstring; here it is checked per element.
"""
import pytest
import torch

from novatune.kernels import nf4 as K
from novatune.measure.numerics import poison_
from novatune.ops import nf4 as ops_nf4

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# numel: 1 and 7 (short single block), 64*5 (whole blocks), 64*256 + 37 (not a multiple of 64; 257 blocks: a second
# absmax2 block of one value), 129 x 67 (odd numel: a padding nibble; 2-D; the byte-per-element kernel),
# 64*256 + 38 and 130 x 67 (even numel, short last block: the byte-per-pair kernel's masks)
SHAPES = [(1,), (7,), (320,), (64 * 256 + 37,), (64 * 256 + 38,), (129, 67), (130, 67)]
MAX_GAP = max(b - a for a, b in zip(K.NF4_LEVELS, K.NF4_LEVELS[1:]))  # -1 -> -0.696: 0.3038


def _bnb():
    try:
        import bitsandbytes  # noqa: F401
        import bitsandbytes.functional as F
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable here"
        pytest.skip(f"bitsandbytes is not installable/importable here ({type(e).__name__}: {e}); "
                    f"pip install bitsandbytes (>= 0.48 has a CPU backend)")
    return F


def _weights(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02
    w.view(-1)[:: 97] *= 8  # outliers: blocks whose absmax is far above the rest (the case NF4 handles worst)
    return w.to(dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nested", [True, False])
def test_triton_equals_reference_exactly(shape, dtype, nested, device):
    t = K.nf4_quantize_ref(_weights(shape, dtype), double_quant=nested)
    ref = K.nf4_dequantize_ref(t)
    assert ref.dtype == dtype and ref.shape == torch.Size(shape)
    t_dev = K.NF4Tensor(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in t.__dict__.items()})
    out = poison_(torch.empty(shape, dtype=dtype, device=device))
    got = K.nf4_dequantize(t_dev, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(got).all(), "every element written"
    assert torch.equal(got.cpu(), ref)


@pytest.mark.parametrize("blocksize", [32, 128, 4096])
@pytest.mark.parametrize("dtype", DTYPES)
def test_other_blocksizes_and_an_odd_offset_out(blocksize, dtype, device):
    # the byte-per-pair kernel tiles (blocks, blocksize / 2 bytes): other block sizes change both tile dims; an out
    # that starts at an odd element cannot be viewed as words and takes the byte-per-element kernel
    t = K.nf4_quantize_ref(_weights((3 * blocksize + 10,), dtype), blocksize=blocksize)
    ref = K.nf4_dequantize_ref(t)
    t_dev = K.NF4Tensor(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in t.__dict__.items()})
    assert torch.equal(K.nf4_dequantize(t_dev).cpu(), ref)
    base = poison_(torch.empty(t.numel + 1, dtype=dtype, device=device))
    got = K.nf4_dequantize(t_dev, out=base[1:])
    assert torch.equal(got.cpu(), ref) and torch.isnan(base[:1].float()).all(), "nothing written before out"


@pytest.mark.parametrize("out_dtype", DTYPES)
def test_output_dtype_differs_from_stored(out_dtype, device):
    # bf16 weights dequantised to fp16/fp32 (a compute dtype other than the checkpoint's): one cast of the fp32 value
    t = K.nf4_quantize_ref(_weights((300,), torch.bfloat16))
    ref32 = K.nf4_dequantize_ref(t, torch.float32)
    t_dev = K.NF4Tensor(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in t.__dict__.items()})
    got = K.nf4_dequantize(t_dev, out_dtype)
    assert got.dtype == out_dtype and torch.equal(got.cpu(), ref32.to(out_dtype))


@pytest.mark.parametrize("shape", [(64 * 300 + 5,), (33, 65)])
@pytest.mark.parametrize("nested", [True, False])
def test_round_trip_bound(shape, nested):
    """|w - deq(q(w))| <= MAX_GAP/2 * absmax_b + |absmax_b - a'_b| (+ fp32 rounding), per element (docstring)."""
    w = _weights(shape, torch.float32, seed=1).reshape(-1)
    t = K.nf4_quantize_ref(w, double_quant=nested)
    deq = K.nf4_dequantize_ref(t, torch.float32)
    n = w.numel()
    absmax = torch.nn.functional.pad(w.abs(), (0, -n % 64)).view(-1, 64).amax(1)  # the true per-block absmax
    a_used = K.absmax_ref(t)
    if not nested:
        assert torch.equal(a_used, absmax)
    else:
        # the 8-bit absmax itself: within half the dynamic map's largest gap x its second-level scale
        code2 = K.dynamic_map()
        gap2 = (code2[1:] - code2[:-1]).max()
        a2 = t.absmax2.repeat_interleave(256)[: absmax.numel()]
        assert ((a_used - absmax).abs() <= gap2 / 2 * a2 * (1 + 1e-6) + 1e-12).all()
    per_block = MAX_GAP / 2 * absmax + (a_used - absmax).abs()
    bound = per_block.repeat_interleave(64)[:n] * (1 + 1e-6) + 1e-12  # 1e-6: the fp32 roundings (a few ulps)
    err = (w - deq.reshape(-1)).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3e}"
    # and the bound is not vacuous: the worst element uses a good part of it
    assert (err / bound).max() > 0.3


def test_zero_block_and_exact_levels():
    # an all-zero block dequantises to zeros (bnb divides by 1e-38, not by 0); exact NF4 levels x absmax round-trip
    lv = torch.tensor(K.NF4_LEVELS)
    w = torch.cat([torch.zeros(64), lv.repeat(4) * 0.5])
    t = K.nf4_quantize_ref(w, double_quant=False)
    assert torch.equal(K.nf4_dequantize_ref(t, torch.float32), w)


def test_check_rejects_bad_state():
    t = K.nf4_quantize_ref(torch.randn(200))
    with pytest.raises(ValueError, match="blocks of 64 need"):
        K.check(K.NF4Tensor(**{**t.__dict__, "absmax": t.absmax[:-1]}))
    with pytest.raises(ValueError, match="blocksize"):
        K.nf4_quantize_ref(torch.randn(10), blocksize=48)
    with pytest.raises(ValueError, match="contiguous"):
        K.nf4_dequantize(t, out=torch.empty(201, dtype=torch.float32))


@pytest.mark.parametrize("path", ["cpu", "interpreter"])
@pytest.mark.parametrize("bad", [torch.int32, torch.uint8, torch.float64], ids=str)
def test_output_dtype_is_refused_on_every_path(bad, path, backend_env):
    """Only bf16 / fp16 / fp32 outputs: the kernel refused an integer dtype, the CPU reference truncated the
    levels to integers silently. A wrong `out` buffer is refused on both paths too."""
    backend_env("TRITON_INTERPRET", "1" if path == "interpreter" else "0")
    t = K.nf4_quantize_ref(torch.randn(3, 64, generator=torch.Generator().manual_seed(7)), 64, True)
    with pytest.raises(TypeError, match="output dtype must be one of"):
        ops_nf4.nf4_dequantize(t, bad)
    with pytest.raises(TypeError, match="output dtype must be one of"):
        K.nf4_dequantize_ref(t, bad)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        ops_nf4.nf4_dequantize(t, torch.float32, out=torch.empty(3, 64, dtype=torch.bfloat16))


def test_dynamic_map_and_quantiser_match_bnb():
    F = _bnb()
    assert torch.equal(K.dynamic_map(), F.create_dynamic_map())
    assert torch.equal(K.nf4_code(), F.get_4bit_type("nf4", device="cpu"))
    w = _weights((4097,), torch.bfloat16)
    q, qs = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    t = K.nf4_quantize_ref(w)
    # bnb's CPU quantiser is the same arithmetic (backends/default/ops.py): the same codes, scales and offset
    assert torch.equal(q.reshape(-1), t.packed) and torch.equal(qs.state2.absmax, t.absmax2)
    assert torch.equal(qs.offset, t.offset)


@pytest.mark.parametrize("shape", [(96, 200), (129, 67), (5, 64 * 257)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantises_bnb_params4bit_bit_for_bit(shape, dtype, device):
    """bnb's own Params4bit (quant_type nf4, compress_statistics=True) through from_bnb + our kernel equals
    bnb's dequantize_4bit exactly (both the Triton kernel and the reference)."""
    F = _bnb()
    import bitsandbytes as bnb

    w = _weights(shape, dtype)
    p = bnb.nn.Params4bit(w.clone(), requires_grad=False, quant_type="nf4", compress_statistics=True,
                          blocksize=64)
    p = p.to(device)  # bnb quantises a Params4bit when it moves to a device (CPU included)
    want = F.dequantize_4bit(p.data, p.quant_state).reshape(shape)
    t = ops_nf4.from_bnb(p)
    assert t.nested and t.blocksize == 64 and t.dtype == dtype
    assert torch.equal(K.nf4_dequantize(t).cpu(), want.cpu())
    assert torch.equal(K.nf4_dequantize_ref(t).cpu(), want.cpu())
