"""patch/moe.py's outputs_unread: inside it, the experts modules of families whose output feeds only residual adds
skip the down projection and combine (a recompute that only roots the backward); everywhere else they compute it."""
from __future__ import annotations

import pytest
import torch
from tiny_models import packed_batch, tiny_model

import novatune
from novatune.patch.moe import output_unread, outputs_unread
from novatune.patch.specs import qwen3_moe


def test_only_declaring_families_inside_the_context_skip():
    class Experts(torch.nn.Module):
        _novatune_moe = qwen3_moe.SPEC.moe

    experts = Experts()
    assert not output_unread(experts)
    with outputs_unread():
        assert output_unread(experts)
        experts._novatune_moe = type(qwen3_moe.SPEC.moe)(router_classes=(), experts_classes=())  # not declared
        assert not output_unread(experts)
    assert not output_unread(experts)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_patched_layer_recomputed_unread_gives_the_same_gradients(family, monkeypatch):
    """A decoder layer of a patched tiny MoE model run to be differentiated through, as the graphs' captured
    backward runs it: its gradients equal the computed output's bit for bit, and the experts really skipped
    their combine (counted: an uninitialised output may hold the old values by chance)."""
    from novatune.ops import moe as M

    combines = []
    real = M.combine
    monkeypatch.setattr(M, "combine", lambda *a, **k: combines.append(1) or real(*a, **k))
    torch.manual_seed(0)
    model = tiny_model(family).float()
    novatune.patch(model)
    layer = model.model.layers[0]
    ids, pos, _ = packed_batch([[5, 9, 3]], vocab=model.config.vocab_size)
    x = torch.randn(1, ids.shape[1], model.config.hidden_size, requires_grad=True)
    cos_sin = model.model.rotary_emb(x, pos)
    gout = torch.randn_like(x)
    params = [p for p in layer.parameters() if p.requires_grad]

    def run(unread):
        with outputs_unread() if unread else torch.enable_grad():
            y = layer(x, position_embeddings=cos_sin, position_ids=pos)
        y = y[0] if isinstance(y, tuple) else y
        return torch.autograd.grad(y, [x, *params], gout)

    g_full = run(False)
    assert len(combines) == 1
    g_unread = run(True)
    assert len(combines) == 1  # the experts' output was never computed
    for a, b in zip(g_unread, g_full):
        assert torch.equal(a, b)
