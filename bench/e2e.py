"""Headline end-to-end benchmark (BENCHMARKS.md): stock HF sdpa vs the best peer (Liger + varlen) vs novatune.

Qwen3-4B architecture (random init), full fine-tuning, bf16, packed 4096-token rows with per-document position_ids,
gradient checkpointing (non-reentrant), micro-batch 1, grad-accum 4, fused AdamW. Same init, same data, same steps
for every stack; each stack runs in its own process (memory and caches don't leak), one GPU run:

    python bench/e2e.py --stacks hf_sdpa,varlen_liger,novatune          # driver: spawns one process per stack
    python bench/e2e.py --stack novatune --steps 3                       # one stack (what the driver runs)

tokens/s = trained tokens / wall time of the timed optimizer steps (after --warm warm-up steps), synchronised.
peak GiB = torch.cuda.max_memory_allocated() over the timed steps. MFU = tok/s x FLOPs/token / the 8192^3 bf16
matmul rate measured by the driver in the same run. Rows go to bench/results/e2e.jsonl.

LoRA (--lora R): every stack trains PEFT LoRA r=R, alpha 2R, no dropout, on the seven projections of every layer,
wired as shared/reference/anchor_e2e.py --lora wires it (gradient checkpointing, then enable_input_require_grads,
then get_peft_model; PEFT's default fp32 adapters on the bf16 model); the optimizer gets the trainable parameters.
hf_sdpa is then "PEFT stock", varlen_liger the peer + PEFT, novatune `novatune.patch` on the PEFT model (fused
LoRA linears included). novatune_full is novatune with full fine-tuning even under --lora, so "LoRA faster than
our own full fine-tuning" is measured in the same run. novatune_eager is novatune with cuda_graphs=False (the
A/B of novatune/patch/graphs.py, which applies to LoRA/QLoRA stacks):

    python bench/e2e.py --lora 16 --stacks hf_sdpa,varlen_liger,novatune,novatune_full
MFU under --lora counts the frozen matmuls at 4 x params (forward + input gradient) and the adapters at 6 x.

QLoRA (--qlora R): BENCHMARKS.md's QLoRA workload (defaults: --arch qwen3-8b --seq 2048). The random-init model's
linears (all but lm_head) are quantised in place to bitsandbytes NF4 with double quantisation, bf16 compute
(novatune.train.qlora.quantize_linears_, as the trainer's model.arch path does), then the --lora wiring above with
rank R. hf_sdpa is then "PEFT + bitsandbytes stock" in BENCHMARKS' faster recipe: no prepare_model_for_kbit_training
(its fp32 casts of embeddings, norms and lm_head halve the speed); novatune is the same model patched (fused QLoRA
linears: NF4 dequantised per GEMM). Rows add weights_gib (allocated after quantisation + PEFT, before the first
step: NF4 linears, bf16 embeddings/norms/lm_head, fp32 adapters). novatune_full has no meaning here (refused).

    python bench/e2e.py --qlora 16 --stacks hf_sdpa,novatune --steps 3

Under 7 GiB peak (the acceptance), where the bytes are (Qwen3-8B, 2048 tokens, r16; novatune plan's terms): NF4
linears 3.3 GiB, bf16 embeddings + untied lm_head 2.3 GiB, fp32 adapters + grads + AdamW 0.65 GiB, checkpointed
layer inputs 0.56 GiB + one layer's recompute ~0.5 GiB; stock adds ~3.5 GiB of fp32 logits, which novatune's fused
cross-entropy never makes. novatune (this stack only; rows: nf4_embedding) also holds the untied input embedding in
NF4 (novatune.train.qlora.quantize_embeddings_, the trainer's method.quantize_embeddings default: rows dequantised as
gathered), 0.86 GiB saved: `novatune plan examples/qlora.yaml` estimates ~6.6 GiB patched (7.5 without). The
frozen (V, H) matrices, each ~0.86 GiB saved in NF4 (lm_head's is left):
  * lm_head in NF4, dequantised per vocab slice inside the fused cross-entropy: the "vocab" mode already walks
    W in (Vc, H) row slices (twice: statistics, then gradients), and a frozen lm_head needs no grad_W, so each
    slice would be nf4_dequantize'd into one (Vc, H) buffer just before its GEMM. Not a small change: the
    registered op takes W as a Tensor (schema), kernels/linear_cross_entropy.py is at the 600-line limit, and
    the double-quantised absmax must be sliced on 256-block boundaries (Vc*H/64 a multiple of 256: true for
    H=4096 when Vc is a multiple of 4). Left for the lead.
  * embed_tokens in NF4 with a gather-then-dequantise forward: done (novatune.ops.nf4.NF4Embedding).
Both bring the estimate to ~5.8 GiB.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

STACKS = ("hf_sdpa", "hf_flex", "varlen_liger", "flex_liger", "novatune", "novatune_full", "novatune_eager")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # the anchor's


def build_model(arch: str, layers: int | None, attn: str, device: str):
    import torch
    import transformers

    from novatune.train.arch import arch_config

    cfg = arch_config(arch, {"num_hidden_layers": layers} if layers else None)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    torch.set_default_dtype(torch.float32)
    return model, cfg


def make_rows(n_rows: int, seq: int, vocab: int, seed: int = 1):
    """Documents with log-normal lengths (median ~600 tokens), packed greedily; labels -100 on each first token."""
    import torch

    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n_rows):
        ids, pos, lab = [], [], []
        while len(ids) < seq:
            n = int(min(seq, max(32, math.exp(6.4 + 0.7 * torch.randn(1, generator=g).item()))))
            n = min(n, seq - len(ids))
            doc = torch.randint(0, vocab, (n,), generator=g).tolist()
            ids += doc
            pos += list(range(n))
            lab += [-100] + doc[1:]
        rows.append((ids, pos, lab))
    return rows


def flops_per_token(cfg, rows, lora_params: int = 0) -> float:
    """BENCHMARKS.md: 6 x matmul params (incl. lm_head) + attention, causal within documents. LoRA (lora_params >
    0): frozen matmuls 4 x (forward + input gradient), the adapters 6 x (as novatune.train.metrics counts)."""
    from novatune.train.arch import attention_flops_per_token, count_matmul_params

    ctx = 0.0
    for _, pos, _ in rows:
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
        ctx += sum((starts[i + 1] - starts[i]) ** 2 / 2 for i in range(len(starts) - 1)) / len(pos)
    dense = 4 * count_matmul_params(cfg) + 6 * lora_params if lora_params else 6 * count_matmul_params(cfg)
    return dense + attention_flops_per_token(cfg, ctx / len(rows))


def add_peft_lora(model, r: int):
    """PEFT LoRA exactly as the anchor adds it (module docstring); adapters seeded so every stack gets the same."""
    import torch
    from peft import LoraConfig, get_peft_model

    model.enable_input_require_grads()
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=LORA_TARGETS))


def run_stack(args) -> dict:
    import torch

    stack = args.stack
    attn = {"hf_sdpa": "sdpa", "hf_flex": "flex_attention", "flex_liger": "flex_attention",
            "varlen_liger": "peer_varlen", "novatune": "sdpa", "novatune_full": "sdpa",
            "novatune_eager": "sdpa"}[stack]
    from novatune.bench import peer  # the peer's wiring, shared with `novatune bench`

    if attn == "peer_varlen":
        attn = peer.register_peer_varlen()
    if stack.endswith("liger"):
        peer.apply_liger({"qwen3-4b": "qwen3", "qwen3-8b": "qwen3", "llama-3.2-1b": "llama",
                          "qwen2.5-0.5b": "qwen2"}[args.arch])
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model, cfg = build_model(args.arch, args.layers, attn, dev)
    nf4_embedding = False
    if args.qlora:
        from novatune.train.qlora import quantize_embeddings_, quantize_linears_

        quantize_linears_(model, torch.bfloat16)  # bf16 weights freed layer by layer as their NF4 copies appear
        if stack in ("novatune", "novatune_eager"):  # novatune's recipe (the trainer's default); stock stays PEFT + bnb's bf16 table
            print(quantize_embeddings_(model, torch.bfloat16), flush=True)
            nf4_embedding = type(model.get_input_embeddings()).__name__ == "NF4Embedding"
    lora = args.lora if stack != "novatune_full" else 0
    report = None

    def novatune_patch(m):
        import novatune

        rep = novatune.patch(m, attention=args.attention, cross_entropy_mode=args.ce_mode,
                             fuse_qk_norm_rope=not args.no_fuse_qk,
                             cuda_graphs=False if stack == "novatune_eager" else "auto")
        print(rep, flush=True)
        return rep

    if stack.startswith("novatune") and not lora:
        report = novatune_patch(model)
    if not args.no_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        model = add_peft_lora(model, lora)  # after checkpointing, as the anchor and novatune's trainer order it
        if stack in ("novatune", "novatune_eager"):
            report = novatune_patch(model)  # patch goes last: it sees the LoRA layers
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    # what the model holds before the first step (QLoRA: NF4 linears + the rest + adapters): the "weights GiB"
    weights_gib = round(torch.cuda.memory_allocated() / 2**30, 2) if dev == "cuda" else 0.0
    opt = torch.optim.AdamW(trainable, lr=1e-5, fused=(dev == "cuda"))
    rows = make_rows(args.ga * (args.warm + args.steps), args.seq, cfg.vocab_size)
    # The same feed for every stack: pinned host tensors copied without blocking the host (a trainer's prefetch).
    pin = (lambda x: x.pin_memory()) if dev == "cuda" else (lambda x: x)  # noqa: E731
    host = [tuple(pin(torch.tensor([x])) for x in row) for row in rows]
    host_meta = stack.startswith("novatune") and not args.no_host_meta

    def batch_kwargs(i):
        ids, pos, lab = (x.to(dev, non_blocking=True) for x in host[i])
        kw = dict(input_ids=ids, position_ids=pos, labels=lab)
        if host_meta:
            # novatune's collator hands over the document offsets it computed on the host (as TRL's
            # DataCollatorWithFlattening does): the model then never syncs to find document boundaries
            starts = [t for t, p_ in enumerate(rows[i][1]) if p_ == 0] + [len(rows[i][1])]
            kw.update(cu_seq_lens_q=torch.tensor(starts, dtype=torch.int32),
                      max_length_q=max(b - a for a, b in zip(starts, starts[1:])))
        return kw

    def opt_step(k):
        losses = []
        for j in range(args.ga):
            out = model(**batch_kwargs(k * args.ga + j))
            (out.loss / args.ga).backward()
            losses.append(out.loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        return torch.stack(losses).mean()

    if args.diag:
        install_diagnostics()
    losses = []
    for k in range(args.warm):
        t_w = time.perf_counter()
        losses.append(opt_step(k).item())
        if args.diag:
            print(f"DIAG warm step {k}: {1e3 * (time.perf_counter() - t_w):.1f} ms", flush=True)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    sync()
    if not args.no_gc_freeze:
        # Every stack alike: a full garbage collection walks all of transformers' Python objects and took 170-195 ms
        # (run 15, --diag), landing at random in some timed step (+10% on that step). Freezing what exists after
        # the warm-up steps keeps collections short without disabling them (torchtitan disables GC instead).
        import gc

        gc.collect()
        gc.freeze()
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    timed, ends = [], []
    if dev == "cuda":
        ends.append(torch.cuda.Event(enable_timing=True))
        ends[-1].record()
    for k in range(args.warm, args.warm + args.steps):
        timed.append(opt_step(k))
        if dev == "cuda":  # an event per step: per-step times without a host sync inside the timed region
            ends.append(torch.cuda.Event(enable_timing=True))
            ends[-1].record()
    sync()
    dt = time.perf_counter() - t0
    step_ms = [round(a.elapsed_time(b), 1) for a, b in zip(ends, ends[1:])]  # GPU-side time of each timed step
    losses += [float(x) for x in timed]
    tps = args.steps * args.ga * args.seq / dt
    fpt = flops_per_token(cfg, rows, sum(p.numel() for p in trainable) if lora else 0)
    extra = {}
    if stack.startswith("novatune"):
        from novatune.attention.backends import last_choice

        choice = last_choice()
        extra["attention_backend"] = choice.backend if choice else None
        from novatune.patch.apply import _find_state

        found = _find_state(model.get_base_model() if hasattr(model, "get_base_model") else model)
        if found is not None and found[1].graphs is not None:
            extra["cuda_graphs"] = found[1].graphs.stats()
    if args.memory and dev == "cuda":
        try:
            extra["memory"] = memory_peak_report(model, batch_kwargs(args.ga), f"{args.memory}_{stack}")
        except Exception as e:  # noqa: BLE001 - a diagnostic: never lose the timing row over it
            extra["memory"] = f"failed: {type(e).__name__}: {e}"
    if args.profile and dev == "cuda":
        extra["profile"] = profile_micro_step(model, batch_kwargs(0), f"{args.profile}_{stack}")
    return dict(stack=stack, arch=args.arch, **extra, layers=cfg.num_hidden_layers, seq=args.seq, ga=args.ga,
                lora=lora, qlora=bool(args.qlora), nf4_embedding=nf4_embedding, weights_gib=weights_gib,
                trainable_params=sum(p.numel() for p in trainable),
                ckpt=not args.no_ckpt, gc_freeze=not args.no_gc_freeze, warm=args.warm, steps=args.steps, attention=args.attention,
                host_meta=host_meta, ce_mode=args.ce_mode, fuse_qk=not args.no_fuse_qk,
                tok_s=round(tps, 1), step_ms=step_ms, model_tflops=round(tps * fpt / 1e12, 1), gflop_per_tok=round(fpt / 1e9, 2),
                peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev == "cuda" else 0.0,
                # CUDA graphs replay inside a private pool that max_memory_allocated does not see: reserved does
                peak_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2) if dev == "cuda" else 0.0,
                losses=[round(x, 4) for x in losses],
                patch=report.to_dict() if report is not None else None)


def install_diagnostics() -> None:
    """--diag: print every Triton JIT compile (a new specialisation inside the timed steps would be a hiccup) and
    every garbage collection over 5 ms (a full collection walks the model's and autograd's Python objects)."""
    import gc

    import triton

    real_compile = triton.compiler.compile

    def logged_compile(src, *a, **kw):
        t = time.perf_counter()
        out = real_compile(src, *a, **kw)
        name = getattr(getattr(src, "fn", None), "__name__", type(src).__name__)
        print(f"DIAG triton compile {name}: {1e3 * (time.perf_counter() - t):.0f} ms", flush=True)
        return out

    triton.compiler.compile = logged_compile
    import triton.runtime.jit as jit

    if getattr(jit, "compile", None) is real_compile:
        jit.compile = logged_compile
    t_gc = {}

    def gc_cb(phase, info):
        if phase == "start":
            t_gc["t"] = time.perf_counter()
        elif "t" in t_gc and (dt := 1e3 * (time.perf_counter() - t_gc["t"])) > 5:
            print(f"DIAG gc generation {info['generation']}: {dt:.0f} ms, {info['collected']} collected", flush=True)

    gc.callbacks.append(gc_cb)


def memory_peak_report(model, batch: dict, path: str) -> dict:
    """One micro-step under torch's allocation recorder; replay the trace to the moment of peak allocated memory
    and write the largest live blocks with the frames that allocated them (what sets the peak), and whether the
    peak falls in the forward or the backward. Blocks allocated with no Python frame of ours (the autograd
    thread's C++ nodes: AccumulateGrad, embedding backward, ...) are named by their C++ frames."""
    import torch

    model(**batch).loss.backward()  # not recorded: makes the gradients exist, as in micro-steps 2..GA
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=500000, stacks="all")
    loss = model(**batch).loss
    torch.cuda.synchronize()
    n_fwd = sum(len(t) for t in torch.cuda.memory._snapshot()["device_traces"])  # events up to the backward
    loss.backward()
    del loss
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    model.zero_grad(set_to_none=True)
    trace = [e for dev_trace in snap["device_traces"] for e in dev_trace]
    events = [(i, e) for i, e in enumerate(trace) if e["action"] in ("alloc", "free_completed")]
    # walk back from the blocks live at the end to those live at the start, then replay forward to the peak
    live = {b["address"]: (b["size"], "before the recorded micro-step")
            for seg in snap["segments"] for b in seg["blocks"] if b["state"] == "active_allocated"}
    for _, e in reversed(events):
        if e["action"] == "alloc":
            live.pop(e["addr"], None)
        else:
            live[e["addr"]] = (e["size"], "before the recorded micro-step")
    cur = best = sum(v[0] for v in live.values())
    best_live, best_at = dict(live), -1
    for i, e in events:
        if e["action"] == "alloc":
            frames = e.get("frames", [])
            ours = [f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}"
                    for f in frames if f["filename"].endswith(".py")
                    and ("torch/" not in f["filename"] or "nn/modules" in f["filename"])]
            if not ours:  # C++ only (or torch internals): the autograd node / aten op that allocated it
                ours = [f"[c++] {f['name'][:70]}" for f in frames
                        if any(k in f["name"] for k in ("autograd", "at::native", "_backward", "Accumulate"))]
            live[e["addr"]] = (e["size"], " <- ".join(ours[:4]))
            cur += e["size"]
            if cur > best:
                best, best_live, best_at = cur, dict(live), i
        elif e["addr"] in live:
            cur -= live.pop(e["addr"])[0]
    phase = ("before the step" if best_at < 0 else "forward" if best_at < n_fwd
             else f"backward, event {best_at - n_fwd} of {len(trace) - n_fwd}")
    groups: dict[str, list] = {}
    for size, where in best_live.values():
        g = groups.setdefault(where, [0, 0])
        g[0] += size
        g[1] += 1
    top = sorted(groups.items(), key=lambda kv: -kv[1][0])[:25]
    with open(path + ".txt", "w") as f:
        f.write(f"peak allocated in the recorded micro-step: {best / 2**30:.3f} GiB, in the {phase}\n")
        for where, (size, n) in top:
            f.write(f"{size / 2**30:8.3f} GiB {n:5d} blocks  {where[:260]}\n")
    return {"peak_replayed_gib": round(best / 2**30, 3), "phase": phase,
            "top": [(round(size / 2**30, 3), where[:200]) for where, (size, _) in top[:8]]}


def _category(name: str) -> str:
    k = name.lower()
    for cat, words in [("attention", ["flash", "fmha", "attention", "attn", "flex", "sdpa", "triton_tem"]),
                       ("gemm", ["gemm", "sm90_xmma", "cutlass", "matmul", "nvjet", "cublas"]),
                       ("cross_entropy", ["cross_entropy", "log_softmax", "nll", "softmax", "_lce_"]),
                       ("norm", ["rms", "norm"]), ("rope", ["rope", "rotary"]), ("swiglu", ["swiglu", "silu"]),
                       ("optimizer", ["adam", "foreach"]), ("copy/cast", ["copy", "cast", "cat", "fill"])]:
        if any(w in k for w in words):
            return cat
    return "elementwise/other"


def profile_micro_step(model, batch: dict, path) -> dict:
    """One micro-step (fwd+bwd) under torch.profiler: CUDA time per category, busy vs wall, Chrome trace."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    # with_stack (Python frames) would name the launching code, but it slows the host ~2x (run 13): the gaps
    # measured then are the profiler's, so CPU ops only (aten op names still say where a launch came from)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        model(**batch).loss.backward()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3
    model.zero_grad(set_to_none=True)
    per_kernel, busy = {}, 0.0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us = e.time_range.elapsed_us()
            per_kernel[e.name] = per_kernel.get(e.name, 0.0) + us
            busy += us
    cats = {}
    for name, us in per_kernel.items():
        cats[_category(name)] = cats.get(_category(name), 0.0) + us
    prof.export_chrome_trace(path + ".json")
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:30]
    with open(path + ".txt", "w") as f:
        f.write(f"wall {wall_ms:.1f} ms, CUDA busy {busy / 1e3:.1f} ms\n")
        for c, us in sorted(cats.items(), key=lambda kv: -kv[1]):
            f.write(f"  {c:18s} {us / 1e3:8.2f} ms {100 * us / busy:5.1f}%\n")
        for name, us in top:
            f.write(f"    {us / 1e3:8.2f} ms  {name[:120]}\n")
        f.write(gap_report(path + ".json"))
    return {"wall_ms": round(wall_ms, 2), "cuda_busy_ms": round(busy / 1e3, 2),
            "categories_ms": {c: round(us / 1e3, 2) for c, us in sorted(cats.items(), key=lambda kv: -kv[1])}}


def gap_report(trace_path: str, min_gap_us: float = 40.0, top: int = 25) -> str:
    """Where the GPU sat idle inside the profiled micro-step (launch gaps), from the Chrome trace: the largest idle
    spans between consecutive GPU activities, each with the CPU ops around the launch of the kernel that ended it,
    and every host<->device synchronisation the CPU made (a sync drains the GPU queue, so the next kernels start
    late). Under the profiler the host is slower than without it: compare gaps between stacks, not absolutely."""
    with open(trace_path) as f:
        evs = json.load(f)["traceEvents"]
    gpu = sorted((e for e in evs if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e),
                 key=lambda e: e["ts"])
    launches = {e["args"].get("correlation"): e for e in evs
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "args" in e}
    cpu_ops = [e for e in evs if e.get("cat") in ("cpu_op", "python_function") and "dur" in e]

    def around(ts: float, tid) -> str:  # the innermost CPU ops running at host time ts on thread tid
        inside = [e for e in cpu_ops if e.get("tid") == tid and e["ts"] <= ts <= e["ts"] + e["dur"]]
        inside.sort(key=lambda e: e["dur"])
        return " < ".join(e["name"][:48] for e in inside[:4])

    gaps, idle = [], 0.0
    for a, b in zip(gpu, gpu[1:]):
        g = b["ts"] - (a["ts"] + a["dur"])
        if g > 0:
            idle += g
        if g >= min_gap_us:
            gaps.append((g, a, b))
    lines = [f"GPU idle between activities: {idle / 1e3:.2f} ms over {len(gpu)} GPU activities; "
             f"{len(gaps)} gaps >= {min_gap_us:.0f} us sum {sum(g for g, _, _ in gaps) / 1e3:.2f} ms"]
    for g, a, b in sorted(gaps, key=lambda t: -t[0])[:top]:
        ln = launches.get(b.get("args", {}).get("correlation"))
        where = around(ln["ts"], ln.get("tid")) if ln else "?"
        lines.append(f"  gap {g:8.1f} us  before {b['name'][:50]!r} (after {a['name'][:30]!r})  launched in: {where}")
    syncs = [e for e in evs if e.get("cat") in ("cuda_runtime", "cuda_driver")
             and any(k in e["name"] for k in ("Synchronize", "cudaMemcpy", "EventSynchronize", "StreamWait"))
             and "Async" not in e["name"]]
    syncs += [e for e in evs if e.get("cat") in ("cuda_runtime",) and e["name"] == "cudaMemcpyAsync"
              and e.get("dur", 0) > 20]  # a blocking copy to pageable host memory shows as a long MemcpyAsync
    lines.append(f"host syncs/blocking copies: {len(syncs)}")
    for e in sorted(syncs, key=lambda e: e["ts"])[:top]:
        lines.append(f"  {e['name']} {e.get('dur', 0):.0f} us  in: {around(e['ts'], e.get('tid'))}")
    return "\n".join(lines) + "\n"


def drive(args) -> int:
    """Run each stack in its own process, then print ratios measured side by side in this run."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from novatune.measure.results import write_row
    from novatune.measure.timing import matmul_tflops

    peak = matmul_tflops()
    runs = []  # (stack, result or None) in the order run; a stack may be named twice (e.g. A,B,B,A)
    for stack in args.stacks.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--stack", stack, "--arch", args.arch, "--seq",
               str(args.seq), "--ga", str(args.ga), "--warm", str(args.warm), "--steps", str(args.steps),
               "--attention", args.attention, "--ce_mode", args.ce_mode] \
            + (["--no_host_meta"] if args.no_host_meta else []) + (["--no_fuse_qk"] if args.no_fuse_qk else []) \
            + (["--profile", args.profile] if args.profile else []) + (["--diag"] if args.diag else []) \
            + (["--no_gc_freeze"] if args.no_gc_freeze else []) \
            + (["--memory", args.memory] if args.memory else []) \
            + (["--layers", str(args.layers)] if args.layers else []) \
            + (["--no_ckpt"] if args.no_ckpt else []) \
            + (["--qlora", str(args.qlora)] if args.qlora else ["--lora", str(args.lora)] if args.lora else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        for ln in proc.stdout.splitlines():
            if ln.startswith("DIAG"):
                print(f"[{stack}] {ln}", flush=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(f"[{stack}] FAILED (exit {proc.returncode})\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}",
                  flush=True)
            runs.append((stack, None))
            continue
        res = json.loads(lines[-1][len("RESULT "):])
        res["mfu"] = round(res["model_tflops"] / peak, 4)
        res["matmul_tflops_measured"] = round(peak, 1)
        res["run_index"] = len(runs)
        runs.append((stack, res))
        print(f"[{stack}] {res['tok_s']:.0f} tok/s, peak {res['peak_gib']} GiB, weights {res['weights_gib']} GiB, "
              f"step ms {res['step_ms']}, losses {res['losses']}", flush=True)
    # a stack run more than once (alternated order, BENCHMARKS.md: run the pair twice under 5%) is pooled: the
    # ratios use the mean tok/s of its runs; each run's row keeps its own figure
    pooled = {}
    for stack, res in runs:
        if res:
            pooled.setdefault(stack, []).append(res["tok_s"])
    mean = {k: sum(v) / len(v) for k, v in pooled.items()}
    base = mean.get("hf_sdpa")
    peers = [k for k in mean if k != "hf_sdpa" and not k.startswith("novatune")]
    best_peer = max(peers, key=lambda k: mean[k]) if peers else None
    ok = [res for _, res in runs if res]
    for r in ok:
        m = mean[r["stack"]]
        r["tok_s_runs"] = pooled[r["stack"]]
        r["x_stock"] = round(m / base, 3) if base else None
        r["x_best_peer"] = round(m / mean[best_peer], 3) if best_peer else None
        r["best_peer"] = best_peer
        write_row(args.results, {"bench": "e2e", **r})
    print(f"\n{'stack':14s} {'tok/s':>9s} {'x stock':>8s} {'x peer':>7s} {'MFU':>6s} {'peak GiB':>9s} "
          f"{'rsv GiB':>8s} {'wts GiB':>8s}  losses")
    for r in ok:
        print(f"{r['stack']:14s} {r['tok_s']:9.0f} {r['x_stock'] or 0:8.3f} {r['x_best_peer'] or 0:7.3f} "
              f"{r['mfu']:6.3f} {r['peak_gib']:9.2f} {r['peak_reserved_gib']:8.2f} {r['weights_gib']:8.2f}  {r['losses']}")
        if r.get("profile"):
            print(f"{'':14s} profile: {r['profile']}")
    if any(len(v) > 1 for v in pooled.values()):
        print("pooled (mean of runs): " + ", ".join(f"{k} {mean[k]:.0f} {pooled[k]}" for k in mean))
    return 0 if all(res for _, res in runs) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stacks", default="hf_sdpa,varlen_liger,novatune", help=f"driver mode: comma list of {STACKS}")
    p.add_argument("--stack", choices=STACKS, help="run one stack in this process and print RESULT <json>")
    p.add_argument("--arch", default=None, help="a name from novatune.train.arch.ARCHS (default qwen3-4b; "
                   "--qlora: qwen3-8b)")
    p.add_argument("--layers", type=int, default=0, help="override num_hidden_layers (0: the architecture's)")
    p.add_argument("--seq", type=int, default=None, help="tokens per packed row (default 4096; --qlora: 2048)")
    p.add_argument("--ga", type=int, default=4)
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--no_ckpt", action="store_true")
    p.add_argument("--lora", type=int, default=0, help="PEFT LoRA rank on every stack (0: full fine-tuning); "
                   "novatune_full stays full fine-tuning")
    p.add_argument("--qlora", type=int, default=0, help="QLoRA rank: NF4 base weights (bitsandbytes) + PEFT LoRA "
                   "r=R on every stack (module docstring)")
    p.add_argument("--attention", default="auto", help="novatune attention backend")
    p.add_argument("--ce_mode", default="auto", help="novatune fused cross-entropy mode: auto | tokens | vocab")
    p.add_argument("--no_fuse_qk", action="store_true", help="novatune: separate q/k-norm and RoPE kernels")
    p.add_argument("--no_host_meta", action="store_true",
                   help="novatune derives document offsets from CUDA position_ids (one sync per micro-batch) "
                        "instead of receiving the collator's host-side cu_seq_lens_q")
    p.add_argument("--results", default="bench/results/e2e.jsonl")
    p.add_argument("--memory", default="", help="path prefix: replay one micro-step's allocations to the peak")
    p.add_argument("--no_gc_freeze", action="store_true", help="leave Python's GC as is (full collections in the "
                   "timed steps, ~0.2 s each)")
    p.add_argument("--diag", action="store_true", help="print Triton compiles, long GCs and warm-up step times")
    p.add_argument("--profile", default="", help="path prefix: profile one micro-step per stack (trace + table)")
    args = p.parse_args(argv)
    args.arch = args.arch or ("qwen3-8b" if args.qlora else "qwen3-4b")
    args.seq = args.seq or (2048 if args.qlora else 4096)
    if args.qlora:
        if args.lora and args.lora != args.qlora:
            p.error(f"--qlora {args.qlora} sets the LoRA rank; drop --lora {args.lora}")
        named = [args.stack] if args.stack else args.stacks.split(",")
        if "novatune_full" in named:
            p.error("--qlora: novatune_full (full fine-tuning) cannot train 4-bit weights; drop it from --stacks")
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from novatune.train.qlora import require_bnb

        require_bnb()  # before any process is spawned: "qlora needs bitsandbytes: pip install bitsandbytes"
        args.lora = args.qlora
    if args.stack:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        print("RESULT " + json.dumps(run_stack(args)), flush=True)
        return 0
    return drive(args)


if __name__ == "__main__":
    raise SystemExit(main())
