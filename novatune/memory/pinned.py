"""Page-locked host buffers of the size asked for.

torch's pinned allocator (`torch.empty(..., pin_memory=True)`) rounds every block up to a power of two: a 2.73 GiB
layer input of a 358k-token row takes 4 GiB of page-locked memory, and 35 of them ask the host for 140 GiB instead of
96. Here the buffer is ordinary host memory registered with CUDA (`cudaHostRegister`): page-locked at its own size
(rounded to whole pages), so copies from and into it run asynchronously on a stream like any pinned tensor's
(torch's `is_pinned()` knows only its own allocator's blocks and says False; its non_blocking copies call
cudaMemcpyAsync either way). The
registration ends when the tensor returned here is garbage-collected: callers keep that tensor (not only views of
it) for as long as they use the memory, as the offload engine's pool and the weight streamer do.
"""
from __future__ import annotations

import ctypes
import mmap
import weakref

import torch

PAGE = mmap.PAGESIZE
HOST_REGISTER_MAPPED = 2  # cudaHostRegisterMapped


def cuda_runtime() -> ctypes.CDLL | None:
    """The CUDA runtime library this process has loaded (torch's), for the calls torch's binding lacks; None where
    none is loaded (no CUDA) or the process map cannot be read."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    except OSError:
        return None
    major = (torch.version.cuda or "").split(".")[0]
    # torch's own runtime first (another package may have loaded a runtime of another major version)
    for path in sorted(paths, key=lambda p: (f"libcudart.so.{major}" not in p, p)):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def clear_cuda_error() -> None:
    """Reset the runtime's last error after a failed call whose code was already handled here: torch's binding
    returns the code and leaves the error set, and torch's next check would raise it from an unrelated call."""
    lib = cuda_runtime()
    if lib is not None:
        lib.cudaGetLastError()


def page_rounded(nbytes: int) -> int:
    """Bytes a registered buffer of `nbytes` page-locks."""
    return -(-int(nbytes) // PAGE) * PAGE


def pinned_empty(shape, dtype: torch.dtype, mapped: bool = False) -> torch.Tensor:
    """An uninitialised host tensor in page-locked memory of its own size (module docstring). The registered range
    starts and ends on page boundaries, as cudaHostRegister asks. `mapped`: also mapped into the device's address
    space (cudaHostRegisterMapped), so kernels can read it through its address (memory/host_embedding.py)."""
    numel = 1
    for n in (shape if isinstance(shape, (tuple, list, torch.Size)) else (shape,)):
        numel *= int(n)
    nbytes = page_rounded(numel * torch.empty((), dtype=dtype).element_size())
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % PAGE
    t = raw[start:start + nbytes].view(dtype)[:numel].view(shape)
    cudart = torch.cuda.cudart()
    try:
        err = int(cudart.cudaHostRegister(t.data_ptr(), nbytes, HOST_REGISTER_MAPPED if mapped else 0))
    except RuntimeError as e:  # torch's binding raises on a CUDA error (torch.AcceleratorError)
        err, detail = -1, str(e).splitlines()[0]
    else:
        detail = f"CUDA error {err}"
    if err != 0:
        clear_cuda_error()
        raise RuntimeError(f"cudaHostRegister of {nbytes / 2**30:.2f} GiB failed ({detail}): the host could not "
                           f"page-lock the memory; lower the offloaded bytes (data.max_length, memory.policy) or "
                           f"free host memory")
    weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())
    return t
