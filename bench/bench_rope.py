"""RoPE on q and k, fwd+bwd together at Qwen3-4B's shapes: q (1, 32, 4096, 128), k (1, 8, 4096, 128), bf16.

    python bench/bench_rope.py                 # all candidates, rows appended to bench/results/ops.jsonl
    python bench/bench_rope.py --quick         # smoke run (fewer iterations)
    python bench/bench_rope.py --sweep         # also novatune's head-split / warp-count variants
    python bench/bench_rope.py --layout bhsd   # contiguous (b, h, s, d) inputs instead of projection views

Inputs are laid out as in HF Qwen3's attention: q_norm(q_proj(x).view(b, s, h, d)).transpose(1, 2), i.e. a
(b, h, s, d) view of (b, s, h, d) memory (--layout proj, the default). cos/sin come from Qwen3RotaryEmbedding with
packed position_ids (documents of ~600 tokens, restarting positions). Candidates: HF eager apply_rotary_pos_emb,
torch.compile of it, Liger's liger_rotary_pos_emb (if importable), novatune.apply_rope (HF layout), and novatune on
the (b, s, h, d) layout (unsqueeze_dim=2; novatune's attention path). There is no torch-native RoPE.

HBM floor: fwd reads q, k, cos, sin and writes q', k'; bwd reads dq', dk', cos, sin and writes dq, dk:
2 * (2 * (|q| + |k|) + |cos| + |sin|) * 2 bytes, divided by the copy rate measured in this run.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fast smoke run (fewer timing iterations)")
    p.add_argument("--sweep", action="store_true", help="also time novatune split/num_warps variants")
    p.add_argument("--layout", choices=["proj", "bhsd"], default="proj", help="HF-layout input memory order")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("HQ", "HK"))
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--results", default="bench/results/ops.jsonl", help="JSON-lines file rows are appended to")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import torch
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

    from novatune.kernels import rope as K
    from novatune.measure.numerics import rel_err
    from novatune.measure.results import write_row
    from novatune.measure.timing import copy_bandwidth_gbps, kernel_us, wall_us
    from novatune.ops.rope import apply_rope
    from novatune.reference import rope as R

    if not torch.cuda.is_available():
        sys.exit("bench_rope.py needs a CUDA GPU")
    dev, dt = "cuda", torch.bfloat16
    b, s, (hq, hk), d = 1, args.seq, args.heads, args.head_dim
    torch.manual_seed(0)

    # packed positions: documents of ~600 tokens (BENCHMARKS.md's median), positions restart at each one
    lens = torch.distributions.LogNormal(torch.log(torch.tensor(600.0)), 0.8).sample((64,)).long().clamp(16, s)
    pos = torch.cat([torch.arange(n) for n in lens.tolist()])[:s]
    pos = torch.cat([pos, torch.arange(s - pos.numel())])[None].to(dev)                   # (1, s)
    cfg = Qwen3Config(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hk, head_dim=d,
                      rope_parameters={"rope_type": "default", "rope_theta": 5e6})
    cos, sin = Qwen3RotaryEmbedding(cfg).to(dev)(torch.zeros(1, device=dev, dtype=dt), pos)  # (1, s, d)

    def leaves(u):
        """q, k as the attention code hands them over (fresh leaves so grads do not accumulate)."""
        qm = torch.randn(b, s, hq, d, device=dev, dtype=dt)   # (b, s, hq, d) memory, like q_norm's output
        km = torch.randn(b, s, hk, d, device=dev, dtype=dt)
        if u == 2:
            q, k = qm, km
        elif args.layout == "proj":
            q, k = qm.transpose(1, 2), km.transpose(1, 2)     # (b, h, s, d) views
        else:
            q, k = qm.transpose(1, 2).contiguous(), km.transpose(1, 2).contiguous()
        return q.requires_grad_(True), k.requires_grad_(True)

    candidates = {"hf_eager": (apply_rotary_pos_emb, 1),
                  "torch_compile": (torch.compile(apply_rotary_pos_emb, dynamic=False), 1)}
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
        candidates["liger"] = (lambda q, k, c, s_, u: liger_rotary_pos_emb(q, k, c, s_, unsqueeze_dim=u), 1)
    except ImportError as e:
        candidates["liger"] = (None, str(e))
    candidates["novatune"] = (apply_rope, 1)
    candidates["novatune_bshd"] = (apply_rope, 2)
    if args.sweep:
        for split in (1, 2, 4):
            for nw in (2, 4, 8):
                def fn(q, k, c, s_, u, split=split, nw=nw):   # raw launchers: the same kernel, forced config
                    K.rope_bwd(*K.rope_fwd(q.detach(), k.detach(), c, s_, u, split=split, num_warps=nw), c, s_, u,
                               split=split, num_warps=nw)
                candidates[f"novatune[split={split},warps={nw}]"] = (fn, 0)

    nbytes = 2 * (2 * (b * s * (hq + hk) * d) + 2 * cos.numel()) * 2
    gbps = copy_bandwidth_gbps()
    floor_us = nbytes / gbps / 1e3
    it = dict(warmup_ms=10, rep_ms=30) if args.quick else {}
    rows = []
    for name, (fn, u) in candidates.items():
        row = {"op": "rope", "candidate": name, "shape": f"q(1,{hq},{s},{d}) k(1,{hk},{s},{d})", "dtype": "bf16",
               "layout": "bshd" if u == 2 else args.layout, "floor_us": round(floor_us, 2),
               "copy_gbps": round(gbps, 1)}
        if fn is None:
            row["absent"] = u
            rows.append(write_row(args.results, row))
            continue
        raw = u == 0
        uu = 1 if raw else u
        q, k = leaves(uu)
        gq, gk = torch.randn(q.shape, device=dev, dtype=dt), torch.randn(k.shape, device=dev, dtype=dt)
        if raw:
            step = lambda q=q, k=k: fn(q, k, cos, sin, uu)  # noqa: E731
        else:
            def step(q=q, k=k, gq=gq, gk=gk):  # bound now: the loop deletes these names at its end
                oq, ok = fn(q, k, cos, sin, uu)
                return torch.autograd.grad((oq, ok), (q, k), (gq, gk))
            # numerics vs the fp32 reference, forward and both grads
            oq, ok = fn(q, k, cos, sin, uu)
            dq, dk = torch.autograd.grad((oq, ok), (q, k), (gq, gk))
            rq, rk = R.rope_ref(q.detach(), k.detach(), cos, sin, uu)
            rdq, rdk = R.rope_bwd_ref(gq, gk, cos, sin, uu)
            row["rel_err"] = max(rel_err(a, r) for a, r in [(oq, rq), (ok, rk), (dq, rdq), (dk, rdk)])
        kus = kernel_us(step, iters=10 if args.quick else 30)
        wus = wall_us(step, **it)
        row.update(kernel_us=round(kus, 2), wall_us=round(wus, 2), frac_floor=round(floor_us / kus, 3))
        rows.append(write_row(args.results, row))
        del q, k, gq, gk, step

    print(f"\nRoPE fwd+bwd, q (1,{hq},{s},{d}) + k (1,{hk},{s},{d}) bf16, layout {args.layout}; "
          f"{torch.cuda.get_device_name()}, copy {gbps:.0f} GB/s, HBM floor {floor_us:.1f} us")
    print(f"{'candidate':34s} {'kernel us':>10s} {'wall us':>10s} {'x floor':>8s} {'rel err':>9s}")
    for r in rows:
        if "absent" in r:
            print(f"{r['candidate']:34s} absent: {r['absent'][:60]}")
            continue
        err = f"{r['rel_err']:.1e}" if "rel_err" in r else "-"
        print(f"{r['candidate']:34s} {r['kernel_us']:10.1f} {r['wall_us']:10.1f} {r['frac_floor']:8.2f} {err:>9s}")
    print(f"rows appended to {args.results}")


if __name__ == "__main__":
    main()
