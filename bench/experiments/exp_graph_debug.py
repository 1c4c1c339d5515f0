"""The graphed test model's first capture, with the capture error's stack (novatune/patch/graphs.py; session 4).
Run under NOVATUNE_GRAPH_CAPTURE_MODE=thread_local / relaxed."""
import sys

sys.path.insert(0, "tests/patch")
import test_cuda_graphs as T  # noqa: E402

import novatune  # noqa: E402


def main():
    model = T._model("cuda")
    novatune.patch(model, tune=False)
    T._train(model, T.LAYOUTS[:4], ga=1)
    st = T._runner(model).stats()
    print("STATS", {k: v for k, v in st.items() if k != "broken_trace"}, flush=True)
    print(st["broken_trace"], flush=True)


if __name__ == "__main__":
    main()
