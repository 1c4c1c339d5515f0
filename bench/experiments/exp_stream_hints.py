"""Experiment (LOG.md, session 2): can streaming cache hints or another tile put novatune's SwiGLU ahead of
torch.compile, and where does the "inplace" fused cross-entropy lose its ~1 ms to mode "tokens"?

    python bench/experiments/exp_stream_hints.py --results bench/results/experiments.jsonl

1. SwiGLU fwd+bwd at 4096 x 9728 bf16 (kernel µs, profiler sum): novatune's kernels as shipped; the same math with
   loads marked evict_first and stores ".cs" (streaming: no reuse, don't pollute L2); other BLOCK / num_warps;
   torch.compile of the reference. Correctness of each variant is checked against the fp32 reference first.
2. Linear CE 4096 x 2560 -> 151936 bf16: per-kernel profiler table for modes "inplace" and "tokens" (fwd+bwd).
"""
from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from novatune.kernels import swiglu as K
from novatune.measure.numerics import rel_err
from novatune.measure.results import write_row
from novatune.measure.timing import copy_bandwidth_gbps, kernel_us


@triton.jit
def _fwd_hint(g_ptr, u_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    g = tl.load(g_ptr + offs, eviction_policy="evict_first").to(tl.float32)
    u = tl.load(u_ptr + offs, eviction_policy="evict_first").to(tl.float32)
    tl.store(y_ptr + offs, (g * tl.sigmoid(g) * u).to(y_ptr.dtype.element_ty), cache_modifier=".cs")


@triton.jit
def _bwd_hint(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    dy = tl.load(dy_ptr + offs, eviction_policy="evict_first").to(tl.float32)
    g = tl.load(g_ptr + offs, eviction_policy="evict_first").to(tl.float32)
    u = tl.load(u_ptr + offs, eviction_policy="evict_first").to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    tl.store(du_ptr + offs, (dy * silu).to(du_ptr.dtype.element_ty), cache_modifier=".cs")
    tl.store(dg_ptr + offs, (dy * u * (sig + silu * (1.0 - sig))).to(dg_ptr.dtype.element_ty), cache_modifier=".cs")


@triton.jit
def _fwd_ind(g_ptr, u_ptr, y_ptr, BLOCK: tl.constexpr):
    # inductor's formulation (run 21's output_code): x / (1 + exp(-x)), int32 offsets, no masks
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    g = tl.load(g_ptr + offs).to(tl.float32)
    u = tl.load(u_ptr + offs).to(tl.float32)
    tl.store(y_ptr + offs, ((g / (tl.exp(-g) + 1.0)) * u).to(y_ptr.dtype.element_ty))


@triton.jit
def _bwd_ind(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    dy = tl.load(dy_ptr + offs).to(tl.float32)
    g = tl.load(g_ptr + offs).to(tl.float32)
    u = tl.load(u_ptr + offs).to(tl.float32)
    d = tl.exp(-g) + 1.0
    sig = 1.0 / d
    tl.store(du_ptr + offs, (dy * (g / d)).to(du_ptr.dtype.element_ty))
    tl.store(dg_ptr + offs, (dy * u * sig * (g * (1.0 - sig) + 1.0)).to(dg_ptr.dtype.element_ty))


def swiglu_variants(rows: int, cols: int, out: str, only_shipped: bool = False) -> None:
    torch.manual_seed(0)
    g = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    u = torch.randn_like(g)
    dy = torch.randn_like(g)
    n = g.numel()
    y_ref = (torch.nn.functional.silu(g.float()) * u.float())
    floor_us = 8 * n * 2 / (copy_bandwidth_gbps() * 1e3)  # fwd: 2 reads + 1 write; bwd: 3 reads + 2 writes

    def shipped(block=None, warps=None):
        def step():
            K.swiglu_fwd(g, u, block=block, num_warps=warps)
            K.swiglu_bwd(dy, g, u, block=block, num_warps=warps)
        return step

    def variant(fwd, bwd, block, warps):  # an experimental kernel pair, checked before it is timed
        y, dg, du = torch.empty_like(g), torch.empty_like(g), torch.empty_like(g)
        grid = (triton.cdiv(n, block),)

        def step():
            fwd[grid](g, u, y, BLOCK=block, num_warps=warps)
            bwd[grid](dy, g, u, dg, du, BLOCK=block, num_warps=warps)
        step()
        assert rel_err(y, y_ref) < 4e-3, f"{fwd.__name__} wrong"
        return step

    def hinted(block, warps):
        return variant(_fwd_hint, _bwd_hint, block, warps)

    def inductor_style(block, warps):
        return variant(_fwd_ind, _bwd_ind, block, warps)

    ref_c = torch.compile(lambda a, b: torch.nn.functional.silu(a) * b)
    gl, ul = g.clone().requires_grad_(True), u.clone().requires_grad_(True)

    def compiled():
        torch.autograd.grad(ref_c(gl, ul), (gl, ul), dy)

    variants = {"shipped": shipped(), "shipped_1024x4": shipped(1024, 4), "shipped_512x4": shipped(512, 4),
                "shipped_512x2": shipped(512, 2), "shipped_256x2": shipped(256, 2), "shipped_256x1": shipped(256, 1),
                "ind_1024x4": inductor_style(1024, 4), "ind_512x4": inductor_style(512, 4),
                "ind_512x2": inductor_style(512, 2), "torch_compile": compiled}
    if not only_shipped:
        variants.update({"hint_4096x8": hinted(4096, 8), "hint_2048x4": hinted(2048, 4),
                         "hint_8192x16": hinted(8192, 16)})
    for name, fn in variants.items():
        us = [kernel_us(fn, iters=50) for _ in range(3)]
        row = {"bench": "exp_swiglu_hints", "variant": name, "shape": f"{rows}x{cols}", "kernel_us_runs": us,
               "kernel_us": min(us), "floor_us": round(floor_us, 2), "frac_of_floor": round(floor_us / min(us), 3)}
        write_row(out, row)
        print(json.dumps(row), flush=True)


def ce_phases(out: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    from novatune.ops import linear_cross_entropy

    torch.manual_seed(0)
    T, H, V = 4096, 2560, 151936
    h = (torch.randn(T, H, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(V, H, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_(True)
    y = torch.randint(0, V, (T,), device="cuda")
    for mode in ("inplace", "tokens"):
        def step():
            linear_cross_entropy(h, w, y, mode=mode).backward()
            h.grad = w.grad = None
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        per: dict[str, float] = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per[e.name] = per.get(e.name, 0.0) + e.time_range.elapsed_us() / 5
        top = sorted(per.items(), key=lambda kv: -kv[1])
        row = {"bench": "exp_ce_phases", "mode": mode, "total_us": round(sum(per.values()), 1),
               "kernels": [(k[:90], round(v, 1)) for k, v in top[:16]]}
        write_row(out, row)
        print(json.dumps(row, indent=0), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="bench/results/experiments.jsonl")
    ap.add_argument("--swiglu_only", action="store_true", help="SwiGLU launch configs only (run 21)")
    a = ap.parse_args()
    swiglu_variants(4096, 9728, a.results, only_shipped=a.swiglu_only)
    if not a.swiglu_only:
        ce_phases(a.results)
