"""SwiGLU activation: y = silu(gate) * up, elementwise, as two Triton kernels (one forward, one backward).

Math (all in fp32 inside the kernels, one rounding to the output dtype at the store):

    sig   = 1 / (1 + exp(-g))
    y     = g * sig * u
    dup   = dy * g * sig                                  (= dy * silu(g))
    dgate = dy * u * sig * (1 + g * (1 - sig))            (= dy * u * d silu/dg)
          = dy * u * (sig + g * sig * (1 - sig))          (the form the kernel evaluates: one multiply fewer)

The backward recomputes sig from g, so autograd saves gate and up (not y, not silu(g)): one activation less
per MLP than HF eager, which keeps gate, silu(gate) and up.

Why it is shaped like this: the op is pure streaming (forward moves 3 elements, backward 5, ~0.3 FLOP/byte), so
the only goal is HBM bandwidth. The tensors are treated as one flat 1-D array (shape does not matter, no
per-row programs and no padding of a row to a power of two as Liger does), each program handles BLOCK
contiguous elements (16-byte vector loads), and the mask is dropped entirely (EVEN) when BLOCK divides the
element count - true at every real MLP shape (4096 x 9728 = 9728 x 4096). Offsets are int32 unless the
tensor has 2^31 elements or more (I64), where they are promoted to int64.

Layout: the launchers call .contiguous() on their inputs (a no-op for the contiguous outputs of nn.Linear; a
copy for strided views) and always return contiguous outputs of the input's shape. Preallocated outputs
(out= / dgate= / dup=) must be contiguous, of the same shape and dtype.

The fp32 oracle (`swiglu_ref` / `swiglu_bwd_ref`) is in novatune.reference.swiglu.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from novatune.kernels.launch import cdiv, lean
from novatune.kernels.rms_norm import _round_to  # fp32 -> dtype with round-to-nearest-even, interpreter too

# Element counts at or above this use int64 offsets (int32 overflows at 2^31). Module-level so a test can lower it.
_I64_THRESHOLD = 2**31 - 1


@triton.jit
def _swiglu_fwd_kernel(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr, EVEN: tl.constexpr, I64: tl.constexpr,
                       SOFT_RNE: tl.constexpr):
    pid = tl.program_id(0)
    if I64:
        pid = pid.to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,) flat element indices
    if EVEN:
        g = tl.load(g_ptr + offs).to(tl.float32)
        u = tl.load(u_ptr + offs).to(tl.float32)
    else:
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = _round_to(g * tl.sigmoid(g) * u, y_ptr.dtype.element_ty, SOFT_RNE)  # the one rounding
    if EVEN:
        tl.store(y_ptr + offs, y)
    else:
        tl.store(y_ptr + offs, y, mask=mask)


@triton.jit
def _swiglu_bwd_kernel(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n,
                       BLOCK: tl.constexpr, EVEN: tl.constexpr, I64: tl.constexpr, SOFT_RNE: tl.constexpr):
    pid = tl.program_id(0)
    if I64:
        pid = pid.to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,) flat element indices
    if EVEN:
        dy = tl.load(dy_ptr + offs).to(tl.float32)
        g = tl.load(g_ptr + offs).to(tl.float32)
        u = tl.load(u_ptr + offs).to(tl.float32)
    else:
        mask = offs < n
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)  # recomputed: cheaper than reading a saved tensor
    silu = g * sig
    du = _round_to(dy * silu, du_ptr.dtype.element_ty, SOFT_RNE)
    dg = _round_to(dy * u * (sig + silu * (1.0 - sig)), dg_ptr.dtype.element_ty, SOFT_RNE)
    if EVEN:
        tl.store(du_ptr + offs, du)
        tl.store(dg_ptr + offs, dg)
    else:
        tl.store(du_ptr + offs, du, mask=mask)
        tl.store(dg_ptr + offs, dg, mask=mask)


# on CUDA the compiled kernel is called directly once Triton has picked it (novatune.kernels.launch)
_FWD, _BWD = lean(_swiglu_fwd_kernel), lean(_swiglu_bwd_kernel)


def default_config(numel: int) -> tuple[int, int]:
    """(BLOCK, num_warps). Big tensors: 512 elements/program with 4 warps (one 8-byte bf16 vector per thread per
    tensor, many small programs): 149.6 µs fwd+bwd at 4096 x 9728 on the H200, equal to torch.compile's 149.4-149.7,
    where 4096/8 gave 150.5 and 256-element programs 191 (LOG.md run 22). Small tensors: 1024/4 so the grid
    still spreads over the SMs (a 1 x 9728 decode-size call gets 10 programs instead of 3). Under
    TRITON_INTERPRET programs run one after another in Python and the per-program cost dominates, so CPU tests
    use a few large programs (16384); the GPU configs are exercised there by passing block/num_warps."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return 16384, 4
    return (512, 4) if numel >= (1 << 22) else (1024, 4)


def _check_pair(a: torch.Tensor, b: torch.Tensor, names: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"swiglu: {names} must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"swiglu: {names} must be on the same device, got {a.device} and {b.device}")


def _check_out(t: torch.Tensor, like: torch.Tensor, name: str) -> None:
    if t.shape != like.shape or t.dtype != like.dtype or t.device != like.device or not t.is_contiguous():
        raise ValueError(f"swiglu: {name} must be contiguous with shape {tuple(like.shape)}, dtype {like.dtype}, "
                         f"device {like.device}; got {tuple(t.shape)}, {t.dtype}, {t.device}, "
                         f"contiguous={t.is_contiguous()}")


# (grid, constexprs) per (numel, block, num_warps, _I64_THRESHOLD). The config depends on nothing else (not dtype,
# not device), and a training run sees a handful of sizes; the cap only bounds growth (e.g. every sequence length).
# TRITON_INTERPRET (read by default_config) is not part of the key: Triton fixes interpreted-or-compiled when the
# kernels are decorated, at import, so it cannot meaningfully change between calls.
_CONFIGS: dict[tuple, tuple] = {}
_CONFIGS_MAX = 4096


def _launch_args(numel: int, block: int | None, num_warps: int | None) -> tuple[tuple[int], dict]:
    key = (numel, block, num_warps, _I64_THRESHOLD)   # the threshold: a test lowers it to force the int64 path
    args = _CONFIGS.get(key)
    if args is None:
        dblock, dwarps = default_config(numel)
        block = block or dblock
        num_warps = num_warps or dwarps
        grid = (cdiv(numel, block),)
        meta = dict(BLOCK=block, EVEN=numel % block == 0, I64=numel + block > _I64_THRESHOLD, num_warps=num_warps)
        args = grid, meta
        if len(_CONFIGS) >= _CONFIGS_MAX:
            _CONFIGS.clear()
        _CONFIGS[key] = args
    return args


def _new_out(like: torch.Tensor) -> torch.Tensor:
    # empty_like keeps dtype and device without building torch.device objects: ~2 µs vs ~5 µs for torch.empty
    return torch.empty_like(like, memory_format=torch.contiguous_format)


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None, *,
               block: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """y = silu(gate) * up in gate's dtype (gate, up: same shape; any rank). One kernel launch."""
    _check_pair(gate, up, "gate and up")
    gate, up = gate.contiguous(), up.contiguous()  # no-op (returns the tensor itself) for Linear outputs
    if out is None:
        out = _new_out(gate)
    else:
        _check_out(out, gate, "out")
    n = gate.numel()
    if n == 0:
        return out
    grid, meta = _launch_args(n, block, num_warps)
    _FWD[grid](gate, up, out, n, SOFT_RNE=not gate.is_cuda, **meta)  # the interpreter truncates
    return out


def swiglu_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, dgate: torch.Tensor | None = None,
               dup: torch.Tensor | None = None, *, block: int | None = None,
               num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) in gate's / up's dtype from dy, gate, up. One kernel launch writes both."""
    _check_pair(gate, up, "gate and up")
    _check_pair(dy, gate, "dy and gate")
    dy, gate, up = dy.contiguous(), gate.contiguous(), up.contiguous()
    if dgate is None:
        dgate = _new_out(gate)
    else:
        _check_out(dgate, gate, "dgate")
    if dup is None:
        dup = _new_out(up)
    else:
        _check_out(dup, up, "dup")
    n = gate.numel()
    if n == 0:
        return dgate, dup
    grid, meta = _launch_args(n, block, num_warps)
    _BWD[grid](dy, gate, up, dgate, dup, n, SOFT_RNE=not gate.is_cuda, **meta)
    return dgate, dup
