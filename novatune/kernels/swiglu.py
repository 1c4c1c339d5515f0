"""SwiGLU activation: y = silu(gate) * up, elementwise, as two Triton kernels (one forward, one backward).
The same kernels compute GeGLU (Gemma's gated MLP, novatune.ops.geglu) with ACT="gelu_tanh"; see below.

Math (all in fp32 inside the kernels, one rounding to the output dtype at the store):

    sig   = 1 / (1 + exp(-g))
    y     = g * sig * u
    dup   = dy * g * sig                                  (= dy * silu(g))
    dgate = dy * u * sig * (1 + g * (1 - sig))            (= dy * u * d silu/dg)
          = dy * u * (sig + g * sig * (1 - sig))          (the form the kernel evaluates: one multiply fewer)

GeGLU, gelu with the tanh approximation (transformers' gelu_pytorch_tanh), written through the sigmoid
(0.5 * (1 + tanh(z)) = sigmoid(2z), so no tanh is needed on any Triton version or in the interpreter):

    k     = sqrt(2 / pi),  z = k * (g + 0.044715 g^3),  sg = sigmoid(2z)
    y     = g * sg * u                                    (= gelu_tanh(g) * u)
    dup   = dy * g * sg
    dgate = dy * u * (sg + g * 2 sg (1 - sg) * k * (1 + 3 * 0.044715 g^2))

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

Fused gate/up (`swiglu_gate_up_fwd` / `_bwd`, Phi-3's gate_up_proj): one (rows, 2I) tensor [gate | up] in, y
(rows, I) out; the backward writes d(gate_up) in the same [dgate | dup] layout, possibly over gate_up itself (each
element is read before it is written, by the one program that owns it). The flat index i of y maps to
gate = i + (i // I) * I and up = gate + I (COLS = I); when I is a multiple of BLOCK a program's block lies in one
row, so the row is a scalar and the loads stay contiguous (vectorised) as in the flat layout. No split copies.

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


ACTIVATIONS = ("silu", "gelu_tanh")


@triton.jit
def _gate(g, ACT: tl.constexpr):
    """(act(g) / g, d act / dg) in fp32: the factor the forward multiplies g by, and the derivative."""
    if ACT == "gelu_tanh":
        g2 = g * g
        s = tl.sigmoid(1.5957691216057308 * g * (1.0 + 0.044715 * g2))  # sigmoid(2z), 2k = 2 sqrt(2 / pi)
        d = s + g * 2.0 * s * (1.0 - s) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * g2)
    else:
        s = tl.sigmoid(g)
        d = s + g * s * (1.0 - s)
    return s, d


@triton.jit
def _gate_up_offsets(pid, offs, COLS: tl.constexpr, BLOCK: tl.constexpr):
    """Offsets of gate and up for the flat output indices offs: the same offsets in two tensors (COLS == 0), or
    the [gate | up] halves of rows of 2 * COLS in one fused tensor."""
    if COLS == 0:
        return offs, offs
    if COLS % BLOCK == 0:
        row = (pid * BLOCK) // COLS  # the whole block lies in one row: a scalar shift keeps the loads contiguous
    else:
        row = offs // COLS
    g_off = offs + row * COLS
    return g_off, g_off + COLS


@triton.jit
def _swiglu_fwd_kernel(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr, EVEN: tl.constexpr, I64: tl.constexpr,
                       SOFT_RNE: tl.constexpr, COLS: tl.constexpr, ACT: tl.constexpr = "silu"):
    pid = tl.program_id(0)
    if I64:
        pid = pid.to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,) flat element indices of y
    g_off, u_off = _gate_up_offsets(pid, offs, COLS, BLOCK)
    if EVEN:
        g = tl.load(g_ptr + g_off).to(tl.float32)
        u = tl.load(u_ptr + u_off).to(tl.float32)
    else:
        mask = offs < n
        g = tl.load(g_ptr + g_off, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + u_off, mask=mask, other=0.0).to(tl.float32)
    factor, _ = _gate(g, ACT)
    y = _round_to(g * factor * u, y_ptr.dtype.element_ty, SOFT_RNE)  # the one rounding
    if EVEN:
        tl.store(y_ptr + offs, y)
    else:
        tl.store(y_ptr + offs, y, mask=mask)


@triton.jit
def _swiglu_bwd_kernel(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr, EVEN: tl.constexpr,
                       I64: tl.constexpr, SOFT_RNE: tl.constexpr, COLS: tl.constexpr, ACT: tl.constexpr = "silu"):
    pid = tl.program_id(0)
    if I64:
        pid = pid.to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,) flat element indices of dy
    g_off, u_off = _gate_up_offsets(pid, offs, COLS, BLOCK)
    if EVEN:
        dy = tl.load(dy_ptr + offs).to(tl.float32)
        g = tl.load(g_ptr + g_off).to(tl.float32)
        u = tl.load(u_ptr + u_off).to(tl.float32)
    else:
        mask = offs < n
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + g_off, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + u_off, mask=mask, other=0.0).to(tl.float32)
    factor, dact = _gate(g, ACT)  # recomputed: cheaper than reading a saved tensor
    du = _round_to(dy * (g * factor), du_ptr.dtype.element_ty, SOFT_RNE)
    dg = _round_to(dy * u * dact, dg_ptr.dtype.element_ty, SOFT_RNE)
    if EVEN:
        tl.store(du_ptr + u_off, du)
        tl.store(dg_ptr + g_off, dg)
    else:
        tl.store(du_ptr + u_off, du, mask=mask)
        tl.store(dg_ptr + g_off, dg, mask=mask)


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


def _launch_args(numel: int, block: int | None, num_warps: int | None, cols: int = 0) -> tuple[tuple[int], dict]:
    """cols: the fused [gate | up] layout's half width (0: separate gate and up tensors)."""
    key = (numel, block, num_warps, _I64_THRESHOLD, cols)   # the threshold: a test lowers it (int64 path)
    args = _CONFIGS.get(key)
    if args is None:
        dblock, dwarps = default_config(numel)
        block = block or dblock
        num_warps = num_warps or dwarps
        grid = (cdiv(numel, block),)
        # the fused layout addresses up to 2 x numel elements of gate_up
        reach = 2 * numel if cols else numel
        meta = dict(BLOCK=block, EVEN=numel % block == 0, I64=reach + block > _I64_THRESHOLD, num_warps=num_warps,
                    COLS=cols)
        args = grid, meta
        if len(_CONFIGS) >= _CONFIGS_MAX:
            _CONFIGS.clear()
        _CONFIGS[key] = args
    return args


def _new_out(like: torch.Tensor) -> torch.Tensor:
    # empty_like keeps dtype and device without building torch.device objects: ~2 µs vs ~5 µs for torch.empty
    return torch.empty_like(like, memory_format=torch.contiguous_format)


def _check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"swiglu kernels: activation must be one of {ACTIVATIONS}, got {activation!r}")


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None, *,
               block: int | None = None, num_warps: int | None = None, activation: str = "silu") -> torch.Tensor:
    """y = act(gate) * up in gate's dtype (gate, up: same shape; any rank), act = silu or gelu_tanh. One launch."""
    _check_activation(activation)
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
    _FWD[grid](gate, up, out, n, SOFT_RNE=not gate.is_cuda, ACT=activation, **meta)  # the interpreter truncates
    return out


def swiglu_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, dgate: torch.Tensor | None = None,
               dup: torch.Tensor | None = None, *, block: int | None = None,
               num_warps: int | None = None, activation: str = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) in gate's / up's dtype from dy, gate, up. One kernel launch writes both."""
    _check_activation(activation)
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
    _BWD[grid](dy, gate, up, dgate, dup, n, SOFT_RNE=not gate.is_cuda, ACT=activation, **meta)
    return dgate, dup



def _check_gate_up(gate_up: torch.Tensor) -> int:
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu_gate_up: gate_up must end in an even dimension [gate | up], got "
                         f"{tuple(gate_up.shape)}")
    return gate_up.shape[-1] // 2


def _buffer(t: torch.Tensor | None, shape: tuple, like: torch.Tensor, name: str) -> torch.Tensor:
    """A new contiguous buffer of `shape` in like's dtype and device, or t checked to be one."""
    if t is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if tuple(t.shape) != tuple(shape) or t.dtype != like.dtype or t.device != like.device or not t.is_contiguous():
        raise ValueError(f"swiglu_gate_up: {name} must be contiguous with shape {tuple(shape)}, dtype {like.dtype}, "
                         f"device {like.device}; got {tuple(t.shape)}, {t.dtype}, {t.device}, "
                         f"contiguous={t.is_contiguous()}")
    return t


def swiglu_gate_up_fwd(gate_up: torch.Tensor, out: torch.Tensor | None = None, *, block: int | None = None,
                       num_warps: int | None = None) -> torch.Tensor:
    """y = silu(gate) * up with [gate | up] = gate_up's two halves along the last dim; y (..., I) in gate_up's
    dtype. One kernel launch, no split copies."""
    cols = _check_gate_up(gate_up)
    gate_up = gate_up.contiguous()
    out = _buffer(out, (*gate_up.shape[:-1], cols), gate_up, "out")
    n = out.numel()
    if n == 0:
        return out
    grid, meta = _launch_args(n, block, num_warps, cols)
    _FWD[grid](gate_up, gate_up, out, n, SOFT_RNE=not gate_up.is_cuda, ACT="silu", **meta)
    return out


def swiglu_gate_up_bwd(dy: torch.Tensor, gate_up: torch.Tensor, dgate_up: torch.Tensor | None = None, *,
                       block: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """d(gate_up) = [dgate | dup] in gate_up's layout and dtype from dy (..., I). dgate_up may be gate_up itself
    (its last use): each element is read before it is written, by the one program that owns it."""
    cols = _check_gate_up(gate_up)
    if tuple(dy.shape) != (*gate_up.shape[:-1], cols) or dy.device != gate_up.device:
        raise ValueError(f"swiglu_gate_up: dy {tuple(dy.shape)} must be gate_up {tuple(gate_up.shape)} with the "
                         f"last dimension halved, on the same device")
    dy, gate_up = dy.contiguous(), gate_up.contiguous()
    dgate_up = _buffer(dgate_up, tuple(gate_up.shape), gate_up, "dgate_up")
    n = dy.numel()
    if n == 0:
        return dgate_up
    grid, meta = _launch_args(n, block, num_warps, cols)
    _BWD[grid](dy, gate_up, gate_up, dgate_up, dgate_up, n, SOFT_RNE=not gate_up.is_cuda, ACT="silu",
               **meta)
    return dgate_up
