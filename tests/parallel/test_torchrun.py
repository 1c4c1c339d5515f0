"""2 processes on the CPU (gloo, through torchrun) against 1 process at the same global batch.

The tiny demo model (2 layers, fp32, novatune.patch on) trains 6 steps of 2 rows each: one process with
micro_batch 2, or two processes with micro_batch 1 each (rank r takes rows r, r + 2, ... of the same global
order), grad_accum 2 in both. Tolerances: everything is fp32 and the two runs differ only in the order of the
reductions (the gradient of one process is one matmul over both rows; under FSDP2 each rank's gradient is summed
by the reduce-scatter, under DDP by the all-reduce): ~1e-7 relative per sum. The per-step loss agrees to 1e-5
relative. The weights agree to 1e-4 of each tensor's largest magnitude: AdamW divides by sqrt(v), so an element
whose gradients are near zero early on turns a rounding difference into a visible one in its update (measured:
2e-5 after 4 steps).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
STEPS = 6
BASE = ["--set", f"train.max_steps={STEPS}", "--set", "train.grad_accum=2", "--set", "data.max_length=128",
        "--set", "data.sources.0.limit=80", "--set", "model.arch_overrides.num_hidden_layers=2",
        "--set", "logging.every=1", "--set", "logging.tensorboard=false", "--set", "logging.progress=false",
        "--set", "checkpoint.save_every=2", "--set", "checkpoint.keep=10",
        "--set", "model.device=cpu"]  # gloo on CPUs also on a GPU machine (two ranks, maybe one GPU)
ONE = ["--set", "train.micro_batch=2"]
TWO = ["--set", "train.micro_batch=1"]


def env() -> dict:
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                          "MASTER_PORT")}
    e.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return e


def run(args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, *args], cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


def train_cli(out: Path, *extra: str, nproc: int | None = None) -> subprocess.CompletedProcess:
    """`novatune train` (nproc: `novatune train --nproc N`, which re-runs itself under torchrun)."""
    more = ["--nproc", str(nproc)] if nproc else []
    return run(["-m", "novatune", "train", "--output-dir", str(out), *more, *BASE, *extra])


def torchrun(out: Path, *extra: str, script: list[str] = ("-m", "novatune", "train"),
             nproc: int = 2) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node N -m novatune train ...` (one process less than going through --nproc)."""
    return run(["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *script, *BASE,
                "--set", f"checkpoint.output_dir={out}", *extra])


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return {r["step"]: r["loss"] for r in rows}


def assert_same_losses(got: dict, want: dict, steps) -> None:
    for s in steps:
        assert got[s] == pytest.approx(want[s], rel=1e-5), (s, got[s], want[s])


def assert_same_weights(a_dir: Path, b_dir: Path, tol: float = 1e-4) -> None:
    a, b = load_file(str(a_dir / "model.safetensors")), load_file(str(b_dir / "model.safetensors"))
    assert set(a) == set(b)
    for k in a:
        scale = a[k].abs().max().clamp_min(1e-6)
        rel = ((a[k] - b[k]).abs().max() / scale).item()
        assert rel < tol, (k, rel)


@pytest.fixture(scope="module")
def one_proc(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one") / "run"
    train_cli(out, *ONE)
    return out


@pytest.fixture(scope="module")
def fsdp_two(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp2") / "run"
    p = torchrun(out, *TWO, "--set", "parallel.strategy=fsdp2")
    assert p.stdout.count("step 1/") == 1, "one progress display (rank 0's)"
    return out


def test_fsdp2_two_processes_equal_one(one_proc, fsdp_two):
    ref, got = losses(one_proc), losses(fsdp_two)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert_same_losses(got, ref, range(1, STEPS + 1))
    assert ref[STEPS] < ref[1] - 0.5  # it trains
    assert_same_weights(one_proc / "final", fsdp_two / "final")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(fsdp_two / "final"))  # one folder, loadable as is
    exported = load_file(str(fsdp_two / "final" / "model.safetensors"))
    torch.testing.assert_close(model.model.embed_tokens.weight, exported["model.embed_tokens.weight"])
    ck = fsdp_two / "checkpoints" / "step_00000004"
    manifest = json.loads((ck / "manifest.json").read_text())
    assert manifest["layout"] == "dcp" and {"dcp/.metadata", "rng_0.pt", "rng_1.pt"} <= set(manifest["files"])
    row = json.loads((fsdp_two / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["world_size"] == 2 and row["tokens_per_s_per_proc"] == pytest.approx(row["tokens_per_s"] / 2)


@pytest.mark.slow  # two torchrun launches: ~50-95 s on a busy 2-core machine
def test_fsdp2_with_novatunes_adamw_kernel_resumes_on_torchs_and_equals_one_process(one_proc, tmp_path):
    """train.adamw_kernel novatune under FSDP2 (on the CPU its fp32 reference): each rank updates its local shards,
    the clipping scale (from the norm summed over both ranks' shards) applied inside the update. Killed after step
    3, its sharded checkpoint of step 2 resumes with torch's AdamW (train.adamw_kernel may change on a resume: the
    state is torch.optim.AdamW's, loaded with the resuming optimizer's own flags). Against one process stepping
    torch's AdamW after clip_grad_norm_: the two AdamW implementations round differently (~1e-7 relative per
    step), inside the module's tolerances."""
    out = tmp_path / "run"
    fsdp2 = ("--set", "parallel.strategy=fsdp2")
    torchrun(out, *TWO, *fsdp2, "--set", "train.adamw_kernel=novatune",
             script=["tests/parallel/stop_after.py", "3"])
    assert not (out / "final").exists() and max(losses(out)) == 3
    assert json.loads((out / "checkpoints" / "step_00000002" / "manifest.json").read_text())["layout"] == "dcp"
    torchrun(out, *TWO, *fsdp2, "--set", "train.adamw_kernel=torch")
    assert_same_losses(losses(out), losses(one_proc), range(1, STEPS + 1))
    assert_same_weights(one_proc / "final", out / "final")


@pytest.mark.slow  # two torchrun launches: ~50-95 s on a busy 2-core machine
def test_fsdp2_with_offloaded_and_selective_layers_equals_one_process(one_proc, tmp_path):
    """The memory policies run inside FSDP2's gathered layers (its hooks sit outside the checkpoint function):
    one layer offloaded (every saved tensor through the engine's host buffers), one selectively recomputed."""
    out = tmp_path / "run"
    torchrun(out, *TWO, "--set", "parallel.strategy=fsdp2", "--set", "memory.policy=per-layer",
             "--set", "memory.layers=[offload, selective]", "--set", "memory.offload_min_bytes=0")
    assert_same_losses(losses(out), losses(one_proc), range(1, STEPS + 1))
    assert_same_weights(one_proc / "final", out / "final")
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    assert 0 < rows[0]["offloaded_gib"] < rows[-1]["offloaded_gib"]  # the engine moved layer 0's inputs


def test_fsdp2_killed_run_resumes_the_same_curve(fsdp_two, tmp_path):
    out = tmp_path / "run"
    fsdp2 = ("--set", "parallel.strategy=fsdp2")
    torchrun(out, *TWO, *fsdp2, script=["tests/parallel/stop_after.py", "3"])
    assert not (out / "final").exists() and max(losses(out)) == 3  # ended after step 3, checkpoint at step 2
    torchrun(out, *TWO, *fsdp2)  # the same command resumes
    assert_same_losses(losses(out), losses(fsdp_two), range(1, STEPS + 1))
    assert_same_weights(fsdp_two / "final", out / "final")


def test_two_process_checkpoint_resumes_in_one_process(fsdp_two, tmp_path):
    out = tmp_path / "run"
    ck = fsdp_two / "checkpoints" / "step_00000002"
    p = train_cli(out, *ONE, "--set", f"checkpoint.resume={ck}")
    assert "resumed from" in p.stdout
    got = losses(out)
    assert sorted(got) == list(range(3, STEPS + 1))
    assert_same_losses(got, losses(fsdp_two), range(3, STEPS + 1))
    assert_same_weights(fsdp_two / "final", out / "final")


@pytest.mark.slow  # four processes on a 2-core machine: ~35 s
def test_a_two_process_checkpoint_resumes_on_four_processes_and_equals_one(one_proc, fsdp_two, tmp_path):
    """Four ranks, as on a 4-GPU node: FSDP2 shards every tensor four ways (the demo's dimensions do not all
    divide by 4, so some shards are padded), DCP reads the two-rank checkpoint of step 2 into the four-rank layout,
    and each rank takes one row of every global micro-batch (micro_batch 1, grad_accum 1: the same 4 rows a step as
    1 x 2 x 2 processes). Steps 3-6 equal one process, whose micro-batches are split another way: the loss is
    normalised by the step's target tokens, not per micro-batch."""
    out = tmp_path / "run"
    ck = fsdp_two / "checkpoints" / "step_00000002"
    p = torchrun(out, *TWO, "--set", "parallel.strategy=fsdp2", "--set", "train.grad_accum=1",
                 "--set", f"checkpoint.resume={ck}", nproc=4)
    assert "resumed from" in p.stdout
    got = losses(out)
    assert sorted(got) == list(range(3, STEPS + 1))
    assert_same_losses(got, losses(one_proc), range(3, STEPS + 1))
    assert_same_weights(one_proc / "final", out / "final")
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["world_size"] == 4


def test_a_damaged_shard_is_caught_before_resuming(fsdp_two, tmp_path):
    import shutil

    from novatune.train import checkpoint as ckpt

    ck = tmp_path / "step_00000002"
    shutil.copytree(fsdp_two / "checkpoints" / ck.name, ck)
    assert ckpt.verify(ck) == []
    shard = ck / "dcp" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert any("__1_0.distcp does not match its checksum" in p for p in ckpt.verify(ck))


def test_a_checkpoint_without_its_manifest_is_damaged_not_one_process(fsdp_two, tmp_path):
    """A DCP checkpoint whose manifest.json is gone still reads as sharded (its dcp/ folder), so verify() names
    the missing manifest and a resume sets it aside like any damage. Before, it read as a one-process checkpoint
    and a multi-process resume stopped with "written by a one-process run"."""
    import shutil

    from novatune.train import checkpoint as ckpt

    ck = tmp_path / "step_00000002"
    shutil.copytree(fsdp_two / "checkpoints" / ck.name, ck)
    (ck / "manifest.json").unlink()
    assert ckpt.is_sharded(ck) and any("manifest.json" in p for p in ckpt.verify(ck))


def test_eval_reads_a_two_process_checkpoint(one_proc, fsdp_two):
    """`novatune eval --model <checkpoint>` of a multi-process run: its DCP shards are read into the one-process
    model, equal to the one-process run's checkpoint of the same step. Before: FileNotFoundError."""
    from novatune.eval.exact_match import load_model

    step = "step_00000004"
    two, _, _ = load_model(str(fsdp_two / "checkpoints" / step), None, "demo", device="cpu", dtype="fp32")
    one, _, _ = load_model(str(one_proc / "checkpoints" / step), None, "demo", device="cpu", dtype="fp32")
    a, b = dict(one.named_parameters()), dict(two.named_parameters())
    assert a.keys() == b.keys()
    for name, t in a.items():
        rel = ((t - b[name]).abs().max() / t.abs().max().clamp_min(1e-6)).item()
        assert rel < 1e-4, (name, rel)
    earlier, _, _ = load_model(str(fsdp_two / "checkpoints" / "step_00000002"), None, "demo", device="cpu",
                               dtype="fp32")
    assert any(not torch.equal(t, b[n]) for n, t in earlier.named_parameters())  # the steps' own weights


def test_ddp_two_processes_equal_one_across_an_epoch_end_with_fewer_rows_than_processes(tmp_path):
    """DDP through `--nproc 2` equals one process at the same global batch, over one epoch of 11 rows: one process
    runs 6 micro-batches of 2 rows (the last holds 1) over 3 steps; 2 processes the same 6 global micro-batches,
    rank 1 running a row with no target token in the last one. Before, 2 processes skipped that row: a step less,
    another schedule, losses apart from the step it fell in."""
    epoch = ["--set", "train.max_steps=null", "--set", "train.epochs=1", "--set", "data.sources.0.limit=20"]
    one, two = tmp_path / "one", tmp_path / "two"
    train_cli(one, *ONE, *epoch)
    train_cli(two, *TWO, *epoch, "--set", "parallel.strategy=ddp", nproc=2)
    ref, got = losses(one), losses(two)
    assert sorted(ref) == sorted(got) == [1, 2, 3]
    assert_same_losses(got, ref, [1, 2, 3])
    summaries = [json.loads((out / "summary.json").read_text()) for out in (one, two)]
    assert summaries[0]["tokens"] == summaries[1]["tokens"]  # the idle row's tokens are not counted
    assert_same_weights(one / "final", two / "final")


@pytest.mark.slow  # a long run stopped from outside: ~40-90 s on a busy 2-core machine
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_signal_stops_both_ranks_at_one_step_with_a_checkpoint(tmp_path, signame):
    """SIGTERM, or SIGINT sent to the launcher alone (a job manager, not a terminal's Ctrl-C: the launcher runs in
    its own session here), to `novatune train --nproc 2` reaches both workers through torchrun; they agree on the
    step to stop at (a host-side all-reduce of the stop flag each step), save one sharded checkpoint at it, and
    exit. Before, a SIGINT to the launcher alone was dropped and the run went on to its end."""
    import signal
    import time

    from novatune.train import checkpoint as ckpt

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "novatune", "train", "--output-dir", str(out), "--nproc", "2", *BASE, *TWO,
           "--set", "parallel.strategy=fsdp2", "--set", "train.max_steps=500", "--set", "checkpoint.save_every=0"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            if (out / "metrics.jsonl").exists() and len(losses(out)) >= 2:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        proc.send_signal(getattr(signal, signame))
        log = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    last = ckpt.latest(out)
    assert last is not None, log[-3000:]
    assert ckpt.verify(last) == []
    assert ckpt.step_of(last) == max(losses(out)) < 500, log[-3000:]
    assert f"stopped by {signame}" in log and not (out / "final").exists()
    assert proc.returncode == 128 + getattr(signal, signame), log[-3000:]
