"""Experiment (LOG.md, session 3): cProfile of one op's host time on the GPU (why is the QLoRA fused linear's
fwd+bwd ~2.4x the dense one's host time in exp_host_overhead.py?).

    python bench/experiments/exp_host_profile.py
"""
from __future__ import annotations

import cProfile
import pstats
import time

import torch


def main() -> None:
    from novatune.kernels import nf4 as KN
    from novatune.ops import lora_linear
    from novatune.ops.nf4 import DequantWeight

    dev = "cuda"
    t = KN.nf4_quantize_ref(torch.randn(128, 128) * 0.02, double_quant=True)
    t = KN.NF4Tensor(**{k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in t.__dict__.items()})
    t.dtype = torch.bfloat16
    dq = DequantWeight(t, torch.bfloat16)
    dense = KN.nf4_dequantize(t)
    xg = torch.randn(64, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    la = torch.randn(16, 128, device=dev, requires_grad=True)
    lb = torch.randn(128, 16, device=dev, requires_grad=True)
    b = torch.randn(64, 128, device=dev, dtype=torch.bfloat16)

    def f(w):
        y = lora_linear(xg, w, None, la, lb, 2.0)
        torch.autograd.grad(y, (xg, la, lb), grad_outputs=b)

    class Cached:  # a Python stand-in that returns the dense weight: the object path without a Triton launch
        shape, dtype, device = dense.shape, dense.dtype, dense.device

        def __call__(self):
            return dense

    class ViaTorch:  # a stand-in whose "dequantisation" is one aten op (a copy) instead of a Triton launch
        shape, dtype, device = dense.shape, dense.dtype, dense.device

        def __call__(self):
            return dense.clone()

    from novatune.kernels import rms_norm as KR

    xr = torch.randn(64, 128, device=dev, dtype=torch.bfloat16)
    wr = torch.randn(128, device=dev, dtype=torch.bfloat16)

    class TritonObject:  # a stand-in that launches some other Triton kernel (RMSNorm fwd) then returns dense
        shape, dtype, device = dense.shape, dense.dtype, dense.device

        def __call__(self):
            KR.rms_norm_fwd(xr, wr)
            return dense

    class NoFusionFlag:  # the NF4 kernel launched without the enable_fp_fusion=False option
        shape, dtype, device = dense.shape, dense.dtype, dense.device

        def __call__(self):
            import novatune.kernels.nf4 as mod
            saved = mod._launch_kwargs
            mod._launch_kwargs = lambda: {}
            try:
                return KN.nf4_dequantize(t)
            finally:
                mod._launch_kwargs = saved

    def fwd_only(w):
        with torch.no_grad():
            lora_linear(xg, w, None, la, lb, 2.0)

    cases = (("dense", lambda: f(dense)), ("nf4", lambda: f(dq)), ("cached object", lambda: f(Cached())),
             ("clone object", lambda: f(ViaTorch())), ("dense fwd no_grad", lambda: fwd_only(dense)),
             ("nf4 fwd no_grad", lambda: fwd_only(dq)), ("dequant", lambda: dq()),
             ("triton-object", lambda: f(TritonObject())), ("nf4 no fusion flag", lambda: f(NoFusionFlag())),
             ("nf4 fwd grad", lambda: lora_linear(xg, dq, None, la, lb, 2.0)),
             ("dense fwd grad", lambda: lora_linear(xg, dense, None, la, lb, 2.0)))
    for name, fn in cases:
        for _ in range(30):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(300):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        print(f"{name}: {(t1 - t0) / 300 * 1e6:.1f} us/call host")
    for name, fn in (("nf4 fwd+bwd", lambda: f(dq)), ("dequant", lambda: dq())):
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(300):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        print(f"=== cProfile {name} (300 calls)")
        pstats.Stats(pr).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
