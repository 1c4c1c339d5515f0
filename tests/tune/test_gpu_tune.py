"""GPU checks of the engine (run by scripts/gpu_check.sh tune): the CUDA PyBind11 extension builds and its
candidates pass every validation check at the real Qwen3-4B shapes and at odd ones; the measurement path captures
CUDA graphs. (The RMSNorm bar - >= 5x HF eager, >= 0.85 of the HBM floor - is read from `novatune tune`'s own
rows by scripts/gpu_check.sh tune, so the 4B run and this file do not time the same candidates twice.)
Plus a CPU compile check of the CUDA sources (nvcc and a host-compiler syntax pass), marked slow."""
from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from novatune.ops.registry import OPS
from novatune.tune.calls import candidates

CUDA_DIR = Path(__file__).resolve().parents[2] / "novatune" / "kernels" / "cuda"
REAL = {"rms_norm": [(4096, 2560), (4096 * 32, 128)], "swiglu": [(4096, 9728)]}


@pytest.mark.gpu
def test_cuda_extension_builds():
    from novatune.kernels import cuda as nt_cuda

    why = nt_cuda.unavailable_reason()
    assert why is None, f"the GPU machine should be able to build the CUDA candidates: {why}"
    ext = nt_cuda.load()
    assert hasattr(ext, "rms_norm_fwd") and hasattr(ext, "swiglu_bwd")
    print("CUDA extension:", nt_cuda.BUILD_INFO)


@pytest.mark.gpu
@pytest.mark.parametrize("op,shape", [(op, s) for op, shapes in REAL.items() for s in shapes])
def test_cuda_candidates_validate_at_real_and_odd_shapes(op, shape):
    from novatune.tune.engine import odd_shapes
    from novatune.tune.validate import validate

    allc = candidates(op, shape, torch.bfloat16, "cuda")
    stock = next(c for c in allc if c.family == "eager")
    results = {c.name: validate(OPS[op], c, stock, odd_shapes(shape, "cuda"), torch.bfloat16, "cuda")
               for c in allc if c.family == "cuda"}
    for name, v in results.items():
        verdict = "ok" if v.ok else f"[{v.check}] {v.reason}"
        print(op, shape, name, verdict, f"max err {max(v.errors.values(), default=0):.2e}")
    bad = {n: f"[{v.check}] {v.reason}" for n, v in results.items() if not v.ok}
    assert not bad, bad
    assert all("poisoned" in v.checks and "deterministic" in v.checks for v in results.values())


@pytest.mark.gpu
def test_cuda_candidates_fp32():
    from novatune.tune.validate import validate

    for op, shape in (("rms_norm", (333, 1024)), ("swiglu", (333, 1000))):
        allc = candidates(op, shape, torch.float32, "cuda")
        stock = next(c for c in allc if c.family == "eager")
        for c in (c for c in allc if c.family == "cuda"):
            v = validate(OPS[op], c, stock, [shape, (1, shape[1])], torch.float32, "cuda")
            assert v.ok, (op, c.name, v.check, v.reason)


@pytest.mark.gpu
def test_measurement_uses_cuda_graphs_and_rotation():
    from novatune.tune.measure import input_sets, l2_bytes, time_fwd_bwd

    spec = OPS["swiglu"]
    c = next(c for c in candidates("swiglu", (4096, 9728), torch.bfloat16, "cuda") if c.name == "novatune_default")
    sets = input_sets(spec, (4096, 9728), torch.bfloat16, "cuda")
    per_set = 3 * 4096 * 9728 * 2
    assert len(sets) * per_set >= 2 * l2_bytes("cuda")
    t = time_fwd_bwd(spec, c.functional(), sets, iters=50)
    assert t.mode == "cuda-graph", t.note
    assert 0 < t.spread_us < t.median_us and t.wall_us is not None


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_sources_compile_for_sm90():
    """nvcc compiles the kernels for sm_90 and the host compiler accepts bindings.cpp against torch's headers
    (a syntax pass: a CPU-only torch has no CUDA libraries to link). ~20 s on 2 cores."""
    with tempfile.TemporaryDirectory() as tmp:
        # a CPU-only torch wheel lacks this generated header; the syntax pass only needs it to exist
        stub = Path(tmp) / "c10" / "cuda" / "impl"
        stub.mkdir(parents=True)
        (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        from torch.utils.cpp_extension import include_paths

        cuda_home = Path(shutil.which("nvcc")).resolve().parents[1]
        incs = [f"-I{p}" for p in include_paths()] + [f"-I{sysconfig.get_paths()['include']}", f"-I{tmp}",
                                                      f"-I{cuda_home / 'include'}", "-I/usr/local/cuda/include"]
        jobs = [["nvcc", "-c", "-O3", "-std=c++17", "-gencode=arch=compute_90,code=sm_90", str(CUDA_DIR / f),
                 "-o", os.path.join(tmp, f + ".o")] for f in ("rms_norm.cu", "swiglu.cu")]
        jobs.append([os.environ.get("CXX", "g++"), "-std=c++17", "-fsyntax-only", "-w",
                     "-DTORCH_EXTENSION_NAME=nt_check", *incs, str(CUDA_DIR / "bindings.cpp")])
        with ThreadPoolExecutor(3) as pool:
            results = list(pool.map(lambda cmd: subprocess.run(cmd, capture_output=True, text=True, timeout=300),
                                    jobs))
        for cmd, r in zip(jobs, results):
            assert r.returncode == 0, f"{' '.join(cmd[:3])}...: {r.stderr[-3000:]}"


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["rope", "qk_norm_rope"])
def test_rope_candidates_compile_validate_and_time_on_the_gpu(op):
    # every registered candidate (Triton launch variants, torch.compile of the reference, HF eager) at Qwen3-4B's
    # shape (4096 tokens, 32 q / 8 kv heads of 128) and the odd ones, bf16; then timed through the engine's
    # CUDA-graph path: a candidate that cannot be captured or compiled would fail here, not in a user's tune run
    from novatune.tune.engine import odd_shapes
    from novatune.tune.measure import input_sets, time_fwd_bwd
    from novatune.tune.validate import validate

    shape = (4096, 32, 8, 128)
    spec = OPS[op]
    allc = candidates(op, shape, torch.bfloat16, "cuda")
    stock = next(c for c in allc if c.family == "eager")
    assert {c.family for c in allc} >= {"eager", "triton", "compile"}, [c.name for c in allc]
    sets = input_sets(spec, shape, torch.bfloat16, "cuda", max_sets=2)
    bad = {}
    for c in allc:
        v = validate(spec, c, stock, odd_shapes(shape, "cuda", spec), torch.bfloat16, "cuda")
        if not v.ok:
            bad[c.name] = f"[{v.check}] {v.reason}"
            continue
        t = time_fwd_bwd(spec, c.functional(), sets, iters=20, warmup=3)
        print(op, c.name, f"{t.median_us:.1f} us [{t.mode}]", f"max err {max(v.errors.values(), default=0):.2e}")
        assert t.median_us > 0
    assert not bad, bad
