"""Frozen-weight streaming beside patch/graphs.py's CUDA graphs (the runner's decisions run on the CPU): a streamed
layer stays in the graphs (its weights keep their slot addresses), the runner finds the streamer's
`before_replay` through its own wrapper, and only the streamer's own pre-hook is let through."""
from __future__ import annotations

import novatune
from novatune.memory.stream import install_streaming
from novatune.patch import graphs
from novatune.patch.apply import _find_state
from tests.patch.test_cuda_graphs import _cpu_model


def test_streamed_layers_stay_graph_compatible_and_acquire_before_each_replay():
    model = _cpu_model()
    novatune.patch(model, cuda_graphs=False, tune=False)
    stack, state = _find_state(model.get_base_model())
    layers = list(stack.layers)
    streamer = install_streaming(layers, [1], "cpu")
    runner = graphs.LayerGraphRunner(layers, state, full_training=True)
    runner.ensure_installed()
    assert runner._check_layers() is None  # the streamer's pre-hook is graph-safe; the slot addresses are fixed
    assert runner.before_replay[0] is None and runner.before_replay[1] is not None
    ptrs = [p.data_ptr() for p in layers[1].parameters()]
    before = streamer.stats["acquires"]
    runner.before_replay[1]()
    assert streamer.stats["acquires"] == before + 1
    assert [p.data_ptr() for p in layers[1].parameters()] == ptrs
    # any other hook on the layer still keeps the batch out of the graphs
    handle = layers[0].register_forward_pre_hook(lambda m, a: None)
    assert "module hooks" in runner._check_layers()
    handle.remove()
    runner.uninstall()
