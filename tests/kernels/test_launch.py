"""The host-side launch helpers (novatune/kernels/launch.py): integer helpers equal to Triton's, a lean key at least
as fine as Triton's specialisation, the lean launch's bookkeeping (on a stand-in kernel, CPU), and on the GPU the
lean launch bit-identical to the JIT launch for every op that uses it, aligned and misaligned."""
from __future__ import annotations

import importlib
import itertools
import logging
from types import SimpleNamespace

import pytest
import torch
import triton

from novatune.kernels import launch as L

native = pytest.importorskip("triton._C.libtriton").native_specialize_impl


@pytest.fixture(autouse=True)
def _fresh_state():
    L.reset()
    yield
    L.reset()


def test_cdiv_and_next_pow2_equal_tritons():
    for a in itertools.chain(range(0, 300), (2**20 - 1, 2**20, 2**20 + 1, 2**31 + 5, 10**12)):
        assert L.next_pow2(a) == triton.next_power_of_2(a), a
        for b in (1, 2, 3, 7, 16, 128, 1000):
            assert L.cdiv(a, b) == triton.cdiv(a, b), (a, b)


def _spec(a):
    from triton.backends.nvidia.compiler import CUDABackend

    return native(CUDABackend, a, False, True, True)


def _kernel_args():
    buf = {dt: torch.empty(64, dtype=dt) for dt in (torch.bfloat16, torch.float16, torch.float32, torch.int64)}
    tensors = [b[o:] for b in buf.values() for o in (0, 1, 2, 4, 8)]  # aligned and misaligned pointers
    tensors.append(torch.nn.Parameter(torch.empty(8)))
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, 2**31 - 16, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**32,
            2**63 - 1, 2**63, 2**64 - 16]
    return tensors + ints + [1e-6, 1.0, 0.0, True, False, None]


def test_lean_key_is_at_least_as_fine_as_tritons_specialisation():
    """Two arguments with one lean key must get one Triton specialisation (else a cached kernel could be reused
    where Triton would compile another); checked over tensors at every alignment, ints around every boundary
    Triton looks at, floats, bools and None."""
    args = _kernel_args()
    for a, b in itertools.product(args, args):
        if L.args_key((a,)) == L.args_key((b,)):
            assert _spec(a) == _spec(b), (a, b)
    # a misaligned pointer and an aligned one never share a key
    x = torch.empty(16, dtype=torch.bfloat16)
    assert L.args_key((x,)) != L.args_key((x[1:],))


def test_unknown_argument_types_are_refused():
    for bad in ((1, 2), torch.float32, "s", 1 + 2j):
        with pytest.raises(TypeError):
            L.args_key((bad,))


class _StandIn:
    """A JIT function's surface that LeanKernel uses: params, pre_run_hooks, run(...) and fn[grid](...)."""

    def __init__(self, names_defaults):
        self.params = [SimpleNamespace(name=n, default=d) for n, d in names_defaults]
        self.pre_run_hooks = []
        self.jit_calls = []
        self.kernel = SimpleNamespace(function=object(), packed_metadata=(4, 1, 0), launches=[])
        self.kernel.run = lambda *a: self.kernel.launches.append(a)

    def run(self, *args, grid, warmup, **meta):
        self.jit_calls.append((grid, args, meta))
        return self.kernel

    def __getitem__(self, grid):
        return lambda *args, **meta: self.run(*args, grid=grid, warmup=False, **meta)


@pytest.fixture
def stand_in(monkeypatch):
    """A LeanKernel around a stand-in, as on CUDA: lean path on, device 3, stream 77, no hooks."""
    import triton.compiler

    fn = _StandIn([("X", None), ("n", None), ("eps", None), ("BLOCK", None), ("EVEN", True)])
    monkeypatch.setattr(triton.compiler, "CompiledKernel", SimpleNamespace)
    lk = L.LeanKernel(fn)
    lk.lean_ok = True
    monkeypatch.setattr(L._STATE, "enabled", True)
    monkeypatch.setattr(L._STATE, "cuda_only", False)  # CPU tensors stand in for CUDA ones
    runtime = SimpleNamespace(launch_enter_hook=SimpleNamespace(calls=[]), launch_exit_hook=SimpleNamespace(calls=[]))
    monkeypatch.setattr(L._STATE, "runtime", runtime)
    monkeypatch.setattr(L._STATE, "get_device", lambda: 3)
    monkeypatch.setattr(L._STATE, "get_stream", lambda device: 77 if device == 3 else None)
    return lk, fn, runtime


def test_lean_launch_passes_what_the_jit_path_would(stand_in):
    """The first launch of a key goes through the JIT path; the next ones call the compiled kernel's launcher with
    the grid, the stream, the packed metadata, no launch metadata or hooks, then every bound argument in order
    (constexprs from the call, then defaults), as Triton's JITFunction.run does, tensors as their addresses."""
    lk, fn, _ = stand_in
    x = torch.empty(32, dtype=torch.bfloat16)
    lk[(5,)](x, 17, 1e-6, BLOCK=64, num_warps=4)
    assert len(fn.jit_calls) == 1 and fn.kernel.launches == []
    lk[(5, 2)](x, 17, 1e-6, BLOCK=64, num_warps=4)
    assert len(fn.jit_calls) == 1
    assert fn.kernel.launches == [(5, 2, 1, 77, fn.kernel.function, (4, 1, 0), None, None, None, x.data_ptr(), 17,
                                   1e-6, 64, True)]
    # anything Triton may specialise differently is a new key: the JIT path again
    lk[(5,)](x[1:], 17, 1e-6, BLOCK=64, num_warps=4)   # misaligned pointer
    lk[(5,)](x, 16, 1e-6, BLOCK=64, num_warps=4)       # another int
    lk[(5,)](x, 17, 1e-6, BLOCK=64, num_warps=8)       # another option
    lk[(5,)](x.float(), 17, 1e-6, BLOCK=64, num_warps=4)  # another dtype
    assert len(fn.jit_calls) == 5 and len(fn.kernel.launches) == 1
    lk[(5,)](x, 17, 1e-6, BLOCK=64, EVEN=False)
    lk[(5,)](x, 17, 1e-6, BLOCK=64, EVEN=False)
    assert fn.kernel.launches[-1][-2:] == (64, False)
    lk[(5,)](x, 17, 1e-6, BLOCK=64, EVEN=0)  # equal to False, but Triton compiles another kernel for it
    assert len(fn.jit_calls) == 7 and len(fn.kernel.launches) == 2


def test_hooks_switches_and_odd_calls_take_the_jit_path(stand_in, monkeypatch):
    lk, fn, runtime = stand_in
    x = torch.empty(32)
    lk[(1,)](x, 3, 0.5, BLOCK=8)
    lk[(1,)](x, 3, 0.5, BLOCK=8)
    assert (len(fn.jit_calls), len(fn.kernel.launches)) == (1, 1)
    runtime.launch_enter_hook.calls.append(print)   # a profiler's launch hook sees every launch
    lk[(1,)](x, 3, 0.5, BLOCK=8)
    runtime.launch_enter_hook.calls.clear()
    fn.pre_run_hooks.append(lambda *a, **k: None)
    lk[(1,)](x, 3, 0.5, BLOCK=8)
    fn.pre_run_hooks.clear()
    lk[lambda meta: (1,)](x, 3, 0.5, BLOCK=8)    # a callable grid
    lk[(1,)]((x, x), 3, 0.5, BLOCK=8)            # a tuple argument
    monkeypatch.setattr(L._STATE, "cuda_only", True)
    lk[(1,)](x, 3, 0.5, BLOCK=8)                 # a tensor off the GPU: Triton's path raises its own error
    monkeypatch.setattr(L._STATE, "cuda_only", False)
    monkeypatch.setattr(L._STATE, "enabled", False)
    lk[(1,)](x, 3, 0.5, BLOCK=8)
    assert (len(fn.jit_calls), len(fn.kernel.launches)) == (7, 1)


def test_switch_and_unverified_triton(monkeypatch, caplog):
    monkeypatch.setenv("NOVATUNE_LEAN_LAUNCH", "0")
    L.reset()
    assert L.lean_enabled() == (False, "NOVATUNE_LEAN_LAUNCH=0")
    monkeypatch.delenv("NOVATUNE_LEAN_LAUNCH")
    L.reset()
    assert L.lean_enabled()[0] is (L._triton_version() in L._VERIFIED)
    monkeypatch.setattr(triton, "__version__", "3.7.1")
    with caplog.at_level(logging.WARNING, logger=L.__name__):
        L.reset()
    enabled, why = L.lean_enabled()
    assert not enabled and "triton 3.7.1" in why and "triton 3.7.1" in caplog.text


def test_interpreted_kernels_keep_tritons_path():
    from novatune.kernels import rms_norm
    from novatune.ops._backend import interpreter_on

    if not interpreter_on():
        pytest.skip("kernels are compiled here")

    assert not rms_norm._FWD.lean_ok and not rms_norm._BWD.lean_ok


# ----------------------------------------------------------------------------------------------- vs Triton's JIT
class _Recorder:
    """Stands in for a launcher module's LeanKernel: records (grid, args, meta) of each launch."""

    def __init__(self, lean_kernel):
        self.lean = lean_kernel
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **meta: self.calls.append((grid, args, meta))


def _recorded_launches(monkeypatch) -> list:
    """(kernel, grid, args, meta) of every launch the per-layer ops make, recorded from their real launchers on the
    CPU: odd shapes, a misaligned input, a view of a fused projection, broadcast tables, overrides."""
    from novatune.kernels import nf4 as kn
    from novatune.kernels import qk_norm_rope as kq
    from novatune.kernels import rms_norm as kr
    from novatune.kernels import rope as kro
    from novatune.kernels import swiglu as ks

    recorders = []
    for mod, names in ((kr, ("_FWD", "_BWD", "_SUM")), (kq, ("_FWD", "_BWD", "_SUM")), (ks, ("_FWD", "_BWD")),
                       (kro, ("_ROPE",)), (kn, ("_PAIRS", "_ELEMS", "_EMBED"))):
        for name in names:
            rec = _Recorder(getattr(mod, name))
            monkeypatch.setattr(mod, name, rec)
            recorders.append(rec)
    gen = torch.Generator().manual_seed(0)
    bf = torch.bfloat16

    def rnd(*shape, dtype=bf):
        return torch.randn(*shape, generator=gen).to(dtype)

    x, w = rnd(3, 37, 96), rnd(96)
    xm = rnd(3 * 37 * 96 + 1)[1:].view(3, 37, 96)  # misaligned
    for xi, wi in ((x, w), (xm, w.float())):
        y, r = kr.rms_norm_fwd(xi, wi, 1e-6)
        kr.rms_norm_bwd(rnd(3, 37, 96), xi, wi, r)
    kr.rms_norm_bwd(rnd(3, 37, 96), x, w, r, block_m=4, num_programs=3, stages=0)
    qkv = rnd(2, 5, 8 * 32)
    q, k = qkv[..., :4 * 32].view(2, 5, 4, 32), qkv[..., 4 * 32:6 * 32].view(2, 5, 2, 32)
    wq, wk, cos, sin = rnd(32), rnd(32), rnd(1, 5, 32), rnd(1, 5, 32)
    qo, ko, rq, rk = kq.qk_norm_rope_fwd(q, k, wq, wk, 1e-6, cos, sin)
    kq.qk_norm_rope_bwd(rnd(2, 5, 4, 32), rnd(2, 5, 2, 32), q, k, wq, wk, rq, rk, cos, sin)
    kq.qk_norm_rope_bwd(qo, ko, q, k, wq, wk, rq, rk, rnd(5, 32), rnd(5, 32), rows=4, stages=1)
    g, u = rnd(7, 33), rnd(7, 33)
    ks.swiglu_fwd(g, u)
    ks.swiglu_bwd(rnd(7, 33), g, u)
    qh, kh = rnd(2, 4, 5, 16), rnd(2, 2, 5, 16)
    kro.rope_fwd(qh, kh, rnd(2, 5, 16), rnd(2, 5, 16))
    kro.rope_bwd(qh, kh, rnd(1, 5, 16), rnd(1, 5, 16))
    for nested in (True, False):  # QLoRA's frozen weights: whole pairs, an odd-offset output, an embedding gather
        t = kn.nf4_quantize_ref(rnd(6, 64), double_quant=nested)
        kn.nf4_dequantize(t)
        kn.nf4_dequantize(t, out=torch.empty(6 * 64 + 1, dtype=bf)[1:])
        kn.nf4_embedding(t, torch.tensor([[0, 5, 2]]))
    return [(rec.lean.fn, *call) for rec in recorders for call in rec.calls]


def test_lean_launch_calls_the_launcher_as_tritons_jit_path_does(monkeypatch):
    """For every launch the per-layer ops make, a compiled-mode JITFunction of the same kernel source is launched
    through Triton's JIT path and through LeanKernel (first launch through the JIT, second from the cache), with
    compilation replaced by a stand-in kernel that records its launcher's arguments: the lean launch passes the
    same grid, stream, function, packed metadata and arguments (launch metadata and hooks None: no hook is set;
    tensors as their data pointers, which Triton's launcher takes as device addresses)."""
    from triton.compiler import CompiledKernel
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    from novatune.kernels.launch import _VERIFIED, _triton_version

    if _triton_version() not in _VERIFIED:
        pytest.skip(f"triton {triton.__version__}: the lean launch is off")
    from triton.backends.compiler import GPUTarget

    launches = []

    class Compiled(CompiledKernel):
        def __init__(self):  # noqa: D107 - no binary: nothing to load
            self.function, self.packed_metadata, self.module = "function", (4, 1, 0), None

        @property
        def run(self):
            return lambda *a: launches.append(a)

        def launch_metadata(self, grid, stream, *args):
            return None

        def __del__(self):
            pass

    monkeypatch.setattr(driver, "_active", SimpleNamespace(
        get_current_device=lambda: 0, get_current_stream=lambda device: 1234,
        get_current_target=lambda: GPUTarget("cuda", 90, 32)))
    recorded = _recorded_launches(monkeypatch)
    assert len(recorded) == 23
    for kernel, grid, args, meta in recorded:
        jit = JITFunction(getattr(kernel, "fn", kernel))  # the source under the interpreter's wrapper

        def compile_stub(key, signature, device, constexprs, options, attrs, warmup, jit=jit):
            jit.device_caches[device][0][key] = compiled = Compiled()
            return compiled

        jit._do_compile = compile_stub
        launches.clear()
        jit[grid](*args, **meta)
        L.reset(enabled=True)
        L._STATE.cuda_only = False  # CPU tensors stand in for CUDA ones
        lk = L.LeanKernel(jit)
        lk[grid](*args, **meta)
        lk[grid](*args, **meta)
        assert len(launches) == 3 and lk.cache, kernel
        want, got = launches[0], launches[2]
        assert len(got) == len(want) and got[:6] == want[:6] and got[6:9] == (None, None, None), kernel
        for a, b in zip(got[9:], want[9:]):  # tensors as their addresses
            assert (a == b.data_ptr() if isinstance(b, torch.Tensor) else a is b), kernel


# ----------------------------------------------------------------------------------------------- GPU
def _ops_calls(dtype, offset):
    """(name, fn() -> tensors) for each op on the lean launch, its inputs starting `offset` elements into a buffer
    (offset 1: misaligned pointers), odd shapes."""
    ops = importlib.import_module("novatune.ops")
    qkr = importlib.import_module("novatune.ops.qk_norm_rope")
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)

    def leaf(*shape):
        n = 1
        for s in shape:
            n *= s
        buf = torch.randn(n + offset, device=dev, dtype=dtype, generator=gen)
        return buf[offset:].view(shape).requires_grad_(True)

    x, w = leaf(3, 37, 200), leaf(200)
    g, u = leaf(5, 333), leaf(5, 333)
    q, k, qw, kw = leaf(2, 7, 6, 64), leaf(2, 7, 2, 64), leaf(64), leaf(64)
    cos, sin = leaf(1, 7, 64).detach(), leaf(1, 7, 64).detach()
    qh, kh = leaf(2, 6, 7, 64), leaf(2, 2, 7, 64)

    def run(fn, *inputs):
        outs = fn()
        outs = outs if isinstance(outs, tuple) else (outs,)
        g_dy = torch.Generator(device=dev).manual_seed(1)  # the same output gradients on every call
        dys = [torch.randn(o.shape, device=dev, dtype=o.dtype, generator=g_dy) for o in outs]
        return [o.detach() for o in outs] + list(torch.autograd.grad(outs, inputs, dys))

    kn = importlib.import_module("novatune.kernels.nf4")
    t = kn.nf4_quantize_ref(torch.randn(6, 192, generator=torch.Generator().manual_seed(0)).to(dtype))
    t = kn.NF4Tensor(**{k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in t.__dict__.items()})
    ids = torch.tensor([[0, 5, 2], [1, 1, 4]], device=dev)

    def dequant():
        out = torch.empty(6 * 192 + offset, device=dev, dtype=dtype)[offset:]
        return [kn.nf4_dequantize(t, out=out), kn.nf4_embedding(t, ids)]

    return [("nf4", dequant),
            ("rms_norm", lambda: run(lambda: ops.rms_norm(x, w, 1e-6), x, w)),
            ("swiglu", lambda: run(lambda: ops.swiglu(g, u), g, u)),
            ("qk_norm_rope", lambda: run(lambda: qkr.qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin), q, k, qw, kw)),
            ("rope", lambda: run(lambda: ops.apply_rope(qh, kh, cos, sin), qh, kh))]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_lean_launch_bit_identical_to_jit_launch(dtype):
    """Every op on the lean launch gives the JIT launch's outputs and gradients bit for bit: aligned inputs, then
    misaligned ones (offset by one element) with the aligned ones' kernels already cached, each twice (the first
    launch of a key goes through the JIT path, the second comes from the cache)."""
    if not L.lean_enabled()[0]:
        pytest.skip(f"lean launch off here: {L.lean_enabled()[1]}")
    L.reset(enabled=False)
    want = {(offset, name): call() for offset in (0, 1) for name, call in _ops_calls(dtype, offset)}
    L.reset(enabled=True)
    for _ in range(2):
        for offset in (0, 1):
            for name, call in _ops_calls(dtype, offset):
                got = call()
                assert len(got) == len(want[offset, name]), name
                for i, (a, b) in enumerate(zip(want[offset, name], got)):
                    assert a.dtype == b.dtype and a.shape == b.shape, (name, offset, i)
                    assert torch.equal(_bits(a), _bits(b)), (name, offset, i)
    from novatune.kernels import rms_norm

    assert len(rms_norm._FWD.cache) >= 2  # an aligned and a misaligned x: two keys, two kernels


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])
