"""memory.embeddings_on_host on the CPU: the module keeps its hooks and computes the same outputs from a host
table through the gather kernel (Triton interpreter); every case it cannot serve is refused with the reason; the
run builder's side is tests/train/test_host_embedding_run.py."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from novatune.memory import host_embedding as he

VOCAB, HIDDEN = 97, 48


def _model(tied=False):
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=24, tie_word_embeddings=tied,
                      use_cache=False)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model.get_input_embeddings().weight.requires_grad_(False)
    return model


def _host(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype)  # poisoned: place_on_host fills it


def test_the_host_table_gives_the_same_logits_and_keeps_the_module_hooks():
    model = _model()
    emb = model.get_input_embeddings()
    ids = torch.randint(0, VOCAB, (2, 13))
    ref = model(input_ids=ids).logits
    seen = []
    emb.register_forward_hook(lambda m, i, o: seen.append(o.shape))  # as PEFT's enable_input_require_grads does
    before = emb.weight
    freed = he.place_on_host(model, pin=_host)
    assert freed == VOCAB * HIDDEN * 4 and he.is_on_host(model)
    assert emb.weight.untyped_storage().data_ptr() != before.untyped_storage().data_ptr()
    assert not emb.weight.requires_grad and torch.equal(emb.weight, before)
    assert torch.equal(model(input_ids=ids).logits, ref)
    assert seen == [(2, 13, HIDDEN)]
    assert "model.embed_tokens.weight" in model.state_dict()  # exports read it as before
    twin = copy.deepcopy(model)  # a copy gathers from its own table
    twin.get_input_embeddings().weight.data.zero_()
    assert torch.equal(model(input_ids=ids).logits, ref) and not torch.equal(twin(input_ids=ids).logits, ref)
    he.restore(model)
    assert not he.is_on_host(model) and "forward" not in emb.__dict__
    assert torch.equal(model(input_ids=ids).logits, ref)
    he.restore(model)  # nothing on the host: nothing to do


@pytest.mark.parametrize("case, match", [
    ("tied", "tied to lm_head"),
    ("trainable", "input embedding trains"),
    ("subclass", "not a plain nn.Embedding"),
    ("max_norm", "max_norm"),
])
def test_tables_it_cannot_serve_are_refused_with_the_reason(case, match):
    model = _model(tied=case == "tied")
    emb = model.get_input_embeddings()
    if case == "trainable":
        emb.weight.requires_grad_(True)
    elif case == "subclass":
        class Scaled(nn.Embedding):
            def forward(self, ids):
                return super().forward(ids) * 2.0
        model.set_input_embeddings(Scaled(VOCAB, HIDDEN))
        model.get_input_embeddings().weight.requires_grad_(False)
    elif case == "max_norm":
        emb.max_norm = 1.0
    with pytest.raises(he.HostEmbeddingRefused, match=match) as e:
        he.place_on_host(model, pin=_host)
    assert "memory.embeddings_on_host: false" in str(e.value)
    assert not he.is_on_host(model)


def test_a_table_off_cuda_is_refused_without_a_test_buffer():
    with pytest.raises(he.HostEmbeddingRefused, match="not a CUDA device"):
        he.place_on_host(_model())
