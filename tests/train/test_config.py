"""Typed config: YAML load, --set overrides, round-trip, and a clear error (key + fix) for every bad case."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from novatune.train.config import Config, ConfigError, apply_overrides, from_dict, load, to_yaml
from novatune.train.config_checks import validate
from novatune.train.demo import demo_config_path

REPO = Path(__file__).resolve().parents[2]


def test_demo_config_loads_and_matches_example():
    cfg = load(None)
    assert cfg.model.arch == "qwen3-tiny" and cfg.data.loss_on == "assistant" and cfg.model.patch
    # examples/demo.yaml is the documented copy of the embedded demo config
    assert (REPO / "examples" / "demo.yaml").read_text() == demo_config_path().read_text()


@pytest.mark.parametrize("name", ["demo.yaml", "qwen3-4b-seed.yaml", "lora.yaml"])
def test_examples_load(name):
    cfg = load(REPO / "examples" / name)
    assert isinstance(cfg, Config)


def test_yaml_round_trip(tmp_path):
    cfg = load(None, ["train.lr=1e-4", "method.type=lora", "method.targets=[q_proj, v_proj]"])
    p = tmp_path / "c.yaml"
    p.write_text(to_yaml(cfg))
    again = from_dict(yaml.safe_load(p.read_text()))
    assert again == cfg


def test_overrides():
    raw = {"data": {"sources": [{"path": "a.jsonl"}]}}
    apply_overrides(raw, ["train.lr=1e-4", "data.sources.0.limit=5", "data.sources.1.type=synthetic",
                          "model.arch_overrides.num_hidden_layers=2", "train.betas=[0.9, 0.95]", "model.name=x=y"])
    cfg = from_dict(raw)
    assert cfg.train.lr == 1e-4 and cfg.train.betas == [0.9, 0.95]
    assert cfg.data.sources[0].limit == 5 and cfg.data.sources[1].type == "synthetic"
    assert cfg.model.arch_overrides == {"num_hidden_layers": 2} and cfg.model.name == "x=y"


def test_gentle_coercions():
    cfg = from_dict({"train": {"lr": "1e-4", "warmup": 10, "epochs": 2.0}, "method": {"targets": "all-linear"}})
    assert cfg.train.lr == 1e-4 and cfg.train.warmup == 10.0 and cfg.train.epochs == 2
    assert cfg.method.targets == ["all-linear"]


def _err(fn) -> str:
    with pytest.raises(ConfigError) as e:
        fn()
    msg = str(e.value)
    assert "fix:" in msg, msg  # every config error says how to fix it
    return msg


def _validate(**sections):
    raw = {"model": {"arch": "qwen3-tiny", "tokenizer": "demo"}, "data": {"sources": [{"type": "synthetic"}]}}
    for k, v in sections.items():
        raw.setdefault(k, {}).update(v)
    return validate(from_dict(raw))


def test_unknown_key_names_it_and_suggests():
    msg = _err(lambda: from_dict({"train": {"schedul": "cosine"}}))
    assert "train.schedul" in msg and "'schedule'" in msg
    msg = _err(lambda: from_dict({"trian": {}}))
    assert "trian" in msg and "'train'" in msg
    msg = _err(lambda: from_dict({"data": {"sources": [{"pth": "x"}]}}))
    assert "data.sources[0].pth" in msg and "'path'" in msg


def test_wrong_type():
    msg = _err(lambda: from_dict({"train": {"lr": "fast"}}))
    assert "train.lr" in msg and "a number" in msg
    msg = _err(lambda: from_dict({"train": {"micro_batch": 1.5}}))
    assert "train.micro_batch" in msg and "integer" in msg
    msg = _err(lambda: from_dict({"data": {"packing": "yes"}}))
    assert "data.packing" in msg and "true or false" in msg
    msg = _err(lambda: from_dict({"train": "fast"}))
    assert "train" in msg and "mapping" in msg


def test_bad_enum():
    msg = _err(lambda: from_dict({"train": {"schedule": "cosin"}}))
    assert "train.schedule" in msg and "'cosine'" in msg and "linear" in msg
    msg = _err(lambda: from_dict({"data": {"loss_on": "assistants"}}))
    assert "data.loss_on" in msg and "assistant" in msg
    msg = _err(lambda: from_dict({"method": {"type": "qlroa"}}))  # qlora is a method since issue 6
    assert "method.type" in msg and "'qlora'" in msg
    msg = _err(lambda: from_dict({"memory": {"tiled_mlp": "sometimes"}}))
    assert "memory.tiled_mlp" in msg and "auto, True, False" in msg
    msg = _err(lambda: from_dict({"model": {"low_memory_load": "yes"}}))
    assert "model.low_memory_load" in msg and "true or false" in msg


def test_missing_data_path(tmp_path):
    msg = _err(lambda: _validate(data={"sources": [{"path": str(tmp_path / "nope.jsonl")}]}))
    assert "data.sources[0].path" in msg and "not found" in msg
    msg = _err(lambda: _validate(data={"sources": [{"type": "jsonl"}]}))
    assert "data.sources[0].path" in msg and "missing" in msg
    msg = _err(lambda: _validate(data={"sources": []}))
    assert "data.sources" in msg


def test_max_length_too_small():
    msg = _err(lambda: _validate(data={"max_length": 4}))
    assert "data.max_length" in msg and "too small" in msg


@pytest.mark.parametrize("sections,key", [
    ({"model": {"name": "x"}}, "model"),  # both name and arch
    ({"model": {"arch": None}}, "model"),  # neither
    ({"model": {"arch": "qwen3-4B"}}, "model.arch"),
    ({"model": {"tokenizer": None}}, "model.tokenizer"),  # qwen3-tiny takes its vocab from a tokenizer
    ({"data": {"format": "text", "loss_on": "assistant"}}, "data.loss_on"),
    ({"data": {"format": "messages"}}, "data.format"),  # synthetic sources are pre-tokenized
    ({"train": {"micro_batch": 0}}, "train.micro_batch"),
    ({"train": {"grad_accum": 0}}, "train.grad_accum"),
    ({"train": {"lr": 0}}, "train.lr"),
    ({"train": {"max_steps": 0}}, "train.max_steps"),
    ({"train": {"warmup": -1}}, "train.warmup"),
    ({"train": {"betas": [0.9]}}, "train.betas"),
    ({"method": {"type": "lora", "r": 0}}, "method.r"),
    ({"method": {"type": "lora", "dropout": 1.5}}, "method.dropout"),
    ({"checkpoint": {"keep": 0}}, "checkpoint.keep"),
    ({"checkpoint": {"resume": "/no/such/checkpoint"}}, "checkpoint.resume"),
    ({"logging": {"every": 0}}, "logging.every"),
    ({"memory": {"tiled_mlp": True}, "model": {"patch": False}}, "memory.tiled_mlp"),
    ({"model": {"patch_options": {"tiled_mlp": True}}}, "model.patch_options.tiled_mlp"),
])
def test_cross_field_errors(sections, key):
    msg = _err(lambda: _validate(**sections))
    assert f"at {key}:" in msg


def test_bad_override_and_file(tmp_path):
    msg = _err(lambda: apply_overrides({}, ["train.lr"]))
    assert "key.path=value" in msg
    msg = _err(lambda: apply_overrides({"data": {"sources": []}}, ["data.sources.3.path=x"]))
    assert "data.sources.3" in msg
    msg = _err(lambda: load(tmp_path / "missing.yaml"))
    assert "not found" in msg
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {lr: [1, 2\n")
    msg = _err(lambda: load(bad))
    assert "not valid YAML" in msg



@pytest.mark.parametrize("section,field,value", [("train", "max_steps", 2.5), ("train", "max_steps", True),
                                                 ("train", "max_steps", "x"), ("train", "fused_adamw", "false"),
                                                 ("logging", "peak_tflops", True),
                                                 ("method", "quantize_embeddings", 1)])
def test_optional_fields_are_type_checked(section, field, value):
    # `int | None` (types.UnionType) is checked like Optional[int]; a bool is not an integer
    with pytest.raises(ConfigError, match=f"{section}.{field}: expected"):
        from_dict({section: {field: value}})
    with pytest.raises(ConfigError, match=r"data.sources\[0\].limit: expected"):
        from_dict({"data": {"sources": [{"path": "x.jsonl", "limit": 0.5}]}})

def test_integral_float_strings_are_integers():
    assert from_dict({"train": {"max_steps": "1e3"}}).train.max_steps == 1000  # YAML reads 1e3 as a string
    assert from_dict({"train": {"max_steps": 1e3, "epochs": "2"}}).train.epochs == 2
    assert from_dict({"train": {"max_steps": None}}).train.max_steps is None
    with pytest.raises(ConfigError, match="train.max_steps: expected an integer, got 2.5"):
        from_dict({"train": {"max_steps": "2.5e0"}})


def test_non_utf8_config_and_bad_eps_name_the_fix(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_bytes(b"train:\n  max_steps: 2  # \xff\n")
    with pytest.raises(ConfigError, match="not UTF-8 text \\(byte 0xff on line 2\\)"):
        load(p, check=False)
    with pytest.raises(ConfigError, match="train.eps: must be > 0"):
        validate(from_dict({"model": {"arch": "qwen3-tiny", "tokenizer": "demo"}, "train": {"eps": -1},
                            "data": {"sources": [{"type": "synthetic"}]}}))


@pytest.mark.parametrize("key", ["lr", "eps", "weight_decay", "max_grad_norm", "warmup"])
def test_an_infinite_training_number_is_refused(key):
    """`--set train.lr=.inf` passed every range check; one step with it saturates the weights."""
    with pytest.raises(ConfigError, match=f"train.{key}: must be a finite number, got inf"):
        validate(from_dict({"model": {"arch": "qwen3-tiny", "tokenizer": "demo"}, "train": {key: float("inf")},
                            "data": {"sources": [{"type": "synthetic"}]}}))


def test_a_config_whose_top_level_is_a_list_names_the_file(tmp_path):
    p = tmp_path / "list.yaml"
    p.write_text("- model: {}\n")
    with pytest.raises(ConfigError, match="list.yaml holds a list at its top level, not a mapping of sections"):
        load(p, ["checkpoint.output_dir=x"])


def test_streaming_frozen_layers_without_a_recompute_is_refused():
    """Streamed weights come back for a layer's recompute: with memory.policy none nothing is recomputed, and an
    explicit count was ignored (the run trained without streaming)."""
    raw = {"model": {"arch": "qwen3-tiny", "tokenizer": "demo"}, "method": {"type": "lora"},
           "memory": {"stream_frozen_layers": 1}, "data": {"sources": [{"type": "synthetic"}]}}
    with pytest.raises(ConfigError, match="stream_frozen_layers: 1 layers to stream, but no layer is recomputed"):
        validate(from_dict(raw))
    validate(from_dict({**raw, "memory": {"stream_frozen_layers": 1, "policy": "checkpoint"}}))
