"""Schedules, FLOPs/MFU arithmetic (docs/BENCHMARKS.md's formula), the memory planner, the metrics files."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from novatune.train.arch import arch_config, count_matmul_params
from novatune.train.config import ConfigError, load
from novatune.train.metrics import PEAK_BF16_TFLOPS, MetricsLog, flops_per_token, peak_tflops
from novatune.train.optim import lr_lambda, warmup_steps
from novatune.train.plan import GiB, plan, render

REPO = Path(__file__).resolve().parents[2]


def test_schedules():
    assert warmup_steps(0.1, 100) == 10 and warmup_steps(5, 100) == 5
    w = [lr_lambda(s, 10, 2, "cosine", 0.0) for s in range(10)]
    assert w[0] == 0.5 and w[1] == 1.0 and w[2] == 1.0  # linear warmup, then the decay starts at 1
    assert all(a >= b for a, b in zip(w[1:], w[2:])) and w[-1] == pytest.approx(0.5 * (1 + torch.cos(
        torch.tensor(7 / 8 * torch.pi)).item()))
    lin = [lr_lambda(s, 10, 0, "linear", 0.1) for s in range(11)]
    assert lin[0] == 1.0 and lin[10] == pytest.approx(0.1) and lin[5] == pytest.approx(0.55)
    assert lr_lambda(7, 10, 2, "constant", 0.0) == 1.0


def test_flops_per_token_matches_benchmarks():
    cfg = arch_config("qwen3-4b")
    n = count_matmul_params(cfg)
    assert n == pytest.approx(4.02e9, rel=0.01)  # matmul params incl. the (tied) lm_head
    # ~25 GFLOP/token at the headline workload's average context (~300-400 attended keys)
    f = flops_per_token(cfg, avg_keys=350)
    assert 24e9 < f < 26.5e9
    assert flops_per_token(cfg, 350, trainable_matmul_frac=0.0) == pytest.approx(f - 2 * n)


def test_peak_table():
    assert peak_tflops(torch.device("cpu")) is None  # CPU: MFU n/a
    assert peak_tflops(torch.device("cpu"), configured=500.0) == 500.0
    assert PEAK_BF16_TFLOPS["H100"] == PEAK_BF16_TFLOPS["H200"] == 989.0 and PEAK_BF16_TFLOPS["A100"] == 312.0


def test_plan_headline_workload_matches_the_anchor():
    cfg = load(REPO / "examples" / "qwen3-4b-seed.yaml", ["model.patch=false"])
    est = plan(cfg, gpu_mem_gib=141)
    # stock HF with checkpointing measured 39.0 GiB peak on the H200 (docs/BENCHMARKS.md)
    assert 35 * GiB < est["peak"] < 43 * GiB and not est["oom"]
    assert est["weights"] == pytest.approx(4.02e9 * 2, rel=0.01) and est["optimizer"] == 2 * est["weights"]
    est40 = plan(cfg, gpu_mem_gib=40)
    assert est40["oom"] and "WARNING" in render(est40)
    no_ckpt = plan(load(REPO / "examples" / "qwen3-4b-seed.yaml", ["memory.gradient_checkpointing=false"]),
                   gpu_mem_gib=24)
    assert no_ckpt["activations_no_ckpt"] > 10 * no_ckpt["activations_ckpt"]
    assert any("gradient_checkpointing=true" in t for t in no_ckpt["advice"])
    lora = plan(load(REPO / "examples" / "lora.yaml"), gpu_mem_gib=80)
    assert 20e6 < lora["trainable"] < 40e6  # r16 all-linear: ~33M adapters
    # PEFT keeps the adapters in fp32 over a bf16 base: fp32 gradients and AdamW moments
    assert lora["gradients"] == 4 * lora["trainable"] and lora["optimizer"] == 2 * 4 * lora["trainable"]


def test_metrics_log_truncates_on_resume(tmp_path):
    m = MetricsLog(tmp_path, tensorboard=False)
    for s in range(1, 6):
        m.write({"step": s, "loss": 1.0 / s})
    m.close()
    MetricsLog(tmp_path, tensorboard=False, resume_step=3).close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]


def test_metrics_nonfinite_is_json_null(tmp_path):
    m = MetricsLog(tmp_path, tensorboard=False)
    m.write({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3})
    m.close()

    def bare(c):
        raise ValueError(c)

    (row,) = [json.loads(x, parse_constant=bare) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert row["loss"] is None and row["grad_norm"] is None and row["lr"] == 1e-3


def test_metrics_torn_last_line_is_dropped_with_a_warning(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "lo')
    MetricsLog(tmp_path, tensorboard=False, resume_step=4).close()
    assert "unreadable" in capsys.readouterr().out
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3]
    m = MetricsLog(tmp_path, tensorboard=False, resume_step=3)
    m.write({"step": 4, "loss": 0.5})
    m.close()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3, 4]


def test_metrics_rewrite_on_resume_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    text = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 6))
    path.write_text(text)
    real_write = Path.write_text

    def killed(self, data, *a, **k):  # the process dies halfway through writing
        real_write(self, data[: len(data) // 2], *a, **k)
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", killed)
    with pytest.raises(KeyboardInterrupt):
        MetricsLog(tmp_path, tensorboard=False, resume_step=3)
    monkeypatch.undo()
    assert path.read_text() == text  # the history is intact


def test_metrics_untouched_when_nothing_to_drop(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2)))
    inode = path.stat().st_ino
    MetricsLog(tmp_path, tensorboard=False, resume_step=2).close()
    assert path.stat().st_ino == inode


def test_moe_matmul_params_count_the_active_experts():
    """Qwen3-30B-A3B: ~3.0B parameters active per token (the "A3B"); the 8-layer MoE bench cut: 766M, so ~4.6
    GFLOP/token before attention (docs/BENCHMARKS.md's MoE anchor: 4.78 with attention)."""
    assert count_matmul_params(arch_config("qwen3-30b-a3b")) == pytest.approx(3.04e9, rel=0.01)
    cut = arch_config("qwen3-30b-a3b", {"num_hidden_layers": 8})
    assert count_matmul_params(cut) == pytest.approx(766.2e6, rel=1e-3)
    dense_layer = arch_config("qwen3-30b-a3b", {"num_hidden_layers": 2, "mlp_only_layers": [0]})
    h = 2048
    attention = h * (4096 + 2 * 512) + 4096 * h
    assert count_matmul_params(dense_layer) == (2 * attention + 3 * h * 6144 + h * 128 + 8 * 3 * h * 768
                                                + h * 151936)


SELECTIVE_X5 = ["memory.policy=per-layer", "memory.layers=[recompute,recompute,recompute,selective,selective,"
                "selective,selective,selective]", "model.patch_options.cross_entropy_mode=vocab"]


# measured with the input embedding's gradient dense and lm_head's from the backward (before memory.embedding_grad
# and memory.lm_head_grad_in_forward)
DENSE = ["memory.embedding_grad=dense", "memory.lm_head_grad_in_forward=false"]


@pytest.mark.parametrize("config,overrides,measured,rel", [
    ("qwen3-30b-a3b-moe", DENSE, 43.205, 0.01),  # checkpointing
    ("qwen3-30b-a3b-moe", DENSE + ["memory.policy=auto"], 45.204, 0.01),  # every layer kept
    ("qwen3-30b-a3b-moe", DENSE + SELECTIVE_X5, 43.178, 0.01),  # a recomputed layer's backward is the peak
])
def test_the_moe_cut_plans_its_measured_peaks(config, overrides, measured, rel):
    """The Qwen3-30B-A3B cut (H200, `session20-3`, `session20-4`). A sparse layer is planned as routed: the
    expert op keeps its gate/up output and no product, and its backward works on top-k rows per token."""
    cfg = load(REPO / "examples" / f"{config}.yaml", overrides)
    est = plan(cfg, gpu_mem_gib=141)
    assert est["peak"] == pytest.approx(measured * GiB, rel=rel)


# Graphed LoRA/QLoRA runs, measured with the CUDA graphs' pool counted (H200; novatune/measure/gpu_memory.py):
# (config, peak GiB, of it the pool, the frozen-head loss chunk of the measured code). The plans stand 4-10% under:
# the pool coexists with the eager memory (planned so) and is planned within 15% (QLoRA's with its dequantised
# weights in it), but the allocated part stands ~0.4-0.8 GiB above the plan's: not yet explained (LOG.md,
# sessions 21-22). The MoE cut was measured in session22-6, the LoRA and QLoRA examples in session23-3, all with a
# frozen lm_head's loss chunks at 128 MiB (the chunk stays a column: a later change of it re-plans at the measured one).
GRAPHED_PEAKS = [("qwen3-30b-a3b-moe-lora", 13.085, 0.633, 128 << 20), ("lora", 10.496, 0.535, 128 << 20),
                 ("qlora", 7.771, 0.691, 128 << 20)]


def _graphed_plan(config: str, chunk_bytes: int, monkeypatch) -> dict:
    from novatune.kernels import linear_cross_entropy

    monkeypatch.setattr(linear_cross_entropy, "FROZEN_HEAD_LOGITS_BYTES", chunk_bytes)
    return plan(load(REPO / "examples" / f"{config}.yaml", []), gpu_mem_gib=141)


@pytest.mark.parametrize("config,measured,pool,chunk", GRAPHED_PEAKS)
def test_graphed_plans_stand_within_ten_percent_of_their_peaks(config, measured, pool, chunk, monkeypatch):
    est = _graphed_plan(config, chunk, monkeypatch)
    assert 0.9 * measured * GiB <= est["peak"] <= 1.1 * measured * GiB
    assert 0.8 * pool * GiB <= est["memory_plan"].graph_pool_bytes <= 1.1 * pool * GiB


@pytest.mark.xfail(strict=True, reason="graphed plans stand under their measured peaks (the constants' comment)")
@pytest.mark.parametrize("config,measured,pool,chunk", GRAPHED_PEAKS)
def test_graphed_plans_stand_at_or_above_their_peaks(config, measured, pool, chunk, monkeypatch):
    est = _graphed_plan(config, chunk, monkeypatch)
    assert est["peak"] >= measured * GiB


@pytest.mark.parametrize("arch,per_expert", [("gpt-oss-20b", 2880), ("qwen3-30b-a3b", 768)])
def test_sparse_layers_are_planned_at_their_top_k_experts(arch, per_expert):
    """A token multiplies by top-k experts (GPT-OSS's intermediate_size is one expert's; Qwen3-MoE's is the unused
    dense size, moe_intermediate_size the expert's). Under `selective` the routed experts run again (their grouped
    GEMMs are not among the ops it keeps)."""
    from dataclasses import replace

    from novatune.memory import planner
    from novatune.train.memory import ASSUMED, layer_costs, layer_shape
    from novatune.train.model import model_config

    cfg = load(REPO / "examples" / "qwen3-4b-seed.yaml", [f"model.arch={arch}",
                                                         "model.arch_overrides.num_hidden_layers=2"])
    mconf = model_config(cfg.model, None, None)
    costs = layer_costs(cfg, mconf, ASSUMED)
    shape = replace(layer_shape(cfg, mconf, 1.0), intermediate=mconf.num_experts_per_tok * per_expert, routed=True,
                    top_k=mconf.num_experts_per_tok, mlp_chunk_tokens=None)
    assert costs == [planner.layer_cost(shape, ASSUMED)] * 2
    dense = planner.layer_cost(replace(shape, routed=False), ASSUMED)
    experts_forward = 2 * shape.tokens * 3 * shape.hidden * shape.intermediate / (
        ASSUMED.matmul_tflops * 1e12 * planner.GEMM_EFFICIENCY)
    assert costs[0].seconds["selective"] - costs[0].seconds["keep"] >= experts_forward
    elementwise = dense.seconds["selective"] - dense.seconds["keep"] - planner.SELECTIVE_DISPATCH_S
    assert elementwise < experts_forward / 4
    assert costs[0].bytes["keep"] < dense.bytes["keep"]  # the product is not kept


def test_the_loss_logits_buffer_is_a_transient_of_its_own():
    """The fused loss runs at the end of the forward, apart from any layer's recompute: its logits buffer (as the
    kernel plans it) is one transient, the recomputed layer's another, and the peak takes the larger. The seed's
    full fine-tuning writes lm_head's gradient into the (tokens x vocab) logits (1.16 GiB, above the layer's
    0.42): measured 32.0 GiB (H200, novatune with checkpointing), planned 31.25 without this term, 31.99 with it."""
    from novatune.kernels.linear_cross_entropy import plan_mode
    from novatune.train.memory import loss_transient_bytes
    from novatune.train.model import model_config

    seed = load(REPO / "examples" / "qwen3-4b-seed.yaml")
    mconf = model_config(seed.model, None, None)
    T, V, H = 4096, mconf.vocab_size, mconf.hidden_size
    assert loss_transient_bytes(seed, mconf) == T * V * 2  # "inplace": the logits hold grad_W
    lora = load(REPO / "examples" / "qwen3-4b-seed.yaml", ["method.type=lora"])
    chunk = plan_mode(T, V, H, torch.bfloat16, grad_weight=False)[1]
    assert chunk < T and loss_transient_bytes(lora, mconf) == chunk * V * 2  # one token chunk, no grad_W
    long = load(REPO / "examples" / "qwen3-4b-seed.yaml", ["data.max_length=65536"])
    mode, cols = plan_mode(65536, V, H, torch.bfloat16, grad_weight=True)
    assert mode == "vocab" and loss_transient_bytes(long, mconf) == 65536 * cols * 2 + 65536 * H * 4
    # the mode the patch is told to run: vocab slices instead of the in-place logits
    sliced = load(REPO / "examples" / "qwen3-4b-seed.yaml", ["model.patch_options.cross_entropy_mode=vocab"])
    mode, cols = plan_mode(T, V, H, torch.bfloat16, grad_weight=True, mode="vocab")
    assert loss_transient_bytes(sliced, mconf) == T * cols * 2 + T * H * 4 < T * V * 2 // 4
    stock = load(REPO / "examples" / "qwen3-4b-seed.yaml", ["model.patch=false"])
    assert loss_transient_bytes(stock, mconf) == 0  # stock HF's logits are counted as static
    with pytest.raises(ConfigError, match="cross_entropy_mode"):
        load(REPO / "examples" / "qwen3-4b-seed.yaml", ["model.patch_options.cross_entropy_mode=chunks"])
    est = plan(seed, gpu_mem_gib=141)
    mp = est["memory_plan"]
    assert mp.outside_transient_bytes == T * V * 2 and mp.transient_bytes == T * V * 2
    assert est["peak"] == mp.static_bytes + mp.activation_bytes + T * V * 2
    assert 31.995 * 0.99 * GiB <= est["peak"] <= 31.995 * 1.04 * GiB
    assert "loss working memory" in render(est)


def test_the_loss_plan_follows_gemma2s_final_soft_cap():
    """A soft-capped loss never runs in place (its gradient needs the logits): planned as the kernel plans it;
    a cap of 0 is no cap, as the patch reads it."""
    from novatune.kernels.linear_cross_entropy import plan_mode
    from novatune.train.memory import loss_transient_bytes
    from novatune.train.model import model_config

    capped = load(REPO / "examples" / "gemma-2-2b.yaml")
    mconf = model_config(capped.model, None, None)
    T, V, H = capped.data.max_length, mconf.vocab_size, mconf.hidden_size
    assert mconf.final_logit_softcapping
    mode, size = plan_mode(T, V, H, torch.bfloat16, grad_weight=True, softcap=mconf.final_logit_softcapping)
    assert mode == "vocab" and loss_transient_bytes(capped, mconf) == T * size * 2 + T * H * 4
    asked_inplace = load(REPO / "examples" / "gemma-2-2b.yaml", ["model.patch_options.cross_entropy_mode=inplace"])
    assert loss_transient_bytes(asked_inplace, mconf) == T * size * 2 + T * H * 4  # the patch refuses it anyway
    mconf.final_logit_softcapping = 0.0
    assert loss_transient_bytes(capped, mconf) == T * V * 2  # no cap: in place


def test_the_fused_loss_switched_off_plans_stock_logits():
    """model.patch_options.cross_entropy false keeps HF's loss: its logits are static, no fused buffer."""
    from novatune.train.memory import loss_transient_bytes
    from novatune.train.model import model_config

    off = load(REPO / "examples" / "qwen3-4b-seed.yaml", ["model.patch_options.cross_entropy=false"])
    on = load(REPO / "examples" / "qwen3-4b-seed.yaml")
    assert loss_transient_bytes(off, model_config(off.model, None, None)) == 0
    est_off, est_on = plan(off, gpu_mem_gib=141), plan(on, gpu_mem_gib=141)
    assert est_off["memory_plan"].static_bytes - est_on["memory_plan"].static_bytes == est_off["logits_stock"]


def test_plan_prints_each_kind_of_layer():
    """A Qwen-MoE config with dense layers among the routed ones (mlp_only_layers): `novatune plan` prints one cost
    block per kind of layer, each naming its layers; a uniform model prints one block, as before."""
    from novatune.train.plan import render

    mixed = render(plan(load(REPO / "examples" / "qwen3-30b-a3b-moe.yaml",
                             ["model.arch_overrides.mlp_only_layers=[0,1,2,5]"]), gpu_mem_gib=141))
    assert "    layers 0-2, 5:\n      keep" in mixed and "    layers 3-4, 6-7:\n      keep" in mixed
    uniform = render(plan(load(REPO / "examples" / "qwen3-30b-a3b-moe.yaml", []), gpu_mem_gib=141))
    assert "layers " not in uniform.split("per decoder layer")[1].split("memory policy")[0]
    assert uniform.count("    recompute  ") == 1
