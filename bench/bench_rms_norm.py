"""RMSNorm fwd+bwd at Qwen3-4B's real shapes: HF eager, torch.nn.RMSNorm, torch.compile, Liger, novatune.

    python bench/bench_rms_norm.py                      # both shapes, all candidates (< 60 s on an H100/H200)
    python bench/bench_rms_norm.py --quick              # fewer repetitions, smoke run
    python bench/bench_rms_norm.py --shapes rmsnorm_qknorm --results /tmp/ops.jsonl

Shapes (BENCHMARKS.md): rmsnorm_hidden = 4096 tokens x 2560 (input/post-attention norms), rmsnorm_qknorm =
(4096 tokens * 32 heads) x 128 (Qwen3's per-head q/k norms). bf16 activations and weights, eps 1e-6.

Figures per candidate (novatune.measure.timing): kernel µs (sum of CUDA kernel durations per fwd+bwd call, from
torch.profiler) and wall µs (do_bench median, with host/launch overhead). HBM floor = bytes that must move / device
copy bandwidth measured in this run; bytes = fwd reads x and writes y, bwd reads dy and x and writes dx:
5 * rows * N * 2 (weights, rstd and dw partials are negligible). frac = floor / kernel µs.
Each candidate's y, dx and dw are checked against the fp32 reference (rel_err columns in the rows).
One JSON row per candidate goes to bench/results/ops.jsonl (--results to override).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = {"rmsnorm_hidden": (4096, 2560), "rmsnorm_qknorm": (4096 * 32, 128)}
EPS = 1e-6


def parse_args(argv=None):
    head, _, rest = __doc__.partition("\n\n")
    p = argparse.ArgumentParser(description=head, epilog=rest, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES), help="shapes to run")
    p.add_argument("--candidates", nargs="+", default=None,
                   help="subset of: hf_eager torch_nn_RMSNorm torch_compile liger novatune")
    p.add_argument("--results", default="bench/results/ops.jsonl", help="JSON-lines file rows are appended to")
    p.add_argument("--sweep", action="store_true",
                   help="also time a grid of novatune launch configs (fwd and bwd kernels alone, CUDA-graph replay) "
                        "to check the default heuristics; compiles ~60 kernel variants on a cold cache")
    return p.parse_args(argv)


def build_candidates(n: int, weight, names):
    """name -> module (or None with a reason string when absent). All share the same weight values."""
    import torch
    from torch import nn

    from novatune.ops.rms_norm import NovaRMSNorm

    class HFRMSNorm(nn.Module):
        """A copy of transformers' Qwen3RMSNorm/LlamaRMSNorm forward (the stock module)."""

        def __init__(self, hidden_size, eps=1e-6):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden_size))
            self.variance_epsilon = eps

        def forward(self, hidden_states):
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
            return self.weight * hidden_states.to(input_dtype)

    def liger():
        try:
            from liger_kernel.transformers.rms_norm import LigerRMSNorm
        except Exception as e:  # noqa: BLE001 - absent or broken: the row says so
            return None, f"liger_kernel not importable ({type(e).__name__})"
        return LigerRMSNorm(n, eps=EPS), None  # defaults as in the anchor (casting_mode llama, in_place)

    makers = {
        "hf_eager": lambda: (HFRMSNorm(n, EPS), None),
        "torch_nn_RMSNorm": lambda: (nn.RMSNorm(n, eps=EPS), None),
        # compiled per shape with static shapes (a second shape would otherwise recompile as dynamic)
        "torch_compile": lambda: (torch.compile(HFRMSNorm(n, EPS), dynamic=False), None),
        "liger": liger,
        "novatune": lambda: (NovaRMSNorm(n, EPS), None),
    }
    out = {}
    for name in names:
        mod, why = makers[name]()
        if mod is not None:
            mod = mod.to(weight.device, weight.dtype)
            with torch.no_grad():
                mod.weight.copy_(weight)
        out[name] = (mod, why)
    return out


def run_shape(tag, rows, n, names, bw_gbps, args):
    import torch

    from novatune.kernels.rms_norm import RESIDENCY, rms_norm_bwd_launch_config, rms_norm_fwd_config, rms_norm_ref
    from novatune.measure.numerics import rel_err
    from novatune.measure.results import write_row
    from novatune.measure.timing import kernel_us, wall_us

    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    x0 = torch.randn(rows, n, device=dev, dtype=dt)
    dy0 = torch.randn(rows, n, device=dev, dtype=dt)
    weight = (1.0 + 0.1 * torch.randn(n, device=dev)).to(dt)
    floor_us = 5 * rows * n * 2 / (bw_gbps * 1e3)

    xr = x0.float().requires_grad_()
    wr = weight.float().requires_grad_()
    yr = rms_norm_ref(xr, wr, EPS)
    yr.backward(dy0.float())

    results = []
    for name, (mod, why) in build_candidates(n, weight, names).items():
        row = {"bench": "rms_norm", "shape": tag, "rows": rows, "n": n, "dtype": "bfloat16", "candidate": name,
               "floor_us": round(floor_us, 2), "copy_gbps": round(bw_gbps, 1), "quick": args.quick}
        if mod is None:
            row["absent"] = why
            results.append(write_row(args.results, row))
            continue
        x = x0.clone().requires_grad_()
        dy = dy0.clone()  # own copy: Liger's in-place backward overwrites dy with dx

        def step(x=x, mod=mod, dy=dy):  # bound now: the loop deletes these names at its end
            x.grad = None
            mod.weight.grad = None
            mod(x).backward(dy)

        y = mod(x)  # correctness on a fresh dy (first compile of fwd and bwd happens here too)
        y.backward(dy0.clone())
        row.update(rel_err_y=rel_err(y, yr), rel_err_dx=rel_err(x.grad, xr.grad),
                   rel_err_dw=rel_err(mod.weight.grad, wr.grad))
        if name == "novatune":
            row["config"] = {"fwd": rms_norm_fwd_config(rows, n),
                             "bwd": rms_norm_bwd_launch_config(dy, x, mod.weight),
                             "residency": sorted({how for _, how in RESIDENCY.values()})}
        reps = dict(warmup_ms=5, rep_ms=20) if args.quick else {}
        row["wall_us"] = round(wall_us(step, **reps), 2)
        row["kernel_us"] = round(kernel_us(step, **(dict(iters=5, warmup=2) if args.quick else {})), 2)
        row["frac_of_floor"] = round(floor_us / row["kernel_us"], 3)
        results.append(write_row(args.results, row))
        del mod, x, dy, y, step
        torch.cuda.empty_cache()
    return results


def sweep(tag, rows, n, args):
    """Kernel time (CUDA-graph replay, µs) of fwd and bwd launch configs around the defaults; rows + top-3 printed."""
    import itertools

    import torch
    from triton.testing import do_bench_cudagraph

    from novatune.kernels.rms_norm import (
        num_sms,
        rms_norm_bwd,
        rms_norm_bwd_launch_config,
        rms_norm_fwd,
        rms_norm_fwd_config,
    )
    from novatune.measure.results import write_row

    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(rows, n, device=dev, dtype=dt)
    dy = torch.randn(rows, n, device=dev, dtype=dt)
    w = torch.ones(n, device=dev, dtype=dt)
    _, rstd = rms_norm_fwd(x, w, EPS)
    sms = num_sms(x.device)
    f0, b0 = rms_norm_fwd_config(rows, n), rms_norm_bwd_launch_config(dy, x, w)
    def around(bm):
        return sorted({max(1, bm // 2), bm, bm * 2})

    grids = {
        "fwd": [dict(block_m=bm, num_warps=nw) for bm, nw in itertools.product(around(f0["block_m"]), (4, 8, 16))],
        "bwd": [dict(block_m=bm, num_warps=nw, stages=st, num_programs=None)
                for bm, nw, st in itertools.product(around(b0["block_m"]), (4, 8, 16), (0, 3))]
        + [dict(b0, num_programs=k * sms) for k in (1, 2, 4)],
    }
    calls = {"fwd": lambda c: (lambda: rms_norm_fwd(x, w, EPS, **c)),
             "bwd": lambda c: (lambda: rms_norm_bwd(dy, x, w, rstd, **c))}
    for phase, cfgs in grids.items():
        timed = []
        for cfg in cfgs:
            fn = calls[phase](cfg)
            fn()  # compile outside the graph capture
            us = do_bench_cudagraph(fn, rep=20) * 1e3
            timed.append((us, cfg))
            write_row(args.results, {"bench": "rms_norm_sweep", "shape": tag, "rows": rows, "n": n, "phase": phase,
                                     "config": cfg, "graph_us": round(us, 2)})
        timed.sort(key=lambda t: t[0])
        default = {"fwd": f0, "bwd": b0}[phase]
        dflt = calls[phase]({k: v for k, v in default.items()})
        dflt()
        print(f"  sweep {tag} {phase}: default {default} {do_bench_cudagraph(dflt, rep=20) * 1e3:.1f} µs; best:")
        for us, cfg in timed[:3]:
            print(f"    {us:7.1f} µs  {cfg}")


def print_table(tag, rows, n, results):
    floor = results[0]["floor_us"] if results else float("nan")
    print(f"\n{tag}: {rows} x {n} bf16, fwd+bwd, HBM floor {floor:.1f} µs")
    print(f"{'candidate':<18}{'kernel µs':>11}{'wall µs':>10}{'frac floor':>12}"
          f"{'err y':>10}{'err dx':>10}{'err dw':>10}")
    for r in results:
        if "absent" in r:
            print(f"{r['candidate']:<18}  absent: {r['absent']}")
            continue
        print(f"{r['candidate']:<18}{r['kernel_us']:>11.1f}{r['wall_us']:>10.1f}{r['frac_of_floor']:>12.3f}"
              f"{r['rel_err_y']:>10.1e}{r['rel_err_dx']:>10.1e}{r['rel_err_dw']:>10.1e}")
    for r in results:
        if "config" in r:
            print(f"  novatune launch config: {r['config']}")


def main(argv=None):
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_rms_norm.py needs a CUDA GPU")
    from novatune.measure.timing import copy_bandwidth_gbps

    names = args.candidates or ["hf_eager", "torch_nn_RMSNorm", "torch_compile", "liger", "novatune"]
    bw = copy_bandwidth_gbps()
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bw:.0f} GB/s")
    for tag in args.shapes:
        rows, n = SHAPES[tag]
        print_table(tag, rows, n, run_shape(tag, rows, n, names, bw, args))
        if args.sweep:
            sweep(tag, rows, n, args)
    print(f"\nrows appended to {args.results}")


if __name__ == "__main__":
    main()
