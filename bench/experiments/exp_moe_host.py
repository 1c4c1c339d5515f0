"""Host work of one sparse MoE block (router + experts), forward and backward, made visible on the CPU.

The MoE micro-step on a GPU is host-bound (the host queues kernels more slowly than the GPU runs them), so what
counts is how many things the host does per layer, not how long the kernels take. This runs a tiny Qwen3-MoE block
patched by novatune on the CPU, with the Triton kernels in the interpreter so the CUDA code path is the one taken,
and counts per forward and per backward:

  aten ops      every aten call the dispatcher sees (TorchDispatchMode), views and metadata included: each costs
                host time; `kernels` counts those that launch a GPU kernel (not views, empty, metadata)
  triton        Triton kernel launches, by kernel name (the interpreter's launch is the counted unit; the aten
                copies the interpreter makes inside it are not counted)
  grouped GEMMs calls of novatune.ops.moe.grouped_mm / grouped_outer: one torch grouped-GEMM launch each on CUDA
                (on the CPU a per-group loop when torch's kernel refuses the shapes: not counted as aten ops)
  py functions  torch.autograd.Function applications (forward) and their Python backwards
  autograd      autograd nodes the forward creates (each runs in the backward: C++ nodes cost a few µs plus their
                kernels, Python ones a Python call)

and the host µs (this thread's CPU time, best of --reps rounds) of one forward + backward with every kernel
stubbed out (Triton launches skipped, grouped GEMMs returning uninitialised outputs): what is left is the Python,
the autograd engine and the dispatch of the remaining small aten ops - the host cost besides the launches
themselves (a lean Triton launch or a grouped GEMM costs ~5-10 µs of host time on the device machine; a Triton
JIT launch ~30 µs). The figure is the CPU's, so it compares trees on one machine only.

`--device cuda` measures instead the wall µs of one forward + backward on the GPU with real launches at a small
token count (--tokens 128 by default there: the kernels finish faster than the host queues them, so the wall
time is the host's), Qwen3-30B-A3B's block shapes (hidden 2048, 128 experts, top-8, intermediate 768), bf16.

    python bench/experiments/exp_moe_host.py                          # this tree
    python bench/experiments/exp_moe_host.py --baseline main          # and main (a git ref or a folder) beside it
    python bench/experiments/exp_moe_host.py --device cuda --baseline main --results bench/results/experiments.jsonl
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter

os.environ.setdefault("TRITON_INTERPRET", "1")  # the CUDA code path (Triton kernels) on the CPU

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# aten ops that launch no kernel on CUDA (views, allocation, metadata)
_NO_KERNEL = {"view", "_unsafe_view", "reshape", "alias", "t", "transpose", "permute", "expand", "as_strided",
              "slice", "select", "unsqueeze", "squeeze", "empty", "empty_like", "empty_strided", "new_empty",
              "detach", "_reshape_alias", "split", "split_with_sizes", "chunk", "unbind", "lift_fresh",
              "is_same_size", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "_to_copy_noop",
              "resize_", "set_", "_has_compatible_shallow_copy_type", "_nested_tensor_from_mask_left_aligned"}


class _Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class Probe:
    """Counts launches and aten ops; optionally stubs every kernel (host-time mode)."""

    def __init__(self, stub: bool):
        self.stub = stub
        self.triton: Counter = Counter()
        self.gemms: Counter = Counter()
        self.functions: Counter = Counter()
        self.counter: _Counter | None = None

    @contextlib.contextmanager
    def _opaque(self):
        c = self.counter
        if c is not None:
            c.paused += 1
        try:
            yield
        finally:
            if c is not None:
                c.paused -= 1

    def install(self) -> contextlib.ExitStack:
        from triton.runtime.interpreter import InterpretedFunction

        import novatune.ops.moe as M

        stack = contextlib.ExitStack()
        probe = self
        run = InterpretedFunction.run

        def counted_run(fn_self, *args, grid, warmup, **kwargs):
            if not warmup:
                probe.triton[fn_self.__name__] += 1
            if probe.stub:
                return None
            with probe._opaque():
                return run(fn_self, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = counted_run
        stack.callback(setattr, InterpretedFunction, "run", run)
        for name in ("grouped_mm", "grouped_outer"):
            original = getattr(M, name)

            def wrapped(a, b, ends, *rest, _original=original, _name=name, **kw):
                probe.gemms[_name] += 1
                if probe.stub:
                    out_dtype = (rest[0] if rest else kw.get("out_dtype")) or a.dtype
                    if _name == "grouped_mm":
                        return a.new_empty(a.shape[0], b.shape[2], dtype=out_dtype)
                    return a.new_empty(ends.shape[0], a.shape[1], b.shape[1])
                with probe._opaque():
                    return _original(a, b, ends, *rest, **kw)

            setattr(M, name, wrapped)
            stack.callback(setattr, M, name, original)
        apply = torch.autograd.Function.apply.__func__

        def counted_apply(cls, *args, **kwargs):
            probe.functions[cls.__name__] += 1
            return apply(cls, *args, **kwargs)

        torch.autograd.Function.apply = classmethod(counted_apply)
        stack.callback(setattr, torch.autograd.Function, "apply", classmethod(apply))
        return stack

    def reset(self) -> None:
        self.triton.clear()
        self.gemms.clear()
        self.functions.clear()

    @contextlib.contextmanager
    def counting(self):
        self.reset()
        self.counter = _Counter()
        with self.counter:
            yield self
        self.counter_done = self.counter
        self.counter = None

    def summary(self) -> dict:
        ops = self.counter_done.ops
        kernels = sum(n for op, n in ops.items() if op not in _NO_KERNEL)
        return {"aten_ops": sum(ops.values()), "aten_kernels": kernels, "triton": sum(self.triton.values()),
                "grouped_gemms": sum(self.gemms.values()),
                "launches": kernels + sum(self.triton.values()) + sum(self.gemms.values()),
                "py_functions": sum(self.functions.values()), "aten_detail": dict(sorted(ops.items())),
                "triton_detail": dict(self.triton), "function_detail": dict(self.functions)}


TINY = dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
QWEN3_30B_A3B = dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128)


def _block(tokens: int, dtype: torch.dtype, device: str = "cpu"):
    import transformers

    import novatune

    shapes = QWEN3_30B_A3B if device == "cuda" else TINY
    cfg = transformers.Qwen3MoeConfig(**shapes, norm_topk_prob=True, num_hidden_layers=1, vocab_size=128,
                                      use_cache=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(device=device, dtype=dtype).train()
    if device == "cuda":
        model.set_experts_implementation("grouped_mm")
    novatune.patch(model)
    block = model.model.layers[0].mlp
    x = torch.randn(1, tokens, shapes["hidden_size"], dtype=dtype, device=device, requires_grad=True)
    return block, x


def cuda_host_us(tokens: int, n: int, reps: int) -> float:
    """Wall µs per forward + backward on the GPU, real launches, best of `reps` rounds of `n` calls."""
    block, x = _block(tokens, torch.bfloat16, "cuda")
    dout = torch.randn_like(x)

    def step():
        x.grad = None
        block.zero_grad(set_to_none=True)
        block(x).backward(dout)

    for _ in range(20):
        step()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / n)
    return 1e6 * best


def _autograd_nodes(out: torch.Tensor) -> Counter:
    seen, stack, kinds = set(), [out.grad_fn], Counter()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        kinds[type(node).__name__] += 1
        stack.extend(n for n, _ in node.next_functions)
    kinds.pop("AccumulateGrad", None)
    return kinds


def counts(tokens: int, dtype: torch.dtype) -> dict:
    block, x = _block(tokens, dtype)
    probe = Probe(stub=False)
    with probe.install():
        block(x).sum().backward()  # warm-up (the interpreter rewrites the kernels once)
        x.grad = None
        block.zero_grad(set_to_none=True)
        with probe.counting():
            out = block(x)
        fwd = probe.summary()
        nodes = _autograd_nodes(out)
        dout = torch.randn_like(out)
        with probe.counting():
            out.backward(dout)
        bwd = probe.summary()
    fwd["autograd_nodes"] = sum(nodes.values())
    fwd["autograd_detail"] = dict(nodes)
    return {"forward": fwd, "backward": bwd}


def host_us(tokens: int, dtype: torch.dtype, n: int, reps: int, cprofile: bool) -> float:
    block, x = _block(tokens, dtype)
    probe = Probe(stub=True)
    dout = torch.randn(x.shape, dtype=dtype)

    def step():
        x.grad = None
        block.zero_grad(set_to_none=True)
        block(x).backward(dout)

    best = float("inf")
    with probe.install():
        for _ in range(20):
            step()
        for _ in range(reps):  # this thread's CPU time: other processes on a shared host barely move it
            t0 = time.thread_time()
            for _ in range(n):
                step()
            best = min(best, (time.thread_time() - t0) / n)
        if cprofile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            for _ in range(n):
                step()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return 1e6 * best


def run(args) -> dict:
    import novatune

    res = {"tree": os.path.dirname(os.path.dirname(novatune.__file__)), "tokens": args.tokens, "dtype": args.dtype,
           "device": args.device}
    if args.device == "cuda":
        res["host_us_fwd_bwd_cuda"] = round(cuda_host_us(args.tokens, args.n, args.reps), 1)
        return res
    # one intra-op thread: on a shared host, waiting for descheduled worker threads would be counted as host time
    torch.set_num_threads(1)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    res.update(counts(args.tokens, dtype))
    res["host_us_fwd_bwd_stubbed"] = round(host_us(args.tokens, dtype, args.n, args.reps, args.cprofile), 1)
    return res


def _print(results: list[dict]) -> None:
    if results[-1]["device"] == "cuda":
        print(f"MoE block (router + experts), Qwen3-30B-A3B shapes, {results[-1]['tokens']} tokens, bf16, GPU: "
              "wall µs per forward + backward (host-bound at this size)")
        for r in results:
            print(f"  {r['host_us_fwd_bwd_cuda']:>10}  {r['tree']}")
        return
    keys = ("aten_ops", "aten_kernels", "triton", "grouped_gemms", "launches", "py_functions")
    print("MoE block (router + experts), tiny Qwen3-MoE shapes; per call. Trees: "
          + "; ".join(f"[{i}] {r['tree']}" for i, r in enumerate(results)))
    head = "".join(f"{f'[{i}]':>10}" for i in range(len(results)))
    for phase in ("forward", "backward"):
        print(f"  {phase:<24}{head}")
        for k in keys:
            print(f"    {k:<22}" + "".join(f"{r[phase][k]:>10}" for r in results))
    print(f"    {'autograd nodes (fwd)':<22}" + "".join(f"{r['forward']['autograd_nodes']:>10}" for r in results))
    print(f"  {'host µs fwd+bwd (stubbed)':<26}" + "".join(f"{r['host_us_fwd_bwd_stubbed']:>10}" for r in results))
    for i, r in enumerate(results):
        for phase in ("forward", "backward"):
            print(f"  [{i}] {phase} aten: {r[phase]['aten_detail']}")
            print(f"  [{i}] {phase} triton: {r[phase]['triton_detail']} functions: {r[phase]['function_detail']}")
        print(f"  [{i}] autograd nodes: {r['forward']['autograd_detail']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, help="default 24 on the CPU, 128 on the GPU")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    # bf16 as on the GPU for the counts; the host µs use it too (fp32 drops the casts the GPU runs)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--baseline", help="another novatune to measure too: a folder holding a `novatune` package, or "
                                        "a git ref of this repository (e.g. main)")
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--results", help="append one row per tree to this .jsonl (e.g. bench/results/experiments.jsonl)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tokens is None:
        args.tokens = 128 if args.device == "cuda" else 24
    results = [baseline(args)] if args.baseline else []
    mine = run(args)
    if args.child:
        print(json.dumps(mine))
        return 0
    results.append(mine)
    _print(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.results:
        from novatune.measure.results import write_row

        shas = [_sha(args.baseline)] if args.baseline else []
        for r, name, sha in zip(results, ["baseline", "this tree"][-len(results):], shas + [_sha("HEAD")]):
            write_row(args.results, {"bench": "exp_moe_host", "tree_role": name, "baseline_ref": args.baseline,
                                     "tree_sha": sha, **{k: v for k, v in r.items() if k != "tree"}})
    return 0


def _sha(ref: str) -> str | None:
    """The short commit of a git ref of this repository (None for a folder or without git)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(["git", "-C", root, "rev-parse", "--short", ref], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 and not os.path.isdir(ref) else None


def baseline(args) -> dict:
    """This script's measurement on another novatune, in a subprocess: a folder holding a `novatune` package, or a
    git ref whose `novatune` is extracted to a temporary folder."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--tokens", str(args.tokens), "--dtype", args.dtype,
           "--n", str(args.n), "--reps", str(args.reps), "--device", args.device]

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def on(path: str) -> dict:
        # the other tree first, this tree out, the rest of the path kept (e.g. carried wheels)
        rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                if p and os.path.abspath(p) != root]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(path), *rest]))
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    if os.path.isdir(os.path.join(args.baseline, "novatune")):
        return on(args.baseline)
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", root, "archive", args.baseline, "novatune"], check=True,
                                 capture_output=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        return on(tmp)


if __name__ == "__main__":
    sys.exit(main())
