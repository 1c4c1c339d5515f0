"""Cache keys change with the device and every version; round trip; a corrupt file is handled, not crashed on."""
from __future__ import annotations

import json

import pytest
import torch

from novatune.tune.cache import (
    CacheError,
    TuneCache,
    entry_key,
    environment,
    selection_from_cache,
)

ENV = {"device": "NVIDIA H200", "capability": "9.0", "torch": "2.11.0+cu130", "triton": "3.6.0", "cuda": "13.0",
       "novatune": "0.1.0"}


def entry(env, op="rms_norm", shape=(4096, 2560), dtype="bfloat16/bfloat16", choice="cuda_v1", params=None):
    return {"op": op, "shape": list(shape), "dtype": dtype, "layout": "rows contiguous", "env": env,
            "choice": choice, "params": params or {}, "kept": True, "chosen_us": 28.0, "reason": "test",
            "candidates": [{"name": choice, "errors": {"4096x2560:out": 1e-3}}]}


@pytest.mark.parametrize("field,value", [("device", "NVIDIA H100 80GB HBM3"), ("capability", "8.0"),
                                         ("torch", "2.12.0"), ("triton", "3.7.0"), ("cuda", "12.8"),
                                         ("novatune", "0.2.0")])
def test_key_changes_with_device_and_versions(field, value):
    base = entry_key("rms_norm", (4096, 2560), "bfloat16/bfloat16", "rows contiguous", ENV)
    assert entry_key("rms_norm", (4096, 2560), "bfloat16/bfloat16", "rows contiguous",
                     dict(ENV, **{field: value})) != base


def test_key_changes_with_op_shape_dtype_layout():
    k = lambda *a: entry_key(*a, ENV)  # noqa: E731
    keys = {k("rms_norm", (4096, 2560), "bfloat16/bfloat16", "rows contiguous"),
            k("swiglu", (4096, 2560), "bfloat16/bfloat16", "rows contiguous"),
            k("rms_norm", (4097, 2560), "bfloat16/bfloat16", "rows contiguous"),
            k("rms_norm", (4096, 2560), "float32/float32", "rows contiguous"),
            k("rms_norm", (4096, 2560), "bfloat16/bfloat16", "strided")}
    assert len(keys) == 5


def test_environment_of_the_cpu_has_versions():
    env = environment("cpu")
    assert env["device"] == "cpu" and env["capability"] is None and env["torch"] == torch.__version__


def test_round_trip(tmp_path):
    c = TuneCache(tmp_path / "c.json")
    key = c.put(entry(ENV))
    c.save()
    back = TuneCache.load(tmp_path / "c.json")
    assert back.entries[key]["choice"] == "cuda_v1"
    assert back.get("rms_norm", [4096, 2560], "bfloat16/bfloat16", "rows contiguous", ENV)["chosen_us"] == 28.0
    assert back.get("rms_norm", [4096, 2560], "bfloat16/bfloat16", "rows contiguous",
                    dict(ENV, device="NVIDIA A100")) is None
    assert back.matching(ENV) and not back.matching(dict(ENV, torch="2.12.0"))


@pytest.mark.parametrize("text", ["{not json", json.dumps({"format": 99, "entries": {}}), json.dumps([1, 2])])
def test_corrupt_file_raises_a_clear_error_and_can_be_moved_aside(tmp_path, text):
    p = tmp_path / "c.json"
    p.write_text(text)
    with pytest.raises(CacheError, match="c.json"):
        TuneCache.load(p)
    cache, note = TuneCache.load_or_reset(p)
    assert cache.entries == {} and "moved aside" in note
    assert not p.exists() and len(list(tmp_path.glob("c.json.corrupt-*"))) == 1


def test_selection_from_cache_uses_matching_kept_entries_and_explains_the_rest(tmp_path):
    env = environment("cpu")
    c = TuneCache(tmp_path / "c.json")
    c.put(entry(env, shape=(6, 8), dtype="float32/float32", choice="torch_native"))
    c.put(entry(env, op="swiglu", shape=(6, 8), dtype="float32", choice="triton_v0", params={"block": 1}))
    c.put(entry(dict(env, torch="0.0"), shape=(7, 8), dtype="float32/float32", choice="torch_native"))
    table, used, notes = selection_from_cache(c, "cpu")
    assert list(table) == [("rms_norm", (6, 8), "float32/float32", "cpu")]
    assert [e["choice"] for e in used] == ["torch_native"]
    assert len(notes) == 1 and "triton_v0" in notes[0] and "default used" in notes[0]
