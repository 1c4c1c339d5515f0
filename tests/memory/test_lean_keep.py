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
    plan = planner.choose(costs, static, all_keep.peak_bytes - int(2.5 * saved))
    assert plan.policies == ["lean"] * 3 + ["keep"] * 5  # three lean layers fit, two would not
    assert plan.fits
    no_lean = planner.choose(costs, static, all_keep.peak_bytes - int(2.5 * saved),
                             allowed=("keep", "recompute", "selective", "offload"))
    assert "lean" not in no_lean.policies and no_lean.seconds > plan.seconds
