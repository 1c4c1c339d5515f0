"""memory.embeddings_on_host through the run: config checks that name the fix, the plan without the table on the
device, and (GPU) the run builder's losses and memory beside the same run with the table on the device."""
from __future__ import annotations

import pytest

from novatune.train.config import ConfigError


@pytest.mark.parametrize("sections, match", [
    ({"method": {"type": "full"}}, "full fine-tuning trains the input embedding"),
    ({"method": {"type": "qlora"}}, "method.quantize_embeddings"),
    ({"method": {"type": "lora"}, "parallel": {"strategy": "ddp"}}, "parallel.strategy: none"),
    ({"method": {"type": "lora"}, "model": {"device": "cpu"}}, "in host memory already"),
])
def test_config_checks_name_the_fix(make_cfg, sections, match):
    if sections["method"]["type"] == "qlora":
        pytest.importorskip("bitsandbytes")  # qlora's own check comes first
    sections = {**sections, "memory": {"embeddings_on_host": True}}
    sections.setdefault("model", {}).setdefault("device", "cuda")
    sections["model"].setdefault("dtype", "bf16")
    with pytest.raises(ConfigError, match=match):
        make_cfg(**sections)


def test_the_plan_takes_the_table_off_the_device(make_cfg):
    from novatune.train.plan import plan, render
    from tests.train.conftest import TINY_ARCH

    def est(on, tied=False):
        cfg = make_cfg(method={"type": "lora"}, memory={"embeddings_on_host": on}, model={
            "device": "cuda", "dtype": "bf16", "arch_overrides": {**TINY_ARCH, "tie_word_embeddings": tied}})
        return plan(cfg, gpu_mem_gib=80)

    off, on = est(False), est(True)
    table = on["host_embedding"]
    assert off["host_embedding"] == 0 and table > 0
    assert off["weights"] - on["weights"] == table
    assert off["memory_plan"].peak_bytes - on["memory_plan"].peak_bytes == table
    assert on["peak_stock"] == off["peak_stock"]  # stock keeps its table on the device
    assert "input embedding table on the host" in render(on) and "on the host" not in render(off)
    # a table the build would refuse is refused by the plan, before any weight loads
    with pytest.raises(ConfigError, match="tied to lm_head"):
        est(True, tied=True)


@pytest.mark.gpu
def test_the_run_builder_trains_the_same_with_the_table_on_the_host(make_cfg):
    """LoRA through the whole builder (novatune.patch, checkpointing): the same losses as the table on the device
    (the gather copies the same values), and the table's bytes off the device."""
    import torch

    from novatune.train.session import build
    from tests.train.conftest import TINY_ARCH

    def run(name, on):
        cfg = make_cfg(name, method={"type": "lora"}, model={
            "device": "cuda", "dtype": "bf16", "patch": True,
            "arch_overrides": {**TINY_ARCH, "vocab_size": 32768, "hidden_size": 256, "tie_word_embeddings": False}},
            memory={"gradient_checkpointing": True, "embeddings_on_host": on})
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        s = build(cfg)
        held = torch.cuda.memory_allocated() - before
        losses = [s.step(s.next_micro_batches()).loss.item() for _ in range(3)]
        emb = s.inner_model.get_input_embeddings().weight
        out = (held, losses, emb.device.type)
        del s
        return out

    held_dev, losses_dev, where_dev = run("device", False)
    held_host, losses_host, where_host = run("host", True)
    assert (where_dev, where_host) == ("cuda", "cpu")
    assert losses_host == losses_dev
    table = 32768 * 256 * 2
    assert held_dev - held_host >= 0.95 * table
