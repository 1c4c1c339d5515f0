"""The device rule's environment switches are read once (use_triton runs on every op call); reset() reads them
again. (tests/conftest.py makes a test that sets them see them at once.)"""
from types import SimpleNamespace

import pytest
import torch

from novatune.ops import _backend


class _NoReads:
    def get(self, *args):
        raise AssertionError("environment read")


def test_use_triton_reads_no_environment_and_reset_does(monkeypatch):
    x = torch.empty(2)
    want = _backend.use_triton(x)
    monkeypatch.setattr(_backend, "os", SimpleNamespace(environ=_NoReads()))
    for _ in range(3):
        assert _backend.use_triton(x) == want
    assert _backend.interpreter_on() in (True, False)
    with pytest.raises(AssertionError, match="environment read"):
        _backend.reset()


def test_setting_the_switch_in_a_test_takes_effect(monkeypatch, reference_backend):
    x = torch.empty(2)
    monkeypatch.setenv("NOVATUNE_BACKEND", "reference")
    assert not _backend.use_triton(x)
    monkeypatch.delenv("NOVATUNE_BACKEND")
    assert _backend.use_triton(x) == _backend.interpreter_on()
    reference_backend()
    assert not _backend.use_triton(x)
