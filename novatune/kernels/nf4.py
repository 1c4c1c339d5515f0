"""NF4 (4-bit NormalFloat) weights, bitsandbytes layout: Triton dequantisation and the fp32 references.

Layout (bitsandbytes 0.4x-0.50 `quantize_4bit(quant_type="nf4", blocksize=64, compress_statistics=True)`, read
from bitsandbytes/functional.py and backends/default/ops.py):

    W (any shape, numel n) is flattened; block b = elements [64 b, 64 b + 64) (the last block may be shorter)
    absmax[b]  = max |W| over block b                                   (fp32, the first-level scale)
    q[i]       = index of the NF4 level nearest to W[i] / absmax[b]     (levels `NF4_LEVELS`, sorted, index 0..15;
                                                                          ties go to the lower level: bucketize on
                                                                          the midpoints)
    packed[j]  = (q[2j] << 4) | q[2j+1]                                 (uint8, (n + 1) // 2 bytes: the FIRST element
                                                                          of a pair in the HIGH nibble; n odd: pad 0)
  double quantisation (compress_statistics=True) stores absmax in 8 bits:
    offset     = mean(absmax)                                           (fp32 scalar)
    absmax is quantised blockwise (blocks of 256 absmax values) with the signed 8-bit *dynamic* map
    `dynamic_map()` (256 levels, bitsandbytes' create_dynamic_map): absmax2[c] = max |absmax - offset| over block c
    (fp32), qabsmax[b] = nearest dynamic level to (absmax[b] - offset) / absmax2[b // 256] (uint8)

Dequantisation, exactly bitsandbytes' sequence of fp32 roundings (so the result is bit-identical to its
`dequantize_4bit`, CPU and CUDA):
    a = fp32(code2[qabsmax[b]] * absmax2[b // 256]);  a = fp32(a + offset)   (two roundings: bnb runs
                                                                            dequantize_blockwise, then `+= offset`)
    W'[i] = dtype(fp32(NF4_LEVELS[q[i]] * a))                               (one fp32 product, one cast)
The Triton launch passes enable_fp_fusion=False so the compiler cannot contract the first two steps into an FMA
(one rounding instead of two would differ from bnb in the last bit).

Round-trip error (stated bound, tested): with g = the largest gap between adjacent NF4 levels (-1 -> -0.696:
0.3038), nearest-level rounding leaves |W/absmax - level| <= g / 2, so without double quantisation
    |W - W'| <= g / 2 * absmax[b]    (+ one fp32 / output-dtype rounding of W')
With double quantisation W' uses a' (the 8-bit absmax) instead of absmax: |W - level a'| <= |W - level absmax| +
|level| |absmax - a'| <= g / 2 * absmax[b] + |absmax[b] - a'[b]|, and |absmax - a'| <= g2 / 2 * absmax2 (g2: the
dynamic map's largest gap), again plus fp32 roundings. tests/kernels/test_nf4.py checks these per element.

Embedding gather (nf4_embedding / nf4_embedding_ref): rows `ids` of a 2-D (V, H) table, out[t, c] = the value of
flat element ids[t] * H + c, with that element's own byte, nibble, block (e // 64) and second-level scale
((e // 64) // 256): any H works (H % 64 != 0: rows start mid-block; H odd: mid-byte), and the result is
nf4_dequantize_ref(t)[ids] bit for bit while reading only the gathered rows.

No torch.autograd, no transformers, no bitsandbytes import here (ARCHITECTURE.md): ops/nf4.py reads bnb's state.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from novatune.kernels.launch import cdiv, lean, next_pow2

# bitsandbytes' get_4bit_type("nf4") (create_normal_map(0.9677083), normalised to [-1, 1]), as fp32 values
NF4_LEVELS = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0)
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # bnb's accepted 4-bit block sizes
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def nf4_code(device=None) -> Tensor:
    return torch.tensor(NF4_LEVELS, dtype=torch.float32, device=device)


def dynamic_map(device=None) -> Tensor:
    """bitsandbytes' create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8) with its exact float
    arithmetic (float32 linspace, float32 tensor x Python-scalar products), so the 256 levels are identical."""
    data: list[float] = []
    non_sign_bits, max_exp = 7, 7
    for i in range(max_exp):
        items = int(2 ** (i + non_sign_bits - max_exp) + 1)
        bounds = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += ((10 ** (-(max_exp - 1) + i)) * means).tolist()
        data += (-(10 ** (-(max_exp - 1) + i)) * means).tolist()
    data += [0, 1.0]
    data.sort()
    return torch.tensor(data, dtype=torch.float32, device=device)


@dataclass
class NF4Tensor:
    """An NF4-quantised tensor in bitsandbytes' layout (module docstring). Nested (double-quantised) when
    `absmax2` is set: then absmax is uint8 codes into `code2`; otherwise absmax is fp32."""

    packed: Tensor  # uint8, ((numel + 1) // 2,)
    absmax: Tensor  # (nblocks,) uint8 (nested) or fp32
    shape: torch.Size
    dtype: torch.dtype  # the dtype dequantisation produces by default (bnb: the original weight's)
    code: Tensor  # (16,) fp32 NF4 levels
    blocksize: int = 64
    absmax2: Tensor | None = None  # (ceil(nblocks / blocksize2),) fp32
    code2: Tensor | None = None  # (256,) fp32 dynamic map
    offset: Tensor | None = None  # () or (1,) fp32: mean of the first-level absmax
    blocksize2: int = 256

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nested(self) -> bool:
        return self.absmax2 is not None

    @property
    def nbytes(self) -> int:
        optional = [t for t in (self.absmax2, self.code2, self.offset) if t is not None]
        ts = [self.packed, self.absmax, self.code] + optional
        return sum(t.numel() * t.element_size() for t in ts)

    def second_level(self) -> tuple[Tensor, Tensor, Tensor]:
        """(absmax2, code2, offset) of a double-quantised tensor."""
        if self.absmax2 is None or self.code2 is None or self.offset is None:
            raise ValueError("nf4: double quantisation needs absmax2, code2 and offset, and one of them is unset")
        return self.absmax2, self.code2, self.offset


def check(t: NF4Tensor) -> None:
    n = t.numel
    nblocks = -(-n // t.blocksize)
    if t.blocksize not in BLOCKSIZES:
        raise ValueError(f"nf4: blocksize {t.blocksize} is not one of bitsandbytes' {BLOCKSIZES}")
    if t.packed.dtype != torch.uint8 or t.packed.numel() != (n + 1) // 2:
        raise ValueError(f"nf4: packed must be uint8 with (numel + 1) // 2 = {(n + 1) // 2} bytes, got "
                         f"{t.packed.dtype} with {t.packed.numel()}")
    if t.absmax.numel() != nblocks:
        raise ValueError(f"nf4: {nblocks} blocks of {t.blocksize} need {nblocks} absmax values, got {t.absmax.numel()}")
    if t.code.numel() != 16:
        raise ValueError(f"nf4: code must hold the 16 NF4 levels, got {t.code.numel()} values")
    if t.absmax2 is not None:  # nested
        if t.absmax.dtype != torch.uint8 or t.code2 is None or t.offset is None or t.code2.numel() != 256:
            raise ValueError("nf4: double quantisation needs uint8 absmax codes, code2 (256 levels) and offset")
        if t.absmax2.numel() != -(-nblocks // t.blocksize2):
            raise ValueError(f"nf4: {nblocks} absmax values in blocks of {t.blocksize2} need "
                             f"{-(-nblocks // t.blocksize2)} second-level scales, got {t.absmax2.numel()}")
    elif t.absmax.dtype != torch.float32:
        raise ValueError(f"nf4: absmax without double quantisation must be fp32, got {t.absmax.dtype}")


# ------------------------------------------------------------------------------------------- fp32 references
def _blockwise_absmax_codes(x: Tensor, levels: Tensor, blocksize: int, pad_to_even: bool = False):
    """bnb's blockwise quantiser (backends/default/ops.py), the same fp32 arithmetic: full blocks scale by
    x * (1 / absmax), the short last block by x / absmax (bnb does both, and they can differ in the last bit).
    Returns (codes int64 (n, or n rounded up to even with a 0.0 pad that quantises to level 0.0), absmax fp32)."""
    flat = x.reshape(-1).float()
    n = flat.numel()
    full = n - n % blocksize
    blocks = flat[:full].view(-1, blocksize)
    absmax = blocks.abs().amax(dim=1)  # (full blocks,)
    scaled = torch.clamp(blocks * (1.0 / absmax.clamp(min=1e-38).view(-1, 1)), -1, 1).reshape(-1)
    if full < n:
        am = flat[full:].abs().max().clamp(min=1e-38)
        absmax = torch.cat([absmax, am.view(1)])
        scaled = torch.cat([scaled, torch.clamp(flat[full:] / am, -1, 1)])
    if pad_to_even and n % 2:
        scaled = torch.nn.functional.pad(scaled, (0, 1))
    bounds = (levels[:-1] + levels[1:]) / 2  # midpoints; bucketize: a tie goes to the lower level
    return torch.bucketize(scaled, bounds), absmax


def nf4_quantize_ref(w: Tensor, blocksize: int = 64, double_quant: bool = True,
                     chunk: int | None = None) -> NF4Tensor:
    """Quantise like bitsandbytes' quantize_4bit(quant_type="nf4", compress_statistics=double_quant), plain
    PyTorch in fp32. The result dequantises with nf4_dequantize_ref or nf4_dequantize (Triton).

    chunk: quantise at most this many elements at a time (a multiple of 2 * blocksize), for large tensors: the
    reference's temporaries are ~20 bytes per element (fp32 copy, scaled values, int64 codes), 12 GiB for a
    152k x 4096 embedding at once. Chunks hold whole blocks and whole bytes, and the double quantisation (whose
    offset is the mean over ALL blocks) runs once on the gathered absmax, so the result is bit-identical."""
    if blocksize not in BLOCKSIZES:
        raise ValueError(f"nf4_quantize_ref: blocksize {blocksize} is not one of {BLOCKSIZES}")
    if w.dtype not in OUT_DTYPES:
        raise TypeError(f"nf4_quantize_ref: w must be bf16, fp16 or fp32, got {w.dtype}")
    if chunk is not None and (chunk <= 0 or chunk % (2 * blocksize)):
        raise ValueError(f"nf4_quantize_ref: chunk {chunk} must be a positive multiple of 2 x blocksize "
                         f"({2 * blocksize}): whole blocks and whole bytes per chunk")
    code = nf4_code(w.device)
    flat = w.reshape(-1)
    step = chunk or max(flat.numel(), 1)
    packed_parts, absmax_parts = [], []
    for s in range(0, max(flat.numel(), 1), step):
        q, am = _blockwise_absmax_codes(flat[s:s + step], code, blocksize, pad_to_even=True)
        q8 = q.to(torch.uint8)
        packed_parts.append((q8[0::2] << 4) | q8[1::2])  # first element of each pair in the high nibble
        absmax_parts.append(am)
        del q, q8
    packed = packed_parts[0] if len(packed_parts) == 1 else torch.cat(packed_parts)
    absmax = absmax_parts[0] if len(absmax_parts) == 1 else torch.cat(absmax_parts)
    out = NF4Tensor(packed=packed, absmax=absmax, shape=torch.Size(w.shape), dtype=w.dtype, code=code,
                    blocksize=blocksize)
    if double_quant:
        offset = absmax.mean()
        code2 = dynamic_map(w.device)
        qa, absmax2 = _blockwise_absmax_codes(absmax - offset, code2, 256)
        out.absmax, out.absmax2, out.code2, out.offset = qa.to(torch.uint8), absmax2, code2, offset
    return out


def absmax_ref(t: NF4Tensor) -> Tensor:
    """The fp32 first-level scales the dequantisation uses (double quantisation undone, bnb's two roundings)."""
    if not t.nested:
        return t.absmax.float()
    absmax2, code2, offset = t.second_level()
    idx = torch.arange(t.absmax.numel(), device=t.absmax.device) // t.blocksize2
    a = code2[t.absmax.long()] * absmax2[idx]  # one fp32 rounding ...
    return a + offset.reshape(())  # ... and a second one, as bnb (dequantize_blockwise, then += offset)


def dequantize_dtype(t: NF4Tensor, dtype: torch.dtype | None, out: Tensor | None = None) -> torch.dtype:
    """The dequantisation's output dtype (`dtype`, else out's, else t.dtype), checked the same on every path:
    TypeError unless one of OUT_DTYPES (an integer cast would truncate the levels), ValueError for an `out` that
    is not a contiguous tensor of t's size in it."""
    dtype = dtype or (out.dtype if out is not None else t.dtype)
    if dtype not in OUT_DTYPES:
        raise TypeError(f"nf4_dequantize: output dtype must be one of {OUT_DTYPES}, got {dtype}")
    if out is not None and (out.dtype != dtype or out.numel() != t.numel or not out.is_contiguous()):
        raise ValueError(f"nf4_dequantize: out must be a contiguous {dtype} tensor of {t.numel} elements, got "
                         f"{out.dtype} {tuple(out.shape)}")
    return dtype


def nf4_dequantize_ref(t: NF4Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Plain-PyTorch dequantisation: fp32 product, one cast to `dtype` (default t.dtype); shape t.shape."""
    check(t)
    dtype = dequantize_dtype(t, dtype)
    n = t.numel
    q = torch.stack([t.packed >> 4, t.packed & 0xF], dim=1).reshape(-1)[:n].long()  # (n,) high nibble first
    scale = absmax_ref(t).repeat_interleave(t.blocksize)[:n]
    return (t.code[q] * scale).to(dtype).view(t.shape)


def _check_rows(t: NF4Tensor, ids: Tensor, dtype: torch.dtype | None) -> torch.dtype:
    check(t)
    if len(t.shape) != 2:
        raise ValueError(f"nf4 embedding: the table is 2-D (num_embeddings, dim), got shape {tuple(t.shape)}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"nf4 embedding: ids must be int32 or int64, got {ids.dtype}")
    dtype = dtype or t.dtype
    if dtype not in OUT_DTYPES:
        raise TypeError(f"nf4 embedding: output dtype must be one of {OUT_DTYPES}, got {dtype}")
    if ids.device.type == "cpu" and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= t.shape[0]):
        # checked where it costs no device sync; on the GPU the kernel writes NaN rows instead (see there)
        raise IndexError(f"nf4 embedding: ids must lie in [0, {t.shape[0]}), got [{int(ids.min())}, "
                         f"{int(ids.max())}]")
    return dtype


def nf4_embedding_ref(t: NF4Tensor, ids: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Rows `ids` of a 2-D NF4 table, dequantised: equals nf4_dequantize_ref(t, dtype)[ids] bit for bit (the same
    fp32 products, per element), but touches only those rows' bytes and blocks. Element (r, c) is element r*H + c
    of the flattened table, so any H works: when H % 64 != 0 a row starts mid-block (and, H odd, mid-byte)."""
    dtype = _check_rows(t, ids, dtype)
    H = t.shape[1]
    e = ids.reshape(-1, 1).long() * H + torch.arange(H, device=ids.device)  # (T, H) flat element indices
    byte = t.packed[e // 2]
    q = torch.where(e % 2 == 0, byte >> 4, byte & 0xF).long()
    blk = e // t.blocksize
    if t.nested:
        absmax2, code2, offset = t.second_level()
        a = code2[t.absmax[blk].long()] * absmax2[blk // t.blocksize2]  # absmax_ref's two roundings, per block
        a = a + offset.reshape(())
    else:
        a = t.absmax[blk]
    return (t.code[q] * a).to(dtype).view(*ids.shape, H)


# ------------------------------------------------------------------------------------------- Triton kernel
@triton.jit
def _nf4_values(packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, i, mask,
                BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr):
    """fp32 dequantised values of flat elements `i` (int64, any shape), bnb's roundings (module docstring)."""
    byte = tl.load(packed_ptr + i // 2, mask=mask, other=0).to(tl.int32)  # each byte read twice, from L1
    nib = tl.where(i % 2 == 0, byte >> 4, byte & 0xF)  # even element: high nibble
    level = tl.load(code_ptr + nib, mask=mask, other=0.0)  # fp32 NF4 level
    blk = i // BLOCKSIZE
    if NESTED:
        qa = tl.load(absmax_ptr + blk, mask=mask, other=0).to(tl.int32)
        a2 = tl.load(absmax2_ptr + blk // BLOCKSIZE2, mask=mask, other=0.0)
        a = tl.load(code2_ptr + qa, mask=mask, other=0.0) * a2  # rounded once ... (no FMA: enable_fp_fusion=False)
        a = a + tl.load(offset_ptr)  # ... and once more, as bnb
    else:
        a = tl.load(absmax_ptr + blk, mask=mask, other=0.0)
    return level * a  # fp32, rounded once


@triton.jit
def _store_out(out_ptr, idx, w, mask, BF16_BITS: tl.constexpr):
    if BF16_BITS:
        # fp32 -> bf16 round-to-nearest-even on the bits, stored through an int16 view of the output: the same
        # result as cvt.rn.bf16.f32 on the GPU, and the Triton interpreter (which truncates in .to(bf16)) computes
        # it too, so the CPU tests check the bits the GPU writes. (NaN stays NaN: 0x7FC0xxxx -> 0x7FC0.)
        bits = w.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(out_ptr + idx, bits.to(tl.int16), mask=mask)
    else:
        tl.store(out_ptr + idx, w.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _nf4_dequant_kernel(packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, out_ptr, n,
                        BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr,
                        BF16_BITS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # int64 offsets: an 8B-parameter tensor passes 2^31 elements
    i = pid * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,) output elements
    mask = i < n
    w = _nf4_values(packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, i, mask,
                    BLOCKSIZE, BLOCKSIZE2, NESTED)
    _store_out(out_ptr, i, w, mask, BF16_BITS)


@triton.jit
def _pair_word(v_even, v_odd, OUT_KIND: tl.constexpr):
    """Two fp32 values -> one word holding both output elements, the even (lower-address) one in the low half:
    bf16 (integer round-to-nearest-even on the bits, as _store_out), fp16 (cvt.rn), or fp32 bit patterns."""
    if OUT_KIND == 0:
        e = v_even.to(tl.uint32, bitcast=True)
        o = v_odd.to(tl.uint32, bitcast=True)
        e = (e + 0x7FFF + ((e >> 16) & 1)) >> 16
        o = (o + 0x7FFF + ((o >> 16) & 1)) >> 16
        return (e | (o << 16)).to(tl.int32, bitcast=True)
    elif OUT_KIND == 1:
        e = v_even.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
        o = v_odd.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
        return (e | (o << 16)).to(tl.int32, bitcast=True)
    else:
        e = v_even.to(tl.uint32, bitcast=True).to(tl.uint64)
        o = v_odd.to(tl.uint32, bitcast=True).to(tl.uint64)
        return (e | (o << 32)).to(tl.int64, bitcast=True)


@triton.jit
def _nf4_dequant_pairs_kernel(packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, out_ptr,
                              n_pairs, n_blocks, BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr,
                              NESTED: tl.constexpr, OUT_KIND: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr):
    # A (quant blocks, bytes per block) tile: each byte is loaded once (16-byte vectors), its two nibbles become
    # two output elements written as one word (out viewed as int32 / int64), and each block's scale is computed
    # once per block instead of once per element: 15.2 µs vs 40.6 for the byte-per-element kernel above on a 4096 x
    # 4096 weight (H200; bitsandbytes' CUDA kernel 23.5; LOG.md run 27).
    HALF: tl.constexpr = BLOCKSIZE // 2
    blk = tl.program_id(0).to(tl.int64) * BLOCKS_PER_PROGRAM + tl.arange(0, BLOCKS_PER_PROGRAM)  # (BPP,)
    j = blk[:, None] * HALF + tl.arange(0, HALF)[None, :]  # (BPP, HALF) byte index == output pair index
    mask = j < n_pairs
    byte = tl.load(packed_ptr + j, mask=mask, other=0).to(tl.int32)
    lv_even = tl.load(code_ptr + (byte >> 4))  # high nibble = the pair's first element; index always in 0..15
    lv_odd = tl.load(code_ptr + (byte & 0xF))
    bmask = blk < n_blocks
    if NESTED:
        qa = tl.load(absmax_ptr + blk, mask=bmask, other=0).to(tl.int32)
        a2 = tl.load(absmax2_ptr + blk // BLOCKSIZE2, mask=bmask, other=0.0)
        a = tl.load(code2_ptr + qa) * a2  # rounded once ... (no FMA: enable_fp_fusion=False)
        a = a + tl.load(offset_ptr)  # ... and once more, as bnb
    else:
        a = tl.load(absmax_ptr + blk, mask=bmask, other=0.0)
    word = _pair_word(lv_even * a[:, None], lv_odd * a[:, None], OUT_KIND)
    tl.store(out_ptr + j, word, mask=mask)


@triton.jit
def _nf4_embedding_kernel(ids_ptr, packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, out_ptr,
                          T, V, H, BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr,
                          BF16_BITS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    # a (BLOCK_T tokens, BLOCK_H columns) tile: out[t, c] = dequant(flat element ids[t] * H + c)
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    col = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    row = tl.load(ids_ptr + tok, mask=tok < T, other=0).to(tl.int64)
    valid = (row >= 0) & (row < V)  # an out-of-range id reads nothing and gets a NaN row (wrapper docstring)
    out_mask = (tok < T)[:, None] & (col < H)[None, :]
    mask = out_mask & valid[:, None]
    i = row[:, None] * H + col[None, :]
    w = _nf4_values(packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, i, mask,
                    BLOCKSIZE, BLOCKSIZE2, NESTED)
    w = tl.where(valid[:, None], w, float("nan"))
    _store_out(out_ptr, tok[:, None] * H + col[None, :], w, out_mask, BF16_BITS)


# on CUDA the compiled kernel is called directly once Triton has picked it (novatune.kernels.launch): QLoRA
# dequantises every frozen weight per forward, recompute and backward
_PAIRS, _ELEMS, _EMBED = lean(_nf4_dequant_pairs_kernel), lean(_nf4_dequant_kernel), lean(_nf4_embedding_kernel)
# enable_fp_fusion=False where the Triton backend takes it (the interpreter does not compile: no FMA). Read when the
# kernels are decorated, at import, which is when Triton fixes interpreted-or-compiled too.
_FP_FUSION_OFF = {} if os.environ.get("TRITON_INTERPRET", "0") == "1" else {"enable_fp_fusion": False}


def _launch_kwargs() -> dict:
    return _FP_FUSION_OFF


def nf4_dequantize(t: NF4Tensor, dtype: torch.dtype | None = None, out: Tensor | None = None,
                   block: int = 1024) -> Tensor:
    """Triton dequantisation into `out` (or a new tensor of t.shape) in `dtype` (default t.dtype); bit-identical
    to nf4_dequantize_ref and to bitsandbytes' dequantize_4bit."""
    check(t)
    dtype = dequantize_dtype(t, dtype, out)
    if out is None:
        out = torch.empty(t.shape, dtype=dtype, device=t.packed.device)
    n = t.numel
    if n == 0:
        return out
    a2, c2, off = _second_level_args(t)
    flat = out.view(-1)
    if n % 2 == 0 and flat.storage_offset() % 2 == 0:  # whole pairs: the byte-per-pair kernel
        kind, word = {torch.bfloat16: (0, torch.int32), torch.float16: (1, torch.int32),
                      torch.float32: (2, torch.int64)}[dtype]
        bpp = max(1, 2048 // (t.blocksize // 2))  # 2 KiB of packed bytes per program: 16 per thread on 4 warps
        n_blocks = t.absmax.numel()
        _PAIRS[(cdiv(n_blocks, bpp),)](
            t.packed, t.absmax, t.code, a2, c2, off, flat.view(word), n // 2, n_blocks, BLOCKSIZE=t.blocksize,
            BLOCKSIZE2=t.blocksize2, NESTED=t.nested, OUT_KIND=kind, BLOCKS_PER_PROGRAM=bpp, num_warps=4,
            **_launch_kwargs())
        return out
    grid = (cdiv(n, block),)  # odd numel (a padding nibble) or an out at an odd element offset
    bf16 = dtype == torch.bfloat16
    _ELEMS[grid](t.packed, t.absmax, t.code, a2, c2, off, out.view(torch.int16) if bf16 else out, n,
                 BLOCKSIZE=t.blocksize, BLOCKSIZE2=t.blocksize2, NESTED=t.nested, BF16_BITS=bf16, BLOCK=block,
                 **_launch_kwargs())
    return out


def nf4_embedding(t: NF4Tensor, ids: Tensor, dtype: torch.dtype | None = None, out: Tensor | None = None) -> Tensor:
    """Triton gather-dequantise: rows `ids` of the 2-D NF4 table t, shape ids.shape + (H,), in `dtype` (default
    t.dtype); bit-identical to nf4_embedding_ref (and to nf4_dequantize(t)[ids]). Only the gathered rows' bytes and
    scales are read. Ids on the CPU are range-checked (IndexError); on the GPU that check would cost a device sync
    per forward, so an out-of-range id instead yields a NaN row (loud in the loss), never a read out of bounds."""
    dtype = _check_rows(t, ids, dtype or (out.dtype if out is not None else None))
    H = t.shape[1]
    shape = (*ids.shape, H)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=t.packed.device)
    elif out.dtype != dtype or out.shape != torch.Size(shape) or not out.is_contiguous():
        raise ValueError(f"nf4_embedding: out must be a contiguous {dtype} tensor of shape {shape}, got "
                         f"{out.dtype} {tuple(out.shape)}")
    if ids.numel() and H:
        _embedding_launch(t, ids.reshape(-1).contiguous(), out, dtype)
    return out


def _second_level_args(t: NF4Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """absmax2, code2 and offset (shape (1,)) as the kernels take them; without double quantisation, placeholders
    for the unused pointers (never read: NESTED=False)."""
    if not t.nested:
        return t.absmax, t.code, t.code
    absmax2, code2, offset = t.second_level()
    return absmax2, code2, offset.reshape(1)


def _embedding_launch(t: NF4Tensor, flat_ids: Tensor, out: Tensor, dtype: torch.dtype) -> None:
    """The launch itself, ids unchecked (the tests drive the kernel's out-of-range NaN rows through it)."""
    (V, H), T = t.shape, flat_ids.numel()
    a2, c2, off = _second_level_args(t)
    block_h = min(next_pow2(H), 1024)
    block_t = max(1, 4096 // block_h)  # ~4096 elements per program: whole 64-element blocks for H >= 64
    grid = (cdiv(T, block_t), cdiv(H, block_h))
    bf16 = dtype == torch.bfloat16
    _EMBED[grid](flat_ids, t.packed, t.absmax, t.code, a2, c2, off, out.view(torch.int16) if bf16 else out, T, V, H,
                 BLOCKSIZE=t.blocksize, BLOCKSIZE2=t.blocksize2, NESTED=t.nested, BF16_BITS=bf16, BLOCK_T=block_t,
                 BLOCK_H=block_h, **_launch_kwargs())
