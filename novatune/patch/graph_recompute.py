"""The backward of a layer whose checkpointed forward replays from a CUDA graph (cuda_graphs="forward",
novatune/patch/graphs.py): the stock checkpoint's recompute and backward, run eagerly.
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from novatune.ops.grad_accumulation import accumulates_into_grad
from novatune.patch.moe import outputs_unread


class Recompute:
    """What a forward-graphed layer's backward needs, fixed at its forward: the call (on the batch's own offsets, or
    the graph's static ones), the input buffer it read (held here: a capture failing later in the batch drops the
    runner's buffers), the trainable parameters, and the forward's autocast state, which the recompute re-enters
    as torch's checkpoint does."""

    def __init__(self, call, src: Tensor, params: list[Tensor], slots: list[tuple], x_grad: bool):
        self.call, self.src, self.params, self.slots, self.x_grad = call, src, params, slots, x_grad
        self.device_type = src.device.type
        self.autocast = dict(enabled=torch.is_autocast_enabled(self.device_type),
                             dtype=torch.get_autocast_dtype(self.device_type),
                             cache_enabled=torch.is_autocast_cache_enabled())


@contextlib.contextmanager
def parameters_as(slots: list[tuple], params: list[Tensor], stand_ins: list[Tensor]):
    """The modules' parameters at `slots` ((module, name) pairs, holding `params`) replaced by `stand_ins` (fresh
    leaves over the same storage) for the block, then put back."""
    try:
        for (m, k), t in zip(slots, stand_ins):
            m._parameters[k] = t
        yield
    finally:
        for (m, k), p in zip(slots, params):
            m._parameters[k] = p


def recompute_backward(rc: Recompute, gout: Tensor):
    """A forward-graphed layer's backward: the stock checkpoint's recompute and backward, eagerly, on the inputs
    its graph read. Where autograd would add every parameter's gradient into an existing .grad itself, with no hook
    or process group to see it (ops/grad_accumulation.accumulates_into_grad: from the second micro-batch of a
    .backward() call), a nested backward makes those additions, so the in-place weight-gradient paths
    (ops/moe_wgrad.py) work as in eager mode; the outer AccumulateGrad then gets no gradient. Anywhere else (the
    first micro-batch, hooks, DDP, torch.autograd.grad, create_graph) the gradients are returned to the caller's
    graph, as eager mode's are. The input's gradient stops at the layer: create_graph reaches no earlier layer
    through it."""
    xin = rc.src.detach().requires_grad_(rc.x_grad)
    nested = bool(rc.params) and all(accumulates_into_grad(p) for p in rc.params)
    # returned gradients are taken on fresh leaves over the parameters' storage: a hook on a parameter then runs
    # once, at the outer AccumulateGrad, as in eager mode
    leaves = list(rc.params) if nested else [p.detach().requires_grad_(True) for p in rc.params]
    inputs = ([xin] if rc.x_grad else []) + leaves
    create = torch.is_grad_enabled()
    # y only roots the backward: its values are never read (MoE experts may skip what produces nothing else)
    with parameters_as(rc.slots, rc.params, leaves), torch.enable_grad(), \
            torch.autocast(rc.device_type, **rc.autocast), outputs_unread():
        y = rc.call(xin)
    if nested:
        torch.autograd.backward(y, gout, inputs=inputs)
        return (xin.grad if rc.x_grad else None), [None] * len(rc.params)
    grads = list(torch.autograd.grad(y, inputs, gout, allow_unused=True, create_graph=create))
    gx = grads.pop(0) if rc.x_grad else None
    return gx, grads
