"""novatune's CUDA C++ kernels (PyBind11), compiled on first use with torch.utils.cpp_extension and cached on disk.

    from novatune.kernels import cuda as nt_cuda
    why = nt_cuda.unavailable_reason()        # None when a build can be attempted, else why not (no nvcc, ...)
    ext = nt_cuda.load()                      # builds once per (sources, versions, arch); raises CudaBuildError
    y, rstd = ext.rms_norm_fwd(x, w, 1e-6, items=1, unroll=2)

Sources: rms_norm.cu, swiglu.cu (kernels + plain-C++ launchers, no torch headers: nvcc compiles them in seconds),
bindings.cpp (the one torch-facing file). Flags: -O3, `-gencode=arch=compute_90,code=sm_90` plus the current GPU's
own capability (cpp_extension then adds no arch flags of its own), no fast-math (the kernels rely on IEEE div/sqrt).
Verified here only as far as a CPU-only machine allows (tests/tune/test_gpu_tune.py::test_cuda_sources_compile_for_sm90:
nvcc object files for sm_90 + a host syntax pass of bindings.cpp); the build itself runs on the GPU machine.

Cache: ~/.cache/novatune/cuda/<hash> (NOVATUNE_CUDA_CACHE overrides the root). The hash covers the sources, the
flags, torch's version and CUDA version, so a change to any of them builds afresh into a new folder; a second
process finds the built .so there and only imports it (cpp_extension's ninja build is a no-op).

Optional by design: nothing else in novatune needs this package; without nvcc/ninja/a CUDA torch, unavailable_reason()
says why and the tune engine skips these candidates with that reason.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = ("rms_norm.cu", "swiglu.cu", "bindings.cpp")
HEADERS = ("launchers.h", "common.cuh")
# no -std: cpp_extension picks the C++ standard torch's headers need (it differs between torch releases)
BASE_CUDA_FLAGS = ("-O3", "-gencode=arch=compute_90,code=sm_90")

_lock = threading.Lock()
_ext = None
_error: Exception | None = None
BUILD_INFO: dict = {}  # what the last load() did: build dir, seconds, cached or built; read by the tune report


class CudaBuildError(RuntimeError):
    """The extension could not be built or imported; the message says why (compiler output tail included)."""


def unavailable_reason() -> str | None:
    """Why the CUDA candidates cannot be built here (None when a build can be attempted)."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    if torch.version.cuda is None:
        return "torch is a CPU-only build"
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None and shutil.which("nvcc") is None:
        return "nvcc not found (set CUDA_HOME or put nvcc on PATH)"
    if not cpp_extension.is_ninja_available():
        return "ninja not found (pip install ninja)"
    return None


def cuda_flags() -> list[str]:
    import torch

    flags = list(BASE_CUDA_FLAGS)
    major, minor = torch.cuda.get_device_capability()
    own = f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"
    if own not in flags:
        flags.append(own)
    return flags


def build_dir(flags: list[str]) -> Path:
    import torch

    h = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        h.update(name.encode())
        h.update((HERE / name).read_bytes())
    h.update(" ".join(flags).encode())
    h.update(f"{torch.__version__}|{torch.version.cuda}".encode())
    root = Path(os.environ.get("NOVATUNE_CUDA_CACHE", Path.home() / ".cache" / "novatune" / "cuda"))
    return root / h.hexdigest()[:16]


def load(verbose: bool = False):
    """The compiled extension module (built on first use). Raises CudaBuildError with the reason on failure;
    a failure is remembered for the process (a second call raises the same error without rebuilding)."""
    global _ext, _error
    with _lock:
        if _ext is not None:
            return _ext
        if _error is not None:
            raise _error
        why = unavailable_reason()
        if why is not None:
            _error = CudaBuildError(f"novatune CUDA kernels unavailable: {why}")
            raise _error
        from torch.utils import cpp_extension

        flags = cuda_flags()
        bdir = build_dir(flags)
        bdir.mkdir(parents=True, exist_ok=True)
        name = f"novatune_cuda_{bdir.name}"
        cached = any(bdir.glob(f"{name}*.so"))
        t0 = time.perf_counter()
        try:
            _ext = cpp_extension.load(name=name, sources=[str(HERE / s) for s in SOURCES],
                                      extra_cflags=["-O3"], extra_cuda_cflags=flags,
                                      extra_include_paths=[str(HERE)], build_directory=str(bdir), verbose=verbose)
        except Exception as e:  # noqa: BLE001 - compiler/linker/import failure: keep the tail of the message
            text = str(e)
            _error = CudaBuildError(f"novatune CUDA kernels failed to build in {bdir}: "
                                    f"{type(e).__name__}: {text[-2000:]}")
            raise _error from e
        BUILD_INFO.update(build_dir=str(bdir), seconds=round(time.perf_counter() - t0, 1),
                          how="loaded from the disk cache" if cached else "compiled", flags=flags)
        return _ext


def load_in_background():
    """Start load() in a thread (the nvcc build overlaps other work); returns a concurrent.futures.Future."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="novatune-cuda-build")
    fut = pool.submit(load)
    pool.shutdown(wait=False)
    return fut
