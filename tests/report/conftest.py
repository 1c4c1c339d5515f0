"""Fixture run folders in the formats `novatune report` reads (README.md there): a `novatune bench` run
(bench/runner.py's bench.jsonl schema), a `novatune validate` run (proof/parity.py's validate.json), two
`novatune eval --output` results and two Chrome traces shaped like torch.profiler's (CPU ops, Python frames, CUDA
runtime launches and GPU kernels linked by `correlation`), with figures chosen so the expected report numbers can be
worked out by hand."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

STOCK_TOK_S, NOVA_TOK_S = 1000.0, 1564.0  # speedup 1.564, as in test_cost_math_by_hand
ENV = {"time": "2026-11-21T09:00:00+00:00", "torch": "2.11.0+cu130", "device": "NVIDIA H100 80GB HBM3",
       "transformers": "5.17.0", "git_sha": "abc1234"}


def bench_row(stack: str, tok_s: float, losses: list[float], step_s: list[float], peak: float) -> dict:
    return {**ENV, "bench": "novatune_bench", "stack": stack, "status": "ok", "reason": None,
            "config": "examples/qwen3-4b-seed.yaml", "overrides": [], "warm": 2, "steps": 3, "tok_s": tok_s,
            "timed_tokens": 3 * 16384, "tokens_per_step": [16384] * 3, "step_s": step_s,
            "gflop_per_tok": 24.96, "mfu": tok_s * 24.96e9 / 989e12, "peak_gib": peak, "losses": losses,
            "x_stock": round(tok_s / STOCK_TOK_S, 4)}


def kernel_trace(path: Path, norm_kernels: list[tuple[str, float]], gemm_us: float) -> None:
    """A forward RMSNorm (Python frame + aten op + launch + kernel), its backward op on the autograd thread (same
    Sequence number), a GEMM, a flash-attention kernel, an optimizer kernel, a memcpy and an unknown kernel."""
    ev = [{"ph": "X", "cat": "python_function", "name": "nn.Module: Qwen3RMSNorm_0", "pid": 1, "tid": 1, "ts": 0,
           "dur": 100},
          {"ph": "X", "cat": "cpu_op", "name": "aten::mul", "pid": 1, "tid": 1, "ts": 10, "dur": 20,
           "args": {"Sequence number": 5}}]
    corr = 0
    for i, (name, us) in enumerate(norm_kernels):
        corr += 1
        ev += [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 12 + i,
                "dur": 0.5, "args": {"correlation": corr}},
               {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": 1000 + 10 * i, "dur": us,
                "args": {"correlation": corr}}]
    # backward of the forward aten::mul (Sequence number 5), on the autograd thread: attributed to the norm
    ev += [{"ph": "X", "cat": "cpu_op", "name": "autograd::engine::evaluate_function: MulBackward0", "pid": 1,
            "tid": 2, "ts": 200, "dur": 20, "args": {"Sequence number": 5}},
           {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 2, "ts": 205, "dur": 0.5,
            "args": {"correlation": 100}},
           {"ph": "X", "cat": "kernel", "name": "void at::native::vectorized_elementwise_kernel<4, mul>", "pid": 0,
            "tid": 7, "ts": 1100, "dur": 9, "args": {"correlation": 100}}]
    others = [("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT", gemm_us, "kernel"),
              ("flash_fwd_kernel", 20, "kernel"), ("multi_tensor_apply_kernel<AdamFunctor>", 4, "kernel"),
              ("Memcpy HtoD (Pinned -> Device)", 3, "gpu_memcpy"), ("mystery_kernel", 1, "kernel")]
    for i, (name, us, cat) in enumerate(others):
        ev.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": 7, "ts": 1200 + 100 * i, "dur": us,
                   "args": {"correlation": 200 + i}})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": ev}))


def eval_result(label: str, correct: int, n: int, tok_s: float) -> dict:
    from novatune.eval.exact_match import wilson_interval

    lo, hi = wilson_interval(correct, n)
    return {"task": "gsm8k", "label": label, "model": label, "n": n, "correct": correct, "accuracy": correct / n,
            "ci95": [round(lo, 4), round(hi, 4)], "avg_request_tokens_per_s": tok_s, "gen_tokens_per_s": tok_s * 32,
            "avg_latency_s": 246.0 / tok_s, "avg_output_tokens": 246.0, "k_shot": 4, "batch_size": 32,
            "max_new_tokens": 512, "requests": n, "notes": []}


@pytest.fixture(scope="session")
def fixture_runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("runs")
    bench = root / "bench-run"
    bench.mkdir()
    rows = [bench_row("stock", STOCK_TOK_S, [12.45, 12.44, 12.43, 12.42, 12.41], [30, 17, 16.4, 16.3, 16.5], 39.0),
            {**ENV, "bench": "novatune_bench", "stack": "liger-peer", "status": "absent",
             "reason": "liger_kernel is not installed", "config": "examples/qwen3-4b-seed.yaml", "overrides": []},
            bench_row("novatune", NOVA_TOK_S, [12.45, 12.4401, 12.4302, 12.42, 12.4101], [20, 10.6, 10.5, 10.4, 10.5],
                      32.4)]
    (bench / "bench.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (bench / "summary.json").write_text(json.dumps({"rows": rows}))
    kernel_trace(bench / "traces" / "stock.json", [("void at::native::vectorized_elementwise_kernel<4, pow>", 7.0)],
                 50.0)
    kernel_trace(bench / "traces" / "novatune.json", [("_rms_norm_fwd_kernel", 3.0)], 50.0)
    val = root / "validate-run"
    val.mkdir()
    wc_rows = [{"layer": 13, "param": f"self_attn.{p}.weight", "stock_vs_base": "CHANGED", "stock_update_rel": 1e-3,
                "novatune_vs_base": "CHANGED", "novatune_update_rel": 1e-3, "stock_vs_novatune_update_rel": 0.02,
                "floor_update_rel": 0.015, "verdict": "MATCH"} for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    (val / "validate.json").write_text(json.dumps({
        **ENV, "config": "examples/qwen3-4b-seed.yaml", "steps": 5, "dtype": "bf16", "factor": 10.0, "passed": True,
        "noise_floor": {"reference": "stock (sdpa)", "alternative": "stock (eager)"},
        "checks": [{"name": "loss_parity", "passed": True, "message": "within 10x the floor", "floor": 1e-4,
                    "tolerance": 1e-3, "max_rel_diff": 2e-4},
                   {"name": "weight_change", "passed": True, "message": "all updated", "floor": 0.015,
                    "tolerance": 0.15, "max_update_rel_diff": 0.02, "rows": wc_rows}],
        "runs": {"stock": {"losses": [1.0]}, "novatune": {"losses": [1.0]}}}))
    (val / "weight_change.json").write_text(json.dumps(wc_rows))
    evals = []
    for name, (c, tps) in {"before": (47, 25.42), "after": (48, 37.69)}.items():
        p = root / f"eval_{name}.json"
        p.write_text(json.dumps(eval_result(f"pre-finetune {name}", c, 50, tps)))
        evals.append(p)
    return {"root": root, "bench": bench, "validate": val, "evals": evals}


@pytest.fixture(scope="session")
def built_report(fixture_runs, tmp_path_factory) -> dict:
    from novatune.report.build import Options, write_report
    from novatune.report.load import load_inputs

    out = tmp_path_factory.mktemp("report")
    inp = load_inputs([fixture_runs["bench"], fixture_runs["validate"]], fixture_runs["evals"])
    res = write_report(inp, Options(gpu_price=2.0, token_budget=1e9), out)
    return {**res, "inputs": inp, "out": out}
