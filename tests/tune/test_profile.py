"""CPU profiling of a tiny model gives a categorised breakdown, module attribution (forward and backward) and a
trace file; the kind classifier maps the kernel names we meet on the GPU."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from novatune.tune.profile import classify, profile_steps, rank_targets

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "patch"))
from tiny_models import packed_batch, tiny_model  # noqa: E402


@pytest.mark.parametrize("name,kind", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "GEMM"),
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNN", "GEMM"),
    ("flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "attention"),
    ("triton_tem_fused_flex_attention_0", "attention"),
    ("_rms_norm_bwd_kernel", "norm"),
    ("_qk_norm_rope_fwd_kernel", "RoPE"),
    ("_swiglu_fwd_kernel", "activation"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
    ("void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda>", "copies"),
    ("Memcpy HtoD (Pinned -> Device)", "copies"),
    ("_lce_fwd_kernel_cross_entropy", "loss"),
])
def test_classifier(name, kind):
    assert classify(name) == kind


def test_cpu_profile_of_a_tiny_model(tmp_path):
    model = tiny_model("qwen3")
    ids, pos, lab = packed_batch([[20, 11]])

    def step():
        model(input_ids=ids, position_ids=pos, labels=lab, use_cache=False).loss.backward()

    trace = tmp_path / "trace.json"
    prof = profile_steps(step, model, steps=2, trace=str(trace))
    assert prof.device == "cpu" and prof.steps == 2
    for kind in ("GEMM", "norm", "attention"):
        assert prof.by_kind.get(kind, 0) > 0, prof.by_kind
    assert 0 < prof.busy_us <= prof.wall_us
    mods = prof.by_module
    assert mods.get("Qwen3RMSNorm", 0) > 0 and mods.get("Qwen3RMSNorm [bwd]", 0) > 0  # bwd via sequence numbers
    assert mods.get("Linear", 0) > 0
    assert json.loads(trace.read_text())["traceEvents"]  # a loadable Chrome/Perfetto trace
    targets = rank_targets(prof, {"norm": 0.0})
    assert targets[0]["possible_gain_us"] >= targets[-1]["possible_gain_us"]
    norm = next(t for t in targets if t["target"] == "norm")
    # the norm kind covers every norm op (rms_norm, Gemma's offset_rms_norm: one kernel family)
    assert "rms_norm" in norm["op"].split(" / ") and norm["possible_gain_us"] == pytest.approx(prof.by_kind["norm"])
    assert "norm" in prof.table()


# --- the kinds sum to busy, and optimizer work (only it) is "optimizer" -----------------------------------------

def _ev(name, *, id=0, device="cpu", start=0.0, end=0.0, parent=None, seq=-1, linked=0, at=None, ann=False,
        kernels=(), thread=1, fwd_thread=0):
    import types

    import torch
    dt = torch.autograd.DeviceType.CPU if device == "cpu" else torch.autograd.DeviceType.CUDA
    return types.SimpleNamespace(
        name=name, id=id, device_type=dt, time_range=types.SimpleNamespace(start=start, end=end), cpu_parent=parent,
        sequence_nr=seq, linked_correlation_id=linked, activity_type=at, is_user_annotation=ann, is_async=False,
        kernels=[types.SimpleNamespace(name=k, duration=d) for k, d in kernels], thread=thread,
        fwd_thread=fwd_thread, self_cpu_time_total=0.0)


def _cuda_events(modern: bool):
    """What torch.profiler hands back for a forward mm in an MLP, its backward, a foreach op inside the model, a fused
    AdamW step and a stray runtime call; with the traps that made the old attribution count some kernels twice:
    kineto's gpu_user_annotation spans of the record_function ranges (the span of the optimizer's range shadows its
    kernels), and a CPU-side cudaLaunchKernel whose CUPTI id equals a torch op's id (torch appends that op's kernels
    to it as well). `modern`: device events carry activity_type / linked_correlation_id (else: older torch)."""
    mlp = _ev("nt_module::Qwen3MLP", id=10, start=0, end=50, at="user_annotation", ann=True,
              kernels=[("nt_module::Qwen3MLP", 400.0)])
    mm = _ev("aten::mm", id=11, start=1, end=10, parent=mlp, seq=5, at="cpu_op", kernels=[("nvjet_tst_TNT", 100.0)])
    fe = _ev("aten::_foreach_add_", id=12, start=11, end=20, parent=mlp, seq=6, at="cpu_op",
             kernels=[("multi_tensor_apply_kernel<Add>", 7.0)])
    bwd = _ev("autograd::engine::evaluate_function: MmBackward0", id=30, start=60, end=90, seq=5, at="cpu_op",
              fwd_thread=1)
    mm_b = _ev("aten::mm", id=31, start=61, end=80, parent=bwd, at="cpu_op", kernels=[("nvjet_tst_NNT", 200.0)])
    opt = _ev("Optimizer.step#AdamW.step", id=20, start=100, end=150, at="user_annotation", ann=True,
              kernels=[("Optimizer.step#AdamW.step", 150.0)])
    adam = _ev("aten::_fused_adamw_", id=21, start=101, end=120, parent=opt, at="cpu_op",
               kernels=[("multi_tensor_apply_kernel<FusedAdamMathFunctor>", 15.0)])
    mul = _ev("aten::mul_", id=22, start=121, end=130, parent=opt, at="cpu_op",
              kernels=[("vectorized_elementwise_kernel<MulFunctor>", 5.0)])
    rt = _ev("cudaLaunchKernel", id=21, start=140, end=141, at="cuda_runtime",
             kernels=[("multi_tensor_apply_kernel<FusedAdamMathFunctor>", 15.0)])
    dev = [  # (name, start, end, linked op id, activity type)
        ("nvjet_tst_TNT", 1000, 1100, 11, "kernel"),
        ("multi_tensor_apply_kernel<Add>", 1100, 1107, 12, "kernel"),
        ("Memcpy HtoD (Pinned -> Device)", 1102, 1110, 0, "gpu_memcpy"),  # another stream, overlaps: 3 µs new
        ("nt_module::Qwen3MLP", 1000, 1400, 10, "gpu_user_annotation"),
        ("nvjet_tst_NNT", 1200, 1400, 31, "kernel"),
        ("multi_tensor_apply_kernel<FusedAdamMathFunctor>", 1500, 1515, 21, "kernel"),
        ("vectorized_elementwise_kernel<MulFunctor>", 1640, 1645, 22, "kernel"),
        ("Optimizer.step#AdamW.step", 1500, 1645, 20, "gpu_user_annotation"),
    ]
    devs = [_ev(n, device="cuda", start=s, end=e, linked=lk if modern else None, at=at if modern else None,
                ann=at == "gpu_user_annotation" and modern) for n, s, e, lk, at in dev]
    cpu = [mlp, mm, fe, bwd, mm_b, opt, adam, mul, rt]
    if not modern:
        for e in cpu:
            e.activity_type = None
    return cpu + devs


@pytest.mark.parametrize("modern", [True, False])
def test_cuda_attribution_counts_each_kernel_once(modern):
    from novatune.tune.profile import analyze

    prof = analyze(_cuda_events(modern), steps=1, wall_us=1000.0, device="cuda")
    assert prof.busy_us == pytest.approx(100 + 7 + 3 + 200 + 15 + 5)  # the kernels' union, no annotation spans
    assert sum(prof.by_kind.values()) == pytest.approx(prof.busy_us)
    assert sum(prof.by_module.values()) == pytest.approx(prof.busy_us)
    assert prof.by_kind["optimizer"] == pytest.approx(15 + 5)  # fused AdamW + a plain op inside Optimizer.step
    assert prof.by_kind["GEMM"] == pytest.approx(300)
    assert prof.by_kind["other"] == pytest.approx(7)  # a foreach kernel inside the model is not optimizer work
    assert prof.by_kind["copies"] == pytest.approx(3)
    assert prof.by_module["Qwen3MLP [bwd]"] == pytest.approx(200) and prof.by_module["(optimizer)"] == 20
    assert "100.0%" not in prof.table() and "GEMM" in prof.table()


def test_cpu_profile_with_checkpointing_and_an_optimizer_step():
    from torch.profiler import ProfilerActivity, profile

    from novatune.tune.profile import BWD_PREFIX, MODULE_PREFIX, analyze, module_ranges

    model = tiny_model("qwen3")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids, pos, lab = packed_batch([[20, 11]])
    params = list(model.parameters())
    opt = __import__("torch").optim.AdamW(params, lr=1e-3, foreach=True)

    def fwd_bwd():
        model(input_ids=ids, position_ids=pos, labels=lab, use_cache=False).loss.backward()

    def step():
        fwd_bwd()
        __import__("torch").nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    prof0 = profile_steps(fwd_bwd, model, steps=1, warmup=0)
    assert prof0.by_kind.get("optimizer", 0) == 0  # no optimizer in the step: nothing is called optimizer work
    model.zero_grad(set_to_none=True)
    with module_ranges(model), profile(activities=[ProfilerActivity.CPU]) as p:
        step()
        # checkpointing's early stop raises out of the recomputed forward: every module range still got closed
        assert not any(m.__dict__.get("_nt_prof_ranges") for m in model.modules())
    evs = p.events()
    prof = analyze(evs, 1, 1e6, "cpu")
    assert sum(prof.by_kind.values()) == pytest.approx(prof.busy_us)

    def chain(e):
        while e is not None:
            yield e.name
            e = e.cpu_parent

    aten = [e for e in evs if e.name.startswith("aten::")]
    in_step = sum(e.self_cpu_time_total for e in aten if any(n.startswith("Optimizer.") for n in chain(e)))
    outside = sum(e.self_cpu_time_total for e in aten
                  if not any(n.startswith(("Optimizer.", MODULE_PREFIX, BWD_PREFIX)) for n in chain(e)))
    assert in_step > 0
    # all of Optimizer.step / zero_grad's ops, plus at most the clip_grad_norm_ / glue ops outside the model
    assert in_step <= prof.by_kind["optimizer"] + 1e-6 <= in_step + outside + 2e-6
    assert prof.by_module["(optimizer)"] == pytest.approx(prof.by_kind["optimizer"])
