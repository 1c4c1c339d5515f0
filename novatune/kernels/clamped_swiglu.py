"""GPT-OSS's clamped SwiGLU as two Triton kernels, reading the interleaved gate/up projection output directly.

Layout: gate_up (..., 2 * I) with gate in the even columns and up in the odd ones (HF's `[..., ::2]`,
`[..., 1::2]`); y (..., I). Output element e of the flattened y reads gate_up[2e] and gate_up[2e + 1] (row r,
column c: r * 2I + 2c = 2 (r * I + c)), so the kernels treat the tensors as flat arrays, like kernels/swiglu.py.

Math in fp32, one rounding at each store (reference/clamped_swiglu.py has the formulas):
    g = min(gate, limit), u = clamp(up, -limit, limit), s = sigmoid(alpha g)
    y = (u + 1) g s
    d gate = dy (u + 1) (s + alpha g s (1 - s))  where gate <= limit, else exactly 0
    d up   = dy g s                              where -limit <= up <= limit, else exactly 0
The clamps are `where`s on comparisons, so a NaN input stays NaN in y and gets a zero gradient (torch.clamp's own
rules). The backward recomputes everything from gate_up: autograd saves gate_up alone.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from novatune.kernels.rms_norm import _round_to
from novatune.kernels.swiglu import default_config

_I64_THRESHOLD = 2**31 - 1  # flat offsets (2 * elements + 1) at or past this use int64; a test lowers it


@triton.jit
def _load_pair(gu_ptr, offs, n, EVEN: tl.constexpr):
    if EVEN:
        gate = tl.load(gu_ptr + 2 * offs).to(tl.float32)
        up = tl.load(gu_ptr + 2 * offs + 1).to(tl.float32)
    else:
        mask = offs < n
        gate = tl.load(gu_ptr + 2 * offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + 2 * offs + 1, mask=mask, other=0.0).to(tl.float32)
    return gate, up


@triton.jit
def _clamped_swiglu_fwd_kernel(gu_ptr, y_ptr, n, alpha, limit, b_ptr, e_ptr, n_inter, BLOCK: tl.constexpr,
                               EVEN: tl.constexpr, I64: tl.constexpr, SOFT_RNE: tl.constexpr,
                               HAS_BIAS: tl.constexpr):
    pid = tl.program_id(0)
    if I64:
        pid = pid.to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,) flat output elements
    gate, up = _load_pair(gu_ptr, offs, n, EVEN)
    if HAS_BIAS:
        # the experts' gate_up bias (GPT-OSS): row r's expert e_r, gate_up += b[e_r] rounded to gate_up's dtype and
        # written back (the backward reads it), then the activation of the rounded value: the bits of a separate add
        m = offs < n
        row = offs // n_inter
        e = tl.load(e_ptr + row, mask=m, other=0).to(tl.int64)
        at = e * (2 * n_inter) + 2 * (offs % n_inter)
        gate = _round_to(gate + tl.load(b_ptr + at, mask=m, other=0.0).to(tl.float32), gu_ptr.dtype.element_ty,
                         SOFT_RNE)
        up = _round_to(up + tl.load(b_ptr + at + 1, mask=m, other=0.0).to(tl.float32), gu_ptr.dtype.element_ty,
                       SOFT_RNE)
        tl.store(gu_ptr + 2 * offs, gate, mask=m)
        tl.store(gu_ptr + 2 * offs + 1, up, mask=m)
        gate = gate.to(tl.float32)
        up = up.to(tl.float32)
    g = tl.where(gate > limit, limit, gate)
    u = tl.where(up > limit, limit, tl.where(up < -limit, -limit, up))
    y = _round_to((u + 1.0) * g * tl.sigmoid(alpha * g), y_ptr.dtype.element_ty, SOFT_RNE)
    if EVEN:
        tl.store(y_ptr + offs, y)
    else:
        tl.store(y_ptr + offs, y, mask=offs < n)


@triton.jit
def _clamped_swiglu_bwd_kernel(dy_ptr, gu_ptr, dgu_ptr, n, alpha, limit, BLOCK: tl.constexpr, EVEN: tl.constexpr,
                               I64: tl.constexpr, SOFT_RNE: tl.constexpr):
    pid = tl.program_id(0)
    if I64:
        pid = pid.to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    gate, up = _load_pair(gu_ptr, offs, n, EVEN)
    if EVEN:
        dy = tl.load(dy_ptr + offs).to(tl.float32)
    else:
        dy = tl.load(dy_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    g = tl.where(gate > limit, limit, gate)
    u = tl.where(up > limit, limit, tl.where(up < -limit, -limit, up))
    s = tl.sigmoid(alpha * g)
    glu = g * s
    dgate = tl.where(gate <= limit, dy * (u + 1.0) * (s + alpha * glu * (1.0 - s)), 0.0)
    dup = tl.where((up >= -limit) & (up <= limit), dy * glu, 0.0)
    dgate = _round_to(dgate, dgu_ptr.dtype.element_ty, SOFT_RNE)
    dup = _round_to(dup, dgu_ptr.dtype.element_ty, SOFT_RNE)
    if EVEN:
        tl.store(dgu_ptr + 2 * offs, dgate)
        tl.store(dgu_ptr + 2 * offs + 1, dup)
    else:
        tl.store(dgu_ptr + 2 * offs, dgate, mask=offs < n)
        tl.store(dgu_ptr + 2 * offs + 1, dup, mask=offs < n)


def _check_gate_up(gate_up: torch.Tensor) -> None:
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"clamped_swiglu: gate_up must have an even last dimension (interleaved gate/up columns), "
                         f"got shape {tuple(gate_up.shape)}")


def _check_out(t: torch.Tensor, shape, like: torch.Tensor, name: str) -> None:
    if tuple(t.shape) != tuple(shape) or t.dtype != like.dtype or t.device != like.device or not t.is_contiguous():
        raise ValueError(f"clamped_swiglu: {name} must be contiguous with shape {tuple(shape)}, dtype {like.dtype}, "
                         f"device {like.device}; got {tuple(t.shape)}, {t.dtype}, {t.device}, "
                         f"contiguous={t.is_contiguous()}")


def _launch(n: int, block: int | None, num_warps: int | None) -> tuple[tuple[int], dict]:
    dblock, dwarps = default_config(n)
    block, num_warps = block or dblock, num_warps or dwarps
    meta = dict(BLOCK=block, EVEN=n % block == 0, I64=2 * (n + block) + 1 > _I64_THRESHOLD, num_warps=num_warps)
    return (triton.cdiv(n, block),), meta


def clamped_swiglu_fwd(gate_up: torch.Tensor, alpha: float, limit: float, out: torch.Tensor | None = None, *,
                       block: int | None = None, num_warps: int | None = None, bias: torch.Tensor | None = None,
                       expert: torch.Tensor | None = None) -> torch.Tensor:
    """y (..., I) in gate_up's dtype from the interleaved gate_up (..., 2I). One kernel launch.
    With `bias` (E, 2I) and `expert` (rows,) integer ids for a contiguous (rows, 2I) gate_up: gate_up[r] +=
    bias[expert[r]] first, in place (rounded to its dtype), and y from that."""
    _check_gate_up(gate_up)
    if bias is not None:
        if (expert is None or expert.dtype.is_floating_point or gate_up.dim() != 2 or not gate_up.is_contiguous()
                or expert.shape != gate_up.shape[:1] or bias.dim() != 2 or bias.shape[1] != gate_up.shape[1]
                or not bias.is_contiguous()):
            raise ValueError("clamped_swiglu: a bias needs a contiguous (rows, 2I) gate_up, integer expert ids (rows,) "
                             "and a contiguous (E, 2I) bias")
        expert = expert.contiguous()
    gate_up = gate_up.contiguous()
    shape = (*gate_up.shape[:-1], gate_up.shape[-1] // 2)
    if out is None:
        out = torch.empty(shape, dtype=gate_up.dtype, device=gate_up.device)
    else:
        _check_out(out, shape, gate_up, "out")
    n = out.numel()
    if n:
        grid, meta = _launch(n, block, num_warps)
        has_bias = bias is not None
        _clamped_swiglu_fwd_kernel[grid](gate_up, out, n, float(alpha), float(limit),
                                         bias if has_bias else gate_up, expert if has_bias else gate_up,
                                         gate_up.shape[-1] // 2, SOFT_RNE=not gate_up.is_cuda, HAS_BIAS=has_bias,
                                         **meta)
    return out


def clamped_swiglu_bwd(dy: torch.Tensor, gate_up: torch.Tensor, alpha: float, limit: float,
                       dgate_up: torch.Tensor | None = None, *, block: int | None = None,
                       num_warps: int | None = None) -> torch.Tensor:
    """d gate_up (..., 2I), interleaved like gate_up and in its dtype, from dy (..., I). One kernel launch."""
    _check_gate_up(gate_up)
    if tuple(dy.shape) != (*gate_up.shape[:-1], gate_up.shape[-1] // 2):
        raise ValueError(f"clamped_swiglu: dy has shape {tuple(dy.shape)}, expected "
                         f"{(*gate_up.shape[:-1], gate_up.shape[-1] // 2)} for gate_up {tuple(gate_up.shape)}")
    dy, gate_up = dy.contiguous(), gate_up.contiguous()
    if dgate_up is None:
        dgate_up = torch.empty_like(gate_up)
    else:
        _check_out(dgate_up, gate_up.shape, gate_up, "dgate_up")
    n = dy.numel()
    if n:
        grid, meta = _launch(n, block, num_warps)
        _clamped_swiglu_bwd_kernel[grid](dy, gate_up, dgate_up, n, float(alpha), float(limit),
                                         SOFT_RNE=not gate_up.is_cuda, **meta)
    return dgate_up
