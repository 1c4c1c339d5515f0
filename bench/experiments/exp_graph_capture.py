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
    torch.cuda.set_sync_debug_mode("error")
    try:
        ids, pos, lab = T._batch(T.LAYOUTS[1], "cuda", 1)
        out = eager(input_ids=ids, position_ids=pos.cpu(), labels=lab)  # CPU position_ids: the host metadata
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


if __name__ == "__main__":
    main()
