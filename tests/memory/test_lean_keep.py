"""The `lean` policy on the CPU: ops offer only inside offering(); a saved view of an offered output is matched,
a dead output or another tensor in its memory never is; a lean layer (novatune's patched Qwen3 and Qwen3-MoE)
keeps no norm output and no rotated q/k and computes gradients bit for bit as a kept one; an in-place change of
a saved tensor raises autograd's error; the planner turns the fewest kept layers lean that make a plan fit."""
from __future__ import annotations

import pytest
import torch

from novatune.memory import lean_keep
from novatune.memory.policy import install, installed
from novatune.ops import recipes
from novatune.ops.qk_norm_rope import qk_norm_rope
from novatune.ops.rms_norm import rms_norm


def test_offers_exist_only_inside_offering_and_only_while_their_output_lives():
    x, w = torch.randn(5, 8), torch.randn(8)
    y = rms_norm(x, w)
    assert recipes.find(y) is None  # outside offering(): nothing offered
    with recipes.offering():
        y = rms_norm(x, w)
        recipe, index = recipes.find(y.view(40))  # a view of the whole output is matched
        assert index == 0 and torch.equal(recipe.outputs()[0], y)
        assert recipes.find(torch.randn(5, 8)) is None
        assert recipes.find(y.to(torch.float64)) is None
        ptr = y.untyped_storage().data_ptr()
        del y, recipe  # the output dies: its memory may hold another tensor next
        other = torch.empty(5, 8)
        assert other.untyped_storage().data_ptr() != ptr or recipes.find(other) is None
    assert not recipes._offers  # the offers end with the outermost offering()


def test_a_recompute_after_an_in_place_change_of_its_input_raises():
    x, w = torch.randn(3, 8), torch.randn(8)
    with recipes.offering():
        y = rms_norm(x, w)
        recipe, _ = recipes.find(y)
    x.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        recipe.outputs()


def test_qk_norm_rope_offers_both_outputs():
    torch.manual_seed(0)
    q, k = torch.randn(1, 7, 4, 16), torch.randn(1, 7, 2, 16)
    wq, wk = torch.randn(16), torch.randn(16)
    cos, sin = torch.randn(1, 7, 16), torch.randn(1, 7, 16)
    with recipes.offering():
        qo, ko = qk_norm_rope(q, k, wq, wk, 1e-6, cos, sin)
        (rq, iq), (rk, ik) = recipes.find(qo.transpose(1, 2)), recipes.find(ko)
        assert rq is rk and (iq, ik) == (0, 1)
        again = rq.outputs()
        assert torch.equal(again[0], qo) and torch.equal(again[1], ko)


def _patched(moe: bool):
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    import novatune

    torch.manual_seed(0)
    common = dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=12, use_cache=False, tie_word_embeddings=False)
    cfg = (Qwen3MoeConfig(**common, moe_intermediate_size=16, num_experts=5, num_experts_per_tok=2,
                          intermediate_size=40, decoder_sparse_step=1) if moe
           else Qwen3Config(**common, intermediate_size=40))
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    novatune.patch(model)
    return model


def _grads(model, ids):
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("moe", [False, True])
def test_a_lean_layer_keeps_no_cheap_copy_and_computes_the_same_gradients(moe, monkeypatch):
    model = _patched(moe)
    layers = list(model.model.layers)
    ids = torch.randint(0, 61, (1, 23))
    install(layers, ["keep", "keep"])
    ref = _grads(model, ids)
    packed = []
    real_pack = lean_keep._pack

    def spy(t):
        out = real_pack(t)
        packed.append((type(out).__name__, tuple(t.shape)))
        return out
    monkeypatch.setattr(lean_keep, "_pack", spy)
    install(layers, ["lean", "lean"])
    assert installed(layers) == ["lean", "lean"]
    got = _grads(model, ids)
    for n in ref:
        assert torch.equal(got[n], ref[n]), n
    recomputed = [torch.Size(shape).numel() for kind, shape in packed if kind == "_Recomputed"]
    tokens, h = 23, 32
    # per layer: the two norms' outputs (saved by the projections / router and experts, some as 2-D views) and
    # Qwen3's rotated q (4 heads) and k (2 heads), saved by attention
    q, kv = tokens * 4 * 12, tokens * 2 * 12
    assert set(recomputed) == {tokens * h, q, kv}
    assert recomputed.count(q) == 2 and recomputed.count(kv) == 2  # saved once per layer, by attention
    assert recomputed.count(tokens * h) >= 2 * 2  # each norm's output, by one consumer at least
    assert not recipes._offers  # nothing offered outlives the layers' forwards


@pytest.mark.parametrize("moe", [False, True])
def test_recompute_mlp_runs_each_mlp_twice_and_attention_once_with_the_gradients_of_keep(moe):
    model = _patched(moe)
    layers = list(model.model.layers)
    ids = torch.randint(0, 61, (1, 23))
    install(layers, ["keep", "keep"])
    ref = _grads(model, ids)
    calls = {"mlp": 0, "self_attn": 0}
    for layer in layers:
        for name in calls:
            getattr(layer, name).register_forward_hook(
                lambda m, a, o, name=name: calls.__setitem__(name, calls[name] + 1))
    install(layers, ["recompute_mlp", "recompute_mlp"])
    assert installed(layers) == ["recompute_mlp", "recompute_mlp"]
    got = _grads(model, ids)
    for n in ref:
        assert torch.equal(got[n], ref[n]), n
    # module hooks run outside the checkpoint, once per layer call: they never see the recompute, so the MLP's own
    # forward is counted below
    assert calls == {"mlp": 2, "self_attn": 2}
    forwards = []
    mlp = layers[0].mlp
    inner = mlp.forward

    def spy(*a, **k):
        forwards.append(1)
        return inner(*a, **k)
    mlp.__dict__["forward"] = spy
    _grads(model, ids)
    assert len(forwards) == 2  # the forward, and the checkpoint's recompute in the backward
    assert mlp.__dict__["forward"] is spy  # the policy put back the forward it found


def test_an_offered_output_changed_in_place_before_its_consumer_saves_it_is_kept_as_it_is():
    """The recipe gives the output as offered; after y.mul_(2) the consumer's saved y is the changed one, so it
    must be stored itself (the gradients then equal the same code without the hooks)."""
    torch.manual_seed(0)
    x, w = torch.randn(6, 8), torch.randn(8)
    mat = torch.randn(8, 5, requires_grad=True)

    def grad(lean: bool):
        mat.grad = None
        ctx = lean_keep.kept_layer() if lean else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        with ctx:
            y = rms_norm(x, w)
            y.mul_(2)
            z = y @ mat  # saves the changed y
        z.square().sum().backward()
        return mat.grad.clone()
    assert torch.equal(grad(True), grad(False))


def test_a_lean_graph_never_run_backward_is_freed():
    import gc
    import weakref

    x = torch.randn(4, 8, requires_grad=True)
    with lean_keep.kept_layer():
        out = (x * 2).softmax(-1)  # softmax saves its own output
    ref = weakref.ref(out)  # held through its own node's saved output, it would outlive `del`
    del out
    gc.collect()
    assert ref() is None


def test_an_in_place_change_of_a_saved_tensor_still_raises_in_a_lean_layer():
    x = torch.randn(4, 8, requires_grad=True)
    with lean_keep.kept_layer():
        y = x * 2
        z = y.sin()  # saves y
    with torch.no_grad():
        y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()


def test_the_planner_turns_the_fewest_kept_layers_lean_that_fit():
    from novatune.memory import planner

    shape = planner.LayerShape(hidden=2048, q_dim=4096, kv_dim=512, intermediate=8 * 768, heads=32, tokens=4096,
                               dtype_bytes=2, attended_keys=1024, routed=True, top_k=8,
                               lean_elements=2 * 2048 + 4096 + 512)
    hw = planner.Hardware(700, 4000, 50)
    cost = planner.layer_cost(shape, hw)
    saved = cost.bytes["keep"] - cost.bytes["lean"]
    assert saved == (2 * 2048 + 4096 + 512) * 4096 * 2
    assert cost.seconds["keep"] < cost.seconds["lean"] < cost.seconds["recompute"]
    costs = [cost] * 8
    static = 40 * 2**30
    all_keep = planner.evaluate(["keep"] * 8, costs, static, None)
    # j lean layers hold j x saved less, and one of them holds it again while its backward recomputes: the peak
    # is all_keep - (j - 1) x saved
    budget = all_keep.peak_bytes - int(1.5 * saved)
    plan = planner.choose(costs, static, budget)
    assert plan.policies == ["lean"] * 3 + ["keep"] * 5  # three lean layers fit, two would not
    assert plan.fits and plan.peak_bytes == all_keep.peak_bytes - 2 * saved
    no_lean = planner.choose(costs, static, budget, allowed=("keep", "recompute", "selective", "offload"))
    assert "lean" not in no_lean.policies and no_lean.seconds > plan.seconds


@pytest.mark.parametrize("arch, patch_options, method, want", [
    ("qwen3", {}, "full", "2h+q+kv"),
    ("qwen3-30b-a3b", {}, "full", "2h+q+kv"),
    ("qwen3", {"fuse_qk_norm_rope": False}, "full", "2h"),
    ("llama-3.2-1b", {}, "full", "2h"),
    ("gemma-3-4b", {}, "full", "0"),  # output-rounded norm: offset_rms_norm offers nothing
    ("olmo-2-7b", {}, "full", "0"),  # post-norms: their outputs only join the residual
    ("qwen3", {}, "lora", "0"),  # frozen base projections save no input
])
def test_lean_counts_only_what_an_op_offers_and_a_consumer_saves(make_cfg_lean, arch, patch_options, method, want):
    from novatune.train.arch import arch_config
    from novatune.train.memory import lean_elements

    mconf = arch_config({"qwen3": "qwen3-4b"}.get(arch, arch))
    cfg = make_cfg_lean(patch_options, method)
    h = mconf.hidden_size
    hd = getattr(mconf, "head_dim", None) or h // mconf.num_attention_heads
    q, kv = mconf.num_attention_heads * hd, mconf.num_key_value_heads * hd
    expect = {"2h+q+kv": 2 * h + q + kv, "2h": 2 * h, "0": 0}[want]
    assert lean_elements(cfg, mconf, h, q, kv) == expect


@pytest.fixture
def make_cfg_lean():
    from types import SimpleNamespace

    def make(patch_options, method):
        return SimpleNamespace(model=SimpleNamespace(patch=True, patch_options=patch_options),
                               method=SimpleNamespace(type=method))
    return make
