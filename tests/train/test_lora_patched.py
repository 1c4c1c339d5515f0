"""The trainer with method.type=lora and model.patch on: novatune's fused LoRA linears (and the rest of the patch)
train the same loss curve as PEFT stock, dropout included (PEFT's own dropout draws: novatune/patch/lora.py).

fp32 on the CPU with NOVATUNE_BACKEND=reference (the ops' PyTorch references, not the Triton interpreter): the
patched and stock steps differ only in summation order (~1e-6 per step); 4 optimizer steps at lr 1e-2 compound
that to ~1e-5 at most, so rel 1e-4 is a tight bound that a wrong dropout mask (several % per step) fails.
"""
import pytest

from novatune.train.loop import train


def _quiet():
    from rich.console import Console

    return Console(quiet=True)


def test_lora_patched_same_loss_curve_as_peft_stock(make_cfg, monkeypatch, reference_backend):
    reference_backend()
    lora = {"type": "lora", "r": 4, "alpha": 8, "dropout": 0.1}
    steps = {"max_steps": 4, "lr": 1e-2}
    stock = train(make_cfg("stock", method=lora, train=steps, model={"patch": False}), console=_quiet())
    fused = train(make_cfg("fused", method=lora, train=steps, model={"patch": True}), console=_quiet())
    reps = fused.patch_report
    assert reps is not None and len(reps.replaced("lora")) == 7 * 2 and not reps.skipped("lora")
    assert sorted(fused.losses) == sorted(stock.losses) == [1, 2, 3, 4]
    for s in stock.losses:
        assert fused.losses[s] == pytest.approx(stock.losses[s], rel=1e-4), s
