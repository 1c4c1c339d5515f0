"""NF4 embedding gather (novatune/kernels/nf4.py nf4_embedding / nf4_embedding_ref, novatune/ops/nf4.py NF4Embedding):
the gathered rows equal nf4_dequantize_ref(table)[ids] bit for bit, for any row width (H % 64 != 0: rows start
mid-block, H odd: mid-byte), tables spanning several second-level (256-block) scales, repeated ids, odd counts,
bf16/fp16/fp32 outputs, into poisoned buffers; the chunked quantiser the module uses equals the one-shot one; the
module is frozen (no parameters, output without grad) yet works under HF's enable_input_require_grads hook.

Exact equality: both sides compute the same fp32 product per element (kernels/nf4.py docstring); any difference is
a wrong byte, nibble, block or scale index, never noise.
"""
import pytest
import torch
from torch import nn

from novatune.kernels import nf4 as K
from novatune.measure.numerics import poison_
from novatune.ops import nf4 as ops_nf4
from novatune.ops.nf4 import NF4Embedding

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (V, H): H % 64 == 0 with 600 blocks (3 second-level scales); H = 67 (rows straddle blocks and bytes, 131*67/64 ->
# 138 blocks); H = 1000 (15.6 blocks a row, one masked 1024-column tile); H = 64 with V = 513 (513 blocks: the last
# second-level block holds one value); H = 3 (many rows per block)
TABLES = [(300, 128), (131, 67), (41, 1000), (513, 64), (50, 3)]
IDS = [(1,), (13,), (2, 37)]


def _table(V, H, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, H, generator=g) * 0.02
    w.view(-1)[::97] *= 8  # outlier blocks
    return w.to(dtype)


def _ids(shape, V, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, shape, generator=g)
    ids.view(-1)[-1] = ids.view(-1)[0]  # a repeat for sure (random ones too, mostly)
    if ids.numel() > 2:
        ids.view(-1)[1], ids.view(-1)[2] = 0, V - 1  # the first and the last row
    return ids


def _to(t, device):
    return K.NF4Tensor(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in t.__dict__.items()})


@pytest.mark.parametrize("V,H", TABLES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_equals_full_dequant_exactly(V, H, dtype, device):
    t = K.nf4_quantize_ref(_table(V, H))
    full = K.nf4_dequantize_ref(t, dtype)
    for shape in IDS:
        ids = _ids(shape, V)
        want = full[ids]
        assert torch.equal(K.nf4_embedding_ref(t, ids, dtype), want)
        out = poison_(torch.empty(*shape, H, dtype=dtype, device=device))
        got = K.nf4_embedding(_to(t, device), ids.to(device), out=out)
        assert got.data_ptr() == out.data_ptr() and torch.isfinite(got).all(), "every element written"
        assert torch.equal(got.cpu(), want)


def test_non_nested_int32_ids_and_dispatch(device):
    t = K.nf4_quantize_ref(_table(77, 96, torch.float32), double_quant=False)
    ids = _ids((29,), 77).to(torch.int32)
    want = K.nf4_dequantize_ref(t, torch.float16)[ids.long()]
    assert torch.equal(K.nf4_embedding(_to(t, device), ids.to(device), torch.float16).cpu(), want)
    assert torch.equal(K.nf4_embedding_ref(t, ids, torch.float16), want)
    assert torch.equal(ops_nf4.nf4_embedding(_to(t, device), ids.to(device), torch.float16).cpu(), want)


def test_out_of_range_ids(device):
    t = K.nf4_quantize_ref(_table(20, 64))
    for bad in (20, -1):
        with pytest.raises(IndexError, match=r"\[0, 20\)"):
            K.nf4_embedding_ref(t, torch.tensor([0, bad]))
        with pytest.raises(IndexError, match=r"\[0, 20\)"):
            K.nf4_embedding(t, torch.tensor([0, bad]))
    # on the GPU the range check would sync: the kernel itself reads nothing out of range and writes NaN rows
    ids = torch.tensor([3, 20, -1, 19], device=device)
    out = torch.zeros(4, 64, dtype=torch.float32, device=device)
    K._embedding_launch(_to(t, device), ids, out, torch.float32)
    out = out.cpu()
    assert out[1:3].isnan().all()
    assert torch.equal(out[[0, 3]], K.nf4_dequantize_ref(t, torch.float32)[[3, 19]])


def test_chunked_quantiser_is_bit_identical():
    w = _table(129, 67)  # numel 8643: odd, a short last block
    one = K.nf4_quantize_ref(w)
    for chunk in (128, 1024, 64 * 256):
        c = K.nf4_quantize_ref(w, chunk=chunk)
        for k in ("packed", "absmax", "absmax2", "offset"):
            assert torch.equal(getattr(c, k), getattr(one, k)), (chunk, k)
    with pytest.raises(ValueError, match="multiple of 2 x blocksize"):
        K.nf4_quantize_ref(w, chunk=64)


def test_module_is_frozen_and_feeds_input_grads(device):
    torch.manual_seed(0)
    emb = nn.Embedding(300, 128, padding_idx=0).to(torch.bfloat16)
    m = NF4Embedding.from_embedding(emb).to(device)
    assert m.compute_dtype == torch.bfloat16 and not list(m.parameters())
    full = K.nf4_dequantize_ref(K.nf4_quantize_ref(emb.weight.detach()), torch.bfloat16)
    ids = _ids((2, 9), 300).to(device)
    out = m(ids)
    assert out.dtype == torch.bfloat16 and not out.requires_grad and torch.equal(out.cpu(), full[ids.cpu()])
    assert torch.equal(m.dequantize().cpu(), full)
    # what transformers' enable_input_require_grads registers on get_input_embeddings(): the frozen output becomes
    # a graph input, so the adapters downstream get gradients through checkpointed layers
    m.register_forward_hook(lambda mod, inp, o: o.requires_grad_(True))
    lin = nn.Linear(128, 4).to(device)
    out = m(ids)
    lin(out.float()).sum().backward()
    assert out.requires_grad and lin.weight.grad is not None and torch.isfinite(lin.weight.grad).all()
    # a float cast moves the output dtype, never the fp32 scales / code tables (their values would change)
    m.to(torch.float16)
    assert m.compute_dtype == torch.float16 and m.absmax2.dtype == m.code2.dtype == torch.float32
    assert torch.equal(m(ids).cpu(), K.nf4_dequantize_ref(K.nf4_quantize_ref(emb.weight.detach()),
                                                          torch.float16)[ids.cpu()])


def test_module_refuses_what_it_cannot_reproduce():
    class Scaled(nn.Embedding):  # e.g. Gemma's embed_scale: a subclass's forward would be dropped silently
        def forward(self, x):
            return super().forward(x) * 2.0

    with pytest.raises(TypeError, match="plain nn.Embedding"):
        NF4Embedding.from_embedding(Scaled(10, 64))
    with pytest.raises(ValueError, match="max_norm"):
        NF4Embedding.from_embedding(nn.Embedding(10, 64, max_norm=1.0))
    with pytest.raises(ValueError, match="2-D double-quantised"):
        NF4Embedding(K.nf4_quantize_ref(torch.randn(10, 64), double_quant=False), torch.float32)
