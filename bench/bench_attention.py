"""Attention on packed rows (BENCHMARKS.md workload): every novatune backend and the stock HF baseline, fwd and fwd+bwd.

Workload: --batch rows of --seq tokens (default 4 x 4096), Hq 32 / Hkv 8, head_dim 128, bf16; documents with
log-normal lengths (median --median = 600, sigma 0.7, min 32, cut at the row end - as reference/anchor_e2e.py),
fixed --seed.

Candidates:
  varlen, flash, fa4, cudnn, flex, sdpa_docs, reference
                                       novatune.attention backends on the packed rows (q/k/v as (tokens, h, d))
  cudnn_aten                           cudnn through torch's aten ops (cudnn: the cudnn-frontend package when it
                                       imports, else the same aten path)
  cudnn_exact                          cudnn with the exact document offsets (no bucketing: one cuDNN graph per
                                       document count and longest document)
  hf_sdpa_dense                        stock: transformers' sdpa_attention_forward with the dense (b, 1, s, s)
                                       document-causal bool mask (repeat_kv: HF uses enable_gqa only without a mask)
  sdpa_one_doc                         the ceiling: plain causal SDPA with ONE document per row (a different workload:
                                       its own flop count; on sm90 cuDNN)
  metadata                             host time to build the PackedBatch (from CPU position_ids) and its BlockMask

Useful FLOPs (BENCHMARKS.md convention, causal within documents): fwd = 4 * sum_docs(L^2 / 2) * Hq * d (QK^T and PV;
with --window W the pairs of a longer document are W^2 / 2 + (L - W) W);
fwd+bwd = 3 x fwd (the backward's 4 matmuls = 2 x fwd; recomputing P in the backward is not counted). A kernel that
computes masked-out tiles (hf_sdpa_dense) gets no credit for them.

Figures: wall ms = triton do_bench median (novatune.measure.timing.wall_us), fwd and fwd+bwd (grads set to None
inside the timed call), plus rel_err of the forward vs the fp32 reference. fresh_layout_ms: the median of
--layouts single fwd+bwd calls (synchronised), each on a document layout never seen before, as every training step
brings one: it includes any per-layout work (a cuDNN graph build, flex's BlockMask; the PackedBatch itself is built
outside the timer). Rows: --results (default
bench/results/attention.jsonl) via novatune.measure.results.write_row. Without CUDA: a tiny smoke run, no rows.

    python bench/bench_attention.py                       # all candidates, < 90 s on an H100/H200
    python bench/bench_attention.py --quick --candidates varlen,flex
    python bench/bench_attention.py --hq 64 --hkv 8 --d 64 --window 128 --sinks --candidates varlen,reference
        # GPT-OSS's attention: per-head sinks (only the sink-capable backends run; the others are error rows)
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

ALL = ("varlen", "flash", "fa4", "cudnn", "cudnn_aten", "cudnn_exact", "flex", "hf_sdpa_dense", "sdpa_one_doc",
       "sdpa_docs", "reference")
DEFAULT = ("varlen", "flash", "fa4", "cudnn", "cudnn_aten", "cudnn_exact", "flex", "hf_sdpa_dense", "sdpa_one_doc")
CUDNN_VARIANTS = {"cudnn_aten": dict(impl="aten"), "cudnn_exact": dict(buckets=False)}


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--hq", type=int, default=32)
    p.add_argument("--hkv", type=int, default=8)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--median", type=float, default=600.0, help="median document length (log-normal)")
    p.add_argument("--sigma", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--candidates", default=",".join(DEFAULT), help=f"comma list from {ALL}")
    p.add_argument("--results", default="bench/results/attention.jsonl")
    p.add_argument("--quick", action="store_true", help="shorter timing loops")
    p.add_argument("--window", type=int, default=None, help="sliding window in keys (HF's definition)")
    p.add_argument("--sinks", action="store_true", help="per-head attention sinks (GPT-OSS), drawn from N(0, 2^2)")
    p.add_argument("--layouts", type=int, default=8, help="document layouts cycled by the new_layout timing")
    return p.parse_args()


def doc_lengths(batch, seq, median, sigma, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        row = []
        while sum(row) < seq:
            L = int(min(seq, max(32, math.exp(math.log(median) + sigma * torch.randn(1, generator=g).item()))))
            row.append(min(L, seq - sum(row)))
        rows.append(row)
    return rows


def cudnn_variant(call, settings: dict):
    """The cudnn backend with other settings for this call (the backward reuses what the forward chose)."""
    from novatune.attention import cudnn

    def run(*args):
        with cudnn.overrides(**settings):
            return call(*args)

    return run


def fresh_layout_ms(fwd, q, k, v, go, args, dev, cuda) -> float:
    """Median ms of one synchronised fwd+bwd on each of --layouts document layouts that no call has seen yet."""
    import torch

    from novatune.attention import PackedBatch

    times = []
    for i in range(args.layouts):
        rows = doc_lengths(args.batch, args.seq, args.median, args.sigma, args.seed + 1000 + i)
        pb = PackedBatch.from_position_ids(torch.tensor([[p for n in r for p in range(n)] for r in rows]), device=dev)
        q.grad = k.grad = v.grad = None
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fwd(pb).backward(go)
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def main():
    args = parse()
    import torch

    from novatune.attention import PackedBatch, last_choice, varlen_attention
    from novatune.measure.numerics import rel_err
    from novatune.reference.attention import attention_sinks_ref

    cuda = torch.cuda.is_available()
    if not cuda:  # smoke run: exercises the script, figures meaningless, nothing written
        args.batch, args.seq, args.hq, args.hkv, args.d, args.median = 2, 256, 4, 2, 32, 60
        print("no CUDA: smoke run at tiny shapes, no rows written")
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    cands = [c.strip() for c in args.candidates.split(",") if c.strip()]
    bad = [c for c in cands if c not in ALL]
    if bad:
        raise SystemExit(f"unknown candidates {bad}; choose from {ALL}")

    def timer(fn):
        if cuda:
            from novatune.measure.timing import wall_us

            return wall_us(fn, warmup_ms=10 if args.quick else 25, rep_ms=40 if args.quick else 100) / 1e3
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[1] * 1e3

    rows_len = doc_lengths(args.batch, args.seq, args.median, args.sigma, args.seed)
    pos = torch.tensor([[p for n in row for p in range(n)] for row in rows_len])  # CPU, as a collator yields it
    b, s, hq, hk, d = args.batch, args.seq, args.hq, args.hkv, args.d
    T = b * s
    docs = [n for row in rows_len for n in row]
    # attended (query, key) pairs per document: L^2 / 2 causal; with a window W < L, W^2 / 2 + (L - W) W
    w = args.window
    fwd_flops = 4 * sum(n * n / 2 if w is None or n <= w else w * w / 2 + (n - w) * w for n in docs) * hq * d
    one_doc_fwd_flops = 4 * b * (s * s / 2) * hq * d
    cfg = dict(batch=b, seq=s, hq=hq, hkv=hk, head_dim=d, dtype=str(dtype).replace("torch.", ""), seed=args.seed,
               docs=len(docs), docs_per_row=round(len(docs) / b, 2), median=args.median,
               flops_convention="fwd=4*sum(pairs)*hq*d, pairs=L^2/2 (window W<L: W^2/2+(L-W)W); fwd_bwd=3*fwd",
               window=args.window, sinks=args.sinks)

    # metadata: host build + H2D + BlockMask, once per batch
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    packed = PackedBatch.from_position_ids(pos, device=dev)
    t1 = time.perf_counter()
    packed.block_mask()
    if cuda:
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    meta = dict(packed_ms=round((t1 - t0) * 1e3, 3), block_mask_ms=round((t2 - t1) * 1e3, 3))
    one_doc = PackedBatch.from_position_ids(torch.arange(s).repeat(b, 1), device=dev)

    g = torch.Generator().manual_seed(args.seed)
    q0, k0, v0 = (torch.randn(T, h, d, generator=g).to(dev, dtype) for h in (hq, hk, hk))
    q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
    go = torch.randn(T, hq, d, generator=g).to(dev, dtype)
    sinks0 = (2 * torch.randn(hq, generator=g)).to(dev, dtype) if args.sinks else None
    sinks = sinks0.clone().requires_grad_() if sinks0 is not None else None
    window = args.window
    with torch.no_grad():
        ref = (attention_sinks_ref(q0, k0, v0, sinks0, packed, window) if sinks0 is not None else
               varlen_attention(q0.float(), k0.float(), v0.float(), packed, backend="reference", window=window))
        ref_one = varlen_attention(q0.float(), k0.float(), v0.float(), one_doc, backend="reference")

    hf_fn, hf_impl = None, "absent"
    if "hf_sdpa_dense" in cands:
        doc = packed.doc_ids().view(b, s)
        i = torch.arange(s, device=dev)
        mask = ((doc[:, :, None] == doc[:, None, :]) & (i[:, None] >= i[None, :]))[:, None]  # (b, 1, s, s) True=attend
        try:
            import types

            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            stub = types.SimpleNamespace(num_key_value_groups=hq // hk, is_causal=True, layer_idx=0, training=True)
            hf_impl = "transformers.integrations.sdpa_attention.sdpa_attention_forward"

            def hf_fn(q_, k_, v_):  # HF layout: (b, h, s, d) views of the (b, s, h, d) projections
                qh, kh, vh = (t.view(b, s, -1, d).transpose(1, 2) for t in (q_, k_, v_))
                out, _ = sdpa_attention_forward(stub, qh, kh, vh, mask, scaling=d ** -0.5)
                return out.reshape(T, hq, d)
        except ImportError:
            hf_impl = "emulated (repeat_kv + sdpa with bool mask)"

            def hf_fn(q_, k_, v_):
                qh, kh, vh = (t.view(b, s, -1, d).transpose(1, 2) for t in (q_, k_, v_))
                kh, vh = (t.repeat_interleave(hq // hk, dim=1) for t in (kh, vh))
                out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
                return out.transpose(1, 2).reshape(T, hq, d)

    def run(name):
        if (sinks is not None or window is not None) and name in ("hf_sdpa_dense", "sdpa_one_doc"):
            raise ValueError(f"{name} runs plain causal attention: no --window / --sinks")
        if name == "hf_sdpa_dense":
            return (lambda: hf_fn(q, k, v)), ref, fwd_flops, hf_impl
        if name == "sdpa_one_doc":
            return (lambda: varlen_attention(q, k, v, one_doc, backend="sdpa")), ref_one, one_doc_fwd_flops, ""
        backend = "cudnn" if name in CUDNN_VARIANTS else name

        def call(pb=packed):
            return varlen_attention(q, k, v, pb, backend=backend, window=window, sinks=sinks)

        return (cudnn_variant(call, CUDNN_VARIANTS[name]) if name in CUDNN_VARIANTS else call), ref, fwd_flops, ""

    from novatune.measure.results import write_row

    table = []
    for name in cands:
        try:
            fwd, r, flops, impl = run(name)
            t0 = time.perf_counter()
            with torch.no_grad():
                out = fwd()  # first call: compiles flex
            if cuda:
                torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            err = rel_err(out, r)
            detail = impl or (last_choice().detail if last_choice() else "")

            def fwd_bwd():
                q.grad = k.grad = v.grad = None
                if sinks is not None:
                    sinks.grad = None
                fwd().backward(go)

            fwd_bwd()  # compile the backward outside the timed loop
            with torch.no_grad():
                ms_f = timer(fwd)
            ms_fb = timer(fwd_bwd)
            fresh = (fresh_layout_ms(fwd, q, k, v, go, args, dev, cuda)
                     if name not in ("hf_sdpa_dense", "sdpa_one_doc") else None)
            row = dict(candidate=name, fwd_ms=round(ms_f, 4), fwd_bwd_ms=round(ms_fb, 4),
                       fresh_layout_ms=None if fresh is None else round(fresh, 3),
                       fwd_tflops=round(flops / ms_f / 1e9, 1), fwd_bwd_tflops=round(3 * flops / ms_fb / 1e9, 1),
                       rel_err_fwd=float(f"{err:.3e}"), first_call_s=round(first_s, 2), detail=detail)
        except Exception as e:  # noqa: BLE001 - a candidate that cannot run is a result too
            row = dict(candidate=name, error=f"{type(e).__name__}: {str(e)[:300]}")
        table.append(row)
        if cuda:
            write_row(args.results, {"bench": "attention", **cfg, **meta, **row})

    if cuda:
        write_row(args.results, {"bench": "attention", **cfg, "candidate": "metadata", **meta})
    print(f"packed attention: {b} x {s} tokens, {len(docs)} docs ({len(docs) / b:.1f}/row), Hq {hq} / Hkv {hk}, "
          f"d {d}, {cfg['dtype']}; metadata {meta['packed_ms']} ms + BlockMask {meta['block_mask_ms']} ms")
    print(f"{'candidate':15s} {'fwd ms':>8s} {'TFLOP/s':>8s} {'f+b ms':>8s} {'TFLOP/s':>8s} {'fresh ms':>8s} "
          f"{'rel err':>9s}  detail")
    for r in table:
        if "error" in r:
            print(f"{r['candidate']:15s} ERROR {r['error']}")
        else:
            fresh = "-" if r["fresh_layout_ms"] is None else f"{r['fresh_layout_ms']:.3f}"
            print(f"{r['candidate']:15s} {r['fwd_ms']:8.3f} {r['fwd_tflops']:8.1f} {r['fwd_bwd_ms']:8.3f} "
                  f"{r['fwd_bwd_tflops']:8.1f} {fresh:>8s} {r['rel_err_fwd']:9.2e}  {r['detail']}")
    if cuda:
        print(f"rows appended to {args.results}")


if __name__ == "__main__":
    main()
