"""FlashAttention-4's CuTe-DSL kernels over packed rows (the "fa4" attention backend; FA3-class on Hopper).

    fa4_attention(q, k, v, packed, scale, window=None) -> (tokens, hq, d)

The `flash-attn-4` package (`pip install flash-attn-4`; its runtime is NVIDIA's CUTLASS DSL) compiles its kernels
for the GPU it finds: on Hopper (sm90) warp-specialised TMA/WGMMA forward and backward kernels (FlashAttention-3's
design), on Blackwell (sm100) its own. Its varlen entry point takes the same contract as the flash backend:
q (tokens, hq, d) and k, v (tokens, hk, d) read in place, one offsets tensor (cu_seqlens, int32) for queries and
keys, causal inside each document and nothing across one, GQA native (query head h reads kv head h // (hq / hk),
the backward sums dK and dV over each group). A sliding window of `window` keys is the (window - 1, 0) window of
FlashAttention. The first call of each configuration compiles its kernels (seconds; cached per process).

Training. As for the cudnn backend (self_check.py): the backward trains where it is known to match the fp32
reference: on a combination in MEASURED_BACKWARD (package version, GPU capability, head_dim, dtype, grouped query
heads, window), or, on any other, after one gradient self-check on the device, once per process and combination.
A failed check refuses the training call with the measured error; forward-only calls run either way.

Host time. The package's Python entry point spends ~110 us per forward call choosing and looking up its compiled
kernel (~270 us with its autograd Function). On the package versions in FAST_FORWARD (their compiled forward's
calling convention measured) and sm90, the backend records the compiled forward and its arguments at the first
call of each configuration (`_Recorder`), checks the direct call against the package's own on the next one (the
same bits, or that configuration stays on the package's path, saying why), and from then on calls the compiled
kernel directly (~10 us). On the seed's training step this measured no change (session28-6, -7: the step is
GPU-bound there); it matters where a slow host starves the GPU. Batches where the package's choice depends on
the batch itself (more than 256 documents: a scheduler aid tensor; documents so short that one query tile holds
the longest: another kernel) take the package's path. The backward is the package's `_flash_attn_bwd`.

Not applied here: logit soft-capping and attention sinks (the package has both; they are not validated through
this backend, so the dispatcher refuses such calls for it, and they run on flex / flash).
"""
from __future__ import annotations

import functools
import importlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from novatune.attention.flash import _capability  # the GPU's capability, cached per device
from novatune.attention.packed import PackedBatch
from novatune.attention.self_check import check_gradients

__all__ = ["fa4_attention", "fa4_why_not", "fa4_detail", "backward_why_not", "gradient_self_check",
           "MEASURED_BACKWARD", "CAPABILITIES"]

PACKAGE = "flash-attn-4"
# GPU generations with a kernel of the package's own design (sm90 Hopper, sm100/sm110 Blackwell). Its sm80 and
# sm120 paths are FlashAttention-2-class: the flash backend already runs those kernels.
CAPABILITIES = (9, 10, 11)
# The head sizes taken: a multiple of 32 in [64, 256] (the models' 64, 128, 256). The package accepts 8..256, but at
# head_dim 16 its dq/dk/dv were 1.17-1.26 relative error from the fp32 reference while its output was right, against
# 2.3-2.6e-3 at 64 and 128 (4.0.0b36, H200; experiments.jsonl fa4_head_dim_accuracy, session28-9): smaller heads run
# on the flash backend.
MIN_HEAD_DIM, MAX_HEAD_DIM = 64, 256

# The backward as measured on the GPU against the fp32 reference (tests/attention/test_fa4.py), keyed by (package
# version, GPU capability, head_dim, dtype, grouped query heads (hq > hk), sliding window) -> None (passed) or the
# measured failure; any other combination checks itself once (gradient_self_check). Measured: 4.0.0b36 on an H200
# (torch 2.11.0+cu130), bf16, GQA 32/8, d 128, with and without a window: the output and the three gradients
# within 1e-2 / 2e-2 of the fp32 reference (session28-2, -7, -9).
MEASURED_BACKWARD: dict[tuple, str | None] = {
    ("4.0.0b36", (9, 0), 128, torch.bfloat16, True, False): None,
    ("4.0.0b36", (9, 0), 128, torch.bfloat16, True, True): None,
}


@functools.cache
def _package() -> tuple[Callable[..., Any] | None, str, str, Any]:
    """(flash_attn_varlen_func, version, "", the interface module) or (None, "", why it cannot be used, None)."""
    try:
        module = importlib.import_module("flash_attn.cute.interface")
        fn = module.flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001 - absent or broken package (its CUDA runtime included): say which
        return None, "", f"{PACKAGE} is not usable ({type(e).__name__}: {str(e)[:160]})", None
    try:
        from importlib.metadata import version
        ver = version(PACKAGE)
    except Exception:  # noqa: BLE001 - imported from a source tree: no distribution metadata
        ver = "source"
    return fn, ver, "", module


def fa4_why_not(q: torch.Tensor, k: torch.Tensor, packed: PackedBatch, window: int | None) -> str | None:
    """Why the fa4 backend cannot run these inputs (None: it can)."""
    if q.device.type != "cuda":
        return "FlashAttention-4 is CUDA-only; use backend='sdpa_docs' / 'reference' on the CPU"
    major, minor = _capability(q.device)
    if major not in CAPABILITIES:
        return (f"FlashAttention-4's own kernels target sm90 / sm100; this GPU is sm{major}{minor} (the flash backend "
                "runs FlashAttention-2 there)")
    fn, _, missing, _ = _package()
    if fn is None:
        return f"{missing}; pip install {PACKAGE}, or use backend='flash'"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"FlashAttention-4 takes fp16/bf16, got {q.dtype}; cast the model or use backend='reference'"
    d = q.shape[-1]
    if d % 32 or not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        return (f"head_dim {d}: the fa4 backend takes a multiple of 32 in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}] (the "
                "sizes it is validated at); use backend='flash'")
    if packed.lengths is None:
        return ("a CUDA-graph static PackedBatch: the fa4 backend is not validated inside graph capture (its first "
                "call compiles); the varlen backend runs there")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return backward_why_not(q, k, window)
    return None  # a call where only v wants a gradient is checked in fa4_attention, which sees v


def _stack(q: torch.Tensor, k: torch.Tensor, window: int | None) -> tuple:
    """MEASURED_BACKWARD's key: (package version, GPU capability, head_dim, dtype, hq > hk, windowed)."""
    return (_package()[1], _capability(q.device), q.shape[2], q.dtype, q.shape[1] > k.shape[1],
            window is not None)


def backward_why_not(q: torch.Tensor, k: torch.Tensor, window: int | None = None) -> str | None:
    """None when the backward may train here (a measured combination that passed, or this one's self-check), else
    the reason with the measured error."""
    stack = _stack(q, k, window)
    if stack in MEASURED_BACKWARD:
        failure = MEASURED_BACKWARD[stack]
    elif torch.cuda.is_current_stream_capturing():
        failure = "its gradient self-check cannot run inside a CUDA-graph capture"
    else:
        failure = gradient_self_check(stack, q.device, q.dtype, q.shape[1], k.shape[1], q.shape[2], window is not None)
    if failure is None:
        return None
    version, (major, minor), d, dtype, _, windowed = stack
    return (f"the fa4 backend's backward ({PACKAGE} {version}, sm{major}{minor}, head_dim {d}, "
            f"{str(dtype).replace('torch.', '')}{', windowed' if windowed else ''}) does not match the fp32 "
            f"reference: {failure}; it runs forward-only calls: train with backend='flash'")


@functools.cache
def gradient_self_check(stack: tuple, device: torch.device, dtype: torch.dtype, hq: int, hk: int, d: int,
                        windowed: bool = False) -> str | None:
    """self_check.check_gradients of this backend, once per process, combination and head shape."""
    return check_gradients(fa4_attention, device, dtype, hq, hk, d, windowed)


# Package versions whose compiled sm90 forward this module calls directly (its argument list as recorded from the
# package's own call and checked against it, tests/attention/test_fa4.py on an H200): any other version runs the
# package's public entry point.
FAST_FORWARD = ("4.0.0b36",)
# The package passes a batch-lookup aid (extra tensors) for batches of more documents than 256 (its
# BIN_BATCH_SEARCH_THRESH in 4.0.0b36), and compiles another kernel where the longest document's packed query rows
# fit one tile (tile_m <= 192 on sm90; 1024 leaves a margin): those batches take the package's path.
_MAX_DOCS = 256
_MIN_PACKED_ROWS = 1024
_RECORDING = threading.Lock()  # the package's JIT cache is swapped for a recorder during one call


class _Recorder:
    """Stands in for the package's forward JIT cache during one call: the compiled kernel it hands out and the
    arguments that kernel receives are kept (the package's own call runs unchanged)."""

    def __init__(self, cache):
        self.cache, self.kernel, self.args = cache, None, None

    def __contains__(self, key):
        return key in self.cache

    def __setitem__(self, key, value):
        self.cache[key] = value

    def __getitem__(self, key):
        kernel = self.cache[key]

        def call(*args):
            self.kernel, self.args = kernel, args
            return kernel(*args)

        return call


@dataclass
class _Direct:
    kernel: Callable[..., Any]
    template: list[Any]       # the recorded arguments, tensors replaced by their role
    checked: bool = False      # the direct call matched the package's own once


_DIRECT: dict[tuple, _Direct | str] = {}  # per configuration: the direct call, or why there is none


def _roles(args, q, k, v, out, lse, cu) -> list[Any] | str:
    """The recorded argument list with each tensor replaced by its role, or why it cannot be replayed."""
    known = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "cu": cu}
    template: list[Any] = []
    for a in args:
        if not isinstance(a, torch.Tensor):
            template.append(a)
            continue
        roles = [r for r, t in known.items() if t is not None and a.data_ptr() == t.data_ptr()
                 and a.shape == t.shape and a.stride() == t.stride()]
        if not roles:
            return f"the compiled forward takes a tensor of shape {tuple(a.shape)} that is not q, k, v, out or lse"
        if len(roles) > 1:  # aliased inputs (k is v): a later batch with distinct tensors could not be told apart
            return f"one tensor is {' and '.join(roles)} in the recorded call"
        template.append(roles[0])
    return template


def _forward_via_package(interface, q, k, v, cu, longest, scale, window, need_lse, record=False):
    """The package's own forward: (out, lse, the recorder or None)."""
    wl, wr = (None, None) if window is None else (window - 1, 0)

    def run():
        return interface._flash_attn_fwd(
            q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest,
            softmax_scale=scale, causal=True, window_size_left=wl, window_size_right=wr, return_lse=need_lse)[:2]

    if not record:
        return (*run(), None)
    with _RECORDING:
        saved = interface._flash_attn_fwd.compile_cache
        recorder = _Recorder(saved)
        interface._flash_attn_fwd.compile_cache = recorder
        try:
            out, lse = run()
        finally:
            interface._flash_attn_fwd.compile_cache = saved
    return out, lse, recorder


def _forward(interface, q, k, v, cu, longest, num_docs, scale, window, need_lse):
    """(out, lse): the compiled kernel called directly where its configuration has been recorded and checked,
    else the package's forward (recording the configuration on the way)."""
    hq, hk = q.shape[1], k.shape[1]
    packed_rows = longest * (hq // hk)
    eligible = (num_docs <= _MAX_DOCS and packed_rows > _MIN_PACKED_ROWS and _capability(q.device)[0] == 9
                and _package()[1] in FAST_FORWARD)
    if not eligible:
        return _forward_via_package(interface, q, k, v, cu, longest, scale, window, need_lse)[:2]
    key = (q.device, q.dtype, k.dtype, v.dtype, tuple(q.shape[1:]), tuple(k.shape[1:]), tuple(v.shape[1:]),
           q.stride(), k.stride(), v.stride(), window, need_lse, scale, all(t.data_ptr() % 16 == 0 for t in (q, k, v)))
    direct = _DIRECT.get(key)
    if direct is None:  # first call of this configuration: the package's path, recorded
        out, lse, recorder = _forward_via_package(interface, q, k, v, cu, longest, scale, window, need_lse,
                                                  record=True)
        template = (_roles(recorder.args, q, k, v, out, lse, cu) if recorder.kernel is not None
                    else "the package's forward made no compiled call to record")
        _DIRECT[key] = template if isinstance(template, str) else _Direct(recorder.kernel, template)
        return out, lse
    if isinstance(direct, str):
        return _forward_via_package(interface, q, k, v, cu, longest, scale, window, need_lse)[:2]
    out = torch.empty(q.shape[0], hq, v.shape[2], dtype=q.dtype, device=q.device)
    lse = torch.empty(hq, q.shape[0], dtype=torch.float32, device=q.device) if need_lse else None
    tensors = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "cu": cu}
    direct.kernel(*[tensors[a] if isinstance(a, str) else a for a in direct.template])
    if not direct.checked:  # once per configuration: the same bits as the package's own call
        want, want_lse, _ = _forward_via_package(interface, q, k, v, cu, longest, scale, window, need_lse)
        same = _same_bits(out, want) and (lse is None or _same_bits(lse, want_lse))
        if not same:
            _DIRECT[key] = "the direct call of the compiled forward differed from the package's own call"
            return want, want_lse
        direct.checked = True
    return out, lse


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (a NaN equals the same NaN: a diverging batch is no reason to leave the direct call)."""
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(ints), b.view(ints))


class _Fa4Attention(torch.autograd.Function):
    """Document-causal attention: the forward through `_forward`, the backward the package's `_flash_attn_bwd` on
    the same offsets, window and scale (as the package's own autograd Function calls them)."""

    @staticmethod
    def forward(ctx, q, k, v, cu, longest: int, num_docs: int, scale: float, window: int | None, need_lse: bool):
        interface = _package()[3]
        q_, k_, v_ = (t.detach() for t in (q, k, v))  # DLPack exports no tensor that requires grad
        out, lse = _forward(interface, q_, k_, v_, cu, longest, num_docs, scale, window, need_lse)
        if need_lse:
            ctx.save_for_backward(q_, k_, v_, out, lse, cu)
        ctx.longest, ctx.scale, ctx.window = longest, scale, window
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse, cu = ctx.saved_tensors
        wl, wr = (None, None) if ctx.window is None else (ctx.window - 1, 0)
        dq, dk, dv = _package()[3]._flash_attn_bwd(
            q, k, v, out, dout, lse, ctx.scale, True, 0.0, window_size_left=wl, window_size_right=wr,
            cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=ctx.longest, max_seqlen_k=ctx.longest)[:3]
        return dq, dk, dv, None, None, None, None, None, None


def fa4_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: PackedBatch, scale: float,
                  window: int | None = None) -> torch.Tensor:
    """(tokens, hq, d) document-causal attention by FlashAttention-4; k, v (tokens, hk, d) with hk dividing hq."""
    fn, version, missing, interface = _package()
    if fn is None:
        raise RuntimeError(f"the fa4 backend is unavailable: {missing}")
    cu, longest = packed.cu_seqlens, packed.max_seqlen
    need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if need_grad and not (q.requires_grad or k.requires_grad):
        why = backward_why_not(q, k, window)  # fa4_why_not asks for q and k; here v alone wants a gradient
        if why is not None:
            raise RuntimeError(why)
    if version in FAST_FORWARD and interface is not None:
        return _Fa4Attention.apply(q, k, v, cu, longest, packed.num_docs, scale, window, need_grad)
    out, _lse = fn(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest,
                   softmax_scale=scale, causal=True, window_size=(None, None) if window is None else (window - 1, 0))
    return out


def fa4_detail() -> str:
    _, ver, missing, _ = _package()
    if missing:
        return missing
    if ver not in FAST_FORWARD:
        return f"{PACKAGE} {ver} flash_attn_varlen_func (CuTe DSL), GQA native"
    direct = sum(isinstance(d, _Direct) and d.checked for d in _DIRECT.values())
    why_not = sorted({d for d in _DIRECT.values() if isinstance(d, str)})
    return (f"{PACKAGE} {ver} (CuTe DSL), GQA native; compiled forward called directly in {direct} configuration(s)"
            + (f"; not in others: {'; '.join(why_not)}" if why_not else ""))
