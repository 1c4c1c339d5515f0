"""Experiment (LOG.md, session 3): why does a Triton launch inside the QLoRA linear's backward cost ~450 µs of host
time (exp_host_profile.py) when the same launch costs ~30 µs in the forward?

Custom autograd Functions whose backward runs a given sequence (cuBLAS mm, a Triton launch, both), timed as
fwd+bwd host µs per call; the same sequences called directly on the main thread for comparison.

    python bench/experiments/exp_bwd_launch.py
"""
from __future__ import annotations

import os
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from exp_host_overhead import host_us  # noqa: E402  (the same loop, one place)


def main() -> None:
    from novatune.kernels import rms_norm as KR

    dev = "cuda"
    a = torch.randn(64, 128, device=dev, dtype=torch.bfloat16)
    w = torch.randn(128, device=dev, dtype=torch.bfloat16)
    m = torch.randn(128, 128, device=dev, dtype=torch.bfloat16)
    b16 = torch.randn(128, 16, device=dev, dtype=torch.bfloat16)
    o16 = torch.empty(64, 16, device=dev, dtype=torch.bfloat16)
    seqs = {
        "mm N=16": lambda: torch.mm(a, b16),
        "triton+mm N=16": lambda: (KR.rms_norm_fwd(a, w), torch.mm(a, b16)),
        "addmm_ b0 N=16": lambda: o16.addmm_(a, b16, beta=0),
        "triton+addmm_ b0 N=16": lambda: (KR.rms_norm_fwd(a, w), o16.addmm_(a, b16, beta=0)),
        "mm out= N=16": lambda: torch.mm(a, b16, out=o16),
        "triton+mm out= N=16": lambda: (KR.rms_norm_fwd(a, w), torch.mm(a, b16, out=o16)),
        "nothing": lambda: None,
        "mm": lambda: torch.mm(a, m),
        "triton": lambda: KR.rms_norm_fwd(a, w),
        "mm+triton": lambda: (torch.mm(a, m), KR.rms_norm_fwd(a, w)),
        "triton+mm": lambda: (KR.rms_norm_fwd(a, w), torch.mm(a, m)),
        "mm+triton+mm": lambda: (torch.mm(a, m), KR.rms_norm_fwd(a, w), torch.mm(a, m)),
    }
    x = a.clone().requires_grad_(True)
    threads = {}
    for name, seq in seqs.items():
        class F(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x * 1

            @staticmethod
            def backward(ctx, g):
                threads.setdefault(name, threading.current_thread().name)
                seq()
                return g

        direct = host_us(seq)
        bwd = host_us(lambda: torch.autograd.grad(F.apply(x), x, grad_outputs=a))
        print(f"{name:14s} direct {direct:7.1f} us   fwd+bwd through autograd {bwd:7.1f} us   backward thread "
              f"{threads.get(name)}")

    # the LoRA linear's shape of autograd: three differentiable inputs (two fp32 leaves), a saved tensor, the
    # real LoRA op's backward vs the same with the Triton launch swapped for an aten copy
    from novatune.ops import lora_linear

    la = torch.randn(16, 128, device=dev, requires_grad=True)
    lb = torch.randn(128, 16, device=dev, requires_grad=True)
    dense = torch.randn(128, 128, device=dev, dtype=torch.bfloat16) * 0.02

    class Obj:
        shape, dtype, device = dense.shape, dense.dtype, dense.device

        def __init__(self, how):
            self.how = how

        def __call__(self):
            if self.how == "triton":
                KR.rms_norm_fwd(a, w)
            elif self.how == "triton+sync-free event":
                KR.rms_norm_fwd(a, w)
                torch.cuda.current_stream().record_event()
            return dense

    import ctypes

    cu = ctypes.CDLL("libcuda.so.1")

    def ctx() -> int:
        c = ctypes.c_void_p()
        cu.cuCtxGetCurrent(ctypes.byref(c))
        return c.value or 0

    log = []

    class Probe(Obj):
        def __call__(self):
            log.append(("enter", threading.current_thread().name, ctx()))
            KR.rms_norm_fwd(a, w)
            log.append(("after triton", ctx()))
            torch.mm(a, m)
            log.append(("after mm", ctx()))
            return dense

    for _ in range(2):
        torch.autograd.grad(lora_linear(x, Probe("x"), None, la, lb, 2.0), x, grad_outputs=a)
    print("main thread context", ctx(), "| backward:", log)

    class Primed(Obj):
        primed = set()

        def __call__(self):
            tid = threading.get_ident()
            if tid not in Primed.primed:  # bind the device's primary context to this thread (runtime API call)
                torch.cuda.set_device(torch.cuda.current_device())
                torch.cuda.current_stream().synchronize()
                Primed.primed.add(tid)
            KR.rms_norm_fwd(a, w)
            return dense

    o = Primed("primed")
    us = host_us(lambda: torch.autograd.grad(lora_linear(x, o, None, la, lb, 2.0), x, grad_outputs=a))
    print(f"lora_linear fwd+bwd, stand-in triton after priming the thread's context: {us:7.1f} us")

    from torch.profiler import ProfilerActivity, profile

    o = Obj("triton")
    for _ in range(10):
        torch.autograd.grad(lora_linear(x, o, None, la, lb, 2.0), x, grad_outputs=a)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            torch.autograd.grad(lora_linear(x, o, None, la, lb, 2.0), x, grad_outputs=a)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))

    for how in ("none", "triton", "triton+sync-free event"):
        o = Obj(how)
        for wrt in ((x,), (x, la, lb), (la, lb)):
            us = host_us(lambda: torch.autograd.grad(lora_linear(x, o, None, la, lb, 2.0), wrt, grad_outputs=a))
            print(f"lora_linear fwd+bwd, stand-in {how:24s} grads of {len(wrt)} inputs: {us:7.1f} us")
    for how in ("none", "triton"):
        o = Obj(how)
        y = lora_linear(x, o, None, la, lb, 2.0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(100):
            y = lora_linear(x, o, None, la, lb, 2.0)
        t1 = time.perf_counter()
        torch.autograd.grad(y, x, grad_outputs=a)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        print(f"stand-in {how}: forward {(t1 - t0) / 100 * 1e6:.1f} us/call; one backward {(t2 - t1) * 1e6:.1f} us")


if __name__ == "__main__":
    main()
