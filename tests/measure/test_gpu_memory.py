"""novatune.measure.gpu_memory: the peak counts what CUDA graphs' private pools hold after their capture."""
import pytest
import torch

from novatune.measure.gpu_memory import graph_pool_idle_bytes, peak_bytes


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_no_cuda_no_graph_pools():
    assert graph_pool_idle_bytes() == 0


@pytest.mark.gpu
def test_a_graphs_temporaries_count_in_the_peak_after_its_capture():
    """A captured temporary (4 MiB) is freed into the graph's pool when the capture ends: the allocator's peak over
    the replays no longer counts it, peak_bytes does."""
    x = torch.randn(1024, 1024, device="cuda")
    out = torch.full_like(x, float("nan"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out.copy_(x * 2 + 1)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    before = graph_pool_idle_bytes()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tmp = x * 2
        out.copy_(tmp + 1)
        del tmp
    out.fill_(float("nan"))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    graph.replay()
    torch.cuda.synchronize()
    replay_peak, allocated = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
    pooled, counted = graph_pool_idle_bytes(), peak_bytes()
    assert replay_peak == allocated  # the replay's temporaries: uncounted by the allocator's peak
    assert pooled - before >= x.numel() * x.element_size()
    assert counted == replay_peak + pooled
    assert torch.equal(out, x * 2 + 1)  # last: its own temporaries (x * 2, + 1, the mask) raise the peak by 9 MiB
