"""RMSNorm: Triton forward/backward kernels and the fp32 reference.

Math (rows r = every leading index, N = last dim, dtype(x) = D, out dtype O = promote(D, dtype(w))):

    rstd_r = 1 / sqrt(mean_j x_rj^2 + eps)                  fp32, one per row, saved for the backward
    n_rj   = round_D(x_rj * rstd_r)                          normalised value rounded to x's dtype FIRST
    y_rj   = round_O(w_j * n_rj)                             (product in fp32), exactly HF's Llama/Qwen3RMSNorm

Backward (fp32 throughout; with xhat = x * rstd, g = dy * w, c_r = mean_j g_rj * xhat_rj):

    dx_rj = rstd_r * (g_rj - xhat_rj * c_r)
    dw_j  = sum_r dy_rj * n_rj

Gemma-style norms (novatune.ops.offset_rms_norm) run the same kernels with two switches: `offset` adds a constant to
the weight (Gemma: y = x_hat * (1 + w)), and ROUND_NORMALISED=False skips round_D, so that
y = round_D((w + offset) * x_hat) is computed in fp32 with one rounding, in x's dtype (dw then uses the unrounded
x_hat, the exact derivative).

The rounding round_D has no useful derivative; dx treats it as the identity (straight-through), which is also what
PyTorch autograd does through HF's `.to(input_dtype)` and what Liger does. dw uses the rounded n, which is the exact
derivative of y with respect to w.

Invariants the kernels keep:
* all arithmetic in fp32; x/dy are read once per pass in their own dtype, y/dx written once (5 * rows * N elements
  move for fwd+bwd, the HBM floor); rstd is reused by the backward instead of recomputing the row reduction of x^2.
* dw is accumulated in fp32: each of the G persistent backward programs keeps a (BLOCK_M, BLOCK_N) fp32 register
  accumulator over its rows and writes one row of a (G, N) fp32 partial buffer; a second kernel sums the G
  partials in fp32 and casts once to w's dtype. G ~ #SMs * k keeps the buffer small (G * N * 4 bytes).
* the summation order is fixed by the launch config: results are deterministic (no atomics).

Two regimes, one kernel: a program handles a (BLOCK_M, BLOCK_N) tile of rows, BLOCK_N = next_pow2(N). Large N
(hidden 2560): one row per tile; small N (Qwen3 q/k-norm, head_dim 128 over tokens*heads rows): 32 rows per forward
tile, 16 per backward tile, so each program moves enough bytes and the row reduction is an intra-warp shuffle.
The backward is persistent (G ~ resident programs, each looping over its row blocks) with the next block's loads
issued before the current block is computed. `rms_norm_fwd_config` /
`rms_norm_bwd_config` give the defaults; the launchers take `block_m`, `num_warps` (and for the backward
`num_programs`, `stages`) overrides so the tune engine can sweep them (bench/bench_rms_norm.py --sweep does).

Nothing here imports torch.autograd or transformers.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from novatune.kernels.launch import cdiv, empty_f32, lean, next_pow2, remember

# Rows are held whole in registers (one pass over x); beyond this many columns that stops being sensible.
MAX_FUSED_N = 65536
# Elements per program tile: 4096 -> 8 KiB of bf16 per tensor per program (one row of 2560, or 32 rows of 128).
_TILE = 4096


# ----------------------------------------------------------------------------------------------- kernels
@triton.jit
def _round_to(v, dtype: tl.constexpr, SOFT_RNE: tl.constexpr):
    """fp32 v -> dtype, round-to-nearest-even. On the GPU this is the hardware cvt.rn. Triton's CPU interpreter
    truncates fp32 -> bf16 instead (3.9), so under it (SOFT_RNE) the rounding is done with integer ops first,
    which makes interpreter results bit-identical to the GPU's and to PyTorch's."""
    if SOFT_RNE and dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        v = bits.to(tl.float32, bitcast=True)
    return v.to(dtype)


@triton.jit
def _rms_norm_fwd_kernel(
    X, W, Y, RSTD,  # X (rows, N) [row stride stride_x]; W (N,); Y (rows, N) [stride_y]; RSTD (rows,) fp32
    stride_x, stride_y, n_rows, N, eps, offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFT_RNE: tl.constexpr, ROUND_NORMALISED: tl.constexpr = True,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    cols = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    row_ok = rows < n_rows
    col_ok = cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)  # rows * stride can pass 2^31 for long sequences x many heads

    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32) + offset  # (BLOCK_N,): the effective weight

    # (BLOCK_M,); padded columns are 0 and do not count. Per-row ops are correctly rounded (div_rn, sqrt_rn:
    # Triton's `/` is the approximate div.full.f32), as torch's mean and rsqrt on the CPU; they cost nothing here.
    var = tl.div_rn(tl.sum(x * x, axis=1), N * 1.0)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
    n = x * rstd[:, None]
    if ROUND_NORMALISED:  # Llama/Qwen round the normalised value to x's dtype before the weight multiply
        n = _round_to(n, X.dtype.element_ty, SOFT_RNE).to(tl.float32)
    y = w[None, :] * n
    # .cs (streaming: evict first): y is written once here; measured +1.5% for the op at 4096 x 2560 on the H200,
    # neutral at the q/k-norm shape (LOG.md run 20; evict-first LOADS were neutral to -5%)
    tl.store(Y + rows64[:, None] * stride_y + cols[None, :], _round_to(y, Y.dtype.element_ty, SOFT_RNE),
             mask=mask, cache_modifier=".cs")
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _bwd_tile(x_raw, dy_raw, w, rows, rows64, cols, col_ok, RSTD, DX, stride_dx, n_rows, N,
              X_DTYPE: tl.constexpr, SOFT_RNE: tl.constexpr, ROUND_NORMALISED: tl.constexpr = True):
    """dx of one (BLOCK_M, BLOCK_N) tile, stored; returns the tile's dw contribution dy * n (fp32)."""
    row_ok = rows < n_rows
    rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)  # (BLOCK_M,): padded rows give dx = 0 and add 0 to dw
    x = x_raw.to(tl.float32)
    dy = dy_raw.to(tl.float32)
    xhat = x * rstd[:, None]
    g = dy * w[None, :]
    c = tl.sum(g * xhat, axis=1) / N  # (BLOCK_M,); approximate division is fine here, div_rn costs registers
    dx = (g - xhat * c[:, None]) * rstd[:, None]
    mask = row_ok[:, None] & col_ok[None, :]
    tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], _round_to(dx, DX.dtype.element_ty, SOFT_RNE),
             mask=mask, cache_modifier=".cs")  # streaming store, as y's in the forward
    # dy/dw is the (rounded, where the forward rounds it) normalised value the forward multiplied by w
    if ROUND_NORMALISED:
        xhat = _round_to(xhat, X_DTYPE, SOFT_RNE).to(tl.float32)
    return dy * xhat


@triton.jit
def _rms_norm_bwd_kernel(
    DY, X, W, RSTD, DX, DW_PARTIAL,  # DY, X, DX (rows, N) row-strided; W (N,); RSTD (rows,); DW_PARTIAL (G, N) fp32
    stride_dy, stride_x, stride_dx, n_rows, N, offset, n_blocks,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr, SOFT_RNE: tl.constexpr,
    ROUND_NORMALISED: tl.constexpr = True,
):
    # Persistent: program pid handles row blocks pid, pid + G, pid + 2G, ... and owns row pid of DW_PARTIAL.
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    offs_m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32) + offset  # (BLOCK_N,), once per program
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # dw partial; reduced over its rows only at the end

    if STAGES == 0:
        # Prefetch by hand: the next block's loads are issued before the current block is computed, so two
        # blocks of x/dy are in flight per program, held in registers in their narrow dtype until used.
        # Works the same on every Triton version.
        rows64 = (pid * BLOCK_M + offs_m).to(tl.int64)
        mask = (rows64 < n_rows)[:, None] & col_ok[None, :]
        x_raw = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        dy_raw = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
        for blk in range(pid, n_blocks, G):
            rows = blk * BLOCK_M + offs_m
            rows64 = rows.to(tl.int64)
            nrows64 = rows64 + G * BLOCK_M  # this program's next block; fully masked after its last one
            nmask = (nrows64 < n_rows)[:, None] & col_ok[None, :]
            x_next = tl.load(X + nrows64[:, None] * stride_x + cols[None, :], mask=nmask, other=0.0)
            dy_next = tl.load(DY + nrows64[:, None] * stride_dy + cols[None, :], mask=nmask, other=0.0)
            acc += _bwd_tile(x_raw, dy_raw, w, rows, rows64, cols, col_ok, RSTD, DX, stride_dx, n_rows, N,
                             X.dtype.element_ty, SOFT_RNE, ROUND_NORMALISED)
            x_raw = x_next
            dy_raw = dy_next
    else:
        # Triton's software pipeliner: STAGES-1 blocks in flight through cp.async into shared memory (no
        # register cost). Verified to pipeline (LDGSTS in the SASS) with Triton 3.9 for sm_90.
        for blk in tl.range(pid, n_blocks, G, num_stages=STAGES):
            rows = blk * BLOCK_M + offs_m
            rows64 = rows.to(tl.int64)
            mask = (rows < n_rows)[:, None] & col_ok[None, :]
            x_raw = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
            dy_raw = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
            acc += _bwd_tile(x_raw, dy_raw, w, rows, rows64, cols, col_ok, RSTD, DX, stride_dx, n_rows, N,
                             X.dtype.element_ty, SOFT_RNE, ROUND_NORMALISED)

    tl.store(DW_PARTIAL + pid.to(tl.int64) * N + cols, tl.sum(acc, axis=0), mask=col_ok)


@triton.jit
def _sum_partials_kernel(
    P, DW, G, N,  # P (G, N) fp32 partials; DW (N,) in w's dtype
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, SOFT_RNE: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32)
    for g0 in range(0, G, BLOCK_G):
        g = g0 + tl.arange(0, BLOCK_G)
        m = (g < G)[:, None] & col_ok[None, :]
        acc += tl.load(P + g[:, None] * N + cols[None, :], mask=m, other=0.0)
    tl.store(DW + cols, _round_to(tl.sum(acc, axis=0), DW.dtype.element_ty, SOFT_RNE), mask=col_ok)


# ----------------------------------------------------------------------------------------------- launch configs
def _num_warps_for(tile: int, elems_per_thread: int) -> int:
    return max(4, min(32, tile // (32 * elems_per_thread)))


def rms_norm_fwd_config(n_rows: int, n_cols: int) -> dict:
    """Default forward launch config: dict(block_m, num_warps). BLOCK_N is always next_pow2(N) (a row per pass).

    16 elements per thread (two 16-byte bf16 vectors per tensor): ~40 registers, so 6+ programs fit per SM
    (sm_90, Triton 3.9), i.e. tens of KiB of loads in flight per SM through occupancy alone.
    """
    block_n = next_pow2(n_cols)
    block_m = max(1, min(_TILE // block_n, next_pow2(max(n_rows, 1))))
    # 32 elements per thread: the H200 sweep (bench/results/ops.jsonl, 751c797) put 4 warps on a 4096 tile at
    # 9.8 µs vs 10.6 for 8 warps (4096 x 2560), and level (18.0 vs 18.3) on 131072 x 128
    return {"block_m": block_m, "num_warps": _num_warps_for(block_m * block_n, 32)}


def rms_norm_bwd_config(n_rows: int, n_cols: int, num_sms: int, resident_per_sm: int = 2) -> dict:
    """Default backward launch config: dict(block_m, num_warps, num_programs, stages).

    8 elements per thread, half the forward's: the backward keeps much more live per element (x, dy, the prefetched
    next block, w, the dw accumulator). sm_90, Triton 3.9: 8 elements -> 64 registers, 16 -> ~125. Tiles of
    2048 elements when rows are short (16 rows of 128 on 8 warps: 4 programs per SM, and a few registers more
    only drops that to 3), else one row (4096 padded on 16 warps: 2 per SM).
    num_programs (G) is the persistent grid: as many programs as can be resident at once (resident_per_sm per SM;
    the launcher measures it from the compiled kernel's register and shared-memory use), then lowered to the
    smallest G with the same number of row blocks per program (4096 blocks over 264 -> 256 programs of 16), which
    keeps the (G, N) fp32 partial buffer small: 2.6 MB for N = 2560, 256 KB for N = 128.
    stages 0 = prefetch one block ahead in registers; >= 2 = Triton's cp.async pipeliner with that many stages
    (one-row tiles: 4, i.e. three rows of x and dy in flight per program through shared memory).
    """
    block_n = next_pow2(n_cols)
    block_m = max(1, min(_TILE // block_n, next_pow2(max(n_rows, 1))))
    # Measured on the H200 (bench_rms_norm --sweep, 751c797): 4096 x 2560 bwd 23.8 µs with one row on 8 warps and
    # Triton's pipeliner (stages 3) vs 33.3 µs for 16 warps with register prefetch; 131072 x 128 bwd 30.8 µs with
    # 32-row tiles on 8 warps vs 32.9 for 16-row tiles. Both are 16 elements per thread.
    # stages 4 for one-row tiles: measured through the tune engine (CUDA-graph replay over rotated inputs, H200,
    # bench/experiments/exp_rms_floor.py, 60e6848) fwd+bwd 37.55 µs graph / 33.38 kernel vs 39.14 / 35.14 at
    # stages 3; 5 stages measured the same as 4 (37.66 / 33.65)
    return {"block_m": block_m, "num_warps": _num_warps_for(block_m * block_n, 16),
            "num_programs": _persistent_grid(cdiv(n_rows, block_m), num_sms, resident_per_sm),
            "stages": 4 if block_m == 1 else 0}


def _persistent_grid(n_blocks: int, num_sms: int, per_sm: int) -> int:
    g = max(1, min(n_blocks, per_sm * num_sms))
    return cdiv(n_blocks, cdiv(n_blocks, g))  # same blocks per program, fewer partial rows


@functools.cache
def _device_limits(device_index: int) -> tuple[int, int, int, int]:
    """(SMs, registers per SM, threads per SM, shared memory per SM) with Hopper values where torch lacks one."""
    p = torch.cuda.get_device_properties(device_index)
    return (p.multi_processor_count, getattr(p, "regs_per_multiprocessor", 65536),
            getattr(p, "max_threads_per_multi_processor", 2048),
            getattr(p, "shared_memory_per_multiprocessor", 228 * 1024))


@functools.cache
def _block_smem(device_index: int) -> int:
    p = torch.cuda.get_device_properties(device_index)
    return getattr(p, "shared_memory_per_block_optin", 0) or 163 * 1024  # torch without the field: an A100's


def _fit_stages(stages: int, bytes_per_stage: int, device: torch.device) -> int:
    """The most cp.async stages (<= `stages`) whose buffers (stages - 1 tiles of x and dy) fit one program's shared
    memory on this device, or 0 (register prefetch) when not even 2 do: 4 stages of a 16384-wide bf16 row need
    197 KB (Triton 3.9's sm_90 compile) (an H100/H200 block may use 227 KB, an A100's 164 KB)."""
    index = torch.device(device).index
    limit = _block_smem(index if index is not None else torch.cuda.current_device())
    while stages >= 2 and (stages - 1) * bytes_per_stage > limit - 4096:  # 4 KB for the compiler's own scratch
        stages -= 1
    return stages if stages >= 2 else 0


def num_sms(device: torch.device) -> int:
    """SMs of a CUDA device; 4 for the CPU interpreter (small, so the persistent loop really loops in tests)."""
    if device.type == "cuda":
        return _device_limits(device.index if device.index is not None else torch.cuda.current_device())[0]
    return 4


# (device, dtypes, meta) -> (programs per SM, how it was obtained); read by tests and the benchmark
RESIDENCY: dict = {}


def _resident_per_sm(compile_kernel, key: tuple, num_warps: int, device: torch.device) -> int:
    """How many programs of a compiled kernel one SM holds at once (registers, threads, shared memory).

    Sizing the persistent grid by the real register count (which moves between Triton versions) keeps the grid
    from under-filling the GPU, or queueing a second wave, when a config lands on either side of a register cliff.
    """
    if device.type != "cuda":
        return 2
    if key not in RESIDENCY:
        try:
            kernel = compile_kernel()  # compiles (cached) without launching
            kernel._init_handles()
            _, regs, threads, smem = _device_limits(device.index if device.index is not None
                                                    else torch.cuda.current_device())
            regs_per_thread = -(-kernel.n_regs // 8) * 8  # allocation granularity: 256 registers per warp
            fit = min(regs // (regs_per_thread * 32 * num_warps), threads // (32 * num_warps),
                      smem // max(kernel.metadata.shared, 1), 32)
            RESIDENCY[key] = (max(1, fit), f"measured: {kernel.n_regs} registers, {kernel.metadata.shared} B smem")
        except Exception as e:  # noqa: BLE001 - a Triton API change must not break the op: keep the default
            RESIDENCY[key] = (2, f"fallback: {type(e).__name__}: {e}")
    return RESIDENCY[key][0]


# ----------------------------------------------------------------------------------------------- launchers
# Launch wrappers: on CUDA the compiled kernel is called directly once Triton has picked it (novatune.kernels.launch)
_FWD, _BWD, _SUM = lean(_rms_norm_fwd_kernel), lean(_rms_norm_bwd_kernel), lean(_sum_partials_kernel)
# Launch configs by shape (and dtypes, device, overrides): a training run sees a handful of keys; the cap only
# bounds growth (e.g. every sequence length). Values are plain ints and dicts, nothing tied to a tensor.
_FWD_CONFIGS: dict[tuple, tuple] = {}
_BWD_CONFIGS: dict[tuple, dict] = {}


def _rows_view(t: torch.Tensor, n: int) -> torch.Tensor:
    """(..., N) -> (rows, N) with unit column stride; a copy only if no such view exists."""
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _rows_of(t: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """(tensor the kernel reads as (rows, N), its row stride). A contiguous tensor is passed as it is (the kernel
    needs only its data pointer): no view is built."""
    if t.is_contiguous():
        return t, n
    t2 = _rows_view(t, n)
    return t2, t2.stride(0)


def _check_n(n: int) -> None:
    if n > MAX_FUSED_N:
        raise ValueError(f"rms_norm kernel holds a row in registers; N={n} > {MAX_FUSED_N}")


def check_inputs(x: torch.Tensor, weight: torch.Tensor, op: str = "rms_norm") -> None:
    """TypeError / ValueError for what no path of the op takes: non-floating x or weight (a norm of integers is
    truncated), a weight that is not (N,) on x's device. Raised, not asserted (python -O keeps it): the kernel
    would read N weights past a shorter one, and the fp32 reference would broadcast a (1,) or (1, N) weight.
    novatune.ops calls it before choosing a path, so the CPU path refuses what the kernels refuse."""
    if not (x.is_floating_point() and weight.is_floating_point()):
        raise TypeError(f"{op}: x and weight must be floating point, got {x.dtype} and {weight.dtype} (cast the "
                        "input, e.g. x.float())")
    if x.dim() == 0 or tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"{op}: weight must have shape ({x.shape[-1] if x.dim() else 'N'},) (x's last dim), got "
                         f"{tuple(weight.shape)} for x {tuple(x.shape)}")
    if weight.device != x.device:
        raise ValueError(f"{op}: weight is on {weight.device} but x on {x.device}: move them to one device")


def _check_buffer(t: torch.Tensor, shape, dtype: torch.dtype, name: str) -> None:
    """A preallocated output must be contiguous with the output's shape and dtype (the kernel writes it flat)."""
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or not t.is_contiguous():
        raise ValueError(f"rms_norm: {name} must be a contiguous {tuple(shape)} {dtype} tensor, got "
                         f"{tuple(t.shape)} {t.dtype} contiguous={t.is_contiguous()}")


def _fwd_launch(rows: int, n: int, block_m: int | None, num_warps: int | None, on_gpu: bool,
                round_normalised: bool = True) -> tuple:
    key = (rows, n, block_m, num_warps, on_gpu, round_normalised)
    got = _FWD_CONFIGS.get(key)
    if got is None:
        cfg = rms_norm_fwd_config(rows, n)
        bm = block_m or cfg["block_m"]
        meta = dict(BLOCK_M=bm, BLOCK_N=next_pow2(n), SOFT_RNE=not on_gpu, num_warps=num_warps or cfg["num_warps"],
                    ROUND_NORMALISED=round_normalised)
        got = remember(_FWD_CONFIGS, key, ((cdiv(rows, bm),), meta))
    return got


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, out: torch.Tensor | None = None,
                 rstd: torch.Tensor | None = None, block_m: int | None = None,
                 num_warps: int | None = None, offset: float = 0.0,
                 round_normalised: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """y (x.shape), rstd (x.shape[:-1], fp32). `out`/`rstd` may be preallocated (contiguous).

    round_normalised=True (Llama/Qwen): y = (w + offset) * round_x(x_hat) in dtype promote(x, w).
    round_normalised=False (Gemma, GPT-OSS): y = round_x((w + offset) * x_hat), all in fp32, in x's dtype."""
    check_inputs(x, weight)
    shape = x.shape
    n = shape[-1]
    _check_n(n)
    out_dtype = torch.promote_types(x.dtype, weight.dtype) if round_normalised else x.dtype
    if out is None:
        out = torch.empty_like(x, dtype=out_dtype, memory_format=torch.contiguous_format)
    else:
        _check_buffer(out, shape, out_dtype, "out")
    if rstd is None:
        rstd = empty_f32(shape[:-1], x.device)
    else:
        _check_buffer(rstd, shape[:-1], torch.float32, "rstd")
    numel = x.numel()
    if numel == 0:
        return out, rstd
    rows = numel // n
    x2, stride_x = _rows_of(x, n)
    grid, meta = _fwd_launch(rows, n, block_m, num_warps, x.is_cuda, round_normalised)
    # out and rstd are contiguous: the kernel reads them as (rows, N) and (rows,)
    _FWD[grid](x2, weight.contiguous(), out, rstd, stride_x, n, rows, n, eps, float(offset), **meta)
    return out, rstd


def _sum_config(g: int, n: int, on_gpu: bool) -> tuple:
    """(grid, meta) of the partial-sum kernel: dw (N,) = partial (G, N).sum(0) in fp32, cast once to dw's dtype.
    Column strips (32 fp32 = a 128-byte line per partial row; 16 for small N so that N = 128 still gets 8
    programs), each reading all G rows in one 8K-element tile when G <= 256..512: the whole kernel is then one
    round of loads, ~the latency of a single memory access, for the 2.6 MB / 256 KB of partials."""
    rb_n = min(next_pow2(n), 32 if n > 1024 else 16)
    rb_g = max(16, min(next_pow2(g), 8192 // rb_n))
    return (cdiv(n, rb_n),), dict(BLOCK_G=rb_g, BLOCK_N=rb_n, SOFT_RNE=not on_gpu, num_warps=8)


def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, *,
                 dx: torch.Tensor | None = None, dw: torch.Tensor | None = None, block_m: int | None = None,
                 num_warps: int | None = None, num_programs: int | None = None,
                 stages: int | None = None, offset: float = 0.0,
                 round_normalised: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """dx (x.shape, x dtype), dw (N,, weight dtype). `dx`/`dw` may be preallocated (contiguous). offset and
    round_normalised: as the forward was called (rms_norm_fwd)."""
    check_inputs(x, weight)
    shape = x.shape
    n = shape[-1]
    _check_n(n)
    if dy.shape != shape or rstd.shape != shape[:-1]:
        raise ValueError(f"rms_norm backward: dy {tuple(dy.shape)} must have x's shape {tuple(shape)} and rstd "
                         f"{tuple(rstd.shape)} its leading dims (as rms_norm_fwd returned it)")
    if dx is None:
        dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    else:
        _check_buffer(dx, shape, x.dtype, "dx")
    if dw is None:
        dw = torch.empty_like(weight, memory_format=torch.contiguous_format)
    else:
        _check_buffer(dw, weight.shape, weight.dtype, "dw")
    numel = x.numel()
    if numel == 0:
        dw.zero_()
        return dx, dw
    rows = numel // n
    (x2, stride_x), (dy2, stride_dy) = _rows_of(x, n), _rows_of(dy, n)
    w = weight.contiguous()
    rstd = rstd if rstd.is_contiguous() else rstd.contiguous()
    key = (rows, n, x.device, dy.dtype, x.dtype, w.dtype, block_m, num_warps, num_programs, stages,
           round_normalised)
    cfg = _BWD_CONFIGS.get(key)
    if cfg is None:
        args = [dy2, x2, w, rstd, dx, None, stride_dy, stride_x, n, rows, n, 0.0]
        cfg = _bwd_launch_config(args, block_m, num_warps, num_programs, stages)
        cfg["meta"]["ROUND_NORMALISED"] = round_normalised
        cfg["sum"] = _sum_config(cfg["num_programs"], n, x.is_cuda)
        remember(_BWD_CONFIGS, key, cfg)
    g = cfg["num_programs"]
    partial = torch.empty(g, n, dtype=torch.float32, device=x.device)  # (G, N)
    # dx is contiguous: the kernel reads it as (rows, N) with row stride N
    _BWD[(g,)](dy2, x2, w, rstd, dx, partial, stride_dy, stride_x, n, rows, n, float(offset), cfg["n_blocks"],
               **cfg["meta"])
    sum_grid, sum_meta = cfg["sum"]
    _SUM[sum_grid](partial, dw, g, n, **sum_meta)
    return dx, dw


def _sum_partials(partial: torch.Tensor, dw: torch.Tensor) -> torch.Tensor:
    """dw (N,) = partial (G, N).sum(0) in fp32, cast once to dw's dtype (the backward's second launch)."""
    g, n = partial.shape
    grid, meta = _sum_config(g, n, partial.is_cuda)
    _SUM[grid](partial, dw, g, n, **meta)
    return dw


def _bwd_launch_config(args: list, block_m, num_warps, num_programs, stages) -> dict:
    dy2, x2, w = args[:3]
    rows, n = args[9], args[10]
    sms = num_sms(x2.device)
    cfg = rms_norm_bwd_config(rows, n, sms)
    bm = block_m or cfg["block_m"]
    meta = dict(BLOCK_M=bm, BLOCK_N=next_pow2(n), STAGES=cfg["stages"] if stages is None else stages,
                SOFT_RNE=not x2.is_cuda, num_warps=num_warps or cfg["num_warps"])
    if x2.is_cuda and meta["STAGES"] >= 2 and stages is None:
        meta["STAGES"] = _fit_stages(meta["STAGES"], bm * meta["BLOCK_N"] * (x2.element_size() + dy2.element_size()),
                                     x2.device)
    n_blocks = cdiv(rows, bm)
    if num_programs is None:
        key = (x2.device, dy2.dtype, x2.dtype, w.dtype, *meta.values())
        wargs = list(args)
        wargs[5] = args[3]  # any fp32 pointer: warmup only needs the signature of DW_PARTIAL
        per_sm = _resident_per_sm(lambda: _rms_norm_bwd_kernel.warmup(*wargs, n_blocks, grid=(1,), **meta), key,
                                  meta["num_warps"], x2.device)
        num_programs = _persistent_grid(n_blocks, sms, per_sm)
    return {"num_programs": max(1, min(num_programs, n_blocks)), "n_blocks": n_blocks, "meta": meta}


def rms_norm_bwd_launch_config(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, **overrides) -> dict:
    """The config rms_norm_bwd would launch for these tensors (defaults, measured residency, overrides applied)."""
    n = x.shape[-1]
    x2, dy2 = _rows_view(x, n), _rows_view(dy, n)
    rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    args = [dy2, x2, weight.contiguous(), rstd, x2, None, dy2.stride(0), x2.stride(0), n, x2.shape[0], n, 0.0]
    cfg = _bwd_launch_config(args, overrides.get("block_m"), overrides.get("num_warps"),
                             overrides.get("num_programs"), overrides.get("stages"))
    m = cfg["meta"]
    return {"block_m": m["BLOCK_M"], "num_warps": m["num_warps"], "num_programs": cfg["num_programs"],
            "stages": m["STAGES"]}
