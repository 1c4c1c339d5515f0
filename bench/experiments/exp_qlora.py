"""Experiment (LOG.md, session 3): where does a QLoRA micro-step's time go, and how fast is NF4 dequantisation?

    python bench/experiments/exp_qlora.py --results bench/results/experiments.jsonl

For each Qwen3-8B projection shape (out x in, bf16, NF4 blocksize 64 with double quantisation): kernel µs of
novatune's byte-per-pair dequantisation kernel, the byte-per-element kernel it replaced (reached through an out
at an odd element offset, which still takes it), bitsandbytes' `dequantize_4bit` (when importable, CUDA), and
the bf16 GEMM it feeds at 2048 tokens (x Wᵀ), so the dequantisation can be read as a fraction of the GEMM.
Bandwidth counts the packed bytes read plus the bf16 written. Each kernel is checked bit for bit against bnb
or the reference first.
"""
from __future__ import annotations

import argparse

import torch

from novatune.kernels import nf4 as K
from novatune.measure.results import write_row
from novatune.measure.timing import copy_bandwidth_gbps, kernel_us

# Qwen3-8B: hidden 4096, 32 q heads / 8 kv heads of 128, intermediate 12288, 36 layers
SHAPES = {"q_proj/o_proj": (4096, 4096), "k_proj/v_proj": (1024, 4096), "gate/up_proj": (12288, 4096),
          "down_proj": (4096, 12288)}
PER_LAYER = {"q_proj/o_proj": 2, "k_proj/v_proj": 2, "gate/up_proj": 2, "down_proj": 1}


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--results", default="")
    p.add_argument("--tokens", type=int, default=2048)
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    bw = copy_bandwidth_gbps()
    try:
        import bitsandbytes.functional as F
    except Exception as e:  # noqa: BLE001
        F = None
        print(f"bitsandbytes not importable ({type(e).__name__}: {e}): no bnb column")
    print(f"copy bandwidth {bw:.0f} GB/s")
    print(f"{'weight':14s} {'shape':>11s} {'pairs us':>9s} {'GB/s':>6s} {'elem us':>8s} {'bnb us':>7s} {'GEMM us':>8s}")
    layer = {"pairs": 0.0, "element": 0.0, "bnb": 0.0, "gemm": 0.0}
    for name, shape in SHAPES.items():
        w = torch.randn(shape, device=dev, dtype=torch.bfloat16) * 0.02
        if F is not None:
            packed, qs = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
            from novatune.ops.nf4 import from_bnb

            class _P:  # what from_bnb reads: .data and .quant_state
                data, quant_state = packed, qs
            t = from_bnb(_P)
            want = F.dequantize_4bit(packed, qs)
        else:
            t = K.nf4_quantize_ref(w.cpu(), double_quant=True)
            t = K.NF4Tensor(**{k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in t.__dict__.items()})
            want = K.nf4_dequantize_ref(t).to(dev)
        n = w.numel()
        base = torch.empty(n + 1, device=dev, dtype=torch.bfloat16)
        got_pairs = K.nf4_dequantize(t)
        got_elem = K.nf4_dequantize(t, out=base[1:])
        assert torch.equal(got_pairs.view(-1), want.view(-1)) and torch.equal(got_elem, want.view(-1)), name
        us_pairs = kernel_us(lambda: K.nf4_dequantize(t))
        us_elem = kernel_us(lambda: K.nf4_dequantize(t, out=base[1:]))
        us_bnb = kernel_us(lambda: F.dequantize_4bit(packed, qs)) if F is not None else None
        x = torch.randn(args.tokens, shape[1], device=dev, dtype=torch.bfloat16)
        us_gemm = kernel_us(lambda: x @ w.t())
        gbs = (n // 2 + 2 * n) / us_pairs / 1e3
        print(f"{name:14s} {shape[0]:5d}x{shape[1]:<5d} {us_pairs:9.1f} {gbs:6.0f} {us_elem:8.1f} "
              f"{us_bnb or 0:7.1f} {us_gemm:8.1f}")
        for k, v in (("pairs", us_pairs), ("element", us_elem), ("bnb", us_bnb or 0.0), ("gemm", us_gemm)):
            layer[k] += PER_LAYER[name] * v
        if args.results:
            write_row(args.results, {"bench": "exp_qlora_dequant", "weight": name, "shape": list(shape),
                                     "tokens": args.tokens, "pairs_us": round(us_pairs, 2),
                                     "element_us": round(us_elem, 2), "bnb_us": round(us_bnb, 2) if us_bnb else None,
                                     "gemm_us": round(us_gemm, 2), "pairs_gbps": round(gbs, 1),
                                     "copy_gbps": round(bw, 1)})
    # a micro-step dequantises every linear 3x (forward, recomputed forward, backward) and runs 3 GEMMs per linear
    print(f"per layer: dequant pairs {layer['pairs']:.0f} us, element {layer['element']:.0f}, bnb {layer['bnb']:.0f}; "
          f"one GEMM pass {layer['gemm']:.0f} us")
    print(f"per micro-step (36 layers x 3 passes): dequant pairs {108 * layer['pairs'] / 1e3:.1f} ms, element "
          f"{108 * layer['element'] / 1e3:.1f}, bnb {108 * layer['bnb'] / 1e3:.1f}; "
          f"GEMMs ~{108 * layer['gemm'] / 1e3:.1f} ms")


if __name__ == "__main__":
    main()
