"""The peer stack's packed-batch metadata (novatune/bench/peer.py): recomputed for every new batch even when the
new position_ids occupies the freed memory of the previous one (the address-keyed cache it replaces returned the
previous batch's document boundaries then), reused across the layers of one batch."""
import torch

from novatune.bench.peer import PackedMeta


def test_a_new_batch_in_recycled_memory_gets_its_own_boundaries():
    meta = PackedMeta()
    storage = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    first = storage.view(1, 8)
    cu, mx = meta(first)
    assert cu.tolist() == [0, 3, 5, 8] and mx == 3
    assert meta(first)[0] is cu and meta.misses == 1, "the layers of one batch share one computation"
    # the next micro-batch written into the same memory (what the caching allocator does after a free), reached
    # through a new tensor object: same data_ptr and shape, different documents
    storage.copy_(torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1]]))
    second = storage.view(1, 8)
    assert second.data_ptr() == first.data_ptr() and second.shape == first.shape
    cu2, mx2 = meta(second)
    assert cu2.tolist() == [0, 6, 8] and mx2 == 6 and meta.misses == 2


def test_liger_is_called_with_the_keywords_its_family_takes(monkeypatch):
    """Liger's Gemma functions take geglu (no swiglu), Llama's swiglu: each gets only its own keywords."""
    import sys
    import types

    from novatune.bench.peer import apply_liger

    seen = {}

    def gemma2_fn(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, geglu=True,
                  model=None):
        seen["gemma2"] = dict(rope=rope, geglu=geglu, flce=fused_linear_cross_entropy, ce=cross_entropy)

    def qwen3_fn(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True,
                 model=None):
        seen["qwen3"] = dict(swiglu=swiglu)

    fake = types.ModuleType("liger_kernel.transformers")
    fake.apply_liger_kernel_to_gemma2, fake.apply_liger_kernel_to_qwen3 = gemma2_fn, qwen3_fn
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    assert apply_liger("gemma2") == "apply_liger_kernel_to_gemma2"
    apply_liger("qwen3")
    assert seen == {"gemma2": dict(rope=True, geglu=True, flce=True, ce=False), "qwen3": dict(swiglu=True)}
