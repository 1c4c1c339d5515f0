"""Page-locked host buffers of their own size (novatune/memory/pinned.py)."""
from __future__ import annotations

import gc

import pytest
import torch

from novatune.memory.pinned import PAGE, page_rounded, pinned_empty


def test_page_rounding():
    assert page_rounded(0) == 0 and page_rounded(1) == PAGE and page_rounded(PAGE) == PAGE
    assert page_rounded(int(2.73 * 2**30)) < int(2.73 * 2**30) + PAGE


@pytest.mark.gpu
def test_gpu_registered_buffer_is_pinned_copies_asynchronously_and_unregisters():
    """The buffer's pages are registered with CUDA (registering them again is refused as already registered; torch's
    is_pinned() knows only its own allocator's blocks); a non_blocking round trip through it on a side stream
    returns the values; once the tensor is collected the registration is gone."""
    n = 3 * 2**20 + 7  # not a power of two
    host = pinned_empty((n,), torch.float32)
    cudart = torch.cuda.cudart()
    assert host.data_ptr() % PAGE == 0
    with pytest.raises(RuntimeError, match="already"):  # cudaErrorHostMemoryAlreadyRegistered
        cudart.cudaHostRegister(host.data_ptr(), PAGE, 0)
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
    probe = torch.empty(n, dtype=torch.float32)
    # the probe may or may not reuse the freed address; either way registering it must succeed (no leftover
    # registration overlapping it)
    assert int(cudart.cudaHostRegister(probe.data_ptr(), n * 4, 0)) == 0, ptr  # raises if still registered
    cudart.cudaHostUnregister(probe.data_ptr())


def test_a_registration_the_host_refuses_names_the_fix(monkeypatch):
    """torch's cudart binding raises on a CUDA error: the caller gets the size and what to lower, not the raw error."""
    class Refusing:
        def cudaHostRegister(self, ptr, size, flags):
            raise RuntimeError("CUDA error: out of memory\nmore")

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Refusing())
    with pytest.raises(RuntimeError, match=r"cudaHostRegister of 0\.00 GiB failed \(CUDA error: out of memory\).*"
                                           r"data\.max_length"):
        pinned_empty((1000,), torch.float32)
