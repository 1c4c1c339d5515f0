"""patch(model)'s dense projections (novatune.ops.linear): over accumulated micro-batches every weight's gradient
equals stock's, the GEMM adds into .grad from the second micro-batch on, the down projection takes it only where
a recompute runs its GEMM anyway (auto), and linear_wgrad_in_place=False keeps the modules' own calls (fp32 on
the CPU)."""
from __future__ import annotations

import functools
import importlib

import pytest
import torch
from torch import nn

import novatune
import novatune.ops.linear as L
from novatune.measure.numerics import assert_close
from novatune.memory.policy import install
from tests.patch.tiny_models import packed_batch, tiny_model, tiny_olmo2

tiled = importlib.import_module("novatune.patch.tiled")  # novatune.patch the attribute is the function
PROJECTIONS = 7  # q, k, v, o, gate, up, down per layer


def _tiny(family: str):
    return tiny_olmo2() if family == "olmo2" else tiny_model(family)


def _accumulate(model, batches):
    for ids, pos, lab in batches:
        model(input_ids=ids, position_ids=pos, labels=lab).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _spy_in_place(monkeypatch) -> list[tuple[int, bool]]:
    """(the weight's data_ptr, whether its gradient went into .grad) for each projection run through `linear`."""
    taken: list[tuple[int, bool]] = []
    real = L.accumulates_into_grad
    monkeypatch.setattr(L, "accumulates_into_grad", lambda p: taken.append((p.data_ptr(), real(p))) or taken[-1][1])
    return taken


@pytest.mark.parametrize("family,asked", [("qwen3", True), ("llama", True), ("olmo2", "auto")])
def test_accumulated_gradients_equal_stock(family, asked, monkeypatch):
    """Asked for (Qwen3, Llama) or by auto (OLMo 2, its post-norm reading the down projection's output): every
    projection, the down projection too (no checkpoint here)."""
    taken = _spy_in_place(monkeypatch)
    batches = [packed_batch([[9, 14], [23]], seed=s) for s in range(3)]
    stock = _tiny(family).train()
    ours = _tiny(family).train()
    report = novatune.patch(ours, linear_wgrad_in_place=asked)
    assert "weight gradients accumulated inside the GEMMs" in str(report)
    want, got = _accumulate(stock, batches), _accumulate(ours, batches)
    assert want.keys() == got.keys()
    for name in want:
        assert_close(got[name], want[name], name=name)  # fp32's tolerance: the patched kernels round elsewhere
    per_micro_batch = PROJECTIONS * ours.config.num_hidden_layers
    flags = [t for _, t in taken]
    assert len(flags) == 3 * per_micro_batch
    assert not any(flags[:per_micro_batch]) and all(flags[per_micro_batch:])


def test_auto_takes_it_where_a_post_norm_reads_the_mlp_output():
    """auto: on for OLMo 2 (its post-norm reads the down projection's output, so the recompute runs that GEMM
    anyway), off for Qwen3 (the checkpoint would stop before it; the other projections measured slower in place
    under full-layer checkpointing and on kept MoE layers, bench.jsonl session30-4)."""
    for family, on in (("olmo2", True), ("qwen3", False)):
        model = _tiny(family).train()
        report = novatune.patch(model)
        assert ("weight gradients accumulated inside the GEMMs" in str(report)) is on, family
        assert model.model.layers[0].self_attn._novatune_linear_wgrad is on
        assert model.model.layers[0].mlp._novatune_linear_wgrad is on
        assert model.model.layers[0].mlp._novatune_down_wgrad is on
    with pytest.raises(ValueError, match="linear_wgrad_in_place"):
        novatune.patch(tiny_model("qwen3"), linear_wgrad_in_place="yes")


@pytest.mark.parametrize("how", ["recompute_mlp", "tiled"])
def test_auto_returns_the_down_projections_gradient_under_a_checkpoint_of_the_mlps_own(how, monkeypatch):
    """Under memory.policy recompute_mlp, or the tiled MLP's per-chunk checkpoints, nothing inside the checkpoint
    reads the down projection's output, so its GEMM would run again only for novatune.ops.linear: auto returns its
    gradient to autograd there, in the forward and in the recompute alike (a different call in the recompute would
    save other tensors: torch's checkpoint raises), while the other projections still take the in-place path.
    linear_wgrad_in_place=True keeps it everywhere (checked under recompute_mlp). Two micro-batches: the second
    finds .grad and takes the in-place path."""
    if how == "tiled":
        monkeypatch.setattr(tiled, "CHUNK_BYTES", 1)
        monkeypatch.setattr(tiled, "MIN_CHUNK_ROWS", 16)  # 3 chunks of a 46-token micro-batch
    batches = [packed_batch([[9, 14], [23]], seed=s) for s in range(2)]
    stock = tiny_olmo2().train()
    want = _accumulate(stock, batches)
    taken = _spy_in_place(monkeypatch)
    for asked in ("auto", True) if how == "recompute_mlp" else ("auto",):
        taken.clear()
        ours = tiny_olmo2().train()
        novatune.patch(ours, linear_wgrad_in_place=asked, tiled_mlp=how == "tiled" or "auto")
        layers = list(ours.model.layers)
        if how == "recompute_mlp":
            ours.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            install(layers, ["recompute_mlp"] * len(layers))
        got = _accumulate(ours, batches)
        for name in want:
            assert_close(got[name], want[name], name=name)
        downs = {layer.mlp.down_proj.weight.data_ptr() for layer in layers}
        ups = {layer.mlp.up_proj.weight.data_ptr() for layer in layers}
        called = {ptr for ptr, _ in taken}
        assert bool(downs & called) is (asked is True), asked
        assert ups <= called and any(t for _, t in taken)
        assert all("_novatune_mlp_own_checkpoint" not in layer.mlp.__dict__ for layer in layers)


@pytest.mark.parametrize("family,asked", [("qwen3", "auto"), ("olmo2", False)])
def test_off_calls_the_modules(family, asked, monkeypatch):
    """Off by default for Qwen3 (auto), and when asked for OLMo 2 (where auto would take it)."""
    calls: list = []
    monkeypatch.setattr(L, "linear", lambda *a: calls.append(1))
    model = _tiny(family).train()
    report = novatune.patch(model, linear_wgrad_in_place=asked)
    assert "weight gradients accumulated inside the GEMMs" not in str(report)
    ids, pos, lab = packed_batch([[9, 14]])
    model(input_ids=ids, position_ids=pos, labels=lab).loss.backward()
    assert calls == []


@pytest.mark.parametrize("scope", ["module", "global"])
def test_a_projections_backward_hook_runs_and_changes_its_gradients_as_stocks(scope):
    """Full backward hooks (each projection's own, or a global one) that halve grad_input: the projections are
    then called as modules, so the hooks run as often as stock's and the gradients follow them. Before, the in-place
    path skipped the modules' calls, on the first micro-batch too: no hook ran, and gradients were off by up to 20x."""
    from torch.nn.modules.module import register_module_full_backward_hook

    batches = [packed_batch([[9, 14], [23]], seed=0)]
    calls = {"stock": 0, "ours": 0}

    def halve(tag, module, grad_input, grad_output):
        if type(module) is not nn.Linear or module.out_features == 257:  # the projections, not lm_head
            return None
        calls[tag] += 1
        return tuple(None if g is None else 0.5 * g for g in grad_input)

    grads = {}
    for tag in calls:
        model = tiny_olmo2().train()
        if tag == "ours":
            novatune.patch(model)  # auto: in place for OLMo 2
        handles = ([register_module_full_backward_hook(functools.partial(halve, tag))] if scope == "global" else
                   [m.register_full_backward_hook(functools.partial(halve, tag)) for m in model.modules()
                    if type(m) is nn.Linear])
        grads[tag] = _accumulate(model, batches)
        for h in handles:
            h.remove()
    assert calls["ours"] == calls["stock"] == PROJECTIONS * 2
    for name in grads["stock"]:
        assert_close(grads["ours"][name], grads["stock"][name], name=name)


def test_a_projection_output_a_forward_hook_keeps_is_not_written_over():
    """The fused MLP writes its gradients over gate and up (swiglu_inplace_backward), which nobody else holds,
    unless a forward hook saw the projection's call: it may have kept the output, which then stays as it was."""
    kept = []
    model = tiny_model("qwen3").train()
    novatune.patch(model)
    model.model.layers[0].mlp.gate_proj.register_forward_hook(lambda m, a, out: kept.append((out, out.clone())))
    ids, pos, lab = packed_batch([[9, 14]])
    model(input_ids=ids, position_ids=pos, labels=lab).loss.backward()
    (out, copy), = kept
    assert torch.equal(out, copy)
