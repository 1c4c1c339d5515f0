"""Argument checks of the routed expert MLP (novatune.ops.moe.moe_experts, moe_lora.moe_experts_lora): shapes,
dtypes and devices that fit together, and expert ids in [0, E), checked without a host sync on a device."""
from __future__ import annotations

from collections.abc import Collection

import torch
from torch import Tensor


def check_experts_args(x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor, transposed: bool,
                       activation: str, gate_up_bias: Tensor | None, down_bias: Tensor | None,
                       activations: Collection[str]) -> None:
    """ValueError / TypeError naming the mismatch when the expert MLP's arguments do not fit together (shapes,
    dtypes, devices); `activations`: the activation names the op implements. The ids' range is check_expert_ids."""
    if x.dim() != 2 or ids.dim() != 2 or ids.shape != weights.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(f"moe_experts: x must be (T, H) and ids, weights (T, K); got {tuple(x.shape)}, "
                         f"{tuple(ids.shape)}, {tuple(weights.shape)}")
    if activation not in activations:
        raise ValueError(f"moe_experts: activation {activation!r} unknown; available: {sorted(activations)}")
    if gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(f"moe_experts: the expert weights do not match: gate_up and down must be 3-D, (E, 2I, H) "
                         f"and (E, H, I) (transposed: (E, H, 2I), (E, I, H)); got {tuple(gate_up.shape)} / "
                         f"{tuple(down.shape)}")
    e, h, two_i = gate_up.shape[0], x.shape[1], gate_up.shape[2 if transposed else 1]
    shapes = {"gate_up": (e, h, two_i) if transposed else (e, two_i, h),
              "down": (e, two_i // 2, h) if transposed else (e, h, two_i // 2),
              "gate_up_bias": (e, two_i), "down_bias": (e, h)}
    layout = "(E, H, 2I) / (E, I, H)" if transposed else "(E, 2I, H) / (E, H, I)"
    for name, t in zip((*shapes, "ids", "weights"), (gate_up, down, gate_up_bias, down_bias, ids, weights)):
        if t is not None and name in shapes and (two_i % 2 or tuple(t.shape) != shapes[name]):
            raise ValueError(f"moe_experts: the expert weights do not match x: {name} must be {shapes[name]} "
                             f"(gate_up / down {layout}, biases (E, 2I) / (E, H); x (T, H = {h}), E = {e}, "
                             f"2I = {two_i} even); got {tuple(t.shape)}")
        if t is not None and t.device != x.device:
            raise ValueError(f"moe_experts: {name} is on {t.device} but x on {x.device}: move them to one device")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"moe_experts: ids must be integer expert indices, got {ids.dtype}")
    if gate_up.is_cuda and (gate_up.dtype != torch.bfloat16 or down.dtype != torch.bfloat16):
        raise ValueError(f"moe_experts on CUDA runs torch's grouped_mm, which takes bf16 only; the expert weights "
                         f"are {gate_up.dtype}/{down.dtype}: train in bf16, or patch with moe=False")


def check_expert_ids(ids: Tensor, num_experts: int) -> None:
    """Ids outside [0, E) would index out of bounds (the sort's narrow keys also wrap them onto other experts). On
    the host: a ValueError. On a device: torch._assert_async, queued with the kernels (it fails the stream, as an
    out-of-range index in PyTorch's CUDA ops does) instead of a host sync every layer."""
    if ids.device.type == "cpu" and type(ids) is torch.Tensor and not torch.compiler.is_compiling():
        lo, hi = torch.aminmax(ids) if ids.numel() else (0, 0)
        if int(lo) < 0 or int(hi) >= num_experts:
            raise ValueError(f"moe_experts: expert ids must lie in [0, {num_experts}) (E = gate_up.shape[0]), got "
                             f"ids in [{int(lo)}, {int(hi)}]")
        return
    torch._assert_async(((ids >= 0) & (ids < num_experts)).all(),
                        f"moe_experts: an expert id is outside [0, {num_experts})")
