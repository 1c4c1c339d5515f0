"""Why does a layer's CUDA-graph capture fail? (novatune/patch/graphs.py; session 4)

1. One eager forward+backward of a tiny LoRA Qwen3 under torch.cuda.set_sync_debug_mode("error"): any op that
   synchronises the host (illegal inside a capture) raises with its Python stack.
2. Then a graphed training batch with every attention backend's exception printed (the automatic choice
   swallows them and tries the next backend, which hides the first capture error).
"""
import sys
import traceback

import torch

sys.path.insert(0, "tests/patch")
import test_cuda_graphs as T  # noqa: E402

import novatune  # noqa: E402
from novatune.attention import backends  # noqa: E402


def main():
    eager = T._model("cuda")
    novatune.patch(eager, cuda_graphs=False, tune=False)
    T._train(eager, T.LAYOUTS[:1], ga=1)
    print("== sync debug: one eager batch", flush=True)
    ids, pos, lab = T._batch(T.LAYOUTS[1], "cuda", 1)
    pos = pos.cpu()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = eager(input_ids=ids, position_ids=pos, labels=lab)  # CPU position_ids: the host metadata
        out.loss.backward()
        print("no synchronising op", flush=True)
    except Exception:
        traceback.print_exc()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    print("== graphed batch with backend exceptions shown", flush=True)
    model = T._model("cuda")
    novatune.patch(model, tune=False)
    T._train(model, T.LAYOUTS[:1], ga=1)  # eager warm-up batch
    for name, fn in list(backends._IMPLS.items()):
        def wrapped(*a, _fn=fn, _name=name, **k):
            try:
                return _fn(*a, **k)
            except Exception:
                print(f"backend {_name} raised:", flush=True)
                traceback.print_exc()
                raise
        backends._IMPLS[name] = wrapped
    try:
        T._train(model, T.LAYOUTS[2:4], ga=1)
    except Exception:
        traceback.print_exc()
    st = T._runner(model).stats()
    print("stats", st, flush=True)
    from novatune.kernels import rms_norm as R

    print("RESIDENCY", R.RESIDENCY, flush=True)
    print("== each op of layer 0 captured alone", flush=True)
    layer = model.get_base_model().model.layers[0]
    x = torch.randn(1, T.SEQ, T.ARCH["hidden_size"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    attn = layer.self_attn
    q = torch.randn(1, T.SEQ, 4, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, T.SEQ, 2, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cos = torch.randn(1, T.SEQ, 32, device="cuda", dtype=torch.bfloat16)
    from novatune.attention.packed import PackedBatch
    from novatune.ops.qk_norm_rope import qk_norm_rope
    cu = torch.tensor([0, 100, 256, 256, 256, 256, 256, 256, 256], dtype=torch.int32, device="cuda")
    pb = PackedBatch.graph_static(cu, 256, 1, T.SEQ)
    tests = {
        "rms_norm": lambda: layer.input_layernorm(x),
        "q_proj (LoRA)": lambda: attn.q_proj(x),
        "mlp (LoRA + swiglu)": lambda: layer.mlp(x),
        "qk_norm_rope": lambda: qk_norm_rope(q, k, attn.q_norm.weight, attn.k_norm.weight, 1e-6, cos, cos),
        "varlen (static packed)": lambda: backends.varlen_attention(q.reshape(-1, 4, 32), k.reshape(-1, 2, 32),
                                                                    k.reshape(-1, 2, 32), pb, backend="varlen"),
    }
    stream = torch.cuda.Stream()
    for name, fn in tests.items():
        for grad in (False, True):
            try:
                with torch.set_grad_enabled(grad):
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        y = fn()
                        if grad:
                            yy = y[0] if isinstance(y, tuple) else y
                            yy.float().sum().backward()
                    torch.cuda.current_stream().wait_stream(stream)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, stream=stream, capture_error_mode="thread_local"):
                        y = fn()
                        if grad:
                            yy = y[0] if isinstance(y, tuple) else y
                            yy.float().sum().backward()
                    g.replay()
                    torch.cuda.synchronize()
                print(f"{name} grad={grad}: OK", flush=True)
            except Exception as e:
                print(f"{name} grad={grad}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                traceback.print_exc(limit=-6)


if __name__ == "__main__":
    main()
