"""Experiment (LOG.md, session 3): how close to the HBM floor can RMSNorm fwd+bwd at 4096 x 2560 bf16 get when
measured the way `novatune tune` measures (CUDA-graph replay over rotated inputs that exceed 2x the L2, and the
profiler's kernel sum over the same rotation)?

exp_rms_dw.py timed kernels on one L2-resident input (fwd 8.25 µs = 1.2x the "floor"): flattering. Here every
figure goes through novatune.tune.measure, as issue 5's 0.85 line is judged, with:
  * novatune_default: the shipped fwd + bwd (persistent bwd + partial-sum kernel; stages 4 since 4eddc5c);
  * atomic_dw: shipped fwd + the one-launch backward of exp_rms_dw.py (dweight reduced by fp32 atomics), at the
    shipped backward's config (stages 4 since 4eddc5c) and at stages 3;
  * bwd configs the earlier sweeps did not try (cp.async stages 4 and 5; 16 warps at stages 3 and 4);
  * calibration: an op with RMSNorm's exact big-tensor traffic and launch count but no math (fwd reads x and
    writes y; bwd reads x and dy, writes dx; dweight a tiny zero fill): the most any fwd+bwd pair of kernels
    can reach at this size through this measurement; calibration_2_launches writes the zero dweight inside the
    backward launch (the real op's minimum of two launches; calibration_no_math has a third, a zero fill).

    python bench/experiments/exp_rms_floor.py --results bench/results/experiments.jsonl
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from novatune.kernels import rms_norm as K
from novatune.measure.results import write_row
from novatune.measure.timing import copy_bandwidth_gbps
from novatune.ops.registry import OPS
from novatune.tune.measure import input_sets, kernel_us, time_fwd_bwd

sys.path.insert(0, os.path.dirname(__file__))
import exp_rms_dw as X  # noqa: E402


def _op(bwd):
    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, eps):
            y, rstd = K.rms_norm_fwd(x, w, eps)
            ctx.save_for_backward(x, w, rstd)
            return y

        @staticmethod
        def backward(ctx, dy):
            x, w, rstd = ctx.saved_tensors
            dx, dw = bwd(dy.contiguous(), x, w, rstd)
            return dx, dw, None

    return lambda x, weight, eps: F.apply(x, weight, eps)


def _calibration(in_launch_dw: bool):
    """RMSNorm's traffic with no math: fwd copies x to y, bwd reads x and dy and writes dx; dweight is zero, written
    inside the backward launch (in_launch_dw) or by a separate fill kernel."""
    class Calibration(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, eps):
            y = torch.empty_like(x)
            X.copy_1r1w(x, y)
            ctx.save_for_backward(x, w)
            return y

        @staticmethod
        def backward(ctx, dy):
            x, w = ctx.saved_tensors
            dx = torch.empty_like(x)
            dw = torch.empty_like(w) if in_launch_dw else torch.zeros_like(w)
            X.copy_2r1w(x, dy.contiguous(), dx, dw if in_launch_dw else None)
            return dx, dw, None

    return lambda x, weight, eps: Calibration.apply(x, weight, eps)


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--results", default="")
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args(argv)
    shape, dtype = (4096, 2560), torch.bfloat16
    spec = OPS["rms_norm"]
    sets = input_sets(spec, shape, dtype, "cuda")
    bw = copy_bandwidth_gbps()
    floor = spec.floor_bytes(shape, dtype) / (bw * 1e3)
    variants = {
        "novatune_default": _op(lambda dy, x, w, r: K.rms_norm_bwd(dy, x, w, r)),
        "atomic_dw": _op(lambda dy, x, w, r: X.rms_norm_bwd_atomic(dy, x, w, r)),
        "atomic_dw_G264": _op(lambda dy, x, w, r: X.rms_norm_bwd_atomic(dy, x, w, r, num_programs=264)),
        "bwd_stages3": _op(lambda dy, x, w, r: K.rms_norm_bwd(dy, x, w, r, stages=3)),
        "bwd_stages4": _op(lambda dy, x, w, r: K.rms_norm_bwd(dy, x, w, r, stages=4)),
        "bwd_stages5": _op(lambda dy, x, w, r: K.rms_norm_bwd(dy, x, w, r, stages=5)),
        "bwd_16warps_stages3": _op(lambda dy, x, w, r: K.rms_norm_bwd(dy, x, w, r, num_warps=16, stages=3)),
        "bwd_16warps_stages4": _op(lambda dy, x, w, r: K.rms_norm_bwd(dy, x, w, r, num_warps=16, stages=4)),
        "atomic_dw_stages3": _op(lambda dy, x, w, r: X.rms_norm_bwd_atomic(dy, x, w, r, stages=3)),
        "calibration_no_math": _calibration(in_launch_dw=False),
        "calibration_2_launches": _calibration(in_launch_dw=True),
    }
    print(f"RMSNorm {shape[0]}x{shape[1]} bf16: floor {floor:.2f} µs (copy bw {bw:.0f} GB/s), {len(sets)} rotated "
          f"input sets")
    print(f"{'variant':24s} {'graph us':>9s} {'frac':>6s} {'kernel us':>10s} {'frac':>6s}")
    for name, fn in variants.items():
        try:
            t = time_fwd_bwd(spec, fn, sets, iters=args.iters)
            k = kernel_us(spec, fn, sets)
        except Exception as e:  # noqa: BLE001 - a config that does not compile/fit is reported, not fatal
            print(f"{name:24s} failed: {type(e).__name__}: {str(e)[:140]}")
            continue
        print(f"{name:24s} {t.median_us:9.2f} {floor / t.median_us:6.3f} {k:10.2f} {floor / k:6.3f}  [{t.mode}]")
        if args.results:
            write_row(args.results, {"bench": "exp_rms_floor", "variant": name, "shape": list(shape),
                                     "graph_us": round(t.median_us, 2), "spread_us": round(t.spread_us, 2),
                                     "kernel_us": round(k, 2), "floor_us": round(floor, 2),
                                     "graph_frac": round(floor / t.median_us, 3), "kernel_frac": round(floor / k, 3),
                                     "mode": t.mode, "copy_gbps": round(bw, 1)})


if __name__ == "__main__":
    main()
