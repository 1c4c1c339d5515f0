"""Page-locked host buffers of their own size (novatune/memory/pinned.py)."""
from __future__ import annotations

import ctypes
import gc

import pytest
import torch

from novatune.memory.pinned import PAGE, cuda_runtime, page_rounded, pinned_empty


def test_page_rounding():
    assert page_rounded(0) == 0 and page_rounded(1) == PAGE and page_rounded(PAGE) == PAGE
    assert page_rounded(int(2.73 * 2**30)) < int(2.73 * 2**30) + PAGE


class _PointerAttributes(ctypes.Structure):
    # cudaPointerAttributes begins with the memory type; newer CUDA releases append fields, so the runtime may
    # write more than the four fields of CUDA 11/12: room for them keeps its write inside this buffer
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int), ("devicePointer", ctypes.c_void_p),
                ("hostPointer", ctypes.c_void_p), ("room", ctypes.c_byte * 1024)]


def _registered(ptr: int) -> bool:
    """cudaPointerGetAttributes: type 1 (cudaMemoryTypeHost) for page-locked host memory, 0 for plain memory."""
    lib = cuda_runtime()
    assert lib is not None, "torch's CUDA runtime library is not in the process map"
    attrs = _PointerAttributes()
    assert lib.cudaPointerGetAttributes(ctypes.byref(attrs), ctypes.c_void_p(ptr)) == 0
    return attrs.type == 1


@pytest.mark.gpu
def test_gpu_registered_buffer_is_pinned_copies_asynchronously_and_unregisters():
    """The buffer's pages are registered with CUDA (the runtime's pointer attributes say page-locked host memory;
    torch's is_pinned() knows only its own allocator's blocks); a non_blocking round trip through it on a side
    stream returns the values; once the tensor is collected the registration is gone."""
    n = 3 * 2**20 + 7  # not a power of two
    plain = torch.empty(n, dtype=torch.float32)
    host = pinned_empty((n,), torch.float32)
    assert host.data_ptr() % PAGE == 0
    assert _registered(host.data_ptr()) and _registered(host.data_ptr() + 4 * (n - 1))
    assert not _registered(plain.data_ptr())  # the yardstick
    src = torch.randn(n, device="cuda")
    back = torch.full((n,), float("nan"), device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        host.copy_(src, non_blocking=True)
        back.copy_(host, non_blocking=True)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(back, src)
    ptr = host.data_ptr()
    del host
    gc.collect()
    assert not _registered(ptr)


@pytest.mark.gpu
def test_gpu_a_failed_registration_leaves_no_cuda_error_behind(monkeypatch):
    """torch's binding returns a failed registration's code and leaves the runtime's error set (seen on torch 2.11:
    a later, unrelated call raised "already mapped"): pinned_empty raises its own error and clears the runtime's."""
    host = pinned_empty((1000,), torch.float32)
    real = torch.cuda.cudart()

    class Again:  # registers the same pages again: cudaErrorHostMemoryAlreadyRegistered
        def cudaHostRegister(self, ptr, size, flags):
            return real.cudaHostRegister(host.data_ptr(), PAGE, 0)

        def cudaHostUnregister(self, ptr):
            return real.cudaHostUnregister(ptr)

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Again())
    with pytest.raises(RuntimeError, match="cudaHostRegister of .* failed"):
        pinned_empty((1000,), torch.float32)
    monkeypatch.undo()
    x = torch.ones(4, device="cuda") * 2  # a kernel launch checks the runtime's last error
    torch.cuda.synchronize()
    assert float(x.sum()) == 8.0


def test_a_registration_the_host_refuses_names_the_fix(monkeypatch):
    """torch's cudart binding raises on a CUDA error: the caller gets the size and what to lower, not the raw error."""
    class Refusing:
        def cudaHostRegister(self, ptr, size, flags):
            raise RuntimeError("CUDA error: out of memory\nmore")

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Refusing())
    with pytest.raises(RuntimeError, match=r"cudaHostRegister of 0\.00 GiB failed \(CUDA error: out of memory\).*"
                                           r"data\.max_length"):
        pinned_empty((1000,), torch.float32)
