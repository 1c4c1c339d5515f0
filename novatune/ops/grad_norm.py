"""The gradients' total L2 norm (what gradient clipping divides by), with torch.nn.utils.get_total_norm's contract.

    total_norm(tensors) -> 0-dim tensor        = torch.nn.utils.get_total_norm(tensors, 2.0)

torch groups the tensors by device and dtype, takes each tensor's norm with `_foreach_norm` (fp32 accumulation,
returned in the tensor's dtype), and returns the norm of those norms (`vector_norm` of their stack). This op keeps
that structure and those roundings and replaces only the per-tensor norms of CUDA tensors by novatune's kernels
(novatune.kernels.grad_norm), which read the gradients at the card's bandwidth where `_foreach_norm` reaches about
half of it on bf16 (5.6 B bf16 gradients: 5.05 ms in torch's, bench/experiments/exp_optimizer_bandwidth.py). The
per-tensor fp32 norms differ from torch's only in summation order, so after the rounding to a bf16 gradient's dtype
they almost always agree to the bit, and fp32 ones agree within fp32 summation error (tests/ops/test_grad_norm.py).
Non-finite gradients give an inf or NaN norm, as torch's (the trainer's non-finite check reads it).

Squares from the kernels that write a gradient's final value: around a step's last backward the trainer opens
`final_gradient_squares()`; a kernel that adds into `.grad` there (the experts' weight gradient,
novatune.ops.moe) also writes the sums of squares of the values it stores and records them (`record_squares`), and
total_norm sums those instead of reading the gradient again: on the Qwen3-30B-A3B cut the experts hold 86% of the
gradients. A record counts only while it describes the gradient as it is: the same tensor, its version counter
unchanged. torch's in-place ops bump it (autograd adding a second contribution included); a Triton kernel's write
does not, so the kernels that add into `.grad` bump it themselves (novatune.ops.moe). total_norm drops every record
once it has read them, and a backward that raises leaves none.

An optimizer-side reduction, not a differentiable op: no custom-op registration or SPEC. Device rule as every op
(novatune.ops._backend): CUDA tensors -> the kernels; CPU -> torch's own function (the kernels under
TRITON_INTERPRET=1). Tensors the kernels do not take (sparse, non-contiguous, integer, DTensor) take torch's.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
from torch import Tensor
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from novatune.kernels import grad_norm as K
from novatune.ops._backend import use_triton

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def _kernel_takes(t: Tensor) -> bool:
    return (type(t) is torch.Tensor and t.layout == torch.strided and t.dtype in _FLOATS and t.is_contiguous()
            and use_triton(t))


_collecting = False
_records: dict[int, tuple[weakref.ref, int, Tensor]] = {}  # id(grad) -> (the grad, its version, its partials)


@contextlib.contextmanager
def final_gradient_squares():
    """Around a step's last backward (one process, nothing changes the gradients between it and the norm): kernels
    that store a gradient's final value record its sums of squares for total_norm. Earlier records are dropped."""
    global _collecting
    _records.clear()
    _collecting = True
    try:
        yield
    except BaseException:
        _records.clear()  # a backward that did not finish leaves no gradient whose squares are known
        raise
    finally:
        _collecting = False


def squares_wanted() -> bool:
    """Whether a kernel storing a gradient's final value should record its squares now."""
    return _collecting


def record_squares(grad: Tensor, partials: Tensor) -> None:
    """`partials` (fp32) sum to the squared L2 norm of `grad` as it is now."""
    _records[id(grad)] = (weakref.ref(grad), grad._version, partials)


def _recorded(t: Tensor) -> Tensor | None:
    entry = _records.get(id(t))
    if entry is None or entry[0]() is not t or t._version != entry[1]:
        return None  # another tensor, or this one changed in place since its squares were summed
    return entry[2]


def total_norm(tensors) -> Tensor:
    """torch.nn.utils.get_total_norm(tensors, 2.0, error_if_nonfinite=False): the norm of the per-tensor norms,
    the per-tensor norms of CUDA tensors computed by novatune's kernels (from recorded squares where valid)."""
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    try:
        if not tensors:
            return torch.tensor(0.0)
        if not all(_kernel_takes(t) for t in tensors):
            return torch.nn.utils.get_total_norm(tensors, 2.0, error_if_nonfinite=False, foreach=None)
        first_device = tensors[0].device
        norms = []
        for (device, dtype), ([listed], _) in _group_tensors_by_device_and_dtype([tensors]).items():
            group = [t for t in listed if t is not None]  # (typed Optional; every tensor given is there)
            given = [_recorded(t) for t in group] if _records else None
            # kernels launch on the current device: a model spread over GPUs has a group per device
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                norms.append(K.norms(group, given).to(dtype))  # as _foreach_norm returns them: the tensors' dtype
        return torch.linalg.vector_norm(torch.cat([n.to(first_device) for n in norms]), 2.0)
    finally:
        _records.clear()  # a record serves one norm
