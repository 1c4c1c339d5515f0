"""Benchmark: lm_head + cross-entropy, forward and backward together, at Qwen3-4B's shape.

    python bench/bench_linear_cross_entropy.py                 # 4096 x 2560 -> 151936, bf16 (H100/H200: < 60 s)
    python bench/bench_linear_cross_entropy.py --quick         # 1024 tokens, short timing loops
    python bench/bench_linear_cross_entropy.py --chunk 1024    # also time novatune with forced chunks
    python bench/bench_linear_cross_entropy.py --vocab-slice 8192   # also time novatune_vocab with 8192 columns
    python bench/bench_linear_cross_entropy.py --candidates novatune_inplace,novatune_tokens   # a subset

Candidates (each computes the loss and the gradients of hidden and lm_weight):
  hf_eager          F.linear + transformers' ForCausalLMLoss (bf16 logits, .float(), F.cross_entropy)
  torch_compile     torch.compile of hf_eager's function
  liger             LigerFusedLinearCrossEntropyLoss (row says absent when liger_kernel is not importable)
  novatune          novatune.ops.linear_cross_entropy, default plan mode="auto" (see novatune.kernels.
                    linear_cross_entropy.plan_mode; at 4096 x 151936 it is the inplace plan)
  novatune_tokens   mode="tokens": token chunks against the whole vocab, 3 GEMMs (one chunk at 4096 tokens:
                    the full bf16 logits)
  novatune_vocab    mode="vocab": two passes over vocab slices, 4 GEMMs, one (T, Vc) logits slice
  novatune_inplace  mode="inplace": 3 GEMMs on transposed logits, grad_W written over consumed logits (peak ~ the
                    bf16 logits + a 16 MiB temp + fp32 grad_h; needs T >= H, else it runs the tokens plan)
  novatune_chunkN   mode="tokens" with chunk_tokens=N (the fp32-accumulator path), with --chunk N
  novatune_vocabN   mode="vocab" with vocab_slice=N, with --vocab-slice N

Figures per candidate: kernel µs (sum of CUDA kernel time per call, torch.profiler), wall µs (do_bench median),
peak MiB (torch.cuda.max_memory_allocated during one call minus what was allocated before it: logits, buffers
and the returned gradients), relative errors of loss / grad_hidden / grad_weight against the fp32 reference.
Floor: the op is compute-bound - three GEMMs of 2*T*H*V flops (logits, grad_hidden, grad_weight) at the bf16
matmul rate measured in the same run (novatune.measure.timing.matmul_tflops); the HBM floor (inputs read once,
gradients written once, at the measured copy bandwidth) is reported too. frac = max(floors) / kernel µs (the
vocab plan does a 4th GEMM, the logits' recompute, so its frac is at most ~0.75 by construction; inplace does the
3 GEMMs of tokens, as 2 + 2 + ~9 calls, plus its temp blocks' copies).
One row per candidate goes to --results (default bench/results/ops.jsonl).
"""
from __future__ import annotations

import argparse
import gc
import sys

import torch
import torch.nn.functional as F

DEFAULT_RESULTS = "bench/results/ops.jsonl"


def _hf_loss_fn(vocab: int):
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except Exception:  # noqa: BLE001 - older/newer layout: the same math inline
        ForCausalLMLoss = None

    def hf_loss(h, w, y):
        logits = F.linear(h, w)  # (1, T, V) in the input dtype, as the HF lm_head
        if ForCausalLMLoss is not None:  # labels already shifted -> shift_labels
            return ForCausalLMLoss(logits, None, vocab, shift_labels=y)
        return F.cross_entropy(logits.float().view(-1, vocab), y.view(-1), ignore_index=-100)

    return hf_loss


def _candidates(args, vocab):
    """name -> loss function (hidden (1, T, H), weight (V, H), labels (1, T)) or a string saying why absent."""
    from novatune.ops.linear_cross_entropy import linear_cross_entropy

    hf_loss = _hf_loss_fn(vocab)
    cands = {"hf_eager": hf_loss, "torch_compile": torch.compile(hf_loss)}
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyLoss,
        )

        liger = LigerFusedLinearCrossEntropyLoss()
        cands["liger"] = lambda h, w, y: liger(w, h.view(-1, h.shape[-1]), y.view(-1))
    except Exception as e:  # noqa: BLE001 - absent or broken: the row says so
        cands["liger"] = f"absent: {type(e).__name__}: {e}"
    cands["novatune"] = lambda h, w, y: linear_cross_entropy(h, w, y)
    cands["novatune_tokens"] = lambda h, w, y: linear_cross_entropy(h, w, y, mode="tokens")
    cands["novatune_vocab"] = lambda h, w, y: linear_cross_entropy(h, w, y, mode="vocab")
    cands["novatune_inplace"] = lambda h, w, y: linear_cross_entropy(h, w, y, mode="inplace")
    if args.chunk:
        cands[f"novatune_chunk{args.chunk}"] = lambda h, w, y: linear_cross_entropy(h, w, y, chunk_tokens=args.chunk)
    if args.vocab_slice:
        cands[f"novatune_vocab{args.vocab_slice}"] = lambda h, w, y: linear_cross_entropy(
            h, w, y, mode="vocab", vocab_slice=args.vocab_slice)
    if args.candidates:
        keep = set(args.candidates.split(","))
        cands = {k: v for k, v in cands.items() if k in keep}
    return cands


def _reference(h, w, y):
    from novatune.reference.linear_cross_entropy import linear_cross_entropy_ref

    hr = h.detach().float().requires_grad_(True)
    wr = w.detach().float().requires_grad_(True)
    loss = linear_cross_entropy_ref(hr, wr, y)
    gh, gw = torch.autograd.grad(loss, (hr, wr))
    return loss.detach(), gh, gw


def _measure(name, loss_fn, h, w, y, ref, args, ceilings):
    from novatune.measure.numerics import rel_err
    from novatune.measure.timing import kernel_us, wall_us

    def step():
        loss = loss_fn(h, w, y)
        return (loss,) + tuple(torch.autograd.grad(loss, (h, w)))

    out = step()  # warm-up: Triton / inductor compilation, cuBLAS heuristics
    errs = {k: rel_err(o.float(), r) for k, o, r in zip(("err_loss", "err_grad_hidden", "err_grad_weight"), out, ref)}
    del out
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = step()
    torch.cuda.synchronize()
    peak_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
    del out
    k_us = kernel_us(step, iters=args.iters, warmup=2)
    w_us = wall_us(step, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    floor = max(ceilings["gemm_floor_us"], ceilings["hbm_floor_us"])
    return {"kernel_us": round(k_us, 1), "wall_us": round(w_us, 1), "peak_mib": round(peak_mib, 1),
            "frac_of_floor": round(floor / k_us, 3), **{k: float(f"{v:.3e}") for k, v in errs.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=2560)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--ignore-frac", type=float, default=0.0, help="fraction of labels set to -100")
    p.add_argument("--chunk", type=int, default=0, help="also time novatune with chunk_tokens=N")
    p.add_argument("--vocab-slice", type=int, default=0, help="also time novatune with mode='vocab', vocab_slice=N")
    p.add_argument("--candidates", default="", help="comma-separated subset of candidate names")
    p.add_argument("--quick", action="store_true", help="1024 tokens and short timing loops (smoke run)")
    p.add_argument("--results", default=DEFAULT_RESULTS, help=f"JSON-lines file (default {DEFAULT_RESULTS})")
    args = p.parse_args(argv)
    args.iters, args.warmup_ms, args.rep_ms = (3, 5, 20) if args.quick else (10, 25, 150)
    if args.quick:
        args.tokens = min(args.tokens, 1024)
    if not torch.cuda.is_available():
        print("bench_linear_cross_entropy: needs a CUDA GPU", file=sys.stderr)
        return 1

    from novatune.kernels.linear_cross_entropy import fp32_addmm_available, plan_mode
    from novatune.measure.results import write_row
    from novatune.measure.timing import copy_bandwidth_gbps, matmul_tflops

    T, H, V = args.tokens, args.hidden, args.vocab
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    tflops, gbps = matmul_tflops(), copy_bandwidth_gbps()
    e = dtype.itemsize
    hbm_bytes = 2 * (T * H + V * H) * e + T * 8  # read h, W; write grad_h, grad_W; labels
    ceilings = {"matmul_tflops": round(tflops, 1), "copy_gbps": round(gbps, 1),
                "gemm_floor_us": round(3 * 2 * T * H * V / (tflops * 1e6), 1),
                "hbm_floor_us": round(hbm_bytes / (gbps * 1e3), 1)}

    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(1, T, H, device="cuda", dtype=dtype, generator=gen).requires_grad_(True)
    w = (torch.randn(V, H, device="cuda", generator=gen) / H**0.5).to(dtype).requires_grad_(True)
    y = torch.randint(0, V, (1, T), device="cuda", generator=gen)
    y[torch.rand(1, T, device="cuda", generator=gen) < args.ignore_frac] = -100
    ref = _reference(h, w, y)
    gc.collect()
    torch.cuda.empty_cache()

    shape = {"tokens": T, "hidden": H, "vocab": V}
    auto = plan_mode(T, V, H, dtype, True)
    plans = {"novatune": auto, "novatune_tokens": plan_mode(T, V, H, dtype, True, "tokens"),
             "novatune_vocab": plan_mode(T, V, H, dtype, True, "vocab"),
             "novatune_inplace": plan_mode(T, V, H, dtype, True, "inplace")}
    if args.chunk:
        plans[f"novatune_chunk{args.chunk}"] = ("tokens", args.chunk)
    if args.vocab_slice:
        plans[f"novatune_vocab{args.vocab_slice}"] = ("vocab", args.vocab_slice)
    plan = {"auto_mode": auto[0], "auto_size": auto[1],
            "fp32_addmm_direct": fp32_addmm_available(torch.device("cuda"), dtype)}
    print(f"T={T} H={H} V={V} {args.dtype}  matmul {tflops:.0f} TFLOP/s  copy {gbps:.0f} GB/s  "
          f"GEMM floor {ceilings['gemm_floor_us']:.0f} us  HBM floor {ceilings['hbm_floor_us']:.0f} us  plan {plan}")
    print(f"{'candidate':<20}{'kernel us':>11}{'wall us':>10}{'peak MiB':>10}{'frac':>7}"
          f"{'err loss':>11}{'err dh':>10}{'err dW':>10}")
    for name, fn in _candidates(args, V).items():
        row = {"op": "linear_cross_entropy", "candidate": name, "shape": shape, "dtype": args.dtype,
               "ignore_frac": args.ignore_frac, "quick": args.quick, **ceilings}
        if isinstance(fn, str):
            row.update(absent=True, reason=fn)
            print(f"{name:<20}{fn}")
        else:
            try:
                row.update(_measure(name, fn, h, w, y, ref, args, ceilings))
            except torch.cuda.OutOfMemoryError as ex:
                row.update(error=f"OOM: {ex}"[:300])
            if name.startswith("novatune"):
                mode, size = plans[name]
                size_key = {"tokens": "chunk_tokens", "vocab": "vocab_slice", "inplace": "inplace_tmp_rows"}[mode]
                row.update(plan, mode=mode, **{size_key: size})
            if "kernel_us" in row:
                print(f"{name:<20}{row['kernel_us']:>11.0f}{row['wall_us']:>10.0f}{row['peak_mib']:>10.0f}"
                      f"{row['frac_of_floor']:>7.2f}{row['err_loss']:>11.1e}{row['err_grad_hidden']:>10.1e}"
                      f"{row['err_grad_weight']:>10.1e}")
            else:
                print(f"{name:<20}{row['error']}")
        write_row(args.results, row)
        gc.collect()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
