"""Test set-up: without a GPU, Triton kernels run in the interpreter (TRITON_INTERPRET=1 must be set before
triton compiles anything, so it is set here, before the test modules import novatune.kernels)."""
import os
import shutil

if shutil.which("nvidia-smi") is None and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"
# Triton chooses compiled kernels or the interpreter when each @triton.jit function is defined (at the import of
# the kernel modules): what the process started with holds
INTERPRETER_AT_START = os.environ.get("TRITON_INTERPRET", "0") == "1"
# novatune.patch reads the tune cache by default: the tests never read (or write) the user's own choices
if "NOVATUNE_TUNE_CACHE" not in os.environ:
    import tempfile

    os.environ["NOVATUNE_TUNE_CACHE"] = os.path.join(tempfile.mkdtemp(prefix="novatune-test-cache-"), "tune.json")

import pytest  # noqa: E402
import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
# pytest-xdist workers share the machine's cores: one intra-op thread pool per worker sized to its share, so that
# two workers on two cores do not run four busy threads
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_collection_modifyitems(config, items):
    # a test that takes the `device` fixture runs its kernels on CUDA where there is one (compiled Triton, not the
    # interpreter): the GPU suite selects them with `-m "gpu or on_device"` (scripts/gpu_check.sh tests)
    on_device = pytest.mark.on_device
    for item in items:
        if "device" in getattr(item, "fixturenames", ()):
            item.add_marker(on_device)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_check.sh on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    """The device kernel tests run on: CUDA when present, else the CPU through the Triton interpreter."""
    return "cuda" if HAS_CUDA else "cpu"


_BACKEND_ENV = ("NOVATUNE_BACKEND", "TRITON_INTERPRET")


@pytest.fixture(autouse=True, scope="session")
def _backend_env_read_again():
    """novatune.ops._backend reads NOVATUNE_BACKEND / TRITON_INTERPRET once. For the whole test session, setting or
    deleting either (monkeypatch.setenv and its undo, os.environ[...]) makes it read them again, so a test that sets
    them sees them at once; `reference_backend` / `backend_env` say it explicitly."""
    from novatune.ops import _backend

    environ = type(os.environ)
    real_set, real_del = environ.__setitem__, environ.__delitem__

    def setitem(self, key, value):
        real_set(self, key, value)
        if key in _BACKEND_ENV:
            _backend.reset()

    def delitem(self, key):
        real_del(self, key)
        if key in _BACKEND_ENV:
            _backend.reset()

    environ.__setitem__, environ.__delitem__ = setitem, delitem
    yield
    environ.__setitem__, environ.__delitem__ = real_set, real_del
    _backend.reset()


@pytest.fixture
def backend_env(monkeypatch):
    """A function that sets NOVATUNE_BACKEND or TRITON_INTERPRET for the rest of the test (undone at its end) and
    makes the device rule read it. Asking for the interpreter skips the test where the process did not start with it
    (a GPU machine): kernels launched on CPU tensors there would be compiled CUDA kernels."""
    from novatune.ops import _backend

    def set_env(name: str, value: str) -> None:
        if name == "TRITON_INTERPRET" and value == "1" and not INTERPRETER_AT_START:
            pytest.skip("needs the Triton interpreter, which is set before triton loads (machines without a GPU, CI)")
        monkeypatch.setenv(name, value)
        _backend.reset()

    return set_env


@pytest.fixture
def reference_backend(backend_env):
    """A function that sets NOVATUNE_BACKEND=reference for the rest of the test (undone at its end)."""
    return lambda: backend_env("NOVATUNE_BACKEND", "reference")
