"""Experiment: how close can RMSNorm fwd+bwd get to the HBM floor, and does folding the dw partial sum into the
backward kernel (atomics + a last-program finish) beat the shipped two-kernel backward?

    python bench/experiments/exp_rms_dw.py --results bench/results/experiments.jsonl
    TRITON_INTERPRET=1 python bench/experiments/exp_rms_dw.py --check-only      # CPU: correctness checks only

At x = (4096, 2560) and (131072, 128) bf16, bf16 weight (kernel µs, profiler sum per call; min of 3 runs):
1. shipped forward; shipped backward (persistent kernel + `_sum_partials_kernel`), also with num_programs = #SMs,
   2 x #SMs (where the default differs) and, where the default is the register-prefetch path (stages 0), stages 3;
2. `_bwd_atomic_kernel`: the shipped backward's stages >= 2 path whose programs atomically add their fp32 dw
   partial into an N-element workspace; the last program to finish (ticket counter) casts it into dw and
   re-zeroes the workspace, so there is one kernel and no memset per call; same G sweep;
3. calibration, the same bytes with no math: copy_1r1w (the forward's traffic), copy_2r1w (the backward's:
   dx = x + dy), torch's y.copy_(x). Kernels of 10-20 µs cannot reach the 1 GiB-copy bandwidth (launch ramp, tail),
   so these give the achievable time at this size.
Fraction of floor = floor_us / kernel_us (1.0 = at the floor); floor_fwd = 2*rows*N*2 B / bw, floor_bwd = 3*rows*N*2
B / bw, totals against 5*rows*N*2 B / bw, bw = copy_bandwidth_gbps(). Correctness is checked on the GPU first.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

from novatune.kernels import rms_norm as K
from novatune.kernels.rms_norm import _bwd_tile, _round_to
from novatune.reference.rms_norm import rms_norm_bwd_ref

SHAPES = [(4096, 2560), (131072, 128)]
CHECK_SHAPES = [(37, 127), (5, 127), (37, 2560), (5, 2560)]  # odd rows/N: masks, G = 1 and G > 1 with loops


# ----------------------------------------------------------------------------------------------- kernels
@triton.jit
def _bwd_atomic_kernel(
    DY, X, W, RSTD, DX, DW, DW_ACC, COUNTER,  # as the shipped kernel; DW (N,) w dtype; DW_ACC (N,) fp32; COUNTER int32
    stride_dy, stride_x, stride_dx, n_rows, N, n_blocks,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr, SOFT_RNE: tl.constexpr,
):
    # Same persistent loop as the shipped backward's STAGES >= 2 path (cp.async pipeliner), same per-tile math.
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    offs_m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for blk in tl.range(pid, n_blocks, G, num_stages=STAGES):
        rows = blk * BLOCK_M + offs_m
        rows64 = rows.to(tl.int64)
        mask = (rows < n_rows)[:, None] & col_ok[None, :]
        x_raw = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        dy_raw = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
        acc += _bwd_tile(x_raw, dy_raw, w, rows, rows64, cols, col_ok, RSTD, DX, stride_dx, n_rows, N,
                         X.dtype.element_ty, SOFT_RNE)

    # Instead of a (G, N) partial row + a second kernel: fp32 atomics into one N-vector (they execute in L2; the
    # order across programs is not fixed, so dw is no longer bit-deterministic). Relaxed: only their sum matters,
    # the ordering against the finish is given by the barrier + acq_rel ticket below.
    tl.atomic_add(DW_ACC + cols, tl.sum(acc, axis=0), mask=col_ok, sem="relaxed")
    # All threads' adds are issued before the ticket (bar.sync); the ticket's release (gpu scope, cumulative over
    # what the barrier ordered before it) publishes them: the usual CUDA "last block" (threadFenceReduction) pattern.
    tl.debug_barrier()
    ticket = tl.atomic_add(COUNTER, 1, sem="acq_rel")  # scalar atomic: one thread, result broadcast to the program
    if ticket == G - 1:
        # Last program: every other program's adds happened before its ticket, which our acquire saw. The barrier
        # orders the other threads' loads after thread 0's acquire (Triton's broadcast of the scalar result
        # already has one; explicit, since that is a lowering detail). .cg: read L2, where the atomics live.
        tl.debug_barrier()
        total = tl.load(DW_ACC + cols, mask=col_ok, other=0.0, cache_modifier=".cg")
        tl.store(DW + cols, _round_to(total, DW.dtype.element_ty, SOFT_RNE), mask=col_ok)
        # Leave the workspace zeroed for the next call (same threads, same addresses: after the load above)
        tl.store(DW_ACC + cols, tl.zeros_like(total), mask=col_ok)
        tl.store(COUNTER, 0)


@triton.jit
def _copy_1r1w_kernel(X, Y, n_rows, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # The forward's traffic and tiling (BLOCK_M rows of next_pow2(N), masked, .cs store), no math
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < N)[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(Y + offs, tl.load(X + offs, mask=mask), mask=mask, cache_modifier=".cs")


@triton.jit
def _copy_2r1w_kernel(X, DY, DX, DW, n_rows, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      WRITE_DW: tl.constexpr):
    # The backward's traffic (read x and dy, write dx), one add so neither load is dead; WRITE_DW: program 0 also
    # writes a zero dweight in the same launch (the real op's minimum of two launches per fwd+bwd)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < N)[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    s = tl.load(X + offs, mask=mask).to(tl.float32) + tl.load(DY + offs, mask=mask).to(tl.float32)
    tl.store(DX + offs, s.to(DX.dtype.element_ty), mask=mask, cache_modifier=".cs")
    if WRITE_DW:
        if tl.program_id(0) == 0:
            tl.store(DW + cols, tl.zeros([BLOCK_N], dtype=tl.float32).to(DW.dtype.element_ty), mask=cols < N)


# ----------------------------------------------------------------------------------------------- launchers
_WORKSPACE: dict = {}  # (device, N) -> (fp32 acc (N,), int32 counter (1,)); zeroed once, re-zeroed by the kernel


def atomic_bwd_config(dy, x, weight, num_programs=None, stages=None) -> dict:
    """The shipped backward's launch config, forced onto the pipelined path (stages 3 where it says 0), with G
    sized from the residency of the shipped kernel at those stages (same loop and footprint but for the tail)."""
    over = {"num_programs": num_programs} if num_programs else {}
    if stages:
        over["stages"] = stages
    cfg = K.rms_norm_bwd_launch_config(dy, x, weight, **over)
    if cfg["stages"] < 2:
        cfg = K.rms_norm_bwd_launch_config(dy, x, weight, stages=3, **over)
    return cfg


def rms_norm_bwd_atomic(dy, x, weight, rstd, *, num_programs=None, stages=None, dx=None, dw=None):
    """(dx, dw) as K.rms_norm_bwd, in one kernel. Not safe for concurrent calls with the same N on two streams
    (shared workspace); fine for this experiment."""
    n = x.shape[-1]
    x2, dy2 = K._rows_view(x, n), K._rows_view(dy, n)
    rows = x2.shape[0]
    cfg = atomic_bwd_config(dy, x, weight, num_programs, stages)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if dx is None else dx
    dw = torch.empty(n, dtype=weight.dtype, device=x.device) if dw is None else dw
    key = (x.device, n)
    if key not in _WORKSPACE:
        _WORKSPACE[key] = (torch.zeros(n, dtype=torch.float32, device=x.device),
                           torch.zeros(1, dtype=torch.int32, device=x.device))
    acc, counter = _WORKSPACE[key]
    n_blocks = triton.cdiv(rows, cfg["block_m"])
    _bwd_atomic_kernel[(min(cfg["num_programs"], n_blocks),)](
        dy2, x2, weight.contiguous(), rstd.reshape(-1).contiguous(), dx.view(-1, n), dw, acc, counter,
        dy2.stride(0), x2.stride(0), n, rows, n, n_blocks,
        BLOCK_M=cfg["block_m"], BLOCK_N=triton.next_power_of_2(n), STAGES=cfg["stages"], SOFT_RNE=not x.is_cuda,
        num_warps=cfg["num_warps"])
    return dx, dw


def _copy_grid(x):
    rows, n = x.shape
    bm = K.rms_norm_fwd_config(rows, n)
    meta = {"BLOCK_M": bm["block_m"], "BLOCK_N": triton.next_power_of_2(n), "num_warps": bm["num_warps"]}
    return (triton.cdiv(rows, bm["block_m"]),), meta


def copy_1r1w(x, y):
    grid, meta = _copy_grid(x)
    _copy_1r1w_kernel[grid](x, y, x.shape[0], x.shape[1], **meta)


def copy_2r1w(x, dy, dx, dw=None):
    grid, meta = _copy_grid(x)
    _copy_2r1w_kernel[grid](x, dy, dx, dx if dw is None else dw, x.shape[0], x.shape[1], WRITE_DW=dw is not None,
                            **meta)


# ----------------------------------------------------------------------------------------------- checks
def _inputs(rows, n, device):
    g = torch.Generator().manual_seed(rows * 100003 + n)
    x = torch.randn(rows, n, generator=g).to(torch.bfloat16).to(device)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(torch.bfloat16).to(device)
    dy = torch.randn(rows, n, generator=g).to(torch.bfloat16).to(device)
    return x, w, dy


def check(rows, n, device) -> None:
    """Atomic bwd vs the shipped bwd at the same launch config: dx bit-identical (same math), dw within the fp32
    summation-order difference; called twice (the second call relies on the kernel's re-zeroing)."""
    x, w, dy = _inputs(rows, n, device)
    _, rstd = K.rms_norm_fwd(x, w)
    cfg = atomic_bwd_config(dy, x, w)
    dx_ref, dw_ref = K.rms_norm_bwd(dy, x, w, rstd, **cfg)
    tol = {"rtol": 1e-2, "atol": 1e-2 * dw_ref.float().abs().max().item()}
    for call in (1, 2):
        dx, dw = rms_norm_bwd_atomic(dy, x, w, rstd)
        bad = (dx.view(torch.int16) != dx_ref.view(torch.int16)).sum().item()
        assert bad == 0, f"{rows}x{n} call {call}: dx differs from shipped in {bad} elements ({cfg})"
        where = f"{rows}x{n} call {call}"
        torch.testing.assert_close(dw.float(), dw_ref.float(), **tol, msg=lambda m, where=where: f"{where}: {m}")
    acc, counter = _WORKSPACE[(x.device, n)]
    assert not acc.any() and counter.item() == 0, "workspace not re-zeroed"
    if device == "cpu":  # under the interpreter also against the plain fp32 formula
        rdx, rdw = rms_norm_bwd_ref(dy, x, w, rstd)
        torch.testing.assert_close(dx, rdx)
        torch.testing.assert_close(dw.float(), rdw.float(), **tol)
    print(f"ok {rows}x{n}: {cfg}, dw max |atomic - shipped| = {(dw.float() - dw_ref.float()).abs().max().item():.3g}",
          flush=True)


# ----------------------------------------------------------------------------------------------- timing
def per_kernel_us(fn, iters=50) -> dict:
    """{kernel name (60 chars): µs per call}, rounded for the row (novatune.measure.timing.per_kernel_us)."""
    from novatune.measure.timing import per_kernel_us as per_kernel

    return {name[:60]: round(us, 2) for name, us in per_kernel(fn, iters).items()}


def measure(rows, n, bw, out) -> None:
    from novatune.measure.results import write_row
    from novatune.measure.timing import kernel_us

    x, w, dy = _inputs(rows, n, "cuda")
    y, rstd = K.rms_norm_fwd(x, w)
    dx, dw, y2 = torch.empty_like(x), torch.empty_like(w), torch.empty_like(x)
    floor = {k: m * rows * n * 2 / (bw * 1e3) for k, m in (("fwd", 2), ("bwd", 3), ("total", 5))}
    default = K.rms_norm_bwd_launch_config(dy, x, w)
    sms = K.num_sms(x.device)
    gs = [g for g in (sms, 2 * sms) if g != default["num_programs"]]

    cases = {"fwd": ("fwd", lambda: K.rms_norm_fwd(x, w, out=y, rstd=rstd), default),
             "bwd_shipped": ("bwd", lambda: K.rms_norm_bwd(dy, x, w, rstd, dx=dx, dw=dw), default)}
    for g in gs:
        cases[f"bwd_shipped_G{g}"] = ("bwd", lambda g=g: K.rms_norm_bwd(dy, x, w, rstd, dx=dx, dw=dw, num_programs=g),
                                      {**default, "num_programs": g})
    if default["stages"] < 2:  # the atomic variant runs the pipelined path: separate that from the atomics
        cases["bwd_shipped_stages3"] = ("bwd", lambda: K.rms_norm_bwd(dy, x, w, rstd, dx=dx, dw=dw, stages=3),
                                        atomic_bwd_config(dy, x, w))
    cases["bwd_atomic"] = ("bwd", lambda: rms_norm_bwd_atomic(dy, x, w, rstd, dx=dx, dw=dw),
                           atomic_bwd_config(dy, x, w))
    for g in gs:
        cases[f"bwd_atomic_G{g}"] = ("bwd", lambda g=g: rms_norm_bwd_atomic(dy, x, w, rstd, num_programs=g, dx=dx,
                                                                            dw=dw), atomic_bwd_config(dy, x, w, g))
    cases["copy_1r1w"] = ("fwd", lambda: copy_1r1w(x, y2), None)
    cases["copy_2r1w"] = ("bwd", lambda: copy_2r1w(x, dy, y2), None)
    cases["torch_copy"] = ("fwd", lambda: y2.copy_(x), None)

    got = {}
    print(f"\n{rows}x{n} bf16: floors fwd {floor['fwd']:.2f} bwd {floor['bwd']:.2f} total {floor['total']:.2f} µs "
          f"(copy bw {bw:.0f} GB/s)\n{'variant':24s} {'µs':>8s} {'floor':>7s} {'frac':>6s}  config", flush=True)
    for name, (kind, fn, cfg) in cases.items():
        runs = [round(kernel_us(fn, iters=50), 2) for _ in range(3)]
        got[name] = us = min(runs)
        row = {"bench": "exp_rms_dw", "variant": name, "shape": f"{rows}x{n}", "kernel_us_runs": runs, "kernel_us": us,
               "floor_us": round(floor[kind], 2), "frac_of_floor": round(floor[kind] / us, 3), "config": cfg}
        if name in ("bwd_shipped", "bwd_atomic"):
            row["per_kernel_us"] = per_kernel_us(fn)
        if out:
            write_row(out, row)
        print(f"{name:24s} {us:8.2f} {floor[kind]:7.2f} {floor[kind] / us:6.3f}  {cfg or ''}"
              f"{'  ' + json.dumps(row['per_kernel_us']) if 'per_kernel_us' in row else ''}", flush=True)

    totals = {"total_shipped": got["fwd"] + got["bwd_shipped"], "total_atomic": got["fwd"] + got["bwd_atomic"],
              "total_best": got["fwd"] + min(v for k, v in got.items() if k.startswith("bwd")),
              "total_calibration": got["copy_1r1w"] + got["copy_2r1w"]}
    for name, us in totals.items():
        row = {"bench": "exp_rms_dw", "variant": name, "shape": f"{rows}x{n}", "kernel_us": round(us, 2),
               "floor_us": round(floor["total"], 2), "frac_of_floor": round(floor["total"] / us, 3)}
        if out:
            write_row(out, row)
        print(f"{name:24s} {us:8.2f} {floor['total']:7.2f} {floor['total'] / us:6.3f}", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="bench/results/experiments.jsonl", help="'' to write no rows")
    ap.add_argument("--check-only", action="store_true",
                    help="correctness checks only, at small odd shapes (CPU: run with TRITON_INTERPRET=1)")
    a = ap.parse_args()
    on_gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    dev = "cuda" if on_gpu else "cpu"
    for r, c in CHECK_SHAPES + (SHAPES if on_gpu and not a.check_only else []):
        check(r, c, dev)
    if not a.check_only:
        assert on_gpu, "timing needs a GPU (use --check-only under TRITON_INTERPRET=1)"
        from novatune.measure.timing import copy_bandwidth_gbps

        bw = copy_bandwidth_gbps()
        for r, c in SHAPES:
            measure(r, c, bw, a.results)
