"""Why does a layer's CUDA-graph capture fail? (novatune/patch/graphs.py; session 4)

Each piece of a tiny LoRA Qwen3 layer (bf16, PEFT r8, the test model of tests/patch/test_cuda_graphs.py) is
warmed up on a side stream, then captured alone, forward only and forward + backward, in each capture_error_mode;
the first failing piece names the op. Each capture runs in its own process (a failed capture leaves the CUDA
generator and context unusable for the next one).
"""
import subprocess
import sys
import traceback

import torch

sys.path.insert(0, "tests/patch")


def piece(name: str, grad: bool, mode: str) -> None:
    import test_cuda_graphs as T

    import novatune
    from novatune.attention import backends
    from novatune.attention.packed import PackedBatch
    from novatune.ops.qk_norm_rope import qk_norm_rope

    model = T._model("cuda")
    novatune.patch(model, cuda_graphs=False, tune=False)
    T._train(model, T.LAYOUTS[:1], ga=1)  # eager: compiles every kernel
    layer = model.get_base_model().model.layers[0]
    layer.gradient_checkpointing = False
    attn = layer.self_attn
    h = T.ARCH["hidden_size"]
    x = torch.randn(1, T.SEQ, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q = torch.randn(1, T.SEQ, 4, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, T.SEQ, 2, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cos = torch.randn(1, T.SEQ, 32, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 100, 256, 256, 256, 256, 256, 256, 256], dtype=torch.int32, device="cuda")
    pb = PackedBatch.graph_static(cu, 256, 1, T.SEQ)
    pos = torch.arange(T.SEQ, device="cuda").unsqueeze(0)
    fns = {
        "rms_norm": lambda: layer.input_layernorm(x),
        "q_proj": lambda: attn.q_proj(x),
        "mlp": lambda: layer.mlp(x),
        "qk_norm_rope": lambda: qk_norm_rope(q, k, attn.q_norm.weight, attn.k_norm.weight, 1e-6, cos, cos)[0],
        "varlen": lambda: backends.varlen_attention(q.reshape(-1, 4, 32), k.reshape(-1, 2, 32), k.reshape(-1, 2, 32),
                                                    pb, backend="varlen"),
        "attention": lambda: attn(x, position_embeddings=(cos, cos), attention_mask=None, novatune_packed=pb)[0],
        "layer": lambda: layer(x, position_embeddings=(cos, cos), attention_mask=None, position_ids=pos,
                               novatune_packed=pb),
    }
    fn = fns[name]

    def run():
        with torch.set_grad_enabled(grad):
            y = fn()
            if grad:
                torch.autograd.grad(y.float().sum(), [x, q, k] if name in ("qk_norm_rope", "varlen") else [x])

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g, stream=stream, capture_error_mode=mode):
            run()
        g.replay()
        torch.cuda.synchronize()
        print(f"RESULT {name} grad={grad} {mode}: OK", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"RESULT {name} grad={grad} {mode}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
        traceback.print_exc(limit=-4)


def main():
    if len(sys.argv) == 4:
        return piece(sys.argv[1], sys.argv[2] == "1", sys.argv[3])
    for name in ("rms_norm", "q_proj", "mlp", "qk_norm_rope", "varlen", "attention", "layer"):
        for grad in ("0", "1"):
            for mode in ("thread_local", "relaxed"):
                p = subprocess.run([sys.executable, __file__, name, grad, mode], capture_output=True, text=True)
                res = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")]
                print(res[-1] if res else f"RESULT {name} grad={grad} {mode}: process failed", flush=True)
                if not res or "OK" not in res[-1]:
                    print("\n".join((p.stdout + p.stderr).splitlines()[-14:]), flush=True)
                if mode == "thread_local" and res and "OK" in res[-1]:
                    break  # relaxed adds nothing when thread_local passes


if __name__ == "__main__":
    main()
