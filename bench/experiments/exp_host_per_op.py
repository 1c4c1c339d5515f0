"""Host time per call of novatune's ops beside torch's (CUDA): launch-bound shapes, so the time per call is what
the host spends queueing it. Prints µs per forward and per forward+backward.

    python bench/experiments/exp_host_per_op.py [--cprofile]
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

import novatune.ops as ops


def per_call_us(fn, n=300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    return 1e6 * host / n


dev, dt = "cuda", torch.bfloat16
x = torch.randn(8, 256, device=dev, dtype=dt, requires_grad=True)
w = torch.randn(256, device=dev, dtype=dt, requires_grad=True)
g = torch.randn(8, 512, device=dev, dtype=dt, requires_grad=True)
u = torch.randn(8, 512, device=dev, dtype=dt, requires_grad=True)
rows = [
    ("rms_norm fwd", lambda: ops.rms_norm(x, w, 1e-6)),
    ("torch rms_norm fwd", lambda: F.rms_norm(x, (256,), w, 1e-6)),
    ("rms_norm fwd+bwd", lambda: ops.rms_norm(x, w, 1e-6).sum().backward()),
    ("torch rms_norm fwd+bwd", lambda: F.rms_norm(x, (256,), w, 1e-6).sum().backward()),
    ("swiglu fwd", lambda: ops.swiglu(g, u)),
    ("torch silu*up fwd", lambda: F.silu(g) * u),
    ("swiglu fwd+bwd", lambda: ops.swiglu(g, u).sum().backward()),
    ("torch silu*up fwd+bwd", lambda: (F.silu(g) * u).sum().backward()),
    ("empty launch (torch.add)", lambda: torch.add(x, 1)),
]
for name, fn in rows:
    print(f"{name:28s} {per_call_us(fn):8.1f} µs/call (host)")

if __name__ == "__main__":
    import cProfile
    import pstats
    import sys

    if "--cprofile" in sys.argv:
        q = torch.randn(1, 64, 32, 128, device=dev, dtype=dt, requires_grad=True)
        k = torch.randn(1, 64, 8, 128, device=dev, dtype=dt, requires_grad=True)
        qw = torch.randn(128, device=dev, dtype=dt, requires_grad=True)
        kw = torch.randn(128, device=dev, dtype=dt, requires_grad=True)
        cos = torch.randn(1, 64, 128, device=dev, dtype=dt)
        sin = torch.randn(1, 64, 128, device=dev, dtype=dt)
        from novatune.ops.qk_norm_rope import qk_norm_rope
        print(f"{'qk_norm_rope fwd+bwd':28s} "
              f"{per_call_us(lambda: sum(t.sum() for t in qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin)).backward()):8.1f}"
              " µs/call (host)")
        for name, fn in [("rms_norm fwd+bwd", rows[2][1]),
                         ("qk_norm_rope fwd+bwd",
                          lambda: sum(t.sum() for t in qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin)).backward())]:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            print(f"--- {name}: cProfile, 200 calls, top by own time")
            pstats.Stats(prof).sort_stats("tottime").print_stats(14)
