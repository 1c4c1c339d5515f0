"""`novatune report` from fixture run folders (tests/report/conftest.py): the tables carry the inputs' figures, the
cost math matches hand-worked values, traces are broken down and copied, the HTML is self-contained, and absent
inputs give a report that says so."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from novatune.report import cost
from novatune.report.load import group_rows, latest_per_workload, load_inputs, step_tok_s
from novatune.report.traces import breakdown, classify

STOCK_TOK_S, NOVA_TOK_S = 1000.0, 1564.0
ENV = {"time": "2026-11-21T09:00:00+00:00", "device": "NVIDIA H100 80GB HBM3", "git_sha": "abc1234"}


def bench_row(stack: str, tok_s: float, losses: list[float], step_s: list[float], peak: float) -> dict:
    return {**ENV, "bench": "novatune_bench", "stack": stack, "status": "ok", "config": "examples/qwen3-4b-seed.yaml",
            "overrides": [], "warm": 0, "steps": 1, "tok_s": tok_s, "tokens_per_step": [16384], "step_s": step_s,
            "gflop_per_tok": 24.96, "peak_gib": peak, "losses": losses, "params": 4_000_000_000}


def test_cost_math_by_hand():
    # a worked example: 1,540 -> 2,409 tok/s on an A100
    a = cost.analysis(1540.0, 2409.0, price=1.79, token_budget=1e9, spends=(100_000, 1_000_000))
    assert a["speedup"] == pytest.approx(1.564286, rel=1e-6)
    assert a["cost_reduction"] == pytest.approx(0.360731, rel=1e-5)  # 1 - 1540/2409
    assert a["cost_per_m_before"] == pytest.approx(1.79 / (1540 * 3600) * 1e6)  # $0.3229 per 1M tokens
    assert a["cost_per_m_before"] == pytest.approx(0.32287, rel=1e-4)
    assert a["gpu_hours_before"] == pytest.approx(180.375, rel=1e-4)  # 1e9 / 1540 / 3600
    assert a["gpu_hours_after"] == pytest.approx(115.3086, rel=1e-4)
    assert a["budget_cost_after"] == pytest.approx(115.3086 * 1.79, rel=1e-4)
    (s1, after1, save1), (s2, after2, save2) = a["monthly"]
    assert (s1, round(after1), round(save1)) == (100_000, 63_927, 36_073)  # seed rounds 1.564x: 63,900 / 36,100
    assert round(after2, -2) == 639_300 and after2 + save2 == pytest.approx(s2)


def test_default_prices_and_override():
    assert cost.default_price("NVIDIA H100 80GB HBM3") == cost.DEFAULT_PRICES["H100"]
    assert cost.default_price("NVIDIA A100-SXM4-40GB") == cost.DEFAULT_PRICES["A100"]
    assert cost.default_price("NVIDIA A10G") == cost.DEFAULT_PRICES["A10G"]  # not mistaken for an A100
    assert cost.default_price("cpu") is None
    assert cost.resolve_price("NVIDIA H200", 4.2) == (4.2, "given with --gpu-price")
    price, why = cost.resolve_price("Some TPU", None)
    assert price is None and "--gpu-price" in why


def test_classify_kernels():
    assert classify("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT") == ("GEMM", False)
    assert classify("triton_tem_fused_flex_attention_backward_1") == ("attention", False)
    assert classify("_rms_norm_bwd_kernel") == ("norms", False)
    assert classify("_swiglu_fwd_kernel") == ("activation", False)
    assert classify("multi_tensor_apply_kernel<...>") == ("optimizer", False)
    # a generic elementwise kernel takes the category of the module that launched it
    assert classify("vectorized_elementwise_kernel<mul>", "nn.Module: Qwen3RMSNorm_0 | aten::mul") == ("norms", True)
    assert classify("vectorized_elementwise_kernel<mul>", "modeling_qwen3.py(70): apply_rotary_pos_emb") == \
        ("RoPE", True)
    assert classify("vectorized_elementwise_kernel<mul>") == ("other", False)
    assert classify("whatever", gpu_cat="gpu_memcpy") == ("copies", False)


def test_trace_breakdown_by_hand(fixture_runs):
    b = breakdown(fixture_runs["bench"] / "traces" / "stock.json")
    assert b["kind"] == "gpu" and b["kernels"] == 7
    # 7 us forward (pow inside Qwen3RMSNorm) + 9 us backward (MulBackward0 -> its forward op's module)
    assert b["categories_ms"] == pytest.approx({"norms": 0.016, "GEMM": 0.05, "attention": 0.02, "optimizer": 0.004,
                                                "copies": 0.003, "other": 0.001})
    assert b["total_ms"] == pytest.approx(0.094) and b["attributed"] == 2
    assert b["top"][0][0].startswith("nvjet") and b["top"][0][2] == "GEMM"


def test_cpu_trace_breakdown(tmp_path):
    """A real torch.profiler CPU trace of a tiny HF model: top-level ops, modules found through Python frames."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM

    from novatune.train.arch import arch_config

    model = AutoModelForCausalLM.from_config(arch_config("qwen3-tiny", {"num_hidden_layers": 1}, 501))
    ids = torch.randint(0, 501, (1, 32))
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        model(input_ids=ids, labels=ids).loss.backward()
    prof.export_chrome_trace(str(tmp_path / "cpu.json"))
    b = breakdown(tmp_path / "cpu.json")
    assert b["kind"] == "cpu" and b["total_ms"] > 0
    for cat in ("GEMM", "attention", "norms", "loss"):
        assert b["categories_ms"].get(cat, 0) > 0, (cat, b["categories_ms"])
    assert b["attributed"] > 0


def test_group_rows_and_step_tok_s():
    def row(stack, **kw):
        return {"bench": "e2e", "stack": stack, "arch": "qwen3-4b", "layers": 36, "seq": 4096, "ga": 4, "ckpt": True,
                "tok_s": 1.0, **kw}
    groups = group_rows([row("hf_sdpa"), row("novatune"), row("hf_sdpa"), row("novatune"), row("hf_sdpa", seq=2048)],
                        "x")
    assert [len(g.rows) for g in groups] == [2, 2, 1]  # a repeated stack or another workload starts a new run
    x, y = step_tok_s(row("novatune", warm=2, step_ms=[1000.0, 500.0]))
    assert x == [4, 5] and y == pytest.approx([16384.0, 32768.0])
    x, y = step_tok_s({"warm": 1, "tokens_per_step": [100, 200], "step_s": [9.0, 1.0, 2.0]})
    assert x == [2, 3] and y == pytest.approx([100.0, 100.0])
    # the stacks with their own loop (trl-sft, novatune-train): tokens per timed step over its event time
    x, y = step_tok_s({"stack": "trl-sft", "warm": 2, "seq": 4096, "grad_accum": 4,
                       "tokens_per_step": [16384, 16000], "step_ms": [1000.0, 800.0]})
    assert x == [3, 4] and y == pytest.approx([16384.0, 20000.0])


def test_report_tables(built_report):
    md = built_report["markdown"].read_text()
    fig = built_report["figures"]
    # the speedup is the bench's own figures, not re-measured
    assert fig["speedup"] == pytest.approx(1.564) and fig["baseline"] == "stock"
    assert "1.564x" in md and "| novatune | ok | 1,564 | 1.564 |" in md
    assert "| liger-peer | absent | liger_kernel is not installed" in md
    # cost at --gpu-price 2.0: 2 / (1000 x 3600) x 1e6 = 0.5556 $/1M; 2 / (1564 x 3600) x 1e6 = 0.3552
    assert "| $ per 1M training tokens | 0.5556 | 0.3552 |" in md
    assert "| GPU-hours for 1,000,000,000 tokens | 277.8 | 177.6 |" in md
    assert "36.1%" in md and "| $100,000 | $63,939 | $36,061 |" in md
    assert "given with --gpu-price" in md
    # weight-change table (validate.json's rows, not repeated from weight_change.json beside it)
    assert md.count("| 13 | self_attn.q_proj.weight | CHANGED | CHANGED | MATCH |") == 1
    assert "| loss_parity | pass |" in md
    # eval: the fixture's rows (47/50 vs 48/50), intervals overlap -> sampling noise
    assert "| Accuracy | 0.940 (47/50) | 0.960 (48/50) |" in md and "Avg latency / req (s)" in md
    assert "within sampling noise" in md
    # op-time breakdown: stock before novatune, norms 16 -> 12 us, trace copies beside the report
    assert "| norms | 0.016 | 0.012 | 17.0 | 13.3 | -0.0040 ms (-25%) |" in md
    assert "| category | stock ms | novatune ms |" in md
    assert sorted(p.name for p in built_report["traces"]) == ["novatune.json", "stock.json"]
    assert all(p.exists() for p in built_report["traces"])
    for png in ("loss.png", "tok_s.png", "tok_s_steps.png", "breakdown.png"):
        assert (built_report["out"] / "plots" / png).stat().st_size > 5000


def test_html_is_self_contained(built_report):
    page = built_report["html"].read_text()
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//|file:)""", page, re.IGNORECASE)
    assert "<link" not in page and "<script" not in page and "@import" not in page
    imgs = re.findall(r'<img alt="[^"]*" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(imgs) >= 4
    import base64

    assert all(base64.b64decode(i)[:8] == b"\x89PNG\r\n\x1a\n" for i in imgs)
    for text in ("Speed and memory", "Loss curves", "Op-time breakdown", "Weight change", "GSM8K evaluation",
                 "Monthly fine-tuning spend"):
        assert text in page


def test_wide_tables_fit_the_page():
    """Every table scrolls in its own box; a 9-column table (the weight-change table) is set smaller; columns of
    long text (validate's messages, kernel names) may wrap instead of pushing the table off the page."""
    from novatune.report.html import render_html

    long_msg = "per-step loss: max relative difference 3.77e-05 <= tolerance 5.80e-04 (floor 5.80e-05)"
    page = render_html("t", [("table", [f"c{i}" for i in range(9)], [["0", "mlp.up_proj.weight"] + ["0.1"] * 7]),
                             ("table", ["check", "message"], [["loss_parity", long_msg], ["same_init", "-"]])])
    tables = re.findall(r'<div class="tablewrap"><table([^>]*)>(.*?)</table></div>', page)
    assert len(tables) == 2
    assert tables[0][0] == ' class="wide"' and 'class="txt"' not in tables[0][1]
    assert tables[1][0] == "" and tables[1][1].count('<td class="txt">') == 2  # the whole message column
    assert '<th class="txt">message</th>' in tables[1][1]
    assert "overflow-x: auto" in page and "table.wide" in page


def test_absent_inputs_are_named(tmp_path):
    from novatune.commands.cli import main

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "odd.json").write_text(json.dumps({"what": 1}))
    assert main(["report", str(empty), "-o", str(tmp_path / "out"), "--no-plots"]) == 0
    md = (tmp_path / "out" / "report.md").read_text()
    for msg in ("No side-by-side bench run", "No bench rows", "No Chrome traces", "No validate.json",
                "No eval results", "no cost analysis"):
        assert msg in md, msg
    assert "odd.json: JSON of an unknown kind" in md


def test_mistyped_run_path_exits_2_and_writes_nothing(tmp_path, capsys):
    from novatune.commands.cli import main

    assert main(["report", str(tmp_path / "bench-rn"), "-o", str(tmp_path / "out"), "--no-plots"]) == 2
    assert "bench-rn" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_a_named_file_that_is_no_result_exits_2(tmp_path, capsys):
    """A training data file named as RUN (a mix-up of paths) wrote an empty report with exit 0."""
    from novatune.commands.cli import main

    data = tmp_path / "text.jsonl"
    data.write_text('{"text": "a b c"}\n')
    assert main(["report", str(data), "-o", str(tmp_path / "out"), "--no-plots"]) == 2
    assert "text.jsonl: not a result file" in capsys.readouterr().err and not (tmp_path / "out").exists()


def _bench_file(tmp_path, rows) -> Path:
    f = tmp_path / "bench.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def test_a_missing_stack_keeps_the_stock_row_and_the_speedup(tmp_path):
    """The bench writes a row without config/overrides for a stack that did not run (absent, interrupted): the
    run it sits in stays one run."""
    from novatune.commands.cli import main

    ov = ["train.max_steps=6"]
    rows = [{**bench_row("stock", STOCK_TOK_S, [1.0], [1.0], 39.0), "overrides": ov},
            {**ENV, "bench": "novatune_bench", "stack": "liger-peer", "status": "absent", "reason": "not installed",
             "description": "peer", "config": "examples/qwen3-4b-seed.yaml"},
            {**bench_row("novatune", NOVA_TOK_S, [1.0], [1.0], 32.0), "overrides": ov}]
    f = _bench_file(tmp_path, rows)
    (g,) = latest_per_workload(load_inputs([f]).bench)
    assert [r["stack"] for r in g.rows] == ["stock", "liger-peer", "novatune"]
    assert main(["report", str(f), "-o", str(tmp_path / "out"), "--no-plots"]) == 0
    md = (tmp_path / "out" / "report.md").read_text()
    assert f"{NOVA_TOK_S / STOCK_TOK_S:.3f}x" in md and "No headline speedup" not in md


@pytest.mark.parametrize("change,why", [({"device": "cpu"}, "was measured on the CPU"),
                                        ({"params": 3_300_000}, "trained a toy model (3.3M parameters)")])
def test_no_cost_projection_from_cpu_or_toy_runs(tmp_path, change, why):
    from novatune.commands.cli import main

    rows = [{**bench_row(s, t, [1.0], [1.0], 1.0), **change} for s, t in (("stock", 100.0), ("novatune", 400.0))]
    f = _bench_file(tmp_path, rows)
    assert main(["report", str(f), "-o", str(tmp_path / "out"), "--no-plots"]) == 0
    md = (tmp_path / "out" / "report.md").read_text()
    assert f"No cost projection: the stock row {why}" in md
    assert "estimated monthly savings" not in md and "$ per 1M training tokens" not in md
    assert "lower cost" not in md


def test_cli_report_on_e2e_rows(tmp_path, fixture_runs):
    """bench/e2e.py rows (an older and a newer run in one file): the newest run is the headline, its x_stock kept."""
    from novatune.commands.cli import main

    def row(stack, tok_s, t):
        return {"time": t, "device": "NVIDIA H200", "bench": "e2e", "stack": stack, "arch": "qwen3-4b", "layers": 36,
                "seq": 4096, "ga": 4, "ckpt": True, "warm": 2, "steps": 3, "tok_s": tok_s, "peak_gib": 30.0,
                "gflop_per_tok": 24.96, "losses": [12.4, 12.3], "x_stock": round(tok_s / 8000.0, 3),
                "step_ms": [1100.0, 1050.0]}
    rows = [row("hf_sdpa", 8000.0, "2026-11-20T01:00:00"), row("novatune", 12000.0, "2026-11-20T01:00:00"),
            row("hf_sdpa", 8000.0, "2026-11-21T01:00:00"), row("novatune", 15000.0, "2026-11-21T01:00:00")]
    f = tmp_path / "e2e.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", str(f), "-o", str(tmp_path / "out"), "--no-plots", "--monthly-spend", "10000"]) == 0
    md = (tmp_path / "out" / "report.md").read_text()
    assert "1.875x" in md and "(the bench's own x_stock field: 1.875)" in md  # 15000 / 8000
    assert "$3.50/GPU-hour" in md and "assumed" in md  # H200 default, labelled as an assumption
    assert "| $10,000 | $5,333 | $4,667 |" in md
    inp = load_inputs([f])
    assert len(inp.bench) == 2
