"""`novatune tune` end to end on a tiny CPU config, then `novatune.patch` reading what it recorded; and
`novatune.patch(model, tune=True)` tuning in place. Families are narrowed (no torch.compile, no CUDA) to keep it
to seconds on two cores."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import novatune
from novatune.ops import dispatch
from novatune.tune import patching

ROOT = Path(__file__).resolve().parents[2]
CONFIG = Path(__file__).with_name("tiny_tune.yaml")
sys.path.insert(0, str(ROOT / "tests" / "patch"))
from tiny_models import packed_batch, tiny_model  # noqa: E402


def test_tune_cli_writes_cache_rows_traces_report_and_patch_reads_it(tmp_path):
    cache = tmp_path / "cache.json"
    rows = tmp_path / "rows.jsonl"
    out = tmp_path / "out"
    env = dict(os.environ, NOVATUNE_TUNE_CACHE=str(cache), PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)  # CPU ops then run their fp32 references (the interpreter is slow)
    r = subprocess.run([sys.executable, "-m", "novatune", "tune", str(CONFIG), "--out", str(out), "--results",
                        str(rows), "--families", "eager,native,default", "--iters", "5", "--check-reps", "1"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    ops = {o["op"]: o for o in summary["ops"]}
    # qk_norm_rope: the tiny Qwen3's fused q/k-norm + RoPE (tokens, hq, hk, head_dim), seen through the dispatch hook
    assert set(ops) == {"rms_norm", "swiglu", "linear_cross_entropy", "attention", "qk_norm_rope"}
    assert ops["rms_norm"]["shape"] == "64x64" and ops["swiglu"]["shape"] == "64x96"
    assert ops["qk_norm_rope"]["shape"] == "64x4x2x16"
    assert ops["linear_cross_entropy"]["shape"] == "64x64x257"
    assert ops["attention"]["shape"].startswith("64x4x2x16x")  # tokens, hq, hk, head_dim, the batch's documents
    for f in ("trace_before.json", "trace_after.json", "tune_report.md", "tune_entries.json"):
        assert (out / f).stat().st_size > 0, f
    report = (out / "tune_report.md").read_text()
    assert "## Choices" in report and "Targets ranked by possible gain" in report and "hf_eager" in report
    assert "### qk_norm_rope 64x4x2x16" in report
    rope_rows = [x for x in report.splitlines() if x.startswith("| RoPE |")]  # the profiler's RoPE kind
    assert any("candidate registry" in x for x in rope_rows) and not any("no candidates" in x for x in rope_rows)
    lines = [json.loads(x) for x in rows.read_text().splitlines()]
    cand_rows = [x for x in lines if x["bench"] == "tune"]
    assert {x["candidate"] for x in cand_rows} >= {"hf_eager", "novatune_default", "torch_native"}
    assert sum(x["chosen"] for x in cand_rows) == 5 and lines[-1]["bench"] == "tune_summary"
    assert all("peak_bytes" in x for x in cand_rows)  # None on the CPU (no allocator peak)
    entries = json.loads(cache.read_text())["entries"]
    assert len(entries) == 5 and all(e["env"]["device"] == "cpu" for e in entries.values())

    # patch() reads the cache: non-default choices are installed and listed in the PatchReport
    os.environ["NOVATUNE_TUNE_CACHE"] = str(cache)
    model = tiny_model("qwen3")
    rep = novatune.patch(model)
    non_default = [e for e in entries.values() if e["choice"] != "novatune_default" and e["kept"]]
    assert len(rep.choices) == len(non_default)
    if non_default:
        assert "tuned" in str(rep)
        assert {c["choice"] for c in rep.to_dict()["tuned"]} == {e["choice"] for e in non_default}
    if any(e["applied_by"] == "dispatch" for e in non_default):
        assert dispatch.ACTIVE is not None and dispatch.ACTIVE.table
    attn = next((e for e in non_default if e["op"] == "attention"), None)
    backends = {m.__dict__["_novatune_attn_backend"] for m in model.modules() if "_novatune_attn_backend" in m.__dict__}
    assert backends == {attn["params"]["backend"] if attn else "auto"}  # patch's attention= setting, tuned
    rep.revert()
    assert dispatch.ACTIVE is None or not dispatch.ACTIVE.table


def test_patch_tune_true_tunes_installs_and_records(monkeypatch, tmp_path):
    monkeypatch.setattr(patching, "FAMILIES", {"eager", "native", "default"})
    monkeypatch.setattr(patching, "ITERS", 5)
    model = tiny_model("qwen3")
    rep = novatune.patch(model, tune=True, tune_tokens=24)
    cache = json.loads((tmp_path / "tune_cache.json").read_text())["entries"]
    assert {(e["op"], tuple(e["shape"])) for e in cache.values()} == {
        ("rms_norm", (24, 64)), ("swiglu", (24, 96)), ("linear_cross_entropy", (24, 64, 257)),
        ("attention", (24, 4, 2, 16, 1)), ("qk_norm_rope", (24, 4, 2, 16))}
    names = {e["op"]: {c["name"] for c in e["candidates"]} for e in cache.values()}
    assert names == {"rms_norm": {"hf_eager", "torch_native", "novatune_default"},
                     "swiglu": {"hf_eager", "novatune_default"},
                     "linear_cross_entropy": {"hf_eager", "novatune_default"},
                     "attention": {"hf_eager", "novatune_default", "backend_reference", "backend_sdpa_docs",
                                   "backend_varlen", "backend_flash", "backend_fa4", "backend_cudnn"},
                     # varlen, flash, fa4, cudnn: skipped on the CPU, with their reasons
                     "qk_norm_rope": {"hf_eager", "novatune_default"}}
    attn = next(e for e in cache.values() if e["op"] == "attention")
    cudnn = next(c for c in attn["candidates"] if c["name"] == "backend_cudnn")
    assert "CUDA-only" in cudnn["reason"] and attn["choice"] != "backend_cudnn"
    fa4 = next(c for c in attn["candidates"] if c["name"] == "backend_fa4")
    assert "CUDA-only" in fa4["reason"] and attn["choice"] != "backend_fa4"
    assert len(rep.choices) == sum(e["choice"] != "novatune_default" and e["kept"] for e in cache.values())
    ids, pos, lab = packed_batch([[13, 11]])  # 24 tokens: the tuned shapes
    model(input_ids=ids, position_ids=pos, labels=lab, use_cache=False).loss.backward()
    rep.revert()
    assert dispatch.ACTIVE is None
