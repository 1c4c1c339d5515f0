"""The --memory report's replay of an allocation trace and its naming of the blocks that predate the recording."""
import torch

from novatune.bench.diagnostics import largest_live, replay_to_peak, tensor_owners


def _snapshot(live_at_end: list[tuple[int, int]], events: list[tuple[str, int, int]], graph_pool=()) -> dict:
    """Blocks at addresses in `graph_pool` sit in a CUDA graph's private pool (a segment of their own)."""
    def segment(blocks, pool):
        return {"blocks": blocks, "segment_pool_id": pool, "stream": 7}

    blocks = [{"address": a, "size": n, "state": "active_allocated"} for a, n in live_at_end]
    trace = [{"action": act, "addr": a, "size": n,
              "frames": [{"filename": "/x/novatune/ops/thing.py", "line": 7, "name": "fwd"}]} for act, a, n in events]
    return {"segments": [segment([b for b in blocks if b["address"] not in graph_pool], [0, 0]),
                         segment([b for b in blocks if b["address"] in graph_pool], [1, 3])],
            "device_traces": [trace]}


def test_replay_finds_the_peak_and_names_blocks_from_before_by_owner():
    # 100 and 200 live before the trace (one named by owners, one not); the trace allocates 300 and 400, frees
    # the 300, allocates 50: the peak, 1000, is right after the 400 (trace event 1)
    snap = _snapshot([(1, 100), (2, 200), (4, 400), (5, 50)],
                     [("alloc", 3, 300), ("alloc", 4, 400), ("free_completed", 3, 300), ("alloc", 5, 50)],
                     graph_pool=(2,))
    best, live, at, n = replay_to_peak(snap, {1: "gradients"})
    assert (best, at, n) == (1000, 1, 4)
    assert live[1] == (100, "before the recorded micro-step: gradients")
    assert live[2] == (200, "before the recorded micro-step: no tensor Python can reach (a CUDA-graph pool, "
                            "stream 7)")
    assert live[3][0] == 300 and "novatune/ops/thing.py:7 fwd" in live[3][1]
    assert 5 not in live
    groups = dict(largest_live(live))
    assert groups["before the recorded micro-step: gradients"] == [100, 1]


def test_a_block_freed_in_the_trace_was_live_before_it():
    snap = _snapshot([], [("free_completed", 9, 64), ("alloc", 8, 16)])
    best, live, at, _ = replay_to_peak(snap)
    assert (best, at) == (64, -1)  # the peak is the state before the trace: 64 live, then 0, then 16
    # a block freed in the trace is in no segment of the final snapshot: its pool is unknown
    assert live == {9: (64, "before the recorded micro-step: no tensor Python can reach (pool unknown)")}


def test_tensor_owners_tells_weights_gradients_states_and_other_tensors_apart():
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
    model[1].weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    class Holder:
        pass

    holder = Holder()
    holder.buffers = [torch.randn(7, 11), torch.randn(1 << 18)]  # 28 bytes, 1 MiB
    holder.sparse = torch.eye(3).to_sparse()  # no plain storage (as FSDP2's DTensor): skipped, not an error
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # a storage whose address cannot be read (a trace's leftover): skipped too
        holder.fake = torch.empty(5)
    owners = tensor_owners(model, opt, device_type="cpu")
    ptr = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    assert owners[ptr(model[0].weight)] == "weights (trainable)"
    assert owners[ptr(model[1].weight)] == "weights (frozen)"
    assert owners[ptr(model[0].weight.grad)] == "gradients"
    assert owners[ptr(opt.state[model[0].weight]["exp_avg"])] == "optimizer states"
    assert owners[ptr(holder.buffers[0])] == "other tensors float32 (7, 11)"  # too small to search for its holder
    assert owners[ptr(holder.buffers[1])] == "other tensors float32 (262144,) held by Holder.buffers[]"
