"""A library attention kernel's gradients checked on the device before it trains (the cudnn and fa4 backends).

A backend whose kernels come from a package (cuDNN's fused attention, FlashAttention-4) trains only where its
backward is known to match the fp32 reference: on a stack measured on the GPU (each backend's MEASURED_BACKWARD),
or, anywhere else, after `check_gradients`: one forward + backward on a small ragged problem on the device against
novatune.reference.attention computed from the same rounded inputs. The backends cache the verdict per process,
stack and head shape.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from novatune.attention.packed import PackedBatch

__all__ = ["check_gradients", "CHECK_ROWS", "CHECK_TOLERANCE", "CHECK_WINDOW"]

# The problem: ragged documents (1-token ones, one longer than a 128-token tile) in two rows. The bound: these
# kernels, like FlashAttention-2, keep P and dS in bf16 for the second matmul of each pass (the GPU tests' 2e-2;
# fp16 keeps 3 more mantissa bits).
CHECK_ROWS = ((1, 150, 7, 98), (200, 1, 55))
CHECK_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
CHECK_WINDOW = 64


def check_gradients(attention: Callable[..., torch.Tensor], device: torch.device, dtype: torch.dtype, hq: int,
                    hk: int, d: int, windowed: bool = False) -> str | None:
    """None when `attention(q, k, v, packed, scale[, window])`'s output and three gradients on CHECK_ROWS are within
    CHECK_TOLERANCE of the fp32 reference, else the worst error (or what the call raised). `windowed`: with a
    sliding window of CHECK_WINDOW keys, shorter than the longest documents (a kernel of its own)."""
    from novatune.measure.numerics import rel_err
    from novatune.reference.attention import attention_ref

    pos = torch.tensor([[p for n in row for p in range(n)] for row in CHECK_ROWS])
    packed = PackedBatch.from_position_ids(pos, device=device)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(packed.total_tokens, h, d, generator=gen).to(device, dtype).requires_grad_()
               for h in (hq, hk, hk))
    grad_out = torch.randn(packed.total_tokens, hq, d, generator=gen).to(device, dtype)
    exact = [t.detach().float().requires_grad_() for t in (q, k, v)]
    try:
        # the check runs at the first training call, which may sit inside a checkpointed layer or an offload
        # engine's saved-tensor hooks and under autocast: its own graph keeps its tensors, and its math its dtypes
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), \
                torch.autocast(device.type, enabled=False):
            window = CHECK_WINDOW if windowed else None
            out = attention(q, k, v, packed, d ** -0.5, window) if windowed else attention(q, k, v, packed, d ** -0.5)
            grads = torch.autograd.grad(out, (q, k, v), grad_out)
            ref = attention_ref(exact[0], exact[1], exact[2], packed, window=window)
            ref_grads = torch.autograd.grad(ref, exact, grad_out.float())
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - a kernel that fails on the check's problem fails the check, saying how
        return f"its gradient self-check raised {type(e).__name__}: {str(e)[:200]}"
    errors = {name: rel_err(a, b) for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads))}
    name, worst = max(errors.items(), key=lambda item: item[1])
    limit = CHECK_TOLERANCE.get(dtype, 2e-2)
    if worst <= limit:
        return None
    return f"its gradient self-check measured {name} relative error {worst:.3g} (limit {limit:g})"
