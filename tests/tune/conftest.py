"""Every tune test gets its own cache file and leaves no dispatch table installed behind it."""
import pytest


@pytest.fixture(autouse=True)
def _isolated_tune_state(tmp_path, monkeypatch):
    from novatune.ops import dispatch

    monkeypatch.setenv("NOVATUNE_TUNE_CACHE", str(tmp_path / "tune_cache.json"))
    prev = dispatch.install(dispatch.ACTIVE)
    yield
    dispatch.install(prev)
