"""Every tune test gets its own cache file and leaves no dispatch hook installed behind it."""
import pytest


@pytest.fixture(autouse=True)
def _isolated_tune_state(tmp_path, monkeypatch):
    from novatune.ops import _backend

    monkeypatch.setenv("NOVATUNE_TUNE_CACHE", str(tmp_path / "tune_cache.json"))
    prev = _backend.OVERRIDE
    yield
    _backend.OVERRIDE = prev
