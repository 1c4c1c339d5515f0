"""The experts' weight gradient added into an existing gradient inside the grouped GEMM (Triton).

    grouped_outer_accumulate(a, b, ends, out)      out[e] += a[rows of e]^T @ b[rows of e]     for every expert e
      ... squares=True -> (out, partials)          and the sums of squares of the stored tiles (the clipping norm)
    grouped_outer(a, b, ends, out, scale)          out[e] = scale * a[rows of e]^T @ b[rows of e]   (written)

The second form serves the expert adapters' factor gradients (novatune.ops.moe_lora): b is an (S, r) product, so
the GEMM is one read of a; it writes the gradient in fp32 (the factor's dtype) from bf16 operands, where torch's
grouped GEMM returns a bf16 result at the padded rank to be cut and cast by more passes (experiments.jsonl
moe_lora_thin, session23-4: 41 against 127 us at Qwen3-30B-A3B's gate/up width, S = 32,768). out may have any
strides, but the op writes contiguous tiles: stores into PEFT's own (out, r * E) order (the expert fastest) scatter
and measured 93 us.

a (S, M) and b (S, N) hold the rows of every expert in expert order (group e is rows ends[e-1]:ends[e], cumulative
int32 ends as grouped_mm takes them); out (E, M, N) is the weight's `.grad`. With a = dY and b = X this is dW = dY^T X
for weights stored (E, out, in); with a = X and b = dY, for weights stored (E, in, out).

Why: under gradient accumulation every micro-batch after the first computes the expert weights' gradients as fresh
(E, M, N) tensors (0.75 + 0.375 GiB per layer of Qwen3-30B-A3B in bf16) and autograd then adds them into `.grad`: a
write of dW, then a read of dW and `.grad` and a write of `.grad`. Here each output tile is accumulated in fp32 over
its expert's rows, `.grad`'s tile is read once, added, and written once: no fresh tensor and no separate add. The
rows per expert are few (Qwen3-30B-A3B: 4096 tokens x 8 choices / 128 experts = 256 on average), so the GEMM's output
traffic is a large part of its time, and the accumulation removes two of its four passes.

Numerics: fp32 accumulation of the dot product over the expert's rows (tl.dot; fp32 operands in IEEE precision, no
TF32), plus the existing value read as fp32, rounded once to out's dtype (round to nearest even). autograd's path
rounds twice (dW to bf16, then the sum), so the two agree within a rounding of bf16, and this one is the closer to
the exact sum (tests/kernels/test_moe_wgrad_gemm.py measures both against fp64). An expert without rows leaves its slice
of `out` untouched, bit for bit (its program returns before reading anything; with squares it reads, never writes).

Grid: (tiles of M x tiles of N, E); each program owns one (BLOCK_M, BLOCK_N) tile of one expert and walks that
expert's rows BLOCK_K at a time, so an output element has exactly one writer (deterministic, no atomics).

Two forms of the accumulating kernel. The plain one loads with masks (any strides, bf16 or fp32). The TMA form
(`tma=True`, Hopper and later, bf16 with 16-byte aligned rows: `tma_eligible`) builds tensor descriptors on the
device whose row count is the expert's end, so a block that reaches past the expert's rows reads zeros from the
copy engine's bound check, and reads and writes the gradient's tile as one clipped box: ~11% faster at both
GPT-OSS's and Qwen3-30B-A3B's shapes (session25-7). The same fp32 sums per tile, rounded once; its only allocation
(besides the partials of squares=True) is Triton's scratch for the descriptors (3 x 128 bytes per program, 2-12 MiB
per call at those shapes). ops/moe.py asks for it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from novatune.kernels.launch import cdiv, lean, next_pow2
from novatune.kernels.rms_norm import _round_to  # fp32 -> dtype with round-to-nearest-even, interpreter too

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): the fastest of bench/bench_moe_wgrad.py's seven on an H200 at
# Qwen3-30B-A3B's shapes (ops.jsonl, session16-4: 809 / 410 us for gate_up / down, against 1,106 / 578 for grouped_mm
# + add and 848 / 425 for 128x128x64 with 8 warps)
DEFAULT_CONFIG = (128, 128, 32, 4, 4)


@triton.jit
def _grouped_outer_acc_kernel(A, B, ENDS, OUT, SQ, M, N, stride_a, stride_b, stride_oe, stride_om, stride_on,
                              TILES_N, scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              ACCUMULATE: tl.constexpr, SOFT_RNE: tl.constexpr, SQUARES: tl.constexpr):
    tile = tl.program_id(0)
    e = tl.program_id(1)
    end = tl.load(ENDS + e).to(tl.int64)
    start = tl.load(ENDS + e - 1, mask=e > 0, other=0).to(tl.int64)
    # accumulating: an expert without rows leaves its slice as it is (with SQUARES its tile is still read for
    # them); writing: it gets zeros
    if (end > start) or (not ACCUMULATE) or SQUARES:
        pm = tile // TILES_N
        pn = tile % TILES_N
        cols_m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        cols_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        in_m = cols_m < M
        in_n = cols_n < N
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(start, end, BLOCK_K):
            rows = k0 + ks
            in_rows = rows < end
            a = tl.load(A + rows[:, None] * stride_a + cols_m[None, :], mask=in_rows[:, None] & in_m[None, :],
                        other=0.0)  # (BLOCK_K, BLOCK_M)
            b = tl.load(B + rows[:, None] * stride_b + cols_n[None, :], mask=in_rows[:, None] & in_n[None, :],
                        other=0.0)  # (BLOCK_K, BLOCK_N)
            if A.dtype.element_ty == tl.float32 or SOFT_RNE:
                # fp32 operands, or the CPU interpreter, whose bf16 dot is wrong (Triton 3.9): there bf16 is
                # widened first, exact (a bf16 x bf16 product fits fp32), the same math as the GPU's bf16 MMA
                acc = tl.dot(tl.trans(a.to(tl.float32)), b.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(tl.trans(a), b, acc)
        offs = e.to(tl.int64) * stride_oe + cols_m[:, None].to(tl.int64) * stride_om + cols_n[None, :] * stride_on
        mask = in_m[:, None] & in_n[None, :]
        acc = acc * scale
        if ACCUMULATE:
            acc += tl.load(OUT + offs, mask=mask, other=0.0).to(tl.float32)
        value = _round_to(acc, OUT.dtype.element_ty, SOFT_RNE)
        if end > start or not ACCUMULATE:
            tl.store(OUT + offs, value, mask=mask)
        if SQUARES:  # the stored value's squares (masked lanes hold 0): this tile's part of the gradient norm
            stored = value.to(tl.float32)
            tl.store(SQ + e.to(tl.int64) * tl.num_programs(0) + tile, tl.sum(tl.sum(stored * stored, axis=1), axis=0))


_KERNEL = lean(_grouped_outer_acc_kernel)


@triton.jit
def _grouped_outer_acc_tma_kernel(A, B, ENDS, OUT, SQ, M, N, E, stride_a, stride_b, stride_oe, TILES_N,
                                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                  SOFT_RNE: tl.constexpr, SQUARES: tl.constexpr):
    """The accumulating form through the Tensor Memory Accelerator: each program describes its expert's rows as a
    tensor of `end` rows, so a block reaching past them reads zeros (the hardware's bound check, no mask), and the
    gradient's tile is read and written as a (1, BLOCK_M, BLOCK_N) box of the (E, M, N) tensor (clipped at M, N:
    the box's lanes past them read zeros)."""
    tile = tl.program_id(0)
    e = tl.program_id(1)
    end = tl.load(ENDS + e)
    start = tl.load(ENDS + e - 1, mask=e > 0, other=0)
    if end > start or SQUARES:  # an expert without rows leaves its slice as it is (SQUARES: still read)
        pm = tile // TILES_N
        pn = tile % TILES_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if end > start:
            a_desc = tl.make_tensor_descriptor(A, shape=[end, M], strides=[stride_a, 1],
                                               block_shape=[BLOCK_K, BLOCK_M])
            b_desc = tl.make_tensor_descriptor(B, shape=[end, N], strides=[stride_b, 1],
                                               block_shape=[BLOCK_K, BLOCK_N])
            for k0 in range(start, end, BLOCK_K):
                a = a_desc.load([k0, pm * BLOCK_M])  # (BLOCK_K, BLOCK_M)
                b = b_desc.load([k0, pn * BLOCK_N])  # (BLOCK_K, BLOCK_N)
                if SOFT_RNE:  # the CPU interpreter: bf16 widened first (exact), as the kernel above does
                    acc = tl.dot(tl.trans(a.to(tl.float32)), b.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(tl.trans(a), b, acc)
        o_desc = tl.make_tensor_descriptor(OUT, shape=[E, M, N], strides=[stride_oe, N, 1],
                                           block_shape=[1, BLOCK_M, BLOCK_N])
        acc += o_desc.load([e, pm * BLOCK_M, pn * BLOCK_N]).reshape(BLOCK_M, BLOCK_N).to(tl.float32)
        value = _round_to(acc, OUT.dtype.element_ty, SOFT_RNE)
        if end > start:
            o_desc.store([e, pm * BLOCK_M, pn * BLOCK_N], value.reshape(1, BLOCK_M, BLOCK_N))
        if SQUARES:  # the stored value's squares: this tile's part of the gradient norm
            stored = value.to(tl.float32)
            tl.store(SQ + e.to(tl.int64) * tl.num_programs(0) + tile, tl.sum(tl.sum(stored * stored, axis=1), axis=0))


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the TMA form: the fastest of bench/bench_moe_wgrad.py's nine
# on an H200 (ops.jsonl, session25-7): GPT-OSS gate_up / down 1,356 / 700 us against the plain kernel's 1,541 / 811,
# Qwen3-30B-A3B 722 / 362 against 812 / 406
TMA_CONFIG = (128, 128, 32, 4, 4)
_TMA_ALIGN = 16  # bytes: the descriptors' base addresses and row strides


def _descriptor_scratch(size: int, alignment: int, stream):
    """Global memory for descriptors a kernel builds on the device (triton.set_allocator's callback)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def tma_eligible(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the TMA form can take these operands: bf16 on an NVIDIA GPU of compute capability 9 or later (CPU
    tensors: the interpreter's), unit column strides and rows that do not overlap, 16-byte aligned base addresses
    and row strides, a contiguous `out`, and a Triton with tensor descriptors built on the device."""
    if not hasattr(tl, "make_tensor_descriptor") or not (a.dtype == b.dtype == out.dtype == torch.bfloat16):
        return False
    if a.is_cuda and (torch.version.hip is not None or torch.cuda.get_device_capability(a.device)[0] < 9):
        return False
    if not out.is_contiguous() or a.stride(1) != 1 or b.stride(1) != 1:
        return False
    if a.stride(0) < a.shape[1] or b.stride(0) < b.shape[1]:  # broadcast or overlapping rows
        return False
    size = a.element_size()
    return all(t.data_ptr() % _TMA_ALIGN == 0 for t in (a, b, out)) and all(
        (s * size) % _TMA_ALIGN == 0 for s in (a.stride(0), b.stride(0), out.shape[2]))


def _check(a, b, ends, out, *, same_dtype: bool) -> None:
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[0]:
        raise ValueError(f"a (S, M) and b (S, N) with the same rows, got {tuple(a.shape)} and {tuple(b.shape)}")
    if (out.ndim != 3 or tuple(out.shape[1:]) != (a.shape[1], b.shape[1]) or tuple(ends.shape) != (out.shape[0],)
            or ends.dtype != torch.int32):
        raise ValueError(f"out (E, M, N) = (E, {a.shape[1]}, {b.shape[1]}) and int32 ends (E,), got out "
                         f"{tuple(out.shape)} and ends {tuple(ends.shape)} {ends.dtype}")
    if same_dtype and (not (a.dtype == b.dtype == out.dtype) or a.dtype not in (torch.bfloat16, torch.float32)):
        raise TypeError(f"a, b and out of one dtype, bf16 or fp32; got {a.dtype}, {b.dtype}, {out.dtype}")
    if not (a.device == b.device == out.device == ends.device):
        raise ValueError("a, b, ends and out on one device")


def grouped_outer_accumulate(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor, out: torch.Tensor,
                             config: tuple[int, int, int, int, int] | None = None, tma: bool = False,
                             squares: bool = False):
    """out[e] += a[group e]^T @ b[group e] in place (the module docstring); returns out. a (S, M), b (S, N) with unit
    column stride (rows may be strided), ends (E,) int32 cumulative, out (E, M, N) contiguous; a, b and out of one
    dtype (bf16 or fp32) on one device. `tma`: the Tensor Memory Accelerator form where `tma_eligible` (else the
    plain one), with `config` or TMA_CONFIG.

    squares=True returns (out, partials) instead: partials (fp32, one per output tile of every expert) hold the sums
    of the squares of out's values after the addition, as stored (each tile summed in a fixed tree: deterministic),
    so the sum of partials is out's squared L2 norm without another read of out (the step's gradient norm,
    novatune.ops.grad_norm). Tiles of experts without rows are read for it and left as they are."""
    _check(a, b, ends, out, same_dtype=True)
    if not out.is_contiguous():
        raise ValueError("out (the gradient being accumulated) must be contiguous")
    a = a if a.stride(1) == 1 else a.contiguous()
    b = b if b.stride(1) == 1 else b.contiguous()
    ends = ends.contiguous()  # read as ENDS + e
    use_tma = tma and tma_eligible(a, b, out)
    config = config or (TMA_CONFIG if use_tma else DEFAULT_CONFIG)
    partials = None
    if squares:
        e, m, n = (int(d) for d in out.shape)
        slots = e * cdiv(m, config[0]) * cdiv(n, config[1])  # every program writes its own slot once
        partials = (torch.full((slots,), float("nan"), dtype=torch.float32, device=out.device) if _POISON_SQUARES
                    else torch.empty(slots, dtype=torch.float32, device=out.device))
    if use_tma:
        _launch_tma(a, b, ends, out, config, partials)
    else:
        _launch(a, b, ends, out, config, accumulate=True, scale=1.0, squares=partials)
    return (out, partials) if squares else out


_POISON_SQUARES = False  # tests: the partials start as NaN, so a tile no program summed would show


def _launch_tma(a, b, ends, out, config, squares=None) -> None:
    e, m, n = (int(d) for d in out.shape)
    if e == 0 or m == 0 or n == 0 or (a.shape[0] == 0 and squares is None):
        return  # (with squares and no rows: every tile is still read and summed)
    if out.is_cuda:
        triton.set_allocator(_descriptor_scratch)
    block_m, block_n, block_k, warps, stages = config
    tiles_n = cdiv(n, block_n)
    _grouped_outer_acc_tma_kernel[(cdiv(m, block_m) * tiles_n, e)](
        a, b, ends, out, squares if squares is not None else out, m, n, e, a.stride(0), b.stride(0), out.stride(0),
        tiles_n, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SOFT_RNE=not out.is_cuda,
        SQUARES=squares is not None, num_warps=warps, num_stages=stages)


def _launch(a, b, ends, out, config, *, accumulate: bool, scale: float, squares=None) -> None:
    e, m, n = (int(d) for d in out.shape)
    if e == 0 or m == 0 or n == 0 or (a.shape[0] == 0 and accumulate and squares is None):
        return
    block_m, block_n, block_k, warps, stages = config
    tiles_n = cdiv(n, block_n)
    _KERNEL[(cdiv(m, block_m) * tiles_n, e)](
        a, b, ends, out, squares if squares is not None else out, m, n, a.stride(0), b.stride(0), out.stride(0),
        out.stride(1), out.stride(2), tiles_n, float(scale), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        ACCUMULATE=accumulate, SOFT_RNE=not out.is_cuda, SQUARES=squares is not None, num_warps=warps,
        num_stages=stages)


def _thin_config(n: int) -> tuple[int, int, int, int, int]:
    """Tiles for a narrow b (an adapter's rank): up to 64 of b's columns in one tile, a's columns 128 at a time."""
    return 128, min(64, max(16, next_pow2(n))), 64, 4, 3


def grouped_outer(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor, out: torch.Tensor,
                  scale: float = 1.0) -> torch.Tensor:
    """out[e] = scale * a[group e]^T @ b[group e] written in place for every expert (zeros for an expert without
    rows); returns out. For a narrow b (N up to a few dozen: an adapter's factor gradient, a (S, M) by (S, r)
    product whose time is one read of a). a, b (S, M), (S, N) of one dtype (bf16 or fp32), unit column strides;
    out (E, M, N) of any float dtype and any strides (a factor's gradient in its own dtype and layout): each tile
    is accumulated in fp32 and rounded once at the store."""
    _check(a, b, ends, out, same_dtype=False)
    if a.dtype != b.dtype or a.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"a and b of one dtype, bf16 or fp32; got {a.dtype}, {b.dtype}")
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("grouped_outer: a and b need unit column strides")
    _launch(a, b, ends.contiguous(), out, _thin_config(int(out.shape[2])), accumulate=False, scale=scale)
    return out
