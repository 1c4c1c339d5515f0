"""The experts' weight gradient of one MoE layer added into an existing .grad (a micro-batch after the first under
gradient accumulation), at Qwen3-30B-A3B's shapes (4096 tokens x top-8 over 128 experts, hidden 2048, expert
intermediate 768, bf16, uneven routing):

  gate_up   out (E, 2I, H) += dh^T xs per expert      (a = dh (S, 2I), b = xs (S, H))
  down      out (E, H, I)  += dy^T (w * a) per expert  (a = dy (S, H),  b = w * a (S, I))

Candidates:
  autograd_add      torch's grouped_mm writes a fresh dW, then .grad.add_(dW) (what autograd's AccumulateGrad does)
  slices            novatune.ops.moe_wgrad's column slices: the same GEMM and add, a quarter of dW alive at a time
  kernel B..        novatune.kernels.moe_wgrad: the add inside the grouped GEMM, with tile configuration
                    (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
  tma B..           the same through the Tensor Memory Accelerator (descriptors bounded at each expert's rows)
Figures: kernel µs (sum of CUDA kernel durations), wall µs (median), the transient peak above the resident tensors,
and the largest difference from autograd_add's result in bf16 spacings (of the larger of the result and the
value accumulated into). Rows go to bench/results/ops.jsonl.

    python bench/bench_moe_wgrad.py              # ~1 min on an H100/H200
    python bench/bench_moe_wgrad.py --quick
"""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bench_moe import _measure, moe_arg_parser  # noqa: E402  (this script's folder is on sys.path)

from novatune.measure.results import write_row  # noqa: E402

CONFIGS = [(128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
           (64, 128, 64, 4, 4), (128, 128, 32, 4, 4), (128, 64, 64, 4, 4), (128, 128, 32, 8, 4), (128, 128, 32, 4, 5),
           (128, 128, 32, 4, 3), (128, 128, 64, 8, 4), (128, 256, 32, 8, 4), (128, 256, 64, 8, 4), (64, 256, 32, 4, 4)]
TMA = [(128, 128, 64, 4, 3), (128, 128, 32, 4, 4), (128, 256, 64, 8, 3), (128, 128, 32, 4, 3), (128, 128, 32, 4, 5),
       (128, 128, 32, 4, 6), (128, 128, 32, 8, 4), (128, 64, 32, 4, 4), (64, 128, 32, 4, 4), (128, 128, 16, 4, 6),
       (256, 128, 32, 8, 4), (128, 128, 32, 4, 2), (128, 128, 64, 4, 2), (128, 128, 64, 8, 2), (128, 128, 32, 8, 2),
       (128, 128, 32, 8, 3), (128, 256, 32, 8, 2), (256, 128, 32, 8, 2), (64, 128, 64, 4, 3), (128, 64, 64, 4, 3)]


def _routing(tokens: int, experts: int, top_k: int):
    from novatune.ops.moe import sort_by_expert

    gen = torch.Generator(device="cuda").manual_seed(0)
    bias = torch.randn(experts, device="cuda", generator=gen)  # uneven expert loads, as real routers give
    logits = torch.randn(tokens, experts, device="cuda", generator=gen) + bias
    return sort_by_expert(logits.topk(top_k, dim=-1).indices, experts)


def _candidates(a, b, r, out):
    from novatune.kernels.moe_wgrad import grouped_outer_accumulate
    from novatune.ops.moe import grouped_outer
    from novatune.ops.moe_wgrad import weight_grad

    param = SimpleNamespace(grad=out)  # weight_grad reads .grad only (the checks are accumulates_into_grad's)

    def autograd_add():
        out.add_(grouped_outer(a, b, r.ends))

    def slices():
        weight_grad(lambda dy_cols: grouped_outer(dy_cols, b, r.ends), a, param, 1)

    from novatune.kernels.moe_wgrad import tma_eligible

    cands = {"autograd_add": autograd_add, "slices": slices}
    for cfg in CONFIGS:
        cands["kernel " + "x".join(map(str, cfg))] = \
            (lambda c: lambda: grouped_outer_accumulate(a, b, r.ends, out, config=c))(cfg)
    assert tma_eligible(a, b, out), "the TMA candidates would run the plain kernel at these shapes"
    for cfg in TMA:  # the Tensor Memory Accelerator form
        cands["tma " + "x".join(map(str, cfg))] = \
            (lambda c: lambda: grouped_outer_accumulate(a, b, r.ends, out, config=c, tma=True))(cfg)
    return cands


def main(argv=None):
    ap = moe_arg_parser(__doc__)
    ap.add_argument("--only", default="", help="run the candidates whose name contains this text (and autograd_add, "
                    "the reference of the diff column), e.g. --only tma")
    ap.add_argument("--transposed", action="store_true",
                    help="weights stored (E, in, out) as GPT-OSS's: out (E, H, 2I) += xs^T dh, (E, I, H) += (w a)^T dy")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_moe_wgrad.py needs a CUDA GPU (nothing measured).", file=sys.stderr)
        return 2
    r = _routing(args.tokens, args.experts, args.top_k)
    s, h, i, e = args.tokens * args.top_k, args.hidden, args.inter, args.experts
    gen = torch.Generator(device="cuda").manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)

    rows = []
    pairs = [("gate_up", randn(s, 2 * i), randn(s, h)), ("down", randn(s, h), randn(s, i))]
    if args.transposed:
        pairs = [(proj, b, a) for proj, a, b in pairs]
    for proj, a, b in pairs:
        start = randn(e, a.shape[1], b.shape[1])
        out = start.clone()
        cands = _candidates(a, b, r, out)
        out.copy_(start)
        cands["autograd_add"]()
        want = out.clone()
        # in spacings of the larger of the result and the accumulated value: where dW cancels .grad, autograd's
        # two roundings can give exactly 0 where one rounding keeps the residual (a result's own spacing is tiny)
        big = torch.maximum(want.abs(), start.abs())
        spacing = torch.nextafter(big, torch.full_like(big, float("inf"))).float() - big.float()
        flops = 2 * s * a.shape[1] * b.shape[1]
        for name, fn in cands.items():
            if args.only not in name and name != "autograd_add":
                continue
            out.copy_(start)
            fn()  # from the same start as autograd_add's (and compiled, for a kernel)
            diff = float(((out.float() - want.float()).abs() / spacing).max())
            k_us, w_us, peak_mib = _measure(fn, args.quick)
            rows.append(write_row(args.results, {
                "bench": "moe_wgrad", "op": f"moe_wgrad_{proj}", "candidate": name,
                "shape": [args.tokens, h, i, e, args.top_k], "transposed": args.transposed, "dtype": "bfloat16",
                "kernel_us": round(k_us, 1),
                "wall_us": round(w_us, 1), "step_peak_MiB": round(peak_mib, 1),
                "tflops": round(flops / k_us / 1e6, 1), "max_diff_vs_autograd_add_spacings": round(diff, 3),
                "quick": args.quick}))
    print(f"device {torch.cuda.get_device_name()}; expert weight gradients accumulated into .grad, tokens x hidden "
          f"x inter x experts x top-k = {args.tokens}x{h}x{i}x{e}x{args.top_k}, bf16; rows appended to {args.results}")
    print(f"{'op':<18}{'candidate':<24}{'kernel us':>11}{'wall us':>11}{'peak MiB':>10}{'TFLOP/s':>9}{'diff':>8}")
    for row in rows:
        print(f"{row['op']:<18}{row['candidate']:<24}{row['kernel_us']:>11}{row['wall_us']:>11}"
              f"{row['step_peak_MiB']:>10}{row['tflops']:>9}{row['max_diff_vs_autograd_add_spacings']:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
