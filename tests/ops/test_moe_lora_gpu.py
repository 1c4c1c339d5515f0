"""LoRA on the routed experts on a GPU at Qwen3-30B-A3B's shapes (hidden 2048, 128 experts, top-8, expert
intermediate 768, r 16 on gate/up and down, bf16 weights, fp32 adapters as PEFT keeps them): no host sync in the
forward or the backward, and bf16 results against the fp32 truth, with PEFT's stock bf16 (W + s * B A formed in
bf16, then HF's grouped_mm experts) as the yardstick.

Tolerance: the op's error against the fp32 truth must not exceed twice stock's own (both round h, the activation,
y and the output to bf16; stock also rounds the adapted weight, the op the thin (S, r) products) plus 1e-3, and
stays under the base op's 2e-2 (tests/ops/test_moe_gpu.py)."""
import pytest
import torch
import transformers

import novatune
from novatune.measure.numerics import rel_err
from novatune.reference import moe as R

pytestmark = pytest.mark.gpu
peft = pytest.importorskip("peft")
E, H, INTER, K, RANK, SCALING = 128, 2048, 768, 8, 16, 2.0


def _adapted_block(seed=0):
    cfg = transformers.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=INTER, num_experts=E, num_experts_per_tok=K,
                                      norm_topk_prob=True, num_hidden_layers=1, num_attention_heads=32,
                                      num_key_value_heads=4, head_dim=128, vocab_size=1024, use_cache=False)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().train()
    model.set_experts_implementation("grouped_mm")
    pm = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=SCALING * RANK, target_modules=[],
                                                    target_parameters=["mlp.experts.gate_up_proj",
                                                                       "mlp.experts.down_proj"]))
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    adapters = {}
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                assert p.dtype == torch.float32, "PEFT keeps adapters in fp32 over a bf16 model"
                fan_in = p.shape[1] if "lora_A" in name else RANK
                p.copy_(torch.randn(p.shape, device="cuda", generator=gen) / fan_in ** 0.5)
                adapters[name] = p
    return pm, pm.base_model.model.model.layers[0].mlp.experts, adapters


def _inputs(tokens, seed=2):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, H, device="cuda", generator=gen).to(torch.bfloat16)
    w, ids = R.route_ref(torch.randn(tokens, E, device="cuda", generator=gen), K, renormalize=True)
    return x, ids, w.to(torch.bfloat16)


def _fwd_bwd(wrapper, adapters, x, ids, w, dout):
    xg = x.detach().requires_grad_()
    for p in adapters.values():
        p.grad = None
    out = wrapper(xg, ids, w)
    out.backward(dout)
    return [out.detach(), xg.grad] + [p.grad.clone() for p in adapters.values()]


def _truth(wrapper, adapters, x, ids, w, dout):
    """The fp32 oracle on fp32 copies: each adapted weight formed in fp32, the per-expert MLP, autograd."""
    names = list(adapters)
    leaves = {n: adapters[n].detach().float().requires_grad_() for n in names}
    xf = x.float().requires_grad_()
    experts = wrapper.base_layer.base_layer
    factors = {}
    for wrap in (wrapper, wrapper.base_layer):
        pref = "base_layer." if wrap is wrapper.base_layer else ""
        a = next(v for n, v in leaves.items() if n.endswith(f"experts.{pref}lora_A.default.weight"))
        b = next(v for n, v in leaves.items() if n.endswith(f"experts.{pref}lora_B.default.weight"))
        factors[wrap.parameter_name] = (a.view(E, RANK, -1), b.view(b.shape[0], RANK, E).permute(2, 0, 1))
    gu = R.lora_weight_ref(experts.gate_up_proj, *factors["gate_up_proj"], SCALING)
    dn = R.lora_weight_ref(experts.down_proj, *factors["down_proj"], SCALING)
    out = R.experts_ref(xf, ids, w.float(), gu, dn)
    grads = torch.autograd.grad(out, [xf] + [leaves[n] for n in names], dout.float())
    return [out.detach(), *grads]


def test_lora_experts_bf16_against_fp32_truth_with_stock_as_yardstick():
    pm, wrapper, adapters = _adapted_block()
    x, ids, w = _inputs(2048)
    dout = torch.randn(x.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(5))
    dout = dout.to(torch.bfloat16)
    stock = _fwd_bwd(wrapper, adapters, x, ids, w, dout)
    truth = _truth(wrapper, adapters, x, ids, w, dout)
    report = novatune.patch(pm)
    assert len(report.replaced("moe_lora")) == 1
    ours = _fwd_bwd(wrapper, adapters, x, ids, w, dout)
    names = ["out", "dx"] + list(adapters)
    for name, o, s, t in zip(names, ours, stock, truth):
        ours_err, stock_err = rel_err(o, t), rel_err(s, t)
        assert ours_err <= 2 * stock_err + 1e-3 and ours_err < 2e-2, \
            f"{name}: {ours_err:.3e} vs fp32 truth (stock bf16: {stock_err:.3e})"


def test_lora_experts_forward_backward_without_host_sync():
    pm, wrapper, adapters = _adapted_block()
    novatune.patch(pm)
    x, ids, w = _inputs(4096)
    dout = torch.randn_like(x)
    _fwd_bwd(wrapper, adapters, x, ids, w, dout)  # warm-up: Triton compiles, allocator grows
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _fwd_bwd(wrapper, adapters, x, ids, w, dout)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
