"""memory.lm_head_grad_in_forward through the run builder (CPU, fp32, novatune.patch's fused loss): the session
promises the loss its grad_output, the accumulating micro-steps add lm_head's gradient into .grad in the forward,
and the run trains as without it (fp32: the summation order only); the plan counts a token chunk's logits, not the
full ones."""
from __future__ import annotations

import importlib

import pytest
import torch

from tests.train.conftest import TINY_ARCH

UNTIED = {"patch": True, "arch_overrides": {**TINY_ARCH, "tie_word_embeddings": False}}

# the module itself (the package's `linear_cross_entropy` attribute is the function)
ops_lce = importlib.import_module("novatune.ops.linear_cross_entropy")


def _train(make_cfg, name, on: bool, steps=3):
    from novatune.train.session import build

    s = build(make_cfg(name, model=UNTIED, memory={"lm_head_grad_in_forward": on}, train={"grad_accum": 3}))
    losses, first_grads = [], None
    for _ in range(steps):
        losses.append(s.forward_backward(s.next_micro_batches()).loss.item())
        if first_grads is None:  # the first step's gradients: the same weights on both sides
            first_grads = {n: p.grad.clone() for n, p in s.inner_model.named_parameters()}
        s.apply_update()
    return losses, {n: p.detach().clone() for n, p in s.inner_model.named_parameters()}, first_grads


def test_the_promise_trains_as_the_backward_does(make_cfg, monkeypatch):
    used = []
    real = ops_lce._LossIntoGrad.apply
    monkeypatch.setattr(ops_lce._LossIntoGrad, "apply", lambda *a: used.append(1) or real(*a))
    off_losses, off_w, off_g = _train(make_cfg, "off", False)
    assert used == []
    on_losses, on_w, on_g = _train(make_cfg, "on", True)
    assert len(used) == 3 * 2  # micro-steps 2 and 3 of each step (the first has no .grad to add into)
    assert on_losses == pytest.approx(off_losses, rel=1e-6)
    for n in off_g:  # fp32: the summation order only
        torch.testing.assert_close(on_g[n], off_g[n], rtol=1e-5, atol=1e-8, msg=lambda m, n=n: f"grad {n}: {m}")
    for n in off_w:
        # AdamW divides by sqrt(v): near-zero gradient entries turn fp32 summation noise into up to ~1e-6 of weight
        torch.testing.assert_close(on_w[n], off_w[n], rtol=1e-5, atol=5e-6, msg=lambda m, n=n: f"{n}: {m}")
    assert not ops_lce.promise_broken()


def test_the_plan_counts_one_chunk_of_logits(make_cfg):
    from novatune.train.memory import loss_transient_bytes
    from novatune.train.model import model_config

    big = {**UNTIED, "device": "cuda", "dtype": "bf16", "arch_overrides": {**UNTIED["arch_overrides"],
                                                                          "hidden_size": 2048, "vocab_size": 151_936}}
    on = make_cfg("p_on", model=big, data={"max_length": 4096}, train={"micro_batch": 1, "grad_accum": 4})
    off = make_cfg("p_off", model=big, data={"max_length": 4096}, train={"micro_batch": 1, "grad_accum": 4},
                   memory={"lm_head_grad_in_forward": False})
    mconf = model_config(on.model, None, None)
    assert loss_transient_bytes(on, mconf, into_grad=True) == 832 * 151_936 * 2  # one chunk of 256 MiB at most
    assert loss_transient_bytes(off, mconf) == 4096 * 151_936 * 2  # the in-place mode's full logits
    from novatune.train.plan import plan

    def planned(cfg):
        mp = plan(cfg, gpu_mem_gib=141)["memory_plan"]
        return mp.lm_head_grad_in_forward, mp.outside_transient_bytes

    assert planned(on) == (False, 4096 * 151_936 * 2)  # auto: the plan fits without it (it costs .grad passes)
    forced = make_cfg("p_true", model=big, data={"max_length": 4096}, train={"micro_batch": 1, "grad_accum": 4},
                      memory={"lm_head_grad_in_forward": True})
    assert planned(forced) == (True, 832 * 151_936 * 2)
    tight = plan(off, gpu_mem_gib=141)["peak"] / 2**30 - 0.5  # 0.5 GiB under the plan without it
    fits = make_cfg("p_tight", model=big, data={"max_length": 4096}, train={"micro_batch": 1, "grad_accum": 4},
                    memory={"budget_gib": tight, "policy": "auto"})
    assert planned(fits)[0]  # auto: it makes the plan fit


def test_asking_for_it_where_it_cannot_run_names_the_fix(make_cfg):
    from novatune.train.config import ConfigError

    for sections, why in (({"parallel": {"strategy": "ddp"}}, "reduces the gradients"),
                          ({"method": {"type": "lora"}}, "do not train lm_head"),
                          ({"train": {"grad_accum": 1}}, "grad_accum is 1"),
                          ({"model": {"patch": False}}, "fused loss does not run"),
                          ({"model": {"patch": True, "patch_options": {"cross_entropy": False}}},
                           "fused loss does not run")):
        with pytest.raises(ConfigError, match=why):
            make_cfg(memory={"lm_head_grad_in_forward": True}, **sections)
