"""The memory planner: the choice on synthetic layer costs at the budget's edges, its byte model against the
saved tensors torch really keeps for a tiny Qwen3, selective recompute recomputing no GEMM, the optimizer bytes."""
from __future__ import annotations

import importlib

import pytest
import torch
import transformers

from novatune.memory import lean_keep, planner
from novatune.memory.pinned import PAGE, page_rounded
from novatune.memory.planner import LayerCost, LayerShape, choose, evaluate, saved_elements_per_token

# 4 identical layers: keep 10 bytes, selective 6, recompute 1, offload 0 (+ two 1-byte slots); a recomputed
# layer's backward holds 2 bytes again; static 100
COST = LayerCost(bytes={"keep": 10, "selective": 6, "recompute": 1, "offload": 0},
                 seconds={"keep": 1.0, "selective": 1.05, "recompute": 1.3, "offload": 1.35}, transient=2,
                 input_bytes=1)


@pytest.mark.parametrize("budget,want,peak", [
    (None, ["keep"] * 4, 140),  # no budget: nothing limits
    (140, ["keep"] * 4, 140),  # exactly the peak fits
    (139, ["selective"] + ["keep"] * 3, 138),
    (137, ["selective"] * 2 + ["keep"] * 2, 134),
    (134, ["selective"] * 2 + ["keep"] * 2, 134),
    (133, ["selective"] * 3 + ["keep"], 130),  # faster than [recompute, keep x3] (also 133)
    (129, ["selective"] * 4, 126),
    (125, ["recompute", "selective", "selective", "keep"], 125),
    (124, ["recompute"] + ["selective"] * 3, 121),  # recompute before offload: smaller than needed, and faster
    (104, ["offload"] * 4, 104),  # the smallest plan: every layer offloaded, two slots
])
def test_choose_takes_the_fastest_plan_that_fits(budget, want, peak):
    plan = choose([COST] * 4, 100, budget)
    assert plan.policies == want and plan.peak_bytes == peak and plan.fits
    assert plan.seconds == pytest.approx(sum(COST.seconds[p] for p in want))


# recompute_mlp between selective and recompute: fewer bytes and less time than selective, a smaller backward
# transient: selective is dominated and left out of the search
COST_MLP = LayerCost(bytes={**COST.bytes, "recompute_mlp": 4}, seconds={**COST.seconds, "recompute_mlp": 1.04},
                     transient=2, input_bytes=1, mlp_transient=1)


def test_a_dominated_policy_is_never_chosen_and_recompute_mlp_takes_its_place():
    assert choose([COST_MLP] * 4, 100, 139).policies == ["recompute_mlp"] + ["keep"] * 3
    for budget in range(104, 141):
        assert "selective" not in choose([COST_MLP] * 4, 100, budget).policies
    # where it is not allowed, selective is chosen as before
    no_mlp = tuple(p for p in planner.POLICIES if p != "recompute_mlp")
    assert choose([COST_MLP] * 4, 100, 139, allowed=no_mlp).policies == ["selective"] + ["keep"] * 3
    plan = evaluate(["recompute_mlp"] * 4, [COST_MLP] * 4, 100, None)
    assert plan.peak_bytes == 100 + 4 * 4 + 1  # its kept bytes and the MLP's recomputed tensors in its backward


def test_equal_policies_both_stay_and_a_tiled_mlp_keeps_every_layer_without_a_budget():
    # a tiled MLP keeps no (T x i) tensor, so recompute_mlp keeps what keep keeps (no lean copies here) and only
    # adds the MLP's forward again: keep wins, and without a budget every layer keeps
    shape = LayerShape(hidden=2560, q_dim=4096, kv_dim=1024, intermediate=9728, heads=32, tokens=65536,
                       dtype_bytes=2, attended_keys=300, mlp_chunk_tokens=8192)
    cost = planner.layer_cost(shape, planner.Hardware(700, 3000, 50))
    assert cost.bytes["recompute_mlp"] == cost.bytes["keep"] and cost.seconds["recompute_mlp"] > cost.seconds["keep"]
    assert choose([cost] * 4, 100, None).policies == ["keep"] * 4
    same = LayerCost(bytes={**COST.bytes, "recompute_mlp": 10}, seconds={**COST.seconds, "recompute_mlp": 1.0},
                     transient=2, input_bytes=1, mlp_transient=0)  # recompute_mlp equal to keep
    assert not planner._dominates("keep", "recompute_mlp", [same]) and not planner._dominates("recompute_mlp", "keep",
                                                                                               [same])
    assert choose([same] * 4, 100, None).policies == ["keep"] * 4


def test_nothing_fits_returns_the_smallest_plan_marked():
    plan = choose([COST] * 4, 100, 103)
    assert not plan.fits and plan.policies == ["offload"] * 4 and plan.peak_bytes == 104


def test_allowed_policies_and_the_order_of_layers():
    plan = choose([COST] * 4, 100, 120, allowed=("recompute", "keep"))
    assert plan.policies == ["recompute"] * 3 + ["keep"] and plan.peak_bytes == 100 + 13 + 2
    assert evaluate(["keep", "offload", "recompute", "keep"], [COST] * 4, 100, 10).describe() == \
        "keep x1, offload x1, recompute x1, keep x1"


def test_times_order_and_offload_hides_its_copies_behind_the_layer():
    shape = LayerShape(hidden=2560, q_dim=4096, kv_dim=1024, intermediate=9728, heads=32, tokens=4096,
                       dtype_bytes=2, attended_keys=300)
    fast = planner.layer_cost(shape, planner.Hardware(700, 3000, 50))
    t = fast.seconds
    assert t["keep"] < t["recompute"] < t["offload"]
    # selective's dispatch-mode host time makes it the slowest on this layer, as measured (session21-5)
    assert t["selective"] - planner.SELECTIVE_DISPATCH_S < t["recompute"] < t["selective"]
    assert t["offload"] - t["recompute"] == pytest.approx(2 * planner.COPY_OVERHEAD_S)  # 21 MB at 50 GB/s: hidden
    slow_link = planner.layer_cost(shape, planner.Hardware(700, 3000, 1))  # 1 GB/s: the copy shows
    assert slow_link.seconds["offload"] - slow_link.seconds["recompute"] > 10e-3


# ---------------------------------------------------------------------------------------------- the byte model
class _SavesLikeFlashAttention(torch.autograd.Function):
    """Keeps what FlashAttention keeps for its backward: q, k, v, the output and an fp32 log-sum-exp per head and
    token (the CPU's attention keeps a T x T matrix instead, which no GPU path does)."""

    @staticmethod
    def forward(ctx, q, k, v, heads: int):
        out = q * 1.0
        ctx.save_for_backward(q, k, v, out, torch.zeros(heads, q.numel() // q.shape[-1] // heads))
        return out

    @staticmethod
    def backward(ctx, grad):
        raise AssertionError("forward only: the test counts saved bytes")


def _hf_attention(module, q, k, v, mask, **kw):  # q: (batch, heads, tokens, head_dim)
    return _SavesLikeFlashAttention.apply(q, k, v, q.shape[1]).transpose(1, 2).contiguous(), None


_LEAN_PACK = lean_keep._pack  # the hooks' own function, which the counts wrap
SHAPE = dict(hidden_size=160, intermediate_size=608, num_attention_heads=8, num_key_value_heads=2, head_dim=32)


def _saved_bytes_per_layer(fused: bool, checkpointed: bool, monkeypatch, tokens=64, policy: str | None = None) -> int:
    """Bytes autograd keeps after a forward of 3 layers minus after 2: one decoder layer's share, without what
    every layer shares (cos/sin, the embedding, the loss) and without parameters. `policy`: a layer policy
    installed on every layer (checkpointing on); what its own saved-tensor hooks store as it is counts, and so
    does a checkpointed MLP's input, which its checkpoint holds."""
    from novatune.memory.policy import install
    transformers.AttentionInterface.register("novatune_test_saves", _hf_attention)
    forwards = importlib.import_module("novatune.patch.forwards")
    monkeypatch.setattr(forwards, "varlen_attention",
                        lambda q, k, v, packed, **kw: _SavesLikeFlashAttention.apply(q, k, v, q.shape[1]))

    def count(layers: int) -> int:
        cfg = transformers.Qwen3Config(vocab_size=97, num_hidden_layers=layers, use_cache=False, **SHAPE)
        cfg._attn_implementation = "novatune_test_saves"
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).train()
        if checkpointed:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if fused:
            from novatune.patch.apply import patch

            patch(model)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages: dict[int, int] = {}
        alive = []  # every counted tensor held until the count ends: no freed storage's address is counted again

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                alive.append(t)
            return t

        if policy is not None:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            install(list(model.model.layers), [policy] * layers)
            def counted(t):
                stored = _LEAN_PACK(t)
                if isinstance(stored, lean_keep._Checked):
                    pack(t)
                return stored
            monkeypatch.setattr(lean_keep, "_pack", counted)
            for layer in model.model.layers:
                layer.mlp.register_forward_pre_hook(lambda m, args: [pack(args[0]), None][1])

        ids, pos = torch.randint(0, 97, (1, tokens)), torch.arange(tokens)[None]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, position_ids=pos, use_cache=False)
        return sum(storages.values())

    return count(3) - count(2)


@pytest.mark.parametrize("fused", [False, True], ids=["stock", "patched"])
def test_byte_model_matches_the_saved_tensors(fused, monkeypatch):
    # lean's recomputed copies (patched): the two pre-norms' outputs and Qwen3's rotated q and k
    shape = LayerShape(hidden=160, q_dim=256, kv_dim=64, intermediate=608, heads=8, tokens=64, dtype_bytes=2,
                       attended_keys=32, fused=fused, lean_elements=2 * 160 + 256 + 64 if fused else 0)
    cost = planner.layer_cost(shape, planner.Hardware(700, 3000, 50))
    measured = _saved_bytes_per_layer(fused, checkpointed=False, monkeypatch=monkeypatch)
    # the model is a per-token count: within 3% of what torch keeps (0.4% stock, 0.7% patched when written)
    assert cost.bytes["keep"] == pytest.approx(measured, rel=0.03)
    # a checkpointed layer keeps exactly its input
    assert _saved_bytes_per_layer(fused, checkpointed=True, monkeypatch=monkeypatch) == cost.bytes["recompute"]
    assert saved_elements_per_token(shape)["recompute"] == 160
    # the MLP recomputed, the attention kept (lean where novatune's ops offer their outputs)
    measured = _saved_bytes_per_layer(fused, checkpointed=False, monkeypatch=monkeypatch, policy="recompute_mlp")
    assert cost.bytes["recompute_mlp"] == pytest.approx(measured, rel=0.03)


class _CountMatmuls(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("policy", ["recompute", "selective", "keep", "recompute_mlp"])
def test_selective_recompute_runs_no_matmul_again(policy):
    from novatune.memory.policy import install

    cfg = transformers.Qwen3Config(vocab_size=97, num_hidden_layers=1, use_cache=False, **SHAPE)
    cfg._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(cfg).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    install(list(model.model.layers), [policy])
    out = model(input_ids=torch.randint(0, 97, (1, 16)), position_ids=torch.arange(16)[None], use_cache=False)
    with _CountMatmuls() as counter:
        out.logits.float().sum().backward()
    # lm_head's backward: 2 matmuls (input and weight gradients). The decoder layer's 7 linears: 14 in the
    # backward; recompute runs 6 of them again (the checkpoint stops early: down_proj's output is needed by nothing
    # the backward keeps), recompute_mlp the MLP's gate and up, selective none
    assert counter.n - 2 == {"recompute": 20, "selective": 14, "keep": 14, "recompute_mlp": 16}[policy]


def test_a_tiled_mlp_keeps_no_intermediate_and_holds_one_chunk_in_the_backward():
    """A tiled MLP (patch/tiled.py) keeps no (T x i) tensor for its backward; one chunk's five (chunk x i) tensors
    join the transient, and its backward runs the MLP's GEMMs once more. Under `selective` the policy caches the
    matrix products' outputs inside the chunks' checkpoints too, so gate and up are still kept there."""
    common = dict(hidden=2560, q_dim=4096, kv_dim=1024, intermediate=9728, heads=32, tokens=262144, dtype_bytes=2,
                  attended_keys=8000)
    hw = planner.Hardware(matmul_tflops=700.0, hbm_gbps=3000.0, link_gbps=50.0)
    whole, tiled = (planner.layer_cost(LayerShape(**common, mlp_chunk_tokens=c), hw) for c in (None, 13568))
    i_bytes = 262144 * 9728 * 2
    assert whole.bytes["keep"] - tiled.bytes["keep"] == 3 * i_bytes
    assert whole.bytes["selective"] == tiled.bytes["selective"]
    assert tiled.bytes["recompute"] == whole.bytes["recompute"]
    assert tiled.transient == tiled.bytes["keep"] + 5 * 13568 * 9728 * 2
    mlp_forward = 2 * 262144 * 3 * 2560 * 9728 / (700e12 * planner.GEMM_EFFICIENCY)
    assert tiled.seconds["recompute"] == pytest.approx(whole.seconds["recompute"] + mlp_forward)


def test_the_run_plans_the_tiled_mlp_it_will_run():
    from types import SimpleNamespace

    from novatune.train.config import from_dict
    from novatune.train.memory import layer_shape

    mconf = SimpleNamespace(hidden_size=2560, head_dim=128, num_attention_heads=32, num_key_value_heads=8,
                            intermediate_size=9728)
    base = {"model": {"arch": "qwen3-4b"}, "data": {"sources": [{"type": "synthetic"}]}}
    for length, tiled_mlp, want in [(4096, "auto", None), (262144, "auto", 13568), (262144, False, None),
                                    (8192, True, None), (16384, True, 13568)]:
        data = {**base, "data": {**base["data"], "max_length": length}, "memory": {"tiled_mlp": tiled_mlp}}
        assert layer_shape(from_dict(data), mconf, 1.0).mlp_chunk_tokens == want, (length, tiled_mlp)


def test_one_micro_batch_per_step_counts_gradients_as_the_backward_makes_them():
    """GA 1: no gradient exists at the end of the forward; during layer j's backward the gradients of the layers
    above it exist and the activations of the layers below it are still kept. The peak is the largest of those."""
    cost = LayerCost(bytes={"keep": 10, "recompute": 2, "selective": 6, "offload": 0},
                     seconds={"keep": 1, "recompute": 2, "selective": 1.5, "offload": 2.1}, transient=10,
                     input_bytes=2)
    fresh = planner.FreshGradients(layer=5, other=7)
    static = 100 + 7 + 3 * 5  # weights and optimizer states 100, gradients 22
    plan = evaluate(["recompute", "keep", "keep"], [cost] * 3, static, None, fresh)
    # end of forward: 100 + 22 kept; layer 2: 100 + 7 + 5 + 22; layer 1: 100 + 7 + 10 + 12; layer 0: + 2 + 10
    assert plan.peak_bytes == max(100 + 22, 100 + 7 + 5 + 22, 100 + 7 + 10 + 12, 100 + 7 + 15 + 2 + 10)
    assert plan.peak_bytes < evaluate(["recompute", "keep", "keep"], [cost] * 3, static, None).peak_bytes


def test_offload_past_the_host_budget_does_not_fit():
    cost = LayerCost(bytes={"keep": 10, "recompute": 2, "selective": 6, "offload": 0},
                     seconds={"keep": 1, "recompute": 2, "selective": 1.5, "offload": 2.1}, transient=10,
                     input_bytes=3)
    host = planner.HostBudget(PAGE + 5, "test")  # an offloaded input of 3 bytes page-locks one whole page
    assert evaluate(["offload", "recompute"], [cost] * 2, 0, None, host=host).fits
    assert not evaluate(["offload", "offload"], [cost] * 2, 0, None, host=host).fits
    assert choose([cost] * 3, 0, 30, host=host).policies.count("offload") <= 1


def test_a_plan_short_of_host_memory_says_so_not_gpu_memory():
    from novatune.train.memory import no_fit_message

    cost = LayerCost(bytes={"keep": 10, "recompute": 2, "selective": 6, "offload": 0},
                     seconds={"keep": 1, "recompute": 2, "selective": 1.5, "offload": 2.1}, transient=10,
                     input_bytes=3 * 2**30)
    plan = evaluate(["offload", "offload"], [cost] * 2, 0, 100 * 2**30, host=planner.HostBudget(5 * 2**30, "test"))
    assert plan.offloaded_bytes == 6 * 2**30 and plan.host_limited and not plan.fits
    message = no_fit_message(plan, "offload", "test budget")
    assert "fits the GPU" in message and "6.0 GiB of pinned host memory" in message and "5.0 GiB" in message


def test_offloaded_inputs_page_lock_their_own_size():
    """Offloaded inputs live in registered host buffers of their own size (memory/pinned.py), not in torch's pinned
    blocks rounded up to powers of two: 35 inputs of 2.73 GiB (a 358k-token row of Qwen3-8B) take 95.6 GiB, not
    140, and fit an 84 GiB budget only partly offloaded."""
    size = int(2.73 * 2**30)
    cost = LayerCost(bytes={"keep": 10 * size, "recompute": size, "selective": 2 * size, "offload": 0},
                     seconds={"keep": 1, "recompute": 2, "selective": 1.5, "offload": 2.1}, transient=size,
                     input_bytes=size)
    plan = evaluate(["offload"] * 35, [cost] * 35, 0, None, host=planner.HostBudget(84 * 2**30, "test"))
    assert plan.offloaded_bytes == 35 * page_rounded(size) < 96 * 2**30 and not plan.fits
    assert evaluate(["offload"] * 30 + ["recompute"] * 5, [cost] * 35, 0, None,
                    host=planner.HostBudget(84 * 2**30, "test")).fits


def test_graphed_layers_count_the_pool_in_place_of_the_eager_transient():
    """Layers replayed as CUDA graphs run their recompute and backward inside the graphs' pool, a private pool
    reserved throughout: the peak is static + the graphs' buffers + pool + kept + the loss's working memory, and
    only when every layer recomputes (the graphs capture nothing else). Without graphs: static + kept + max(layer
    transient, loss)."""
    cost = LayerCost(bytes={"keep": 10, "recompute": 2, "selective": 6, "offload": 0},
                     seconds={"keep": 1, "recompute": 2, "selective": 1.5, "offload": 2.1}, transient=10,
                     input_bytes=2, graph_pool=13)
    graphs = planner.LayerGraphs(pool=13, buffers=4)
    recompute = ["recompute"] * 3
    assert evaluate(recompute, [cost] * 3, 100, None).peak_bytes == 100 + 6 + 10
    graphed = evaluate(recompute, [cost] * 3, 100, None, graphs=graphs)
    assert graphed.peak_bytes == 100 + 4 + 13 + 6 and graphed.graph_pool_bytes == 13
    assert graphed.transient_bytes == 0 and graphed.static_bytes == 100 + 4 + 13
    # the loss's working memory comes on top of the pool, which no eager allocation can use
    assert evaluate(recompute, [cost] * 3, 100, None, outside=20, graphs=graphs).peak_bytes == 100 + 4 + 13 + 6 + 20
    assert evaluate(recompute, [cost] * 3, 100, None, outside=20).peak_bytes == 100 + 6 + 20
    # one kept layer: every layer runs eagerly, no pool, no buffers
    mixed = evaluate(["recompute", "recompute", "keep"], [cost] * 3, 100, None, graphs=graphs)
    assert mixed.graph_pool_bytes == 0 and mixed.peak_bytes == 100 + 2 + 2 + 10 + 10
    # one micro-batch per step: the loss runs at the end of the forward, the pool during each layer's backward
    fresh = planner.FreshGradients(layer=5, other=7)
    plan = evaluate(recompute, [cost] * 3, 100 + 7 + 15, None, fresh, outside=9, graphs=graphs)
    assert plan.peak_bytes == 100 + 4 + 13 + max(6 + 9, 7 + 5 + 6, 7 + 15 + 2)
    # auto compares graphed and eager assignments on their own peaks
    assert choose([cost] * 3, 100, 100 + 4 + 13 + 6, allowed=("recompute", "keep"), graphs=graphs).policies == \
        recompute
