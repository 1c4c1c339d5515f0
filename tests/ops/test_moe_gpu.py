"""The MoE layer on a GPU at Qwen3-30B-A3B's shapes (hidden 2048, 128 experts, top-8, expert intermediate 768, 4096
tokens, bf16): no host sync in the forward or the backward (CUDA sync-debug mode "error" turns any synchronising
call into an exception), and the same values as Hugging Face's grouped_mm experts and the fp32 oracle.

Tolerance: bf16 activations and weights, chained roundings of h, the activation, y and the output (as stock) ->
2e-2 relative-norm against the fp32 oracle (tests/ops/test_moe.py); stock's own error is of the same size."""
import pytest
import torch
import transformers

import novatune
from novatune.measure.numerics import assert_close, rel_err
from novatune.reference import moe as R

pytestmark = pytest.mark.gpu


def _block(tokens=4096, seed=0):
    cfg = transformers.Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                                      num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=1,
                                      num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=1024,
                                      use_cache=False)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().train()
    model.set_experts_implementation("grouped_mm")
    x = torch.randn(1, tokens, 2048, device="cuda", dtype=torch.bfloat16)
    return model, model.model.layers[0].mlp, x


def _fwd_bwd(block, x, dout):
    xg = x.detach().requires_grad_()
    block.zero_grad(set_to_none=True)
    out = block(xg)
    out.backward(dout)
    return out.detach(), xg.grad, block.experts.gate_up_proj.grad, block.experts.down_proj.grad, block.gate.weight.grad


def test_moe_layer_forward_backward_without_host_sync():
    model, block, x = _block()
    novatune.patch(model)
    dout = torch.randn_like(x)
    _fwd_bwd(block, x, dout)  # warm-up: Triton compiles, allocator grows
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _fwd_bwd(block, x, dout)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_moe_layer_matches_hf_grouped_mm_and_oracle():
    model, block, x = _block(tokens=2048)
    dout = torch.randn_like(x)
    stock = _fwd_bwd(block, x, dout)
    report = novatune.patch(model)
    assert len(report.replaced("moe_experts")) == 1
    ours = _fwd_bwd(block, x, dout)
    names = ("out", "dx", "d gate_up", "d down", "d router")
    with torch.no_grad():
        logits = x.view(-1, 2048) @ block.gate.weight.T
        w, ids = R.route_ref(logits, 8, renormalize=True)
        ref = R.experts_ref(x.view(-1, 2048), ids, w, block.experts.gate_up_proj, block.experts.down_proj)
    assert_close(ours[0].view(-1, 2048), ref, 2e-2, "out vs fp32 oracle")
    for name, a, b in zip(names, ours, stock):
        err = rel_err(a, b)
        assert err <= 2e-2, f"{name}: {err:.3e} vs HF grouped_mm"


def test_experts_without_tokens_get_zero_weight_gradients():
    """Experts that receive no token: their gate_up and down gradients are exactly zero (the grouped GEMM's
    weight gradient of an empty group), and the others match the fp32 oracle."""
    from novatune.ops.moe import moe_experts

    gen = torch.Generator(device="cuda").manual_seed(3)
    t, h, i, e, k = 1024, 2048, 768, 128, 8
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    ids = torch.stack([torch.randperm(e // 2, device="cuda", generator=gen)[:k] for _ in range(t)])  # half unused
    w = torch.rand(t, k, device="cuda", generator=gen).to(torch.bfloat16)
    gu = (torch.randn(e, 2 * i, h, device="cuda", generator=gen) / h ** 0.5).to(torch.bfloat16).requires_grad_()
    dn = (torch.randn(e, h, i, device="cuda", generator=gen) / i ** 0.5).to(torch.bfloat16).requires_grad_()
    out = moe_experts(x, ids, w, gu, dn)
    out.backward(torch.randn_like(out))
    assert torch.equal(gu.grad[e // 2:], torch.zeros_like(gu.grad[e // 2:]))
    assert torch.equal(dn.grad[e // 2:], torch.zeros_like(dn.grad[e // 2:]))
    assert_close(out.float(), R.experts_ref(x, ids, w, gu, dn), 2e-2, "out")
