"""bench/runner.py's pure parts (stack names, ratios, the table: an absent stack keeps its row), the stack table's
registration point, and the worker's timing of the session's steps."""
from __future__ import annotations

import sys

import pytest

from novatune.bench.runner import add_ratios, render_table
from novatune.bench.stacks import STACKS, Stack, parse_stacks, register, run_from


def test_parse_stacks():
    assert parse_stacks("stock, novatune") == ["stock", "novatune"]
    assert parse_stacks("hf_sdpa,varlen_liger,novatune_eager") == ["stock", "liger-peer", "novatune_eager"]
    with pytest.raises(ValueError, match="unknown stack"):
        parse_stacks("stock,liger")


def test_ratios_and_table_with_an_absent_peer():
    rows = [{"stack": "stock", "status": "ok", "tok_s": 8000.0, "losses": [12.0, 11.0], "mfu": 0.3,
             "peak_gib": 39.0, "gflop_per_tok": 25.1},
            {"stack": "liger-peer", "status": "absent", "reason": "liger_kernel is not installed"},
            {"stack": "novatune", "status": "ok", "tok_s": 16000.0, "losses": [12.0, 11.0011], "mfu": 0.6,
             "peak_gib": 30.0, "gflop_per_tok": 25.1}]
    sp = add_ratios(rows)
    assert sp == {"novatune_vs_stock": 2.0, "novatune_vs_peer": None, "peer_vs_stock": None}
    assert rows[2]["x_stock"] == 2.0 and rows[2]["x_peer"] is None
    assert rows[2]["loss_max_rel_diff_vs_stock"] == pytest.approx(1e-4)
    assert rows[1]["x_stock"] is None
    table = render_table({"rows": rows, "warm": 1, "speedup": sp})
    assert "liger-peer     absent  liger_kernel is not installed" in table
    assert "16,000" in table and "2.000" in table and "60.0%" in table


def test_rounds_alternate_the_order_and_each_row_is_its_median_round(spec, tmp_path, monkeypatch):
    """--rounds 3: A B, B A, A B; a stack's row is its median round's (tok_s, step times and losses of one run),
    with every round's figure, their spread and the largest peak; the ratios compare medians; an absent stack
    runs once; a round that failed makes the stack's row that failure."""
    import dataclasses

    from novatune.bench import runner

    order, figures = [], {"stock": [100.0, 90.0, 120.0], "novatune": [210.0, 190.0, 200.0],
                          "liger-peer": [80.0, 81.0, 82.0]}

    def fake_worker(wspec, timeout):
        stack = wspec["stack"]
        order.append((stack, wspec["stack_dir"]))
        tok = figures[stack][sum(1 for s, _ in order if s == stack) - 1]
        if tok is None:
            return {"stack": stack, "status": "failed", "reason": "boom"}
        return {"stack": stack, "status": "ok", "tok_s": tok, "losses": [tok / 100, 1.0], "peak_gib": tok / 10,
                "step_ms": [1000.0 / tok]}

    monkeypatch.setattr(runner, "run_worker", fake_worker)
    monkeypatch.setattr(runner, "measure_peak_tflops", lambda: (None, None))
    monkeypatch.setitem(STACKS, "liger-peer", dataclasses.replace(STACKS["liger-peer"],
                                                                  unavailable=lambda cfg: "not installed here"))
    summary = runner.run_bench(spec["config"], [], ["stock", "novatune", "liger-peer"], tmp_path / "run", 1, 1,
                               log=lambda *_: None, rounds=3)
    assert [s for s, _ in order] == ["stock", "novatune", "novatune", "stock", "stock", "novatune"]
    assert order[2][1] == str(tmp_path / "run" / "round2" / "novatune")
    rows = {r["stack"]: r for r in summary["rows"]}
    assert rows["stock"]["tok_s"] == 100.0 and rows["stock"]["step_ms"] == [10.0]  # the median run's own figures
    assert rows["stock"]["round_tok_s"] == [100.0, 90.0, 120.0] and rows["stock"]["peak_gib"] == 12.0
    assert rows["stock"]["round_spread"] == pytest.approx(120 / 90 - 1, abs=1e-4)
    assert rows["stock"]["loss_max_rel_diff_across_rounds"] == pytest.approx(0.2)
    assert rows["novatune"]["tok_s"] == 200.0 and rows["novatune"]["x_stock"] == 2.0
    assert rows["liger-peer"]["status"] == "absent" and "rounds" not in rows["liger-peer"]
    assert summary["rounds"] == 3 and summary["speedup"]["novatune_vs_stock"] == 2.0

    order.clear()
    figures["novatune"] = [210.0, None, 200.0]
    summary = runner.run_bench(spec["config"], [], ["stock", "novatune"], tmp_path / "run2", 1, 1,
                               log=lambda *_: None, rounds=3)
    failed = {r["stack"]: r for r in summary["rows"]}["novatune"]
    assert failed["status"] == "failed" and failed["reason"] == "boom" and failed["round_tok_s"] == [210.0]
    assert [s for s, _ in order].count("novatune") == 2, "a stack that failed is not run again"
    assert summary["exit_code"] == 1


def _interrupted_rounds(spec, run_dir, monkeypatch, rounds: int, interrupt_at: int) -> tuple[dict, dict]:
    """run_bench over stock and novatune with `rounds`, Ctrl-C arriving in the `interrupt_at`-th worker run
    (run k reports 100 k tok/s); (rows by stack, summary) as summary.json holds them."""
    import json

    from novatune.bench import runner

    runs = []

    def fake_worker(wspec, timeout):
        runs.append(wspec["stack"])
        if len(runs) == interrupt_at:
            raise KeyboardInterrupt
        return {"stack": wspec["stack"], "status": "ok", "tok_s": 100.0 * len(runs), "losses": [1.0]}

    monkeypatch.setattr(runner, "run_worker", fake_worker)
    monkeypatch.setattr(runner, "measure_peak_tflops", lambda: (None, None))
    with pytest.raises(KeyboardInterrupt):
        runner.run_bench(spec["config"], [], ["stock", "novatune"], run_dir, 1, 1, log=lambda *_: None,
                         rounds=rounds)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {r["stack"]: r for r in summary["rows"]}, summary


def test_an_interrupted_bench_of_rounds_fails_the_stacks_short_of_rounds(spec, tmp_path, monkeypatch):
    """Ctrl-C in round 2 of 3: no stack has all its rounds, so no row claims a median the others did not get."""
    rows, summary = _interrupted_rounds(spec, tmp_path / "run", monkeypatch, rounds=3, interrupt_at=3)
    assert rows["stock"]["status"] == rows["novatune"]["status"] == "failed" and summary["exit_code"] == 1
    assert "interrupted after 1 of 3 rounds" in rows["stock"]["reason"]
    assert "interrupted after 1 of 3 rounds" in rows["novatune"]["reason"]


def test_an_interrupt_in_the_last_round_keeps_the_stacks_that_finished(spec, tmp_path, monkeypatch):
    """--rounds 2 (A B, B A), Ctrl-C in A's second run: B has both rounds and keeps its median row."""
    rows, _ = _interrupted_rounds(spec, tmp_path / "run", monkeypatch, rounds=2, interrupt_at=4)
    assert rows["novatune"]["status"] == "ok" and rows["novatune"]["round_tok_s"] == [200.0, 300.0]
    assert rows["novatune"]["tok_s"] == 200.0  # of an even count, the slower middle round
    assert rows["stock"]["status"] == "failed" and "after 1 of 2 rounds" in rows["stock"]["reason"]


def test_a_sigterm_while_the_rows_are_written_waits_for_them(spec, tmp_path, monkeypatch):
    """`timeout` firing after the last round has finished: the rows of every round are still written (to the run
    directory and to --results), then the bench ends with exit status 143 as a SIGTERM would have ended it."""
    import json
    import os
    import signal

    from novatune.bench import runner
    from novatune.measure import results as results_module

    monkeypatch.setattr(runner, "run_worker", lambda wspec, timeout: {"stack": wspec["stack"], "status": "ok",
                                                                      "tok_s": 100.0, "losses": [1.0]})
    monkeypatch.setattr(runner, "measure_peak_tflops", lambda: (None, None))
    real_write = results_module.write_row
    signalled = []

    def write_after_a_sigterm(path, row):
        if not signalled:
            signalled.append(1)
            os.kill(os.getpid(), signal.SIGTERM)  # handled at once, in this (the main) thread
        return real_write(path, row)

    monkeypatch.setattr(results_module, "write_row", write_after_a_sigterm)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stop:
        runner.run_bench(spec["config"], [], ["stock", "novatune"], tmp_path / "run", 1, 1, log=lambda *_: None,
                         results=str(tmp_path / "results.jsonl"), rounds=2)
    assert stop.value.code == 143 and signalled
    assert signal.getsignal(signal.SIGTERM) is before
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["stack"] for r in rows] == ["stock", "novatune"] and all(r["status"] == "ok" for r in rows)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["exit_code"] == 0


def test_profile_and_memory_run_in_the_last_round_into_the_run_directory(spec, tmp_path, monkeypatch):
    """The last round's diagnostics stay on the row even when another round is the median."""
    from novatune.bench import runner

    seen = []

    def fake_worker(wspec, timeout):
        seen.append(wspec)
        row = {"stack": wspec["stack"], "status": "ok", "tok_s": 400.0 - 100 * len(seen), "losses": [1.0]}
        if wspec["profile"]:
            row.update(profile={"wall_ms": 1.0}, trace="traces/stock.json", memory={"peak": 2.0})
        return row

    monkeypatch.setattr(runner, "run_worker", fake_worker)
    monkeypatch.setattr(runner, "measure_peak_tflops", lambda: (None, None))
    summary = runner.run_bench(spec["config"], [], ["stock"], tmp_path / "run", 1, 1, log=lambda *_: None,
                               rounds=3, profile=True, memory=True)
    assert [(w["profile"], w["memory"]) for w in seen] == [(False, False), (False, False), (True, True)]
    assert all(w["diag_dir"] == str(tmp_path / "run") for w in seen)
    row = summary["rows"][0]
    assert row["tok_s"] == 200.0 and row["trace"] == "traces/stock.json" and row["memory"] == {"peak": 2.0}


def test_round_order_alternates():
    from novatune.bench.runner import round_order

    assert [round_order(["a", "b", "c"], i) for i in range(3)] == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]


TINY = """
model:
  arch: qwen3-tiny
  arch_overrides: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 2,
                   num_key_value_heads: 1, head_dim: 16, vocab_size: 128}
  device: cpu
  dtype: fp32
  patch: false
data:
  sources: [{type: synthetic, num_docs: 40, median_length: 20, sigma: 0.5, min_length: 4, seed: 1}]
  max_length: 64
  shuffle: false
train: {max_steps: 4, micro_batch: 1, grad_accum: 2, lr: 1.0e-3, schedule: constant, seed: 0}
checkpoint: {output_dir: runs/unused, export: false}
logging: {every: 1, tensorboard: false, progress: false}
"""


@pytest.fixture
def spec(tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY)
    return {"stack": "stock", "stack_dir": str(tmp_path / "stock"), "config": str(cfg), "overrides": [],
            "warm": 2, "steps": 2, "gc_freeze": True}


def test_timed_steps_count_only_the_timed_steps_and_match_the_trainer(spec, tmp_path):
    """Warm-up steps are neither timed nor counted; the losses are the trainer's own for the same config."""
    import gc

    from novatune.bench.worker import load_stack_config, timed_steps
    from novatune.train.loop import train
    from novatune.train.session import build

    cfg, base = load_stack_config(spec)
    session = build(cfg, base)
    ahead = build(cfg, base).batches(4)
    try:
        m = timed_steps(session, spec)
    finally:
        gc.unfreeze()
    assert m["tokens_per_step"] == [sum(mb["num_tokens"] for mb in mbs) for mbs in ahead[2:]]
    assert m["keys"] == sum(mb["attn_keys"] for mbs in ahead[2:] for mb in mbs)
    assert m["timed_s"] > 0 and m["peak_bytes"] is None and len(m["losses"]) == len(m["grad_norms"]) == 4
    cfg2, _ = load_stack_config({**spec, "stack_dir": str(tmp_path / "loop")})
    res = train(cfg2, base)
    assert m["losses"] == [res.losses[s] for s in sorted(res.losses)]


def test_a_registered_stack_with_its_own_trainer_runs_in_the_worker(spec, tmp_path, monkeypatch):
    """The registration point for a stack that trains with another trainer (e.g. TRL's SFTTrainer)."""
    import json
    import types

    from novatune.bench import worker

    seen = {}

    def run(spec_, cfg, base):
        seen["max_steps"] = cfg.train.max_steps
        return {"tok_s": 1.0, "losses": [1.0] * 4}

    from novatune.bench import stacks

    monkeypatch.setitem(sys.modules, "fake_trainer_module", types.SimpleNamespace(run=run))
    monkeypatch.setattr(stacks, "STACKS", dict(STACKS))  # registered for this test only
    register(Stack("fake-trainer", "a stand-in trainer", ["model.patch=false"],
                   run=run_from("fake_trainer_module:run")))
    assert parse_stacks("fake-trainer") == ["fake-trainer"]
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({**spec, "stack": "fake-trainer"}))
    assert worker.main([str(path)]) == 0
    row = json.loads((tmp_path / "stock" / "result.json").read_text())
    assert row["status"] == "ok" and row["tok_s"] == 1.0 and row["stack"] == "fake-trainer"
    assert seen["max_steps"] == 4


def test_the_worker_refuses_a_missing_spec(capsys):
    from novatune.bench import worker

    assert worker.main([]) == 2
    assert "SPEC.json" in capsys.readouterr().err


def _session_losses(spec: dict) -> list[float]:
    """The per-step losses of the bench worker's own loop (the novatune session's step) on the spec's run."""
    import gc

    from novatune.bench.worker import load_stack_config, timed_steps
    from novatune.train.session import build

    nova = {**spec, "stack": "novatune", "overrides": ["model.patch=true"]}
    cfg, base = load_stack_config(nova)
    try:
        return timed_steps(build(cfg, base), nova)["losses"]
    finally:
        gc.unfreeze()


def test_the_trl_stack_trains_like_the_session(spec, tmp_path):
    """`novatune bench --stacks trl-sft`: SFTTrainer + novatune.patch(trainer) on the session's model, rows and
    optimizer gives the novatune session's per-step losses (fp32 on the CPU: equal to 1e-5 relative; TRL sums the
    micro-batch losses of a step the way the session does, only the reduction order differs)."""
    import json

    pytest.importorskip("trl")
    from novatune.bench import worker

    path = tmp_path / "spec.json"
    path.write_text(json.dumps({**spec, "stack": "trl-sft"}))
    assert worker.main([str(path)]) == 0
    row = json.loads((tmp_path / "stock" / "result.json").read_text())
    assert row["status"] == "ok", row.get("reason")
    assert row["tok_s"] > 0 and "cross_entropy" in row["patch_report"] and len(row["losses"]) == 4
    ref = _session_losses(spec)
    assert row["losses"] == pytest.approx(ref, rel=1e-5)


def test_the_table_takes_a_row_from_a_stack_with_its_own_trainer():
    """A run-function stack (trl-sft) has no FLOP count or loss comparison of its own: the table still renders."""
    rows = [{"stack": "novatune", "status": "ok", "tok_s": 200.0, "x_stock": None, "x_peer": None, "mfu": None,
             "peak_gib": 1.0, "gflop_per_tok": 24.9, "loss_max_rel_diff_vs_stock": None, "losses": [1.0, 2.0]},
            {"stack": "trl-sft", "status": "ok", "tok_s": 190.0, "x_stock": None, "x_peer": None,
             "peak_gib": 1.1, "losses": [1.0, 2.0]}]
    sp = {"novatune_vs_stock": None, "novatune_vs_peer": None, "peer_vs_stock": None}
    table = render_table({"rows": rows, "warm": 1, "speedup": sp})
    assert "trl-sft" in table and "190" in table


def test_moe_stacks_name_their_experts_and_refuse_varlen_without_cuda():
    """stock and hf-varlen set transformers' grouped_mm experts explicitly on MoE models (and record it); dense
    models are left alone; hf-varlen is absent with its reason where torch's varlen attention cannot run."""
    import transformers

    from novatune.bench import stacks
    from novatune.train.config import load

    moe = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=3, num_experts_per_tok=2,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64))
    moe.set_experts_implementation("eager")
    assert stacks._grouped_mm_experts(moe) == "experts=grouped_mm"
    assert moe.config._experts_implementation == "grouped_mm"
    dense = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, vocab_size=64))
    assert stacks._grouped_mm_experts(dense) is None
    phi3 = transformers.AutoModelForCausalLM.from_config(transformers.Phi3Config(  # a dense fused gate_up_proj
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    assert stacks._grouped_mm_experts(phi3) is None
    cfg = load(None, ["model.device=cpu"])
    assert "CUDA" in stacks.STACKS["hf-varlen"].unavailable(cfg)


def test_gpt_oss_stock_attention_is_eager_and_the_varlen_peer_is_refused():
    """GPT-OSS has no sdpa path in HF: the stock stack's attention (hf_default) resolves to eager there and to
    sdpa elsewhere; hf-varlen is absent with the reason (varlen_attn has no sinks and no window) before it builds,
    and the peer's attention function refuses sinks if it is reached anyway (a window is varlen_attn's
    window_size: tests/bench/test_peer_families.py)."""
    from pathlib import Path

    import torch
    import transformers

    from novatune.bench import peer, stacks
    from novatune.train.arch import arch_config
    from novatune.train.config import load
    from novatune.train.model import resolve_attention

    assert "model.attention=hf_default" in stacks.STOCK
    assert resolve_attention(arch_config("gpt-oss-20b"), "hf_default") == "eager"
    assert resolve_attention(arch_config("qwen3-30b-a3b"), "hf_default") == "sdpa"
    assert resolve_attention(arch_config("gpt-oss-20b"), "sdpa") == "sdpa"  # an explicit choice stays
    example = Path(__file__).resolve().parents[2] / "examples" / "gpt-oss-20b-cut.yaml"
    assert "sinks" in stacks.STACKS["hf-varlen"].unavailable(load(example))
    if not hasattr(torch.nn.attention, "varlen"):
        pytest.skip("this torch has no varlen_attn")
    forward = transformers.AttentionInterface._global_mapping[peer.register_peer_varlen()]
    q = torch.zeros(1, 2, 6, 4)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5]])
    with pytest.raises(peer.PeerUnavailable, match="sinks"):
        forward(None, q, q, q, None, position_ids=pos, s_aux=torch.zeros(2))


def test_parallel_rows_are_measured_against_one_process_at_the_same_global_batch():
    """x_one_process / scaling / loss diff of a row trained on N processes against the one-process novatune row."""
    rows = [{"stack": "novatune", "status": "ok", "tok_s": 16000.0, "losses": [12.0, 11.0], "nproc": 1},
            {"stack": "novatune_ddp", "status": "ok", "tok_s": 30400.0, "losses": [12.0, 11.0022], "nproc": 2,
             "tok_s_per_proc": 15200.0, "peak_gib_per_rank": [39.5, 39.5]},
            {"stack": "novatune_fsdp2", "status": "failed", "reason": "worker exited with code 1", "nproc": 2}]
    add_ratios(rows)
    assert rows[1]["x_one_process"] == 1.9 and rows[1]["scaling"] == 0.95
    assert rows[1]["loss_max_rel_diff_vs_one_process"] == pytest.approx(2e-4)
    assert rows[0]["scaling"] is None and rows[2]["x_one_process"] is None
    table = render_table({"rows": rows, "warm": 1, "speedup": {"novatune_vs_stock": None, "novatune_vs_peer": None,
                                                               "peer_vs_stock": None}})
    assert "novatune_ddp on 2 processes: 15,200 tok/s per process, 1.900x one process" in table
    assert "(scaling 0.950)" in table


def test_stack_processes_under_nproc():
    from novatune.bench.runner import stack_procs, worker_command

    assert stack_procs("novatune_fsdp2", 4) == (4, 1) and stack_procs("novatune_ddp", 2) == (2, 1)
    assert stack_procs("novatune", 4) == (1, 4)  # one process, grad_accum x 4: the same global batch
    assert stack_procs("novatune_fsdp2", 1) == (1, 1) and stack_procs("stock", 1) == (1, 1)
    cmd = worker_command("spec.json", 2)
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and "--nproc-per-node=2" in cmd
    assert cmd[-3:] == ["-m", "novatune.bench.worker", "spec.json"]


def test_nproc_without_a_parallel_stack_or_enough_gpus_names_the_fix(spec):
    from novatune.bench.worker import load_stack_config
    from novatune.commands.bench import check_nproc
    from novatune.train.errors import ConfigError

    cfg, _ = load_stack_config(spec)
    with pytest.raises(ConfigError, match="add a parallel stack to --stacks"):
        check_nproc(2, cfg, ["stock", "novatune"])
    with pytest.raises(ConfigError, match="must be >= 1"):
        check_nproc(0, cfg, ["novatune"])
    check_nproc(2, cfg, ["novatune", "novatune_fsdp2"])  # a CPU config: gloo processes, no GPU count


@pytest.mark.slow  # two worker processes and one torchrun of two: ~20-40 s on a busy 2-core machine
@pytest.mark.parametrize("parallel", ["novatune_fsdp2", "novatune_ddp"])
def test_bench_with_two_processes_trains_the_one_process_global_batch(spec, tmp_path, monkeypatch, parallel):
    """`novatune bench --nproc 2` on the CPU (gloo): the parallel stack's row counts both ranks' tokens, its
    per-step losses equal the one-process row's at grad_accum x 2 (fp32: only the reduction order differs, 1e-5),
    and each row says how many processes trained it."""
    from novatune.bench.runner import run_bench

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    s = run_bench(spec["config"], ["model.patch=false", "model.arch_overrides.num_hidden_layers=2"],
                  ["novatune", parallel], tmp_path / "run", warm=1, steps=2, log=lambda _: None, nproc=2)
    one, par = s["rows"]
    assert (one["status"], par["status"]) == ("ok", "ok"), par.get("reason")
    assert (one["nproc"], par["nproc"], one["grad_accum"], par["grad_accum"]) == (1, 2, 4, 2)
    assert par["tokens_per_step"] == one["tokens_per_step"] and par["timed_tokens"] == one["timed_tokens"]
    # both rounded to 0.1 tok/s: on a slow machine (~100 tok/s) that is more than 1e-3 of the value
    assert par["tok_s_per_proc"] == pytest.approx(par["tok_s"] / 2, abs=0.1)
    assert par["loss_max_rel_diff_vs_one_process"] < 1e-5 and par["scaling"] > 0
    assert s["nproc"] == 2
    assert (tmp_path / "run" / parallel / "worker.log").read_text().count("RESULT ") == 1  # rank 0's row only


def test_the_train_stack_times_the_trainers_own_loop_with_the_sessions_losses(spec, tmp_path):
    """`novatune bench --stacks novatune-train`: `novatune train`'s loop on the run; its per-step losses are the
    bench worker's (the same session step, fp32 on the CPU: equal to 1e-6 relative) and it times the steps after
    the warm-up."""
    import json

    from novatune.bench import worker

    path = tmp_path / "spec.json"
    path.write_text(json.dumps({**spec, "stack": "novatune-train"}))
    assert worker.main([str(path)]) == 0
    row = json.loads((tmp_path / "stock" / "result.json").read_text())
    assert row["status"] == "ok", row.get("reason")
    assert row["tok_s"] > 0 and len(row["losses"]) == spec["warm"] + spec["steps"]
    assert len(row["tokens_per_step"]) == spec["steps"] and row["timed_tokens"] == sum(row["tokens_per_step"])
    ref = _session_losses(spec)
    assert row["losses"] == pytest.approx(ref, rel=1e-6)
