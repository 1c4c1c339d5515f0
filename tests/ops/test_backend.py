"""The device rule's environment switches are read once (use_triton runs on every op call); reset() reads them
again."""
import torch

from novatune.ops import _backend


def test_environment_is_read_once_and_reset_reads_it_again(monkeypatch):
    x = torch.empty(2)
    monkeypatch.delenv("NOVATUNE_BACKEND", raising=False)
    _backend.reset()
    before = _backend.use_triton(x)
    monkeypatch.setenv("NOVATUNE_BACKEND", "reference")
    assert _backend.use_triton(x) == before  # no environment read per call
    _backend.reset()
    assert _backend.use_triton(x) is False
    monkeypatch.delenv("NOVATUNE_BACKEND")
    _backend.reset()
    assert _backend.use_triton(x) == before


def test_reference_backend_fixture_forces_the_references(reference_backend):
    reference_backend()
    assert not _backend.use_triton(torch.empty(2))
