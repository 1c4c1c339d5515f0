"""Experiment (LOG.md, session 3): host time per call of novatune's ops and of their building blocks.

The QLoRA micro-step (Qwen3-8B, 2048-token rows) is host-bound: CUDA busy 188 ms of a ~340 ms micro-step
(bench/e2e.py --profile). This measures what one call costs the CPU: N calls back to back on tiny tensors (so the
GPU never falls behind and the loop's wall time is the host's), after a warm-up, then one synchronize.

    python bench/experiments/exp_host_overhead.py --results bench/results/experiments.jsonl
"""
from __future__ import annotations

import argparse
import time

import torch
import triton

from novatune.measure.results import write_row


@triton.jit
def _empty_kernel(X):
    pass


def host_us(fn, n: int = 300, warmup: int = 30) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--results", default="")
    args = p.parse_args(argv)
    from novatune.kernels import nf4 as KN
    from novatune.kernels import rms_norm as KR
    from novatune.ops import lora_linear, rms_norm
    from novatune.ops.nf4 import DequantWeight

    dev = "cuda"
    a = torch.randn(64, 128, device=dev, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    w = torch.randn(128, device=dev, dtype=torch.bfloat16)
    xg = a.clone().requires_grad_(True)
    wg = w.clone().requires_grad_(True)
    y0, rstd = KR.rms_norm_fwd(a, w)
    out = torch.empty_like(a)
    t = KN.nf4_quantize_ref(torch.randn(128, 128) * 0.02, double_quant=True)
    t = KN.NF4Tensor(**{k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in t.__dict__.items()})
    t.dtype = torch.bfloat16
    wd = torch.randn(128, 128, device=dev, dtype=torch.bfloat16)
    la = torch.randn(16, 128, device=dev, dtype=torch.float32, requires_grad=True)
    lb = torch.randn(128, 16, device=dev, dtype=torch.float32, requires_grad=True)
    dq = DequantWeight(t, torch.bfloat16)
    mm_a = torch.randn(64, 128, device=dev, dtype=torch.bfloat16)
    n = a.shape[-1]

    def fwd_bwd():
        y = rms_norm(xg, wg, 1e-6)
        torch.autograd.grad(y, (xg, wg), grad_outputs=b)

    def lora_fwd_bwd(weight):
        def f():
            y = lora_linear(xg, weight, None, la, lb, 2.0)
            torch.autograd.grad(y, (xg, la, lb), grad_outputs=b)
        return f

    cases = {
        "torch.empty": lambda: torch.empty(64, 128, device=dev),
        "torch.add": lambda: torch.add(a, b),
        "torch.mm 64x128x128": lambda: torch.mm(mm_a, wd),
        "addmm_ 64x128x128": lambda: out.addmm_(mm_a, wd.t()),
        "triton empty kernel (JIT launch)": lambda: _empty_kernel[(1,)](a),
        "triton rms fwd kernel (JIT launch)": lambda: KR._rms_norm_fwd_kernel[(64,)](
            a, w, out, rstd, n, n, 64, n, 1e-6, 0.0, BLOCK_M=1, BLOCK_N=128, SOFT_RNE=False, num_warps=4),
        "kernels.rms_norm_fwd": lambda: KR.rms_norm_fwd(a, w),
        "kernels.rms_norm_bwd": lambda: KR.rms_norm_bwd(b, a, w, rstd),
        "ops.rms_norm fwd (grad)": lambda: rms_norm(xg, wg, 1e-6),
        "ops.rms_norm fwd+bwd": fwd_bwd,
        "kernels.nf4_dequantize 128x128": lambda: KN.nf4_dequantize(t),
        "ops.lora_linear fwd+bwd dense": lora_fwd_bwd(wd),
        "ops.lora_linear fwd+bwd nf4": lora_fwd_bwd(dq),
    }
    # the compiled kernel launched directly (no JIT binder / cache key): what a pre-bound launcher could save. The
    # launcher takes every bound argument, constexprs included (triton/runtime/jit.py, JITFunction.run)
    try:
        ck = KR._rms_norm_fwd_kernel.warmup(a, w, out, rstd, n, n, 64, n, 1e-6, 0.0, BLOCK_M=1, BLOCK_N=128,
                                            SOFT_RNE=False, num_warps=4, grid=(64,))
        ck._init_handles()
        stream = torch.cuda.current_stream().cuda_stream
        run = ck.run
        fn, meta = ck.function, ck.packed_metadata
        cases["triton rms fwd kernel (CompiledKernel.run)"] = lambda: run(
            64, 1, 1, stream, fn, meta, None, None, None, a, w, out, rstd, n, n, 64, n, 1e-6, 0.0, 1, 128, False, True)
        cases["triton rms fwd kernel (CompiledKernel.run)"]()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        print(f"CompiledKernel.run path unavailable: {type(e).__name__}: {e}")
        cases.pop("triton rms fwd kernel (CompiledKernel.run)", None)
    print(f"{'case':48s} {'host us/call':>12s}")
    for name, fn in cases.items():
        try:
            us = host_us(fn)
        except Exception as e:  # noqa: BLE001
            print(f"{name:48s} failed: {type(e).__name__}: {str(e)[:120]}")
            continue
        print(f"{name:48s} {us:12.1f}")
        if args.results:
            write_row(args.results, {"bench": "exp_host_overhead", "case": name, "host_us": round(us, 2)})


if __name__ == "__main__":
    main()
