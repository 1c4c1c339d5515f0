"""Host-side helpers for the launchers: integer arithmetic without Triton's wrappers, and a lean kernel launch.

Per-layer ops (RMSNorm, q/k-norm + RoPE, SwiGLU, RoPE) run thousands of times per optimizer step on small
enough work that the host time spent queueing them shows in wall time. Two costs dominate besides the launch
itself, and both are removed here:

* `triton.cdiv` / `triton.next_power_of_2` are `constexpr_function` objects (Triton 3.6-3.9): each host call
  goes through a wrapper that imports and unwraps its arguments (a few µs). `cdiv` and `next_pow2` below are plain
  integer functions with the same results.
* `JITFunction.__getitem__(grid)(*args)` re-derives, per launch, everything that picks the compiled kernel: it
  binds the arguments, specialises each one (dtype, 16-byte alignment, ints equal to 1 or divisible by 16),
  formats the options into the cache key, checks the kernel's globals and builds launch metadata, then calls the
  compiled kernel's launcher. `LeanKernel` keeps the JIT path as the reference and for the first launch of every
  key; afterwards it calls the compiled kernel's launcher directly with the same grid, stream, packed metadata and
  arguments (constexprs included, as Triton passes them), tensors as their device addresses (which spares the
  launcher a data_ptr() call and a driver query per pointer).

The lean key (`key_and_call_args`) is at least as fine as Triton's own specialisation of every argument, so two
calls with one lean key always get the kernel Triton would compile for them: tensors by dtype and 16-byte
alignment of the data pointer, ints by value, floats and bools by type (Triton does not specialise them). Any
other argument type, a tensor off the GPU, a callable grid, a registered launch hook (e.g. a profiler's), or an
unverified Triton version takes the JIT path. Triton's environment knobs (TRITON_DEBUG, instrumentation) are read
at the first launch of each key: changing them mid-process needs `reset()`.

`NOVATUNE_LEAN_LAUNCH=0` makes every launch take the JIT path (an A/B switch for measurements); it is read once,
`reset()` reads it again and drops the cached kernels. On the CPU interpreter (TRITON_INTERPRET=1) the kernels are
interpreted functions and always take Triton's own path.
"""
from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable
from typing import Any

import torch
import triton

log = logging.getLogger(__name__)

# Triton versions whose launch convention was read and matched: launcher(grid_x, grid_y, grid_z, stream, function,
# packed_metadata, launch_metadata, enter_hook, exit_hook, *all bound arguments), hooks as HookChain objects.
_VERIFIED = ((3, 6), (3, 9))
_CACHE_MAX = 1024


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, as triton.cdiv."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of 2 >= n (n >= 1), as triton.next_power_of_2; 0 for n <= 0 as Triton returns for 0."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


CACHE_MAX = 4096  # launch-setting caches are keyed by shape: the cap only bounds growth (every sequence length)


def remember(cache: dict, key: tuple, value):
    """cache[key] = value, clearing the cache first when it holds CACHE_MAX entries; returns value."""
    if len(cache) >= CACHE_MAX:
        cache.clear()
    cache[key] = value
    return value


def empty_f32(shape: tuple, device: torch.device) -> torch.Tensor:
    """torch.empty(shape, float32) from a tuple of ints: passing the ints one by one skips the symbolic-size parsing
    a torch.Size goes through (~1 µs against ~3.5 µs on the CPU)."""
    return torch.empty(*shape, dtype=torch.float32, device=device) if len(shape) else \
        torch.empty((), dtype=torch.float32, device=device)


def key_and_call_args(args: tuple, cuda_only: bool = True) -> tuple[tuple, list]:
    """(key, call arguments) of a launch. The key is at least as fine as Triton's specialisation of each argument:
    a tensor by dtype and 16-byte alignment of its data pointer, an int by its value (Triton looks at "equal to 1",
    "divisible by 16" and the i32 / i64 / u64 range, all functions of the value), a float or a bool by its type
    (fp32 and u1, never specialised), None as itself. In the call arguments a tensor is its data pointer: Triton's
    launcher takes an int as the device address as it is, where for a tensor it calls data_ptr() and asks the
    driver to translate it (cuPointerGetAttribute, per pointer per launch), which for CUDA device memory gives the
    same address. Raises TypeError for anything else, or (cuda_only) a tensor not on a CUDA device: the call then
    takes the JIT path, which raises Triton's own error for it."""
    key, call = [], []
    for a in args:
        t = type(a)
        if t is int:
            key.append(a)
            call.append(a)
        elif t is float or t is bool:  # by type: 0 == False and 1 == True as dict keys
            key.append(t)
            call.append(a)
        elif isinstance(a, torch.Tensor):
            if cuda_only and not a.is_cuda:
                raise TypeError("a tensor not on a CUDA device")
            ptr = a.data_ptr()
            key.append(a.dtype)
            key.append(ptr & 15 == 0)
            call.append(ptr)
        elif a is None:
            key.append(None)
            call.append(None)
        else:
            raise TypeError(t.__name__)
    return tuple(key), call


def args_key(args: tuple) -> tuple:
    """The key part of key_and_call_args (any device)."""
    return key_and_call_args(args, cuda_only=False)[0]


def _unbound(*args):
    raise RuntimeError("novatune.kernels.launch: the driver is not bound yet")


def _triton_version() -> tuple[int, int]:
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


class _State:
    """Process-wide switches, read once (reset() reads them again)."""

    def __init__(self) -> None:
        self.enabled = os.environ.get("NOVATUNE_LEAN_LAUNCH", "1") != "0"
        self.reason = "" if self.enabled else "NOVATUNE_LEAN_LAUNCH=0"
        if self.enabled and _triton_version() not in _VERIFIED:
            self.enabled = False
            self.reason = (f"triton {triton.__version__}: its launch convention is not one verified for the lean "
                           f"launch ({', '.join(f'{a}.{b}' for a, b in _VERIFIED)})")
            log.warning("novatune: kernels launch through Triton's JIT path: %s", self.reason)
        self.cuda_only = True  # tensors must be CUDA tensors (their pointers are passed as device addresses)
        # triton.knobs.runtime and the driver's current device / stream, bound at the first lean launch
        self.runtime: Any = None
        self.get_device: Callable[[], int] = _unbound
        self.get_stream: Callable[[int], int] = _unbound


_STATE = _State()
_KERNELS: weakref.WeakSet[LeanKernel] = weakref.WeakSet()


def reset(enabled: bool | None = None) -> None:
    """Re-read NOVATUNE_LEAN_LAUNCH (or force `enabled`) and drop every cached compiled kernel."""
    global _STATE
    _STATE = _State()
    if enabled is not None:
        _STATE.enabled = enabled and _triton_version() in _VERIFIED
        _STATE.reason = "" if _STATE.enabled else "disabled by reset()"
    for k in _KERNELS:
        k.cache.clear()


def lean_enabled() -> tuple[bool, str]:
    """(whether CUDA launches take the lean path, why not)."""
    return _STATE.enabled, _STATE.reason


def _bind_runtime(state: _State) -> None:
    from triton import knobs
    from triton.runtime.driver import driver

    active = driver.active
    state.get_device, state.get_stream = active.get_current_device, active.get_current_stream
    state.runtime = knobs.runtime


def _hooks_active(runtime) -> bool:
    """A launch hook (e.g. a profiler's) or a compile-pipeline hook is set: those need Triton's own path. The
    verified versions hold launch hooks in HookChain objects (`.calls`); anything else counts as set."""
    enter, exit_ = runtime.launch_enter_hook, runtime.launch_exit_hook
    return bool(getattr(enter, "calls", True) or getattr(exit_, "calls", True)
                or getattr(runtime, "add_stages_inspection_hook", None) is not None)


class LeanKernel:
    """`LeanKernel(jit_fn)[grid](*args, **meta)` launches like `jit_fn[grid](*args, **meta)` (same kernel, same
    arguments, same stream), with the per-launch host work done once per key on CUDA."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.cache: dict = {}
        self.lean_ok = self._eligible(fn)
        _KERNELS.add(self)

    @staticmethod
    def _eligible(fn) -> bool:
        from triton.runtime.jit import JITFunction

        # the interpreter's functions keep Triton's path
        return type(fn) is JITFunction

    def warmup(self, *args, **kwargs):
        return self.fn.warmup(*args, **kwargs)

    def __getitem__(self, grid):
        return lambda *args, **meta: self.run(grid, args, meta)

    def run(self, grid, args: tuple, meta: dict) -> None:
        state = _STATE
        if not (self.lean_ok and state.enabled) or type(grid) is not tuple:
            self.fn[grid](*args, **meta)
            return
        if state.runtime is None:
            _bind_runtime(state)
        if _hooks_active(state.runtime) or self.fn.pre_run_hooks:
            self.fn[grid](*args, **meta)
            return
        device = state.get_device()
        try:
            args_k, call = key_and_call_args(args, state.cuda_only)
            # meta values with their types: Triton keys constexprs by str(value), so 0 and False differ there
            key = (device, args_k, tuple(meta.items()), tuple(map(type, meta.values())))
            entry = self.cache.get(key)
        except TypeError:  # an argument Triton may specialise otherwise, or an unhashable meta value
            self.fn[grid](*args, **meta)
            return
        if entry is None:
            self._first_launch(key, grid, args, meta)
            return
        launcher, function, packed, tail = entry
        gx = grid[0]
        gy = grid[1] if len(grid) > 1 else 1
        gz = grid[2] if len(grid) > 2 else 1
        launcher(gx, gy, gz, state.get_stream(device), function, packed, None, None, None, *call, *tail)

    def _first_launch(self, key, grid, args: tuple, meta: dict) -> None:
        """Launch through the JIT path (it compiles if needed) and keep what the next launches need."""
        from triton.compiler import CompiledKernel

        kernel = self.fn.run(*args, grid=grid, warmup=False, **meta)
        if not isinstance(kernel, CompiledKernel) or kernel.function is None:
            return  # e.g. a compile hook took over: keep the JIT path for this key
        params = self.fn.params[len(args):]
        tail = tuple(meta[p.name] if p.name in meta else p.default for p in params)
        if len(self.cache) >= _CACHE_MAX:  # ints are keyed by value: bound the growth (e.g. every row count)
            self.cache.clear()
        self.cache[key] = (kernel.run, kernel.function, kernel.packed_metadata, tail)


def lean(fn) -> LeanKernel:
    """Wrap a @triton.jit kernel for lean launches (see LeanKernel)."""
    return LeanKernel(fn)
