"""One sparse MoE layer, forward + backward, at Qwen3-30B-A3B's shapes (hidden 2048, 128 experts, top-8, expert
intermediate 768, 4096 tokens of a packed row, bf16) - the part of the MoE workload novatune's expert op replaces.

Candidates (each on the same block, weights, input and incoming gradient):
  hf_grouped_mm   transformers' Qwen3MoeSparseMoeBlock with its grouped_mm experts (the stock MoE path)
  novatune        the same block after novatune.patch: novatune routing + novatune.ops.moe.moe_experts
  gemm_floor      only the six grouped GEMMs the layer needs (gate_up and down forward, their input and weight
                  gradients) on pre-sorted rows: what the layer costs if everything else were free
Figures: kernel µs (sum of CUDA kernel durations, torch.profiler), wall µs (median with host time), the step's
peak memory above the resident tensors, TFLOP/s of the expert GEMMs (6 x S x 3 x H x I, S = tokens x top-k), and
the largest relative error of the outputs against hf_grouped_mm. Rows go to bench/results/ops.jsonl (--results).

    python bench/bench_moe.py            # ~1 min on an H100/H200
    python bench/bench_moe.py --quick    # fewer repetitions
    python bench/bench_moe.py --tokens 8192 --experts 64 --top-k 4
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from novatune.measure.numerics import rel_err  # noqa: E402
from novatune.measure.results import write_row  # noqa: E402
from novatune.measure.timing import kernel_us, wall_us  # noqa: E402


def _model(args):
    import transformers

    cfg = transformers.Qwen3MoeConfig(hidden_size=args.hidden, moe_intermediate_size=args.inter,
                                      num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
                                      num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=4,
                                      head_dim=128, vocab_size=1024, use_cache=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().train()
    model.set_experts_implementation("grouped_mm")
    return model


def _block_step(block, x, dout):
    xg = x.detach().requires_grad_()

    def step():
        xg.grad = None
        block.zero_grad(set_to_none=True)
        out = block(xg)
        out.backward(dout)
        return out, xg.grad, block.experts.gate_up_proj.grad, block.experts.down_proj.grad

    return step


def _gemm_floor_step(block, x, dout, args):
    """The six grouped GEMMs on rows already sorted by expert (balanced random routing)."""
    from novatune.ops.moe import grouped_mm, grouped_outer, sort_by_expert

    s = x.shape[1] * args.top_k
    ids = torch.stack([torch.randperm(args.experts, device="cuda")[:args.top_k] for _ in range(x.shape[1])])
    r = sort_by_expert(ids, args.experts)
    tokens = r.order // args.top_k
    xs = x.view(-1, args.hidden)[tokens]
    gu, dn = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    a = torch.randn(s, args.inter, device="cuda", dtype=torch.bfloat16)
    dy = dout.view(-1, args.hidden)[tokens]
    dh = torch.randn(s, 2 * args.inter, device="cuda", dtype=torch.bfloat16)

    def step():
        grouped_mm(xs, gu.transpose(-2, -1), r.ends)
        grouped_mm(a, dn.transpose(-2, -1), r.ends)
        grouped_outer(dy, a, r.ends)
        grouped_mm(dy, dn, r.ends)
        grouped_outer(dh, xs, r.ends)
        grouped_mm(dh, gu, r.ends)

    return step


def _measure(step, quick):
    wu, rep, iters = (10, 30, 5) if quick else (25, 100, 20)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    resident = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak_mib = (torch.cuda.max_memory_allocated() - resident) / 2**20
    return kernel_us(step, iters=iters), wall_us(step, warmup_ms=wu, rep_ms=rep), peak_mib


def moe_arg_parser(doc: str) -> argparse.ArgumentParser:
    """The MoE layer's shape (Qwen3-30B-A3B's by default), --quick and --results: the MoE benches' options."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--results", default="bench/results/ops.jsonl")
    return ap


def main(argv=None):
    args = moe_arg_parser(__doc__).parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_moe.py needs a CUDA GPU (nothing measured).", file=sys.stderr)
        return 2
    import novatune

    model = _model(args)
    block = model.model.layers[0].mlp
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1, args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    dout = torch.randn(1, args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    flops = 6 * args.tokens * args.top_k * 3 * args.hidden * args.inter
    shape = [args.tokens, args.hidden, args.inter, args.experts, args.top_k]
    stock_step = _block_step(block, x, dout)
    ref = [t.detach().clone() for t in stock_step()]
    cands = {"hf_grouped_mm": stock_step, "gemm_floor": _gemm_floor_step(block, x, dout, args)}
    rows = []
    for name in ("hf_grouped_mm", "gemm_floor", "novatune"):
        if name == "novatune":
            novatune.patch(model)
            cands[name] = _block_step(block, x, dout)
        step = cands[name]
        outs = step()
        err = None if outs is None else max(rel_err(o, r) for o, r in zip(outs, ref))
        k_us, w_us, peak = _measure(step, args.quick)
        rows.append(write_row(args.results, {
            "bench": "moe", "op": "moe_layer", "candidate": name, "shape": shape, "dtype": "bfloat16",
            "kernel_us": round(k_us, 1), "wall_us": round(w_us, 1), "step_peak_MiB": round(peak, 1),
            "expert_gemm_tflops": round(flops / k_us / 1e6, 1), "max_rel_err_vs_stock": err, "quick": args.quick}))
    print(f"device {torch.cuda.get_device_name()}; MoE layer fwd+bwd, tokens x hidden x inter x experts x top-k = "
          f"{'x'.join(map(str, shape))}, bf16; rows appended to {args.results}")
    print(f"{'candidate':<16}{'kernel us':>12}{'wall us':>12}{'peak MiB':>12}{'GEMM TFLOP/s':>14}{'err':>10}")
    for r in rows:
        err = "-" if r["max_rel_err_vs_stock"] is None else f"{r['max_rel_err_vs_stock']:.1e}"
        print(f"{r['candidate']:<16}{r['kernel_us']:>12}{r['wall_us']:>12}{r['step_peak_MiB']:>12}"
              f"{r['expert_gemm_tflops']:>14}{err:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
