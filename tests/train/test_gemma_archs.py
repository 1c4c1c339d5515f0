"""The family architectures for random-init runs (Gemma 2 / 3, and Phi-4-mini and OLMo 2 where named): the real
configs' quirks are there (so `novatune bench examples/gemma-3-4b.yaml` measures the real thing), the patch accepts
them, the stock attention is one that computes the family's attention, and a family without an SDPA attention
asked for one gets a setup error naming the setting to change."""
import pytest
import torch

import novatune
from novatune.train.arch import arch_config, count_matmul_params
from novatune.train.errors import SetupError
from novatune.train.model import _check_attention_supported


def test_gemma_2_2b_and_gemma_3_4b_configs():
    g2 = arch_config("gemma-2-2b")
    assert type(g2).__name__ == "Gemma2Config" and g2.vocab_size == 256000 and g2.head_dim == 256
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping, g2.sliding_window) == (50.0, 30.0, 4096)
    assert g2.layer_types[:2] == ["sliding_attention", "full_attention"]
    assert count_matmul_params(g2) == pytest.approx(2.61e9, rel=0.01)
    g3 = arch_config("gemma-3-4b")
    assert type(g3).__name__ == "Gemma3TextConfig" and g3.vocab_size == 262208 and g3.num_hidden_layers == 34
    assert g3.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"] and g3.sliding_window == 1024
    assert g3.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert g3.rope_parameters["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    assert g3.final_logit_softcapping is None and g3.attn_logit_softcapping is None


@pytest.mark.parametrize("arch", ["gemma-2-2b", "gemma-3-4b", "phi-4-mini", "olmo-2-7b"])
def test_patch_replaces_everything_on_the_cut_architecture(arch):
    """Two layers of the real shapes, built on the meta device (the real vocabulary costs nothing there, and the
    real configs' token ids stay inside it): nothing skipped."""
    import transformers

    from novatune.train.model import resolve_attention

    cfg = arch_config(arch, {"num_hidden_layers": 2})
    cfg._attn_implementation = resolve_attention(cfg, "hf_default")  # the bench's stock attention
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    report = novatune.patch(model)
    assert not report.skipped(), str(report)
    assert len(report.replaced("attention")) == 2 and len(report.replaced("mlp")) == 2


def test_sdpa_on_a_family_without_it_names_the_fix():
    _check_attention_supported(arch_config("gemma-3-4b"), "sdpa")
    _check_attention_supported(arch_config("qwen3-4b"), "sdpa")
    with pytest.raises(SetupError, match="model.attention=eager"):
        _check_attention_supported(arch_config("gemma-2-2b"), "sdpa")


def test_soft_capped_attention_resolves_to_eager_whatever_the_class_declares(monkeypatch):
    """transformers' sdpa raises on soft-capped logits: the stock attention (hf_default) is eager for any config
    that soft-caps (Gemma 2; a Gemma 3 config that sets attn_logit_softcapping; a release whose Gemma 2 class
    lists sdpa), and an explicit sdpa names the fix; the other families keep sdpa."""
    import transformers

    from novatune.train.model import resolve_attention

    g3_capped = arch_config("gemma-3-4b", {"attn_logit_softcapping": 50.0})
    assert resolve_attention(g3_capped, "hf_default") == "eager"
    with pytest.raises(SetupError, match="soft-caps its attention logits at 50.*model.attention=eager"):
        _check_attention_supported(g3_capped, "sdpa")
    monkeypatch.setattr(transformers.Gemma2ForCausalLM, "_supports_sdpa", True)
    assert resolve_attention(arch_config("gemma-2-2b"), "hf_default") == "eager"
    for arch in ("gemma-3-4b", "phi-4-mini", "olmo-2-7b", "qwen3-4b"):
        assert resolve_attention(arch_config(arch), "hf_default") == "sdpa", arch
