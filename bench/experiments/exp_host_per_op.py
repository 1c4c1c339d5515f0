"""Host time per call of novatune's per-layer ops beside torch's (CUDA), at launch-bound shapes: the time per call
is what the host spends queueing it (the GPU finishes each kernel before the host queues the next).

Prints µs per forward and per forward+backward for rms_norm, qk_norm_rope, swiglu and rope, each through the lean
launch (novatune/kernels/launch.py: the compiled kernel called directly) and through Triton's JIT launch
(NOVATUNE_LEAN_LAUNCH=0's path), and torch's nearest equivalents. `--baseline REF` also runs this script on
another novatune in a subprocess (REF: a folder holding a `novatune` package, or a git ref such as main), so one
call shows before and after.

    python bench/experiments/exp_host_per_op.py [--baseline main|FOLDER] [--cprofile] [--json PATH] [--device cpu]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

import novatune
import novatune.ops as ops

try:  # absent from trees before the lean launch (--baseline)
    from novatune.kernels import launch as lean_launch
except ImportError:
    lean_launch = None


DEVICE = "cuda"  # --device cpu: a smoke run of this script (the CPU path's numbers mean nothing here)


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def per_call_us(fn, n: int = 300, reps: int = 5) -> float:
    """Best of `reps` rounds of host µs per call (no sync inside a round: the host only queues)."""
    for _ in range(20):
        fn()
    _sync()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
        _sync()
    return 1e6 * best


def _grad(out, inputs):
    outs = out if isinstance(out, tuple) else (out,)
    return torch.autograd.grad(outs, inputs, outs)


def cases() -> list[tuple[str, object, object]]:
    """(name, novatune fn, torch fn or None) at small (launch-bound) shapes, bf16."""
    dev, dt = DEVICE, torch.bfloat16
    from novatune.ops.qk_norm_rope import qk_norm_rope

    def leaf(*shape):
        return torch.randn(*shape, device=dev, dtype=dt, requires_grad=True)

    x, w = leaf(8, 256), leaf(256)
    g, u = leaf(8, 512), leaf(8, 512)
    q, k, qw, kw = leaf(1, 8, 32, 128), leaf(1, 8, 8, 128), leaf(128), leaf(128)
    cos, sin = torch.randn(1, 8, 128, device=dev, dtype=dt), torch.randn(1, 8, 128, device=dev, dtype=dt)
    qh, kh = leaf(1, 32, 8, 128), leaf(1, 8, 8, 128)
    from novatune.kernels import nf4

    t = nf4.nf4_quantize_ref(torch.randn(64, 256, dtype=dt))
    t = nf4.NF4Tensor(**{k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in t.__dict__.items()})

    def torch_qk_norm_rope():
        qn = F.rms_norm(q, (128,), qw, 1e-6)
        kn = F.rms_norm(k, (128,), kw, 1e-6)
        c, s = cos.unsqueeze(2), sin.unsqueeze(2)
        rot = lambda t: torch.cat((-t[..., 64:], t[..., :64]), -1)  # noqa: E731
        return qn * c + rot(qn) * s, kn * c + rot(kn) * s

    def torch_rope():
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        rot = lambda t: torch.cat((-t[..., 64:], t[..., :64]), -1)  # noqa: E731
        return qh * c + rot(qh) * s, kh * c + rot(kh) * s

    rows = [
        ("rms_norm fwd", lambda: ops.rms_norm(x, w, 1e-6), lambda: F.rms_norm(x, (256,), w, 1e-6)),
        ("rms_norm fwd+bwd", lambda: _grad(ops.rms_norm(x, w, 1e-6), (x, w)),
         lambda: _grad(F.rms_norm(x, (256,), w, 1e-6), (x, w))),
        ("qk_norm_rope fwd", lambda: qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin), torch_qk_norm_rope),
        ("qk_norm_rope fwd+bwd", lambda: _grad(qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin), (q, k, qw, kw)),
         lambda: _grad(torch_qk_norm_rope(), (q, k, qw, kw))),
        ("swiglu fwd", lambda: ops.swiglu(g, u), lambda: F.silu(g) * u),
        ("swiglu fwd+bwd", lambda: _grad(ops.swiglu(g, u), (g, u)), lambda: _grad(F.silu(g) * u, (g, u))),
        ("rope fwd", lambda: ops.apply_rope(qh, kh, cos, sin), torch_rope),
        ("rope fwd+bwd", lambda: _grad(ops.apply_rope(qh, kh, cos, sin), (qh, kh)),
         lambda: _grad(torch_rope(), (qh, kh))),
        ("empty launch (torch.add)", None, lambda: torch.add(x, 1)),
    ]
    if dev == "cuda":  # the kernel launcher itself, no device rule in front of it
        rows.insert(-1, ("nf4 dequantize (QLoRA)", lambda: nf4.nf4_dequantize(t), None))
    return rows


def measure() -> dict:
    rows = {}
    lean_on = lean_launch is not None and lean_launch.lean_enabled()[0]
    for name, nova, ref in cases():
        row = {}
        if nova is not None:
            if lean_launch is not None:
                lean_launch.reset(enabled=False)
            row["jit"] = per_call_us(nova)
            if lean_on:
                lean_launch.reset(enabled=True)
                row["lean"] = per_call_us(nova)
        if ref is not None:
            row["torch"] = per_call_us(ref)
        rows[name] = row
    if lean_launch is not None:
        lean_launch.reset()
    return rows


def print_rows(title: str, rows: dict) -> None:
    print(f"--- {title}: host µs per call (best of 5 x 300)")
    print(f"{'op':28s} {'lean':>8s} {'jit':>8s} {'torch':>8s}")
    for name, r in rows.items():
        cells = [f"{r[k]:8.1f}" if k in r else f"{'-':>8s}" for k in ("lean", "jit", "torch")]
        print(f"{name:28s} {' '.join(cells)}")


def baseline(ref: str) -> dict:
    """This script run on another novatune: `ref` is a folder holding a `novatune` package, or a git ref whose
    `novatune` is extracted to a temporary folder (needs the repository's .git)."""
    if os.path.isdir(os.path.join(ref, "novatune")):
        return _run_on(os.path.abspath(ref))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", root, "archive", ref, "novatune"], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        return _run_on(tmp)


def _run_on(pythonpath: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        env = dict(os.environ, PYTHONPATH=pythonpath)
        subprocess.run([sys.executable, os.path.abspath(__file__), "--json", out, "--quiet", "--device", DEVICE],
                       env=env, check=True)
        with open(out) as f:
            return json.load(f)


def cprofile() -> None:
    import cProfile
    import pstats

    for name, nova, _ in cases():
        if nova is None or "bwd" not in name:
            continue
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            nova()
        prof.disable()
        _sync()
        print(f"--- {name}: cProfile, 200 calls, top by own time")
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", help="a folder holding a novatune package, or a git ref (e.g. main), to measure too")
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    import triton

    rows = measure()
    if not args.quiet:
        status = lean_launch.lean_enabled() if lean_launch is not None else (False, "no lean launch in this tree")
        print(f"novatune {novatune.__file__}, triton {triton.__version__}, torch {torch.__version__}, "
              f"{torch.cuda.get_device_name() if DEVICE == 'cuda' else DEVICE}; lean launch: {status[0]} {status[1]}")
        print_rows("this tree", rows)
    if args.baseline:
        print_rows(f"baseline {args.baseline} (its launch path)", baseline(args.baseline))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)
    if args.cprofile:
        cprofile()


if __name__ == "__main__":
    main()
