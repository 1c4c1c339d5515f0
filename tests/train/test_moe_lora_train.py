"""method.target_parameters through the run builder: PEFT adapters on the routed experts' weights ([experts]),
built by train/model.py the same way for the stock and the novatune stacks; patched, the adapters run inside the
grouped GEMMs and one training micro-step gives stock's loss and gradients (fp32, tolerance as
tests/patch/test_moe_lora_patch.py); the memory plan counts the expert adapters PEFT creates."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from novatune.data.dataset import BatchStream, build_data
from novatune.train.model import SetupError, apply_patch, build_model, load_tokenizer, prepare
from novatune.train.plan import plan
from novatune.train.session import forward_backward

pytest.importorskip("peft")
TINY_MOE = dict(hidden_size=32, moe_intermediate_size=16, intermediate_size=64, num_experts=5,
                num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                vocab_size="auto")
LORA = {"type": "lora", "r": 4, "alpha": 8, "targets": ["q_proj", "v_proj"], "target_parameters": ["experts"]}


def _moe_cfg(make_cfg, patch: bool):
    return make_cfg(model={"arch": "qwen3-30b-a3b", "arch_overrides": dict(TINY_MOE), "patch": patch},
                    method=dict(LORA))


def _micro_step(cfg, monkeypatch):
    monkeypatch.setenv("NOVATUNE_BACKEND", "reference")  # the kernels have their own tests; this checks the wiring
    tok = load_tokenizer(cfg.model)
    data = build_data(cfg.data, tok, len(tok))
    model = prepare(build_model(cfg.model, torch.device("cpu"), torch.float32, tok, seed=0), cfg)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero: make the adapters change the result
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    report = apply_patch(model, cfg.model)
    batch = [BatchStream(data.rows[:2], micro_batch=2, shuffle=False).next()]
    loss = forward_backward(model, batch, torch.device("cpu"), "host" if report is not None else None)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return model, report, loss, grads


def test_expert_lora_from_the_config_equals_stock(make_cfg, monkeypatch):
    model, report, loss, grads = _micro_step(_moe_cfg(make_cfg, True), monkeypatch)
    _, none, loss_ref, grads_ref = _micro_step(_moe_cfg(make_cfg, False), monkeypatch)
    assert none is None
    assert len(report.replaced("moe_lora")) == 2 and not report.skipped("moe_lora")
    expert_adapters = [n for n in grads if "experts" in n and "lora_" in n]
    assert len(expert_adapters) == 2 * 2 * 2, expert_adapters  # 2 layers x (gate_up, down) x (A, B)
    torch.testing.assert_close(loss, loss_ref, rtol=2e-5, atol=1e-6)
    assert grads.keys() == grads_ref.keys()
    for n in grads_ref:
        torch.testing.assert_close(grads[n], grads_ref[n], rtol=2e-5, atol=1e-6, msg=n)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert plan(_moe_cfg(make_cfg, True))["trainable"] == trainable


def test_expert_targets_on_a_dense_model_and_dropout_are_clear_errors(make_cfg):
    from novatune.train.config_checks import ConfigError

    cfg = make_cfg(method=dict(LORA))  # the dense tiny Qwen3
    tok = load_tokenizer(cfg.model)
    with pytest.raises(SetupError, match="no routed-experts module"):
        prepare(build_model(cfg.model, torch.device("cpu"), torch.float32, tok, seed=0), cfg)
    with pytest.raises(ConfigError, match="method.dropout"):
        make_cfg(method=dict(LORA, dropout=0.1))


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TINY_OVERRIDES = [f"model.arch_overrides.{k}={v}" for k, v in dict(TINY_MOE, num_hidden_layers=3, vocab_size=257)
                  .items()] + ["model.device=cpu", "model.dtype=fp32"]


def test_whole_model_lora_config_builds_layer_by_layer_then_fuses_every_layer(monkeypatch):
    """examples/qwen3-30b-a3b-lora.yaml at toy sizes (the same keys; only the shapes overridden): the low-memory
    build places one decoder layer at a time (every later layer still on the meta device: the whole model never
    exists in another form), then PEFT adapts attention and experts and the patch fuses every layer's experts."""
    from novatune.train.config import load

    cfg = load(EXAMPLES / "qwen3-30b-a3b-lora.yaml", TINY_OVERRIDES)
    assert cfg.model.low_memory_load and cfg.model.arch == "qwen3-30b-a3b" and "num_hidden_layers" not in \
        load(EXAMPLES / "qwen3-30b-a3b-lora.yaml").model.arch_overrides  # the whole 48-layer architecture
    placed = []

    def on_unit(model, path):
        layers = model.model.layers
        done = [i for i, layer in enumerate(layers) if not any(p.is_meta for p in layer.parameters())]
        assert done == list(range(len(done))), done
        placed.append((path, len(done)))

    model = build_model(cfg.model, torch.device("cpu"), torch.float32, seed=0, on_unit=on_unit)
    assert [n for p, n in placed if p.startswith("model.layers.")] == [1, 2, 3]
    model = prepare(model, cfg)
    monkeypatch.setenv("NOVATUNE_BACKEND", "reference")
    report = apply_patch(model, cfg.model)
    assert len(report.replaced("moe_lora")) == 3 and len(report.replaced("lora")) == 3 * 4


@pytest.mark.parametrize("name", ["qwen3-30b-a3b-moe-lora.yaml", "gpt-oss-20b-cut.yaml"])
def test_example_configs_load_and_plan(name):
    from novatune.train.config import load

    cfg = load(EXAMPLES / name)
    est = plan(cfg, gpu_mem_gib=139.8)
    assert not est.get("oom") and est["trainable"] > 0
