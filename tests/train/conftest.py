"""Fixtures for trainer tests: a tiny Qwen3 (2 layers, hidden 32) on a slice of the demo data, CPU fp32."""
from __future__ import annotations

import copy
import json

import pytest

from novatune.train.config import from_dict
from novatune.train.config_checks import validate
from novatune.train.demo import make_records

TINY_ARCH = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16)


@pytest.fixture(scope="session")
def chat_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "chat.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in make_records(96, seed=1)))
    return p


@pytest.fixture
def make_cfg(tmp_path, chat_file):
    """make_cfg(out="name", **section_overrides) -> a validated Config writing under tmp_path/out."""

    def make(out: str = "run", **sections):
        raw = {
            "model": {"arch": "qwen3-tiny", "arch_overrides": dict(TINY_ARCH), "tokenizer": "demo", "patch": False,
                      "device": "cpu", "dtype": "fp32"},
            "data": {"sources": [{"path": str(chat_file)}], "format": "messages", "loss_on": "assistant",
                     "max_length": 128},
            "train": {"max_steps": 4, "micro_batch": 2, "grad_accum": 2, "lr": 3e-3, "warmup": 1, "seed": 0},
            "checkpoint": {"output_dir": str(tmp_path / out), "save_every": 0, "keep": 2},
            "logging": {"every": 1, "progress": False, "tensorboard": False},
        }
        for sec, vals in sections.items():
            raw.setdefault(sec, {}).update(copy.deepcopy(vals))
        return validate(from_dict(raw))

    return make
