"""`novatune bench` diagnostics, each one opt-in and run outside the timed steps (except --diag's printing):

* --diag: every Triton JIT compile (a new specialisation inside the timed steps is a hiccup), every garbage
  collection over 5 ms (a full collection walks the model's and autograd's Python objects), warm-up step times.
* --memory: one micro-step under torch's allocation recorder, replayed to the moment of peak allocated memory:
  the largest live blocks and the frames that allocated them, and whether the peak is in the forward or backward.
* --profile: one micro-step under torch.profiler: CUDA time per kernel category, busy vs wall, a Chrome trace and
  the GPU's idle gaps with the host code that launched the kernel after each gap.
`batch` below is the model's keyword arguments for one micro-batch (labels included).
"""
from __future__ import annotations

import contextlib
import itertools
import json
import time

from novatune.memory import embedding_grad
from novatune.ops.linear_cross_entropy import grad_output_promised


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
    from triton.runtime import jit

    if getattr(jit, "compile", None) is real_compile:
        jit.compile = logged_compile
    t_gc = {}

    def gc_cb(phase, info):
        if phase == "start":
            t_gc["t"] = time.perf_counter()
        elif "t" in t_gc and (dt := 1e3 * (time.perf_counter() - t_gc["t"])) > 5:
            print(f"DIAG gc generation {info['generation']}: {dt:.0f} ms, {info['collected']} collected", flush=True)

    gc.callbacks.append(gc_cb)


@contextlib.contextmanager
def accumulating_micro_step(model, promise: bool = False):
    """Around a forward run as the trainer runs micro-steps 2..GA-1: the embedding's gradient kept as rows where the
    run keeps it so (memory.embedding_grad), and with `promise` (the session's lm_head_grad_in_forward) the loss's
    grad_output promised (lm_head's gradient into .grad by the forward, ops/linear_cross_entropy.py; the callers'
    .backward() on the loss gives 1.0)."""
    with embedding_grad.micro_step(model, last=False), (
            grad_output_promised(1.0) if promise else contextlib.nullcontext()):
        yield


def memory_peak_report(model, batch: dict, path: str, finish=None, optimizer=None, promise: bool = False) -> dict:
    """One micro-step under torch's allocation recorder; replay the trace to the moment of peak allocated memory
    and write the largest live blocks with the frames that allocated them (what sets the peak), and whether the
    peak falls in the forward or the backward. Blocks allocated with no Python frame of ours (the autograd
    thread's C++ nodes: AccumulateGrad, embedding backward, ...) are named by their C++ frames. Blocks live before
    the recording are named by the tensors that own them (tensor_owners: weights, gradients, optimizer states,
    other tensors Python can reach). `finish` (the session's finish_backward) runs after the backward, before the
    gradients are dropped."""
    import torch

    # both micro-steps as an accumulating one (2..GA-1) runs (`accumulating_micro_step`), every other gradient existing
    with accumulating_micro_step(model, promise):
        model(**batch).loss.backward()  # not recorded: makes the gradients exist
    torch.cuda.synchronize()
    owners = tensor_owners(model, optimizer)
    try:
        with accumulating_micro_step(model, promise):
            snap, n_fwd = _recorded_micro_step(model, batch)
    except SystemError as e:
        embedding_grad.discard(model)
        # torch 2.11's recorder breaks autograd Functions run under eager checkpointing (pytorch#179536), C++ or
        # Python frames alike (session 22); graphed layers replay outside it
        raise RuntimeError(f"torch {torch.__version__}'s allocation recorder fails inside this stack's checkpointed "
                           f"autograd Functions (pytorch#179536: {e}); record a stack with CUDA graphs, or another "
                           f"torch") from e
    if finish is not None:
        finish()
    model.zero_grad(set_to_none=True)
    embedding_grad.discard(model)
    best, best_live, best_at, n_events = replay_to_peak(snap, owners)
    phase = ("before the step" if best_at < 0 else "forward" if best_at < n_fwd
             else f"backward, event {best_at - n_fwd} of {n_events - n_fwd}")
    top = largest_live(best_live)
    import os

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".txt", "w") as f:
        f.write(f"peak allocated in the recorded micro-step: {best / 2**30:.3f} GiB, in the {phase}\n")
        for where, (size, n) in top:
            f.write(f"{size / 2**30:8.3f} GiB {n:5d} blocks  {where[:260]}\n")
    return {"peak_replayed_gib": round(best / 2**30, 3), "phase": phase,
            "top": [(round(size / 2**30, 3), where[:200]) for where, (size, _) in top[:8]]}


def _recorded_micro_step(model, batch: dict) -> tuple[dict, int]:
    """Forward and backward under the allocation recorder: (the snapshot, the number of trace events up to the
    backward). The recorder is off again when this returns or raises."""
    import torch

    torch.cuda.memory._record_memory_history(max_entries=500000, stacks="all")
    try:
        loss = model(**batch).loss
        torch.cuda.synchronize()
        n_fwd = sum(len(t) for t in torch.cuda.memory._snapshot()["device_traces"])  # events up to the backward
        loss.backward()
        del loss
        torch.cuda.synchronize()
        return torch.cuda.memory._snapshot(), n_fwd
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def tensor_owners(model, optimizer=None, device_type: str = "cuda") -> dict[int, str]:
    """{storage address: what it is} for the tensors Python can reach: the model's weights (trainable or frozen)
    and gradients, the optimizer's states, and every other live tensor (named by dtype and shape), so blocks that
    predate a recording can be told apart. A block no tensor here owns is held by C++ alone (autograd's saved
    tensors, CUDA-graph pools, library workspaces). Only tensors on `device_type` (the report's device) count."""
    import gc

    import torch

    owners: dict[int, str] = {}

    def storage_of(t) -> tuple[int, int] | None:
        """(address, bytes) of a tensor's storage on the report's device; None for one without plain storage (a
        wrapper subclass such as FSDP2's DTensor, a sparse tensor, a FakeTensor left by a trace)."""
        if not (isinstance(t, torch.Tensor) and t.device.type == device_type):
            return None
        try:
            storage = t.untyped_storage()
            return storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):
            return None

    def own(t, what: str) -> None:
        found = storage_of(t)
        if found is not None and found[1]:
            owners.setdefault(found[0], what)

    for p in model.parameters():
        own(p, "weights (trainable)" if p.requires_grad else "weights (frozen)")
        own(p.grad, "gradients")
    for b in model.buffers():
        own(b, "buffers")
    for state in (optimizer.state.values() if optimizer is not None else ()):
        for v in state.values():
            own(v, "optimizer states")
    for o in gc.get_objects():
        found = storage_of(o)
        if found is not None and found[0] not in owners:
            # the holder's search walks every object the collector tracks: only for tensors that weigh
            held = f" held by {_holder(o)}" if found[1] >= 1 << 20 else ""
            own(o, f"other tensors {str(o.dtype).removeprefix('torch.')} {tuple(o.shape)}{held}")
    return owners


def _holder(t) -> str:
    """The attribute that holds `t`, as `Type.attribute` (through one list, tuple or dict), or '?'."""
    import gc
    import types

    def named(owner, value) -> str | None:
        """`Type.attribute` where `owner` is an object holding `value` as an attribute (its __dict__ may be inline,
        so the object itself is the referrer) or the __dict__ of one."""
        if isinstance(owner, (list, tuple, types.FrameType)):
            return None
        if isinstance(owner, dict):
            key = next((k for k, v in owner.items() if v is value), None)
            holders = [o for o in gc.get_referrers(owner) if getattr(o, "__dict__", None) is owner]
            return f"{type(holders[0]).__name__}.{key}" if key is not None and holders else None
        key = next((k for k, v in getattr(owner, "__dict__", {}).items() if v is value), None)
        return None if key is None else f"{type(owner).__name__}.{key}"

    for ref in gc.get_referrers(t):
        found = named(ref, t)
        if found is None and isinstance(ref, (list, tuple)):
            found = next((f + "[]" for o in gc.get_referrers(ref) if (f := named(o, ref))), None)
        if found:
            return found
    return "?"


def replay_to_peak(snap: dict, owners: dict[int, str] | None = None) -> tuple[int, dict, int, int]:
    """A memory snapshot with its allocation trace replayed to the moment of peak allocated memory: (peak bytes,
    the blocks live then {address: (bytes, allocating frames)}, the trace index of the peak (-1: before the trace),
    the trace's length). Blocks allocated with no Python frame of ours (the autograd thread's C++ nodes:
    AccumulateGrad, embedding backward, ...) are named by their C++ frames; blocks live before the trace by
    `owners` (tensor_owners) where it names them."""
    trace = [e for dev_trace in snap["device_traces"] for e in dev_trace]
    events = [(i, e) for i, e in enumerate(trace) if e["action"] in ("alloc", "free_completed")]
    owners = owners or {}

    segments = {b["address"]: seg for seg in snap["segments"] for b in seg["blocks"]}

    def before(addr: int) -> str:
        if addr in owners:
            return f"before the recorded micro-step: {owners[addr]}"
        if addr not in segments:  # freed during the trace: its segment is not in the final snapshot
            return "before the recorded micro-step: no tensor Python can reach (pool unknown)"
        seg = segments[addr]
        pool = seg.get("segment_pool_id")
        where = "a CUDA-graph pool" if pool and tuple(pool) != (0, 0) else "the eager pool"
        return f"before the recorded micro-step: no tensor Python can reach ({where}, stream {seg.get('stream')})"

    # walk back from the blocks live at the end to those live at the start, then replay forward to the peak
    live = {b["address"]: (b["size"], "")
            for seg in snap["segments"] for b in seg["blocks"] if b["state"] == "active_allocated"}
    for _, e in reversed(events):
        if e["action"] == "alloc":
            live.pop(e["addr"], None)
        else:
            live[e["addr"]] = (e["size"], "")
    live = {addr: (size, before(addr)) for addr, (size, _) in live.items()}
    cur = best = sum(v[0] for v in live.values())
    best_live, best_at = dict(live), -1
    for i, e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], " <- ".join(_our_frames(e.get("frames", []))[:4]))
            cur += e["size"]
            if cur > best:
                best, best_live, best_at = cur, dict(live), i
        elif e["addr"] in live:
            cur -= live.pop(e["addr"])[0]
    return best, best_live, best_at, len(trace)


def _our_frames(frames: list[dict]) -> list[str]:
    """The Python frames of an allocation outside torch's internals (nn.Module calls kept), innermost first; for an
    allocation with none (the autograd thread's C++ nodes) the autograd node or aten op that made it."""
    ours = [f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}"
            for f in frames if f["filename"].endswith(".py")
            and ("torch/" not in f["filename"] or "nn/modules" in f["filename"])]
    return ours or [f"[c++] {f['name'][:70]}" for f in frames
                    if any(k in f["name"] for k in ("autograd", "at::native", "_backward", "Accumulate"))]


def largest_live(live: dict, top: int = 25) -> list:
    """The live blocks grouped by allocating frames, largest first: [(frames, [bytes, blocks])]."""
    groups: dict[str, list] = {}
    for size, where in live.values():
        g = groups.setdefault(where, [0, 0])
        g[0] += size
        g[1] += 1
    return sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]


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


def profile_micro_step(model, batch: dict, path, finish=None, accumulating: bool = False,
                       promise: bool = False) -> dict:
    """One micro-step (fwd+bwd) under torch.profiler: device time per category, busy vs wall, Chrome trace.
    On a CPU (tests) the table counts CPU ops' own time instead of CUDA kernels. `finish` (the session's
    finish_backward) runs after the profiled backward, inside the profile, before the gradients are dropped: once,
    as a training step runs it after its last micro-step only. `accumulating` (gradient accumulation: micro-steps
    2..GA, most of a step): one micro-step runs first, not profiled, so the profiled one adds into gradients that
    exist, as those do (the first micro-step of a step creates them instead, and skips every addition into
    `.grad`)."""
    import os

    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    os.makedirs(os.path.dirname(str(path)) or ".", exist_ok=True)
    if accumulating:
        with accumulating_micro_step(model, promise):
            model(**batch).loss.backward()
    sync()
    # with_stack (Python frames) would name the launching code, but it slows the host ~2x: the gaps measured then
    # are the profiler's, so CPU ops only (aten op names still say where a launch came from)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t0 = time.perf_counter()
        with accumulating_micro_step(model, promise) if accumulating else contextlib.nullcontext():
            model(**batch).loss.backward()
        if finish is not None:
            finish()
        sync()
        wall_ms = (time.perf_counter() - t0) * 1e3
    model.zero_grad(set_to_none=True)
    embedding_grad.discard(model)
    per_kernel, busy = {}, 0.0
    if cuda:
        timed = [(e.name, e.time_range.elapsed_us()) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA]
    else:
        timed = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]
    for name, us in timed:
        per_kernel[name] = per_kernel.get(name, 0.0) + us
        busy += us
    cats = {}
    for name, us in per_kernel.items():
        cats[_category(name)] = cats.get(_category(name), 0.0) + us
    prof.export_chrome_trace(str(path) + ".json")
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:30]
    with open(str(path) + ".txt", "w") as f:
        f.write(f"wall {wall_ms:.1f} ms, {'CUDA' if cuda else 'CPU'} busy {busy / 1e3:.1f} ms\n")
        for c, us in sorted(cats.items(), key=lambda kv: -kv[1]):
            f.write(f"  {c:18s} {us / 1e3:8.2f} ms {100 * us / max(busy, 1e-9):5.1f}%\n")
        for name, us in top:
            f.write(f"    {us / 1e3:8.2f} ms  {name[:120]}\n")
        if cuda:
            f.write(gap_report(str(path) + ".json"))
    return {"wall_ms": round(wall_ms, 2), "busy_ms": round(busy / 1e3, 2), "device": "cuda" if cuda else "cpu",
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
    for a, b in itertools.pairwise(gpu):
        g = b["ts"] - (a["ts"] + a["dur"])
        if g > 0:
            idle += g
        if g >= min_gap_us:
            gaps.append((g, a, b))
    lines = [(f"GPU idle between activities: {idle / 1e3:.2f} ms over {len(gpu)} GPU activities; "
             f"{len(gaps)} gaps >= {min_gap_us:.0f} us sum {sum(g for g, _, _ in gaps) / 1e3:.2f} ms")]
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
