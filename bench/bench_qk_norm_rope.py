"""Qwen3 q/k-norm + RoPE, fwd+bwd together at Qwen3-4B's shapes: q (1, 4096, 32, 128), k (1, 4096, 8, 128), bf16.

    python bench/bench_qk_norm_rope.py                  # all candidates, rows appended to bench/results/ops.jsonl
    python bench/bench_qk_norm_rope.py --quick          # smoke run (fewer iterations)
    python bench/bench_qk_norm_rope.py --sweep          # also novatune fused launch-config variants (CUDA graphs)
    python bench/bench_qk_norm_rope.py --candidates novatune_fused novatune_separate --results /tmp/ops.jsonl

What every candidate computes, from q = q_proj(x).view(b, s, hq, d) and k alike (contiguous (b, s, h, d)):
q_out, k_out = RoPE(RMSNorm_q(q)), RoPE(RMSNorm_k(k)), then the backward to q, k, q_norm.weight and k_norm.weight
from random output grads. Candidates:
  hf_eager            transformers' Qwen3RMSNorm x2 + apply_rotary_pos_emb, exactly as Qwen3Attention calls them
  novatune_separate   novatune.ops.rms_norm x2 + novatune.ops.apply_rope(unsqueeze_dim=2) (today's patched path)
  torch_compile       torch.compile(hf_eager composition, dynamic=False)
  liger               LigerRMSNorm x2 + liger_rotary_pos_emb (row says absent when liger_kernel is not importable)
  novatune_fused      novatune.ops.qk_norm_rope.qk_norm_rope: one launch forward, one (+ a tiny reduction) backward
cos/sin come from Qwen3RotaryEmbedding with packed position_ids (documents of ~600 tokens, positions restarting).

Figures (novatune.measure.timing): kernel µs (sum of CUDA kernel durations per fwd+bwd, torch.profiler), wall µs
(do_bench median, host overhead included), frac_floor = HBM floor / kernel µs. HBM floor = bytes that must move /
copy rate measured in this run; bytes = 5 * (|q| + |k|) (fwd reads q, k and writes q_out, k_out; bwd reads the
output grads and q, k, writes dq, dk) + 2 * (|cos| + |sin|) (read by each pass); weights, rstd and the dw partials are
negligible. At the default shape that is ~214 MB, ~50 µs at 4.25 TB/s.
Each candidate's outputs and four grads are checked against the fp32 math (qk_norm_rope_ref on fp32 copies):
rel_err columns. Every candidate gets its own copies of all inputs, output grads included: Liger's backward writes
into the incoming grads in place (its RoPE backward rotates dq/dk where they lie, its RMSNorm backward then stores
dx there), so over its timing loop the shared grads were overwritten hundreds of times and blew up - which is what
made the candidate after it (novatune_fused) report dq/dk/dw "errors" of 1e32 on a run where Liger was installed.
The shared inputs are verified untouched after every candidate (a row records and restores any that changed).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CANDIDATES = ["hf_eager", "novatune_separate", "torch_compile", "liger", "novatune_fused"]
HF_LAYOUT = {"hf_eager", "torch_compile", "liger"}  # outputs (b, h, s, d) views; the others (b, s, h, d)
EPS = 1e-6


def parse_args(argv=None):
    head, _, rest = __doc__.partition("\n\n")
    p = argparse.ArgumentParser(description=head, epilog=rest, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fast smoke run (fewer timing iterations)")
    p.add_argument("--sweep", action="store_true", help="also time novatune fused launch configs (fwd and bwd)")
    p.add_argument("--candidates", nargs="+", choices=CANDIDATES, default=CANDIDATES, help="subset to run")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("HQ", "HK"))
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--results", default="bench/results/ops.jsonl", help="JSON-lines file rows are appended to")
    return p.parse_args(argv)


def build(names, d):
    """name -> fn(q, k, wq, wk, cos, sin) -> (q_out, k_out), or a reason string when absent."""
    import torch
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    from novatune.ops.qk_norm_rope import qk_norm_rope
    from novatune.ops.rms_norm import rms_norm
    from novatune.ops.rope import apply_rope

    def hf_norm(x, w):  # transformers' Qwen3RMSNorm.forward
        dt = x.dtype
        xf = x.to(torch.float32)
        var = xf.pow(2).mean(-1, keepdim=True)
        return w * (xf * torch.rsqrt(var + EPS)).to(dt)

    def hf_eager(q, k, wq, wk, cos, sin):  # Qwen3Attention: norm on (b, s, h, d), transpose, rope (unsqueeze_dim=1)
        return apply_rotary_pos_emb(hf_norm(q, wq).transpose(1, 2), hf_norm(k, wk).transpose(1, 2), cos, sin)

    out = {}
    for name in names:
        if name == "hf_eager":
            out[name] = hf_eager
        elif name == "torch_compile":
            out[name] = torch.compile(hf_eager, dynamic=False)
        elif name == "novatune_separate":
            out[name] = lambda q, k, wq, wk, c, s: apply_rope(rms_norm(q, wq, EPS), rms_norm(k, wk, EPS), c, s,
                                                              unsqueeze_dim=2)
        elif name == "novatune_fused":
            out[name] = lambda q, k, wq, wk, c, s: qk_norm_rope(q, k, wq, wk, EPS, c, s)
        elif name == "liger":
            try:
                from liger_kernel.transformers.rms_norm import LigerRMSNorm
                from liger_kernel.transformers.rope import liger_rotary_pos_emb
            except Exception as e:  # noqa: BLE001 - absent or broken: the row says so
                out[name] = f"liger_kernel not importable ({type(e).__name__}: {e})"[:200]
                continue
            # LigerRMSNorm's forward with its own defaults (offset, casting mode, in-place backward, ...: whatever
            # this version has) on our weight leaves; its constructor arguments changed across releases
            cfg = {kk: v for kk, v in vars(LigerRMSNorm(d, eps=EPS)).items() if not kk.startswith("_")}

            def liger(q, k, wq, wk, c, s, cfg=cfg):
                qn = LigerRMSNorm.forward(SimpleNamespace(**cfg, weight=wq), q)  # on (b, s, h, d), as in Qwen3
                kn = LigerRMSNorm.forward(SimpleNamespace(**cfg, weight=wk), k)
                return liger_rotary_pos_emb(qn.transpose(1, 2), kn.transpose(1, 2), c, s)  # HF's (b, h, s, d)
            out[name] = liger
    return out


def tables(b, s, hq, hk, d, dev, dt):
    import torch
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    # packed positions: documents of ~600 tokens (BENCHMARKS.md's median), positions restart at each one
    rows = []
    for _ in range(b):
        lens = torch.distributions.LogNormal(torch.log(torch.tensor(600.0)), 0.8).sample((64,)).long().clamp(16, s)
        pos = torch.cat([torch.arange(n) for n in lens.tolist()])[:s]
        rows.append(torch.cat([pos, torch.arange(s - pos.numel())]))
    pos = torch.stack(rows).to(dev)  # (b, s)
    cfg = Qwen3Config(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hk, head_dim=d,
                      rope_parameters={"rope_type": "default", "rope_theta": 5e6})
    return Qwen3RotaryEmbedding(cfg).to(dev)(torch.zeros(1, device=dev, dtype=dt), pos)  # (b, s, d) each


def run_candidates(args, fns, inputs, floor_us, gbps):
    import torch

    from novatune.kernels.qk_norm_rope import RESIDENCY, num_sms, qk_norm_rope_fwd_config
    from novatune.measure.numerics import rel_err
    from novatune.measure.results import write_row
    from novatune.measure.timing import kernel_us, wall_us
    from novatune.reference.qk_norm_rope import qk_norm_rope_ref

    q0, k0, wq0, wk0, cos, sin, gq0, gk0 = inputs
    b, s, hq, d = q0.shape
    hk = k0.shape[2]
    # the fp32 math: outputs and the four grads
    leaves = [t.float().requires_grad_() for t in (q0, k0, wq0, wk0)]
    rq, rk = qk_norm_rope_ref(*leaves, EPS, cos, sin)
    torch.autograd.backward([rq, rk], [gq0.float(), gk0.float()])
    ref = [rq.detach(), rk.detach()] + [t.grad for t in leaves]
    del leaves

    names = ["q", "k", "q_weight", "k_weight", "cos", "sin", "grad_q_out", "grad_k_out"]
    pristine = [t.clone() for t in inputs]  # the shared inputs must not change between candidates
    rows = []
    for name, fn in fns.items():
        row = {"op": "qk_norm_rope", "candidate": name, "shape": f"q({b},{s},{hq},{d}) k({b},{s},{hk},{d})",
               "dtype": "bf16", "floor_us": round(floor_us, 2), "copy_gbps": round(gbps, 1), "quick": args.quick}
        if isinstance(fn, str):
            row["absent"] = fn
            rows.append(write_row(args.results, row))
            continue
        # private copies of everything: a candidate that writes into its inputs or incoming grads (Liger's backward
        # does, in place, at every call of the timing loop) only corrupts its own copies
        q, k, wq, wk = (t.clone().requires_grad_() for t in (q0, k0, wq0, wk0))
        c_own, s_own, gq_own, gk_own = (t.clone() for t in (cos, sin, gq0, gk0))
        hf = name in HF_LAYOUT  # (b, h, s, d) views of (b, s, h, d) memory: feed grads with the same layout
        gq, gk = (gq_own.transpose(1, 2), gk_own.transpose(1, 2)) if hf else (gq_own, gk_own)
        oq, ok = fn(q, k, wq, wk, c_own, s_own)  # first call: compiles (torch.compile / Triton) outside the timing
        # clones: the correctness call must not see grads a previous call modified, nor modify the timing copies
        grads = torch.autograd.grad((oq, ok), (q, k, wq, wk), (gq.clone(), gk.clone()))
        got = [oq.detach().transpose(1, 2) if hf else oq.detach(), ok.detach().transpose(1, 2) if hf else ok.detach(),
               *grads]
        for tag, a, r in zip(["q", "k", "dq", "dk", "dwq", "dwk"], got, ref):
            row[f"rel_err_{tag}"] = rel_err(a.reshape(r.shape), r)
        if name == "novatune_fused":
            from novatune.kernels.qk_norm_rope import qk_norm_rope_bwd_launch_config
            _, _, rstd_q, rstd_k = torch.ops.novatune.qk_norm_rope_fwd(q0, k0, wq0, wk0, EPS, cos, sin)
            row["config"] = {"fwd": qk_norm_rope_fwd_config(b * s, hq, hk, d, True, num_sms(q0.device)),
                             "bwd": qk_norm_rope_bwd_launch_config(gq0, gk0, q0, k0, wq0, wk0, rstd_q, rstd_k,
                                                                    cos, sin),
                             "residency": sorted({how for key, (_, how) in RESIDENCY.items()
                                                  if key[0] == "qk_norm_rope_bwd"})}

        def step(fn=fn, leaves=(q, k, wq, wk), grads_out=(gq, gk), tabs=(c_own, s_own)):
            outs = fn(*leaves, *tabs)
            return torch.autograd.grad(outs, leaves, grads_out)

        it = dict(warmup_ms=10, rep_ms=30) if args.quick else {}
        kus = kernel_us(step, **(dict(iters=5, warmup=2) if args.quick else {}))
        wus = wall_us(step, **it)
        row.update(kernel_us=round(kus, 2), wall_us=round(wus, 2), frac_floor=round(floor_us / kus, 3))
        changed = [n for n, t, p in zip(names, inputs, pristine) if not torch.equal(t, p)]
        if changed:  # should not happen with private copies; never let it leak into the next candidate's numbers
            row["mutated_shared_inputs"] = changed
            for t, p in zip(inputs, pristine):
                t.copy_(p)
        rows.append(write_row(args.results, row))
        del oq, ok, grads, got
        torch.cuda.empty_cache()
    return rows


def sweep(args, inputs):
    """CUDA-graph replay time (µs) of the fused fwd and bwd kernels over launch configs; top 3 + default printed."""
    import itertools

    from triton.testing import do_bench_cudagraph

    from novatune.kernels import qk_norm_rope as K
    from novatune.measure.results import write_row

    q, k, wq, wk, cos, sin, gq, gk = inputs
    b, s, hq, d = q.shape
    hk = k.shape[2]
    sms = K.num_sms(q.device)
    _, _, rq, rk = K.qk_norm_rope_fwd(q, k, wq, wk, EPS, cos, sin)
    grids = {
        "fwd": [dict(block_t=bt, split=sp, num_warps=nw)
                for bt, sp, nw in itertools.product((1, 2), (1, 2, 4), (4, 8, 16))],
        "bwd": [dict(rows=r, num_warps=nw, stages=st)
                for r, nw, st in itertools.product((4, 8, 16, 32), (2, 4, 8, 16), (0, 1, 3))]
        + [dict(rows=8, num_warps=4, stages=0, num_programs=m * sms) for m in (2, 4, 5, 6, 8)],
    }
    calls = {"fwd": lambda c: (lambda: K.qk_norm_rope_fwd(q, k, wq, wk, EPS, cos, sin, **c)),
             "bwd": lambda c: (lambda: K.qk_norm_rope_bwd(gq, gk, q, k, wq, wk, rq, rk, cos, sin, **c))}
    defaults = {"fwd": K.qk_norm_rope_fwd_config(b * s, hq, hk, d, True, sms),
                "bwd": K.qk_norm_rope_bwd_launch_config(gq, gk, q, k, wq, wk, rq, rk, cos, sin)}
    for phase, cfgs in grids.items():
        timed = []
        for cfg in cfgs:
            fn = calls[phase](cfg)
            try:
                fn()  # compile outside the graph capture
                us = do_bench_cudagraph(fn, rep=20) * 1e3
            except Exception as e:  # noqa: BLE001 - e.g. out of registers/shared memory: skip that point
                print(f"  {phase} {cfg}: failed ({type(e).__name__})")
                continue
            timed.append((us, cfg))
            write_row(args.results, {"op": "qk_norm_rope_sweep", "phase": phase, "shape": list(q.shape) + [hk],
                                     "config": cfg, "graph_us": round(us, 2)})
        timed.sort(key=lambda t: t[0])
        dcfg = {kk: v for kk, v in defaults[phase].items() if kk not in ("items", "q_tile", "k_tile")}
        dflt = calls[phase](dcfg)
        dflt()
        print(f"  sweep {phase}: default {dcfg} {do_bench_cudagraph(dflt, rep=20) * 1e3:.1f} µs; best:")
        for us, cfg in timed[:3]:
            print(f"    {us:7.1f} µs  {cfg}")


def main(argv=None):
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_qk_norm_rope.py needs a CUDA GPU")
    from novatune.measure.timing import copy_bandwidth_gbps

    dev, dt = "cuda", torch.bfloat16
    b, s, (hq, hk), d = args.batch, args.seq, args.heads, args.head_dim
    torch.manual_seed(0)
    q = torch.randn(b, s, hq, d, device=dev, dtype=dt)
    k = torch.randn(b, s, hk, d, device=dev, dtype=dt)
    wq = (1.0 + 0.1 * torch.randn(d, device=dev)).to(dt)
    wk = (1.0 + 0.1 * torch.randn(d, device=dev)).to(dt)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    cos, sin = tables(b, s, hq, hk, d, dev, dt)
    inputs = (q, k, wq, wk, cos, sin, gq, gk)

    nbytes = (5 * (q.numel() + k.numel()) + 2 * (cos.numel() + sin.numel())) * 2
    gbps = copy_bandwidth_gbps()
    floor_us = nbytes / gbps / 1e3
    rows = run_candidates(args, build(args.candidates, d), inputs, floor_us, gbps)

    print(f"\nq/k-norm + RoPE fwd+bwd, q ({b},{s},{hq},{d}) + k ({b},{s},{hk},{d}) bf16; "
          f"{torch.cuda.get_device_name()}, copy {gbps:.0f} GB/s, HBM floor {floor_us:.1f} µs ({nbytes / 1e6:.0f} MB)")
    print(f"{'candidate':20s} {'kernel µs':>10s} {'wall µs':>10s} {'x floor':>8s} {'max rel err':>12s}")
    for r in rows:
        if "absent" in r:
            print(f"{r['candidate']:20s} absent: {r['absent'][:70]}")
            continue
        err = max(v for kk, v in r.items() if kk.startswith("rel_err_"))
        print(f"{r['candidate']:20s} {r['kernel_us']:10.1f} {r['wall_us']:10.1f} {r['frac_floor']:8.2f} {err:12.1e}"
              + (f"  (modified shared inputs {r['mutated_shared_inputs']}; restored)"
                 if "mutated_shared_inputs" in r else ""))
    for r in rows:
        if "config" in r:
            print(f"  novatune_fused launch config: {r['config']}")
    if args.sweep:
        sweep(args, inputs)
    print(f"rows appended to {args.results}")


if __name__ == "__main__":
    main()
