"""model.arch_overrides (and eval's --arch-set): an unknown key or unsplittable head counts fail at once, naming
the key and the fix, instead of training the default or failing at the first forward."""
from __future__ import annotations

import pytest

from novatune.eval.exact_match import EvalError, load_model
from novatune.train.arch import arch_config
from novatune.train.config import ModelConfig
from novatune.train.model import SetupError, model_config


def test_unknown_override_suggests_the_field():
    with pytest.raises(ValueError, match="'num_hidden_layer' is not a field.*did you mean 'num_hidden_layers'"):
        arch_config("qwen3-tiny", {"num_hidden_layer": 2}, vocab_size=501)
    assert arch_config("qwen3-tiny", {"num_hidden_layers": 2}, vocab_size=501).num_hidden_layers == 2


def test_heads_that_do_not_split_are_refused():
    mcfg = ModelConfig(arch="qwen3-tiny", arch_overrides={"hidden_size": 64, "num_attention_heads": 3,
                                                                "vocab_size": 501})
    with pytest.raises(SetupError, match="num_attention_heads 3 is not a multiple of num_key_value_heads 2"):
        model_config(mcfg)


def test_eval_arch_set_is_checked_too():
    with pytest.raises(EvalError, match="did you mean 'num_hidden_layers'"):
        load_model(None, "qwen3-tiny", "demo", device="cpu", arch_overrides={"num_hidden_layer": 2})
