"""LoRA linear fwd+bwd benchmark (issue 6): one projection at Qwen3-4B's real shapes, PEFT eager vs novatune.

x (4096 tokens, 2560) -> out 4096 (q_proj) and 9728 (gate/up_proj), r 16, alpha 32, bf16 base weight frozen, x
requires grad (a middle layer: dx is needed), forward + backward together incl. dA and dB:
  base_frozen        the frozen nn.Linear alone (forward + dx GEMMs): what any LoRA implementation must pay
  peft               PEFT's lora.Linear forward + autograd (what `hf_sdpa + PEFT` runs)
  torch_compile      torch.compile of PEFT's expression  base(x) + B(A(x.to(A.dtype))) * s
  novatune           the same PEFT module with novatune.patch's fused forward bound on it (what a patched model
                     runs: PEFT's per-call state checks + novatune.ops.lora_linear)
  novatune_op        novatune.ops.lora_linear called directly (the module's Python overhead is the difference)
  novatune_launchers[order]  the raw GEMM sequences of novatune.kernels.lora without autograd, for both orders
                     (lora_first: the big GEMM accumulates into the K=r product; base_first: the other way round)
Adapter dtype: fp32 by default (what get_peft_model gives on a bf16 model: autocast_adapter_dtype=True), bf16 with
--adapter_dtype bf16 (or both: --adapter_dtype fp32,bf16).

Figures per candidate: kernel µs (sum of GPU kernel durations, torch.profiler) and wall µs (do_bench median), the
step's peak memory above the resident tensors, overhead over base_frozen, and the relative error of y, dx, dA, dB
against the fp32 reference (novatune.reference.lora.lora_linear_ref). Rows go to bench/results/ops.jsonl.

    python bench/bench_lora.py               # ~1 min on an H100/H200 (torch.compile warm-up dominates)
    python bench/bench_lora.py --quick       # smoke run: fewer repetitions, same shapes
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from novatune.measure.numerics import rel_err  # noqa: E402
from novatune.measure.results import write_row  # noqa: E402
from novatune.measure.timing import copy_bandwidth_gbps, kernel_us, wall_us  # noqa: E402

DEVICE = "cuda"  # module-level so a CPU dry run of the script's logic can redirect it
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class _Holder(nn.Module):
    """A one-projection model for PEFT to wrap (inject_adapter_in_model needs a parent module)."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.proj = nn.Linear(n_in, n_out, bias=False)


def _peft_layer(n_in, n_out, r, alpha, adapter_dtype):
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(0)
    holder = _Holder(n_in, n_out).to(DEVICE, torch.bfloat16)
    holder.proj.weight.requires_grad_(False)
    # init_lora_weights=False: B random (PEFT's default B = 0 would make the LoRA term and dA vanish)
    inject_adapter_in_model(LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=["proj"],
                                       init_lora_weights=False), holder)
    layer = holder.proj
    for name, p in layer.named_parameters():
        if "lora_" in name:
            p.data = p.data.to(adapter_dtype)  # as PeftModel's autocast_adapter_dtype does (fp32) or not (bf16)
    return layer


def _bind_novatune(layer):
    """novatune.patch's bound forward on this one PEFT layer, through the applier's own _bind and LoRASpec."""
    from novatune.patch.apply import _bind
    from novatune.patch.lora import lora_linear_forward, skip_reason
    from novatune.patch.report import PatchReport
    from novatune.patch.spec import LoRASpec

    names = LoRASpec()
    why = skip_reason(layer, names)
    if why is not None:
        raise RuntimeError(f"novatune would not fuse this layer: {why}")
    report = PatchReport(family=None, model_class="bench")
    _bind(layer, lora_linear_forward, report, _novatune_lora=names, _novatune_lora_adapter="default")
    return report


def bench_shape(args, n_out, adapter_dtype, hbm_gbps):
    from novatune.kernels.lora import ORDERS, lora_linear_bwd, lora_linear_fwd
    from novatune.ops.lora import lora_linear
    from novatune.reference.lora import lora_linear_ref

    tokens, n_in, r = args.tokens, args.hidden, args.r
    alpha = 2 * r
    s = alpha / r
    layer = _peft_layer(n_in, n_out, r, alpha, adapter_dtype)
    w = layer.base_layer.weight
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    g = torch.Generator(device=DEVICE).manual_seed(1)
    x = torch.randn(tokens, n_in, device=DEVICE, dtype=torch.bfloat16, generator=g).requires_grad_(True)
    dy = torch.randn(tokens, n_out, device=DEVICE, dtype=torch.bfloat16, generator=g)

    # fp32 reference outputs and gradients (dx, dA, dB)
    x32, a32, b32 = (t.detach().float().requires_grad_(True) for t in (x, a, b))
    y32 = lora_linear_ref(x32, w.float(), None, a32, b32, s)
    y32.backward(dy.float())
    ref = (y32.detach(), x32.grad, a32.grad, b32.grad)
    del x32, a32, b32, y32

    def autograd_step(fwd):
        def step():
            x.grad = a.grad = b.grad = None
            y = fwd(x)
            y.backward(dy)
            return y.detach(), x.grad, a.grad, b.grad
        return step

    def base_step():
        x.grad = None
        y = nn.functional.linear(x, w)
        y.backward(dy)
        return None

    compiled = torch.compile(lambda t: nn.functional.linear(t, w) + nn.functional.linear(
        nn.functional.linear(t.to(a.dtype), a), b).mul(s).to(t.dtype))

    def launcher_step(order):
        def step():
            y, xs = lora_linear_fwd(x.detach(), w, None, a, b, s, order=order)
            lora_linear_bwd(dy, x.detach(), w, a, b, xs, s)
        return step

    cands = {"base_frozen": base_step, "peft": autograd_step(layer), "torch_compile": autograd_step(compiled),
             "novatune": None, "novatune_op": autograd_step(lambda t: lora_linear(t, w, None, a, b, s))}
    cands.update({f"novatune_launchers[{o}]": launcher_step(o) for o in ORDERS})
    results, base_k = [], None
    for name, step in cands.items():
        report = None
        if name == "novatune":
            report = _bind_novatune(layer)  # from here on the module runs the fused forward
            step = autograd_step(layer)
        row = {"bench": "lora", "op": "lora_linear", "candidate": name, "shape": [tokens, n_in, n_out, r],
               "dtype": "bfloat16", "adapter_dtype": str(adapter_dtype).replace("torch.", ""), "alpha": alpha,
               "hbm_GBps": round(hbm_gbps), "quick": args.quick}
        outs = step()  # first call: also the compile warm-up; outputs checked against the fp32 reference
        if outs is not None:
            row["rel_err"] = {k: round(rel_err(o, rf), 6) for k, o, rf in zip(("y", "dx", "dA", "dB"), outs, ref)}
        x.grad = a.grad = b.grad = None
        outs = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        row["step_peak_MiB"] = round((torch.cuda.max_memory_allocated() - resident) / 2**20, 1)
        wu, rep, iters = (10, 30, 10) if args.quick else (25, 100, 30)
        k_us, w_us = kernel_us(step, iters=iters), wall_us(step, warmup_ms=wu, rep_ms=rep)
        base_k = k_us if name == "base_frozen" else base_k
        row.update(kernel_us=round(k_us, 1), wall_us=round(w_us, 1),
                   overhead_vs_base=round(k_us / base_k - 1, 3) if base_k else None)
        results.append(write_row(args.results, row))
        if report is not None:
            report.revert()
    return results


def print_table(title, rows, cols):
    print(f"\n{title}")
    print(" | ".join(f"{c:>14}" if i else f"{c:<32}" for i, c in enumerate(cols)))
    for r in rows:
        cells = [r["candidate"]] + ["-" if r.get(c) is None else
                                    (str(r[c]) if not isinstance(r[c], dict) else f"{max(r[c].values()):.1e}")
                                    for c in cols[1:]]
        print(" | ".join(f"{c:>14}" if i else f"{c:<32}" for i, c in enumerate(cells)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=2560, help="in_features (Qwen3-4B hidden)")
    ap.add_argument("--outs", default="4096,9728", help="out_features to bench (q_proj 4096, gate/up 9728)")
    ap.add_argument("--r", type=int, default=16, help="LoRA rank (alpha = 2r)")
    ap.add_argument("--adapter_dtype", default="fp32", help="fp32 (PEFT's default on bf16 models), bf16, or both")
    ap.add_argument("--quick", action="store_true", help="fast smoke run: fewer repetitions")
    ap.add_argument("--results", default="bench/results/ops.jsonl", help="JSON-lines file rows are appended to")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_lora.py needs a CUDA GPU (nothing measured).", file=sys.stderr)
        return 2
    hbm = copy_bandwidth_gbps()
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {hbm:.0f} GB/s; rows appended to {args.results}")
    for ad in args.adapter_dtype.split(","):
        for n_out in (int(v) for v in args.outs.split(",")):
            rows = bench_shape(args, n_out, DTYPES[ad], hbm)
            print_table(f"LoRA linear fwd+bwd {args.tokens}x{args.hidden} -> {n_out}, r {args.r}, bf16 base, "
                        f"{ad} adapters", rows,
                        ["candidate", "kernel_us", "wall_us", "overhead_vs_base", "step_peak_MiB", "rel_err"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
