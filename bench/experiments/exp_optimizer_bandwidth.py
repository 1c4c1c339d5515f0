"""Experiment (issue 14): what the optimizer step of the MoE full fine-tuning cut costs on the card, by part.

The cut's step (4 micro-steps of 4,096 tokens, ~225 ms on an H200) ends with the gradient norm over 5.6 B bf16
gradients and one AdamW pass over 5.6 B bf16 parameters with bf16 moments (7 values of 2 bytes per parameter). Both
are bandwidth-bound: this script times them on tensors of the cut's real shapes (random values) beside a plain
copy (the card's reachable bandwidth for the same bytes), and prints GB/s: novatune's AdamW kernel and torch's
fused AdamW, torch's get_total_norm and novatune.ops.grad_norm.total_norm.

    python bench/experiments/exp_optimizer_bandwidth.py [--layers 8] [--results bench/results/experiments.jsonl]
"""
from __future__ import annotations

import argparse
import json

import torch


def _time(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / reps / 1e3  # seconds


def main() -> None:
    from novatune.kernels.adamw import adamw_step
    from novatune.ops.grad_norm import total_norm

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--results", default=None, help="a .jsonl file to append the row to")
    args = ap.parse_args()
    h, inter, e, vocab = 2048, 768, 128, 151936
    shapes = [(vocab, h), (vocab, h)]
    for _ in range(args.layers):
        shapes += [(e, 2 * inter, h), (e, h, inter), (4096, h), (512, h), (512, h), (h, 4096), (e, h), (h,), (h,),
                   (128,), (128,)]
    shapes.append((h,))
    dev = torch.device("cuda")
    params = [torch.nn.Parameter(torch.randn(s, device=dev, dtype=torch.bfloat16)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    moments = [(torch.zeros_like(p), torch.rand_like(p) * 1e-6) for p in params]
    n = sum(p.numel() for p in params)
    scale = torch.tensor(0.9, device=dev)

    def ours():
        for p, (m, v) in zip(params, moments):
            adamw_step(p.data, m, v, p.grad, scale, lr=1e-5, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                       step=3)

    grads = [p.grad for p in params]

    def norm():
        torch.nn.utils.get_total_norm(grads, 2.0)

    def our_norm():
        total_norm(grads)

    big = torch.empty(n, device=dev, dtype=torch.bfloat16)
    big2 = torch.empty_like(big)

    def copy():
        big2.copy_(big)

    torch_opt = torch.optim.AdamW(params, lr=1e-5, fused=True)

    def torch_fused():
        torch_opt.step()

    rows = {}
    for name, fn, bytes_per in (("novatune adamw", ours, 14), ("grad norm (get_total_norm)", norm, 2),
                                ("grad norm (novatune total_norm)", our_norm, 2),
                                ("copy (read + write)", copy, 4), ("torch fused AdamW", torch_fused, 14)):
        s = _time(fn)
        rows[name] = {"ms": round(s * 1e3, 2), "GB_per_s": round(bytes_per * n / s / 1e9)}
        print(f"{name:30s} {s * 1e3:8.2f} ms  {bytes_per * n / s / 1e9:7.0f} GB/s  ({n / 1e9:.2f} B params)")
    row = {"exp": "optimizer_bandwidth", "params": n, "layers": args.layers, "rows": rows}
    if args.results:
        from novatune.measure.results import write_row

        row = write_row(args.results, row)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
