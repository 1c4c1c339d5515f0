"""The MLP tiled along the sequence (novatune/patch/tiled.py): the same values and gradients as the untiled MLP,
and the (tokens x intermediate) activations never allocated whole, in the forward or the backward.

Chunks are made tiny here (CHUNK_BYTES / MIN_CHUNK_ROWS patched) so a 2 x 37-token batch splits into several
chunks, the last one short. fp32 throughout; tolerances: outputs are the same GEMMs row by row (equal up to BLAS
blocking, ~1e-7 relative); weight gradients are sums over chunks of per-chunk GEMMs (reassociation, ~1e-6).
"""
from __future__ import annotations

import pytest
import torch
from tiny_models import packed_batch, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from novatune.patch import tiled
from novatune.patch.apply import patch
from novatune.patch.tiled import MLPTiling, tiled_rows

ROWS_PER_CHUNK = 16


@pytest.fixture
def small_chunks(monkeypatch):
    # 16-row chunks for intermediate 96 in fp32: CHUNK_BYTES = 16 x 96 x 4, no floor
    monkeypatch.setattr(tiled, "CHUNK_BYTES", ROWS_PER_CHUNK * 96 * 4)
    monkeypatch.setattr(tiled, "MIN_CHUNK_ROWS", 0)
    monkeypatch.setattr(tiled, "AUTO_MIN_BYTES", 0)


class LargestTensor(TorchDispatchMode):
    """The most elements any op produced while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _mlp_and_input(seed=0):
    model = tiny_model("qwen3", seed=seed)
    x = torch.randn(2, 37, 64, generator=torch.Generator().manual_seed(seed + 1))
    return model.model.layers[0].mlp, x


def _run(mlp, x, fn):
    x = x.clone().requires_grad_(True)
    for p in mlp.parameters():
        p.grad = None
    gy = torch.randn(2, 37, 64, generator=torch.Generator().manual_seed(7))
    with LargestTensor() as mode:
        y = fn(x)
        y.backward(gy)
    return y.detach(), x.grad, {n: p.grad for n, p in mlp.named_parameters()}, mode.largest


def test_tiled_rows_same_values_and_grads_no_whole_intermediate():
    mlp, x = _mlp_and_input()
    y0, dx0, g0, big0 = _run(mlp, x, mlp)
    y1, dx1, g1, big1 = _run(mlp, x, lambda t: tiled_rows(mlp, t, ROWS_PER_CHUNK))
    torch.testing.assert_close(y1, y0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx1, dx0, rtol=1e-5, atol=1e-6)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-6, msg=n)
    whole = 2 * 37 * 96  # one (tokens x intermediate) tensor
    assert big0 >= whole
    assert big1 < whole and big1 <= max(ROWS_PER_CHUNK * 96, 96 * 64), big1  # a chunk's, or a weight's


def _loss_and_grads(model, ids, pos, lab):
    for p in model.parameters():
        p.grad = None
    out = model(input_ids=ids, position_ids=pos, labels=lab, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("swiglu", [True, False])
@pytest.mark.parametrize("lora", [False, True])
def test_patched_model_tiled_equals_untiled_under_checkpointing(small_chunks, monkeypatch, swiglu, lora):
    # the trainer's setting: gradient checkpointing (non-reentrant) around each layer, the tiled MLP inside it;
    # with LoRA the adapters' gradients go through the chunks' recompute too
    calls = []
    real = tiled.checkpoint
    monkeypatch.setattr(tiled, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids, pos, lab = packed_batch([[20, 17], [37]])
    results = []
    for mode in (False, True):
        model = tiny_model("qwen3", seed=3)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    torch.nn.init.normal_(p, std=0.1)  # B = 0 at init would hide a wrong adapter gradient
        model.train()
        report = patch(model, swiglu=swiglu, tiled_mlp=mode)
        kind = "mlp" if swiglu else "tiled_mlp"
        assert bool(report.replaced(kind)) == (swiglu or mode), report
        results.append(_loss_and_grads(model, ids, pos, lab))
    # 2 layers x 74 tokens in 16-row chunks = 5 chunks each; the forward, then the layer recompute in backward
    assert len(calls) == 2 * 5 * 2, len(calls)
    (l0, g0), (l1, g1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-6, atol=1e-6)
    assert sorted(g0) == sorted(g1) and g0
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-6, msg=n)


def test_auto_tiles_only_long_batches():
    x = torch.empty(1, 4096, 8, dtype=torch.bfloat16)
    auto = MLPTiling("auto", 9728)
    assert not auto.applies(x)  # 4096 x 9728 x 2 bytes = 76 MiB: below 1 GiB
    long = torch.empty(1, 65536, 8, dtype=torch.bfloat16)  # 1.19 GiB of intermediate
    assert auto.applies(long) and auto.chunk_rows(long) == 13568  # 256 MiB / (9728 x 2), a multiple of 256
    assert MLPTiling(True, 9728).applies(torch.empty(1, 20000, 8, dtype=torch.bfloat16))
    assert not MLPTiling(True, 9728).applies(x)  # one chunk: nothing to tile
    assert not MLPTiling(False, 9728).applies(long)


def test_bad_mode_is_an_error():
    model = tiny_model("qwen3")
    with pytest.raises(ValueError, match="tiled_mlp='yes'.*'auto', True or False"):
        patch(model, tiled_mlp="yes")
    with pytest.raises(ValueError, match="tiled_mlp=1"):
        patch(model, tiled_mlp=1)
