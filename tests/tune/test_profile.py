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
    assert norm["op"] == "rms_norm" and norm["possible_gain_us"] == pytest.approx(prof.by_kind["norm"])
    assert "norm" in prof.table()
