"""SwiGLU fwd+bwd benchmark (BENCHMARKS.md "Operators"), and the Qwen3-4B MLP around it.

Part 1 - the activation at 4096 x 9728 bf16, y = silu(g) * u, forward + backward together:
  hf_eager          silu(g) * u in eager PyTorch (what HF's Qwen3MLP runs)
  torch_compile     torch.compile of that expression
  liger             LigerSiLUMulFunction (row says "absent" when liger_kernel is not importable)
  novatune          novatune.ops.swiglu (custom op + autograd: what a patched model runs)
  novatune_kernels  the two raw launchers with preallocated outputs (no autograd): the op layer's overhead is
                    the difference between this and `novatune` in wall µs
  (torch has no native fused silu-mul op, so there is no torch_native row.)
HBM floor = bytes that must move / copy bandwidth measured in this run; bytes = fwd (read g, u; write y) +
bwd (read dy, g, u; write dg, du) = 8 * rows * cols * 2 for bf16.

Part 2 - the whole MLP, x (4096, 2560) -> gate/up (9728) -> down (2560), bf16, fwd+bwd incl. weight grads:
  stock (HF Qwen3MLP), liger (same modules, Liger's activation), novatune (novatune.ops.swiglu_mlp); wall µs,
  kernel µs (GEMMs included) and the step's peak memory above the resident tensors.

--sweep times the raw kernels over (BLOCK, num_warps) so the default in novatune.kernels.swiglu.default_config
can be re-chosen on a new GPU. Every figure is appended as a row to bench/results/ops.jsonl (--results).

    python bench/bench_swiglu.py            # ~30 s on an H100/H200 (torch.compile warm-up dominates)
    python bench/bench_swiglu.py --quick    # smoke run: fewer repetitions, same shapes
    python bench/bench_swiglu.py --sweep --no-mlp
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from novatune.measure.numerics import rel_err  # noqa: E402
from novatune.measure.results import write_row  # noqa: E402
from novatune.measure.timing import copy_bandwidth_gbps, kernel_us, wall_us  # noqa: E402

DEVICE = "cuda"  # module-level so a CPU dry run of the script's logic can redirect it


def _liger_silu_mul():
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except Exception:  # noqa: BLE001 - absent or broken: the row says so
        try:
            from liger_kernel.transformers.swiglu import LigerSiLUMulFunction
        except Exception:  # noqa: BLE001
            return None
    return LigerSiLUMulFunction.apply


def _timings(step, quick):
    wu, rep, iters = (10, 30, 10) if quick else (25, 100, 30)
    return kernel_us(step, iters=iters), wall_us(step, warmup_ms=wu, rep_ms=rep)


def bench_activation(args, hbm_gbps):
    from novatune.kernels.swiglu import swiglu_bwd, swiglu_bwd_ref, swiglu_fwd, swiglu_ref
    from novatune.ops.swiglu import swiglu

    rows, cols = args.shape
    torch.manual_seed(0)
    g = torch.randn(rows, cols, device=DEVICE, dtype=torch.bfloat16)
    u = torch.randn(rows, cols, device=DEVICE, dtype=torch.bfloat16)
    dy = torch.randn(rows, cols, device=DEVICE, dtype=torch.bfloat16)
    floor_us = 8 * rows * cols * g.element_size() / (hbm_gbps * 1e3)
    ref = (swiglu_ref(g, u), *swiglu_bwd_ref(dy, g, u))

    def autograd_step(fn):
        # Own copies per candidate: Liger's backward writes the grads into its saved inputs' storage, which
        # would corrupt shared inputs for the candidates timed after it.
        gg, uu = g.detach().clone().requires_grad_(True), u.detach().clone().requires_grad_(True)

        def step():
            gg.grad = uu.grad = None
            y = fn(gg, uu)
            y.backward(dy)
            return y, gg.grad, uu.grad
        return step

    compiled = torch.compile(lambda a, b: F.silu(a) * b)
    liger = _liger_silu_mul()
    y_buf, dg_buf, du_buf = torch.empty_like(g), torch.empty_like(g), torch.empty_like(u)

    def raw_step(**cfg):
        def step():
            swiglu_fwd(g, u, out=y_buf, **cfg)
            swiglu_bwd(dy, g, u, dgate=dg_buf, dup=du_buf, **cfg)
        return step

    cands = {"hf_eager": autograd_step(lambda a, b: F.silu(a) * b), "torch_compile": autograd_step(compiled),
             "liger": autograd_step(liger) if liger else None, "novatune": autograd_step(swiglu),
             "novatune_kernels": raw_step()}
    if args.sweep:
        for block in (1024, 2048, 4096, 8192):
            for warps in (4, 8, 16):
                cands[f"novatune_kernels[b{block},w{warps}]"] = raw_step(block=block, num_warps=warps)

    results = []
    for name, step in cands.items():
        base = {"bench": "swiglu", "op": "swiglu", "candidate": name, "shape": [rows, cols], "dtype": "bfloat16",
                "floor_us": round(floor_us, 1), "hbm_GBps": round(hbm_gbps), "quick": args.quick}
        if step is None:
            results.append(write_row(args.results, {**base, "absent": "liger_kernel not importable"}))
            continue
        outs = step()  # first call: also the compile / JIT warm-up; its outputs are checked against ref
        outs = (y_buf, dg_buf, du_buf) if outs is None else [o.clone() for o in outs]
        torch.cuda.synchronize()
        err = {k: round(rel_err(o, r), 6) for k, o, r in zip(("y", "dgate", "dup"), outs, ref)}
        k_us, w_us = _timings(step, args.quick)
        results.append(write_row(args.results, {**base, "kernel_us": round(k_us, 1), "wall_us": round(w_us, 1),
                                                "frac_of_floor": round(floor_us / k_us, 3), "rel_err": err}))
    return results


def bench_mlp(args, hbm_gbps):
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

    from novatune.ops.swiglu import swiglu_mlp

    tokens, (hidden, inter) = args.shape[0], args.mlp
    cfg = Qwen3Config(hidden_size=hidden, intermediate_size=inter, hidden_act="silu")
    torch.manual_seed(0)
    mlp = Qwen3MLP(cfg).to(DEVICE, torch.bfloat16)
    x = torch.randn(tokens, hidden, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, hidden, device=DEVICE, dtype=torch.bfloat16)
    liger = _liger_silu_mul()

    def step_of(fwd):
        def step():
            x.grad = None
            for p in mlp.parameters():
                p.grad = None
            fwd(x).backward(dy)
        return step

    cands = {"stock": step_of(mlp),
             "liger": step_of(lambda t: mlp.down_proj(liger(mlp.gate_proj(t), mlp.up_proj(t)))) if liger else None,
             "novatune": step_of(lambda t: swiglu_mlp(t, mlp.gate_proj, mlp.up_proj, mlp.down_proj))}
    results = []
    for name, step in cands.items():
        base = {"bench": "swiglu", "op": "swiglu_mlp", "candidate": name, "shape": [tokens, hidden, inter],
                "dtype": "bfloat16", "hbm_GBps": round(hbm_gbps), "quick": args.quick}
        if step is None:
            results.append(write_row(args.results, {**base, "absent": "liger_kernel not importable"}))
            continue
        step()  # warm-up
        x.grad = None
        for p in mlp.parameters():
            p.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated()  # weights + inputs, no grads
        step()
        torch.cuda.synchronize()
        peak_mib = (torch.cuda.max_memory_allocated() - resident) / 2**20
        k_us, w_us = _timings(step, args.quick)
        results.append(write_row(args.results, {**base, "kernel_us": round(k_us, 1), "wall_us": round(w_us, 1),
                                                "step_peak_MiB": round(peak_mib, 1)}))
    return results


def print_table(title, rows, cols):
    print(f"\n{title}")
    print(" | ".join(f"{c:>14}" if i else f"{c:<34}" for i, c in enumerate(cols)))
    for r in rows:
        cells = [r["candidate"]] + [("absent" if "absent" in r else "-") if r.get(c) is None else
                                    (str(r[c]) if not isinstance(r[c], dict) else f"{max(r[c].values()):.1e}")
                                    for c in cols[1:]]
        print(" | ".join(f"{c:>14}" if i else f"{c:<34}" for i, c in enumerate(cells)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="4096x9728", help="rows x cols of gate/up (default: Qwen3-4B, 4096 tokens)")
    ap.add_argument("--mlp", default="2560x9728", help="hidden x intermediate of the MLP part (default Qwen3-4B)")
    ap.add_argument("--quick", action="store_true", help="fast smoke run: fewer repetitions")
    ap.add_argument("--sweep", action="store_true", help="also time the raw kernels over (BLOCK, num_warps)")
    ap.add_argument("--no-mlp", action="store_true", help="skip the whole-MLP part")
    ap.add_argument("--results", default="bench/results/ops.jsonl", help="JSON-lines file rows are appended to")
    args = ap.parse_args(argv)
    args.shape = tuple(int(v) for v in args.shape.lower().split("x"))
    args.mlp = tuple(int(v) for v in args.mlp.lower().split("x"))
    if not torch.cuda.is_available():
        print("bench_swiglu.py needs a CUDA GPU (nothing measured).", file=sys.stderr)
        return 2

    hbm = copy_bandwidth_gbps()
    rows = bench_activation(args, hbm)
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {hbm:.0f} GB/s, "
          f"floor {rows[0]['floor_us']} us; rows appended to {args.results}")
    print_table(f"SwiGLU fwd+bwd {args.shape[0]}x{args.shape[1]} bf16",
                rows, ["candidate", "kernel_us", "wall_us", "frac_of_floor", "rel_err"])
    if not args.no_mlp:
        print_table(f"MLP fwd+bwd x {args.shape[0]}x{args.mlp[0]} -> {args.mlp[1]} -> {args.mlp[0]} bf16",
                    bench_mlp(args, hbm), ["candidate", "kernel_us", "wall_us", "step_peak_MiB"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
