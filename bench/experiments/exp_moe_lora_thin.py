"""The expert adapters' thin kernels against torch's grouped GEMM and casts, at Qwen3-30B-A3B's shapes (32,768 rows
sorted over 128 experts, rank 16, bf16 operands, PEFT's fp32 factors):

  project   u = x @ A^T per expert (S x K -> S x 16): cast + grouped_mm (the factor cast each call), grouped_mm on a
            cast factor, novatune.kernels.moe_lora.lowrank_project
  outer     a factor's gradient a_e^T g_e (S x M by S x 16) in fp32: grouped_mm + cast + PEFT's layout, and
            novatune.kernels.moe_wgrad.grouped_outer written into PEFT's own order or contiguous
  B cast    PEFT's lora_B (out, 16 * 128) fp32 to (E, out, 16) bf16: torch's copy, novatune's expert_major

Times are CUDA-event means over 50 calls after 3 warm-ups. One row per measurement goes to the results file
(experiments.jsonl by default), with the relative difference from torch's result where there is one.

    python bench/experiments/exp_moe_lora_thin.py [--results bench/results/experiments.jsonl]
"""
from __future__ import annotations

import argparse
import sys

import torch

from novatune.kernels.moe_lora import expert_major, lowrank_project
from novatune.kernels.moe_wgrad import grouped_outer
from novatune.measure.results import write_row
from novatune.ops import moe as M

E, S, R = 128, 32768, 16


def timed_us(fn, n: int = 50) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n * 1000


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="bench/results/experiments.jsonl")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("exp_moe_lora_thin.py needs a CUDA GPU (nothing measured).", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    expert = torch.sort(torch.randint(0, E, (S,), device="cuda").to(torch.uint8), stable=True).values
    ends = torch.searchsorted(expert, torch.arange(E, device="cuda", dtype=expert.dtype), right=True,
                              out_int32=True)

    def row(kind: str, k: int, times: dict, diff: float | None = None) -> None:
        r = write_row(args.results, {"exp": "moe_lora_thin", "kind": kind, "shape": [S, k, R, E],
                                     "us": {n: round(t, 1) for n, t in times.items()}, "rel_diff": diff})
        print(r["kind"], k, r["us"], diff)

    for k in (2048, 768, 1536):  # x @ A^T at gate/up's and down's inputs; dy @ B at gate/up's output
        x = torch.randn(S, k, device="cuda", dtype=torch.bfloat16)
        lora_a = torch.randn(R * E, k, device="cuda")  # PEFT's (r * E, in) fp32
        cast = lambda: lora_a.view(E, R, k).to(torch.bfloat16).contiguous()  # noqa: E731
        a_bf = cast()
        ref = M.grouped_mm(x, a_bf.transpose(1, 2), ends)
        row("project", k, {"cast+grouped_mm": timed_us(lambda: M.grouped_mm(x, cast().transpose(1, 2), ends)),
                           "grouped_mm": timed_us(lambda: M.grouped_mm(x, a_bf.transpose(1, 2), ends)),
                           "lowrank_project": timed_us(lambda: lowrank_project(x, a_bf.transpose(1, 2), ends))},
            rel(lowrank_project(x, a_bf.transpose(1, 2), ends), ref))
        g = torch.randn(S, R, device="cuda", dtype=torch.bfloat16)
        peft_order = torch.empty(k, R * E, device="cuda").view(k, R, E).permute(2, 0, 1)
        contiguous = torch.empty(E, k, R, device="cuda")
        row("outer", k, {
            "grouped_mm+cast+layout": timed_us(
                lambda: M.grouped_outer(x, g, ends).float().permute(1, 2, 0).reshape(k, R * E)),
            "grouped_outer_peft_order": timed_us(lambda: grouped_outer(x, g, ends, peft_order)),
            "grouped_outer_contiguous": timed_us(lambda: grouped_outer(x, g, ends, contiguous))},
            rel(grouped_outer(x, g, ends, contiguous), M.grouped_outer(x, g, ends)))
    for out_features in (1536, 2048):
        view = torch.randn(out_features, R * E, device="cuda").view(out_features, R, E).permute(2, 0, 1)
        torch_copy = lambda: view.to(torch.bfloat16, memory_format=torch.contiguous_format).contiguous()  # noqa
        row("b_cast", out_features, {"torch_copy": timed_us(torch_copy),
                                     "expert_major": timed_us(lambda: expert_major(view, torch.bfloat16, R))},
            rel(expert_major(view, torch.bfloat16, R), torch_copy()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
