"""`novatune eval`: answer extraction, prompts, the Wilson interval, output-token counting, and real generation runs
of a tiny random model on the bundled sample (CPU, a few problems, a few new tokens: well under 30 s)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from novatune.eval.exact_match import (
    SAMPLE,
    EvalError,
    EvalSettings,
    build_prompt,
    clean_solution,
    evaluate,
    extract_answer,
    generate_batch,
    gold_answer,
    is_correct,
    load_model,
    load_problems,
    normalize_number,
    output_length,
    pick_shots,
    resolve_model_dir,
    wilson_interval,
)


@pytest.mark.parametrize("text,want", [
    ("48 + 36 = 84 muffins.\n#### 84", "84"),
    ("The total is 1,275 books.\n#### 1,275", "1275"),  # thousands separators
    ("So she pays $18.00 in total. The answer is $18.00.", "18"),  # dollars, trailing zeros and period
    ("The answer is: 3.50", "3.5"),
    ("It was -4 degrees, then -4 + 18 = 14.", "14"),  # last number
    ("It drops to -7 degrees.", "-7"),  # negative answer
    ("#### 72\nThe answer is 5", "72"),  # '####' wins over a later 'answer is'
    ("The answer is 12 apples, 3 each.", "12"),  # 'answer is' wins over the last number
    ("Each gets 15.\n\nQuestion: A box holds 99 pens", "15"),  # cut at the next few-shot question
    ("no digits here", None),
    ("", None),
])
def test_extract_answer(text, want):
    assert extract_answer(text) == want


def test_normalize_and_compare():
    assert normalize_number("400") == "400"  # not Decimal's 4E+2
    assert normalize_number("-0.0") == "0"
    assert normalize_number("1,234.500") == "1234.5"
    assert normalize_number("abc") is None
    assert is_correct("18", "18") and is_correct("18.0", "18") and not is_correct("19", "18")
    assert not is_correct(None, "18")
    assert gold_answer("blah <<2*3=6>>6\n#### 6") == "6"
    with pytest.raises(EvalError, match="####"):
        gold_answer("no final line")


def test_wilson_interval_known_values():
    # published Wilson 95% intervals: 0/10 -> (0, 0.2775), 5/10 -> (0.2366, 0.7634), 10/10 -> (0.7225, 1)
    lo, hi = wilson_interval(0, 10)
    assert lo == 0 and hi == pytest.approx(0.2775, abs=1e-4)
    lo, hi = wilson_interval(5, 10)
    assert (lo, hi) == (pytest.approx(0.2366, abs=1e-4), pytest.approx(0.7634, abs=1e-4))
    lo, hi = wilson_interval(10, 10)
    assert lo == pytest.approx(0.7225, abs=1e-4) and hi == 1.0
    # 47/50: centre pulled towards 1/2, interval inside (0, 1) and containing the estimate
    lo, hi = wilson_interval(47, 50)
    assert lo < 0.94 < hi and hi < 1 and math.isclose(lo, 0.8378, abs_tol=1e-3)


def test_sample_file_and_prompt():
    probs = load_problems(SAMPLE)
    assert len(probs) >= 20 and all(p["gold"] for p in probs)
    q = probs[0]["question"]
    shots = pick_shots(probs, q, 4)
    assert len(shots) == 4 and all(s["question"] != q for s in shots)  # never its own solution
    prompt = build_prompt(q, shots)
    assert prompt.count("Question:") == 5 and prompt.endswith(f"Question: {q}\nAnswer:")
    assert "<<" not in prompt and f"#### {shots[0]['gold']}" in prompt  # annotations gone, final line kept
    assert clean_solution("a <<1+1=2>>2\n#### 2") == "a 2\n#### 2"
    with pytest.raises(EvalError, match="k-shot"):
        pick_shots(probs[:3], q, 4)


def test_load_problems_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no final"}) + "\n")
    with pytest.raises(EvalError, match="bad.jsonl:1"):
        load_problems(bad)
    with pytest.raises(EvalError, match="not a file"):
        load_problems(tmp_path / "missing.jsonl")
    for limit in (0, -3):  # not "the first problem" nor "all but 3"
        with pytest.raises(EvalError, match=f"--limit {limit}: evaluate at least 1 problem"):
            load_problems(SAMPLE, limit)


@pytest.fixture(scope="module")
def tiny():
    model, tok, desc = load_model(None, "qwen3-tiny", "demo", device="cpu", arch_overrides={"num_hidden_layers": 2})
    return model, tok, desc


def test_output_length_counts_to_eos_or_stop(tiny):
    _, tok, _ = tiny
    ids = tok("5 + 7 = 12\n#### 12\n\nQuestion: next one", add_special_tokens=False)["input_ids"]
    n, text = output_length(ids, {tok.eos_token_id}, tok, ("Question:",))
    assert "Question:" in tok.decode(ids[:n]) and "Question:" not in tok.decode(ids[:n - 1])
    assert extract_answer(text) == "12"
    body = tok("#### 3", add_special_tokens=False)["input_ids"]
    padded = body + [tok.eos_token_id] + [tok.pad_token_id] * 5  # how HF pads a finished sequence
    n, text = output_length(padded, {tok.eos_token_id}, tok, ("Question:",))
    assert n == len(body) + 1 and text == "#### 3"


def test_left_padded_batch_matches_single_prompt(tiny):
    """Greedy tokens of a short prompt are the same alone and left-padded beside a longer one (fp32)."""
    model, tok, _ = tiny
    tok.padding_side = "left"
    short, long = "Question: 2 + 2?\nAnswer:", "Question: " + "a very long question " * 8 + "\nAnswer:"
    alone, _ = generate_batch(model, tok, [short], 6, (), True, [tok.eos_token_id])
    both, _ = generate_batch(model, tok, [long, short], 6, (), True, [tok.eos_token_id])
    assert both[1][:len(alone[0])] == alone[0]


def test_evaluate_tiny_random_model(tiny):
    model, tok, _ = tiny
    probs = load_problems(SAMPLE, limit=4)
    res = evaluate(model, tok, probs, load_problems(SAMPLE), EvalSettings(k_shot=2, batch_size=3, max_new_tokens=6))
    assert res["n"] == 4 and res["requests"] == 4 and len(res["problems"]) == 4
    assert all(1 <= p["output_tokens"] <= 6 for p in res["problems"])
    assert res["gen_tokens"] == sum(p["output_tokens"] for p in res["problems"])
    assert res["gen_tokens_per_s"] == pytest.approx(res["gen_tokens"] / res["gen_time_s"], rel=1e-3)
    assert res["ci95"] == [round(x, 4) for x in wilson_interval(res["correct"], 4)]
    assert sorted({p["batch_size"] for p in res["problems"]}) == [1, 3]  # 4 requests in batches of 3 and 1
    assert [p["index"] for p in res["problems"]] == [0, 1, 2, 3]  # file order restored


def test_cli_eval_on_export_dir(tmp_path, tiny):
    """A novatune run folder (its final/ export) evaluates through the CLI and writes the result JSON."""
    from novatune.commands.cli import main

    model, tok, _ = tiny
    model.save_pretrained(tmp_path / "run" / "final")
    tok.save_pretrained(tmp_path / "run" / "final")
    assert resolve_model_dir(str(tmp_path / "run")) == (tmp_path / "run" / "final", "export")
    out = tmp_path / "eval.json"
    rc = main(["eval", "--model", str(tmp_path / "run"), "--limit", "2", "--k-shot", "1", "--max-new-tokens", "4",
               "--device", "cpu", "--repeat", "2", "--label", "after", "--output", str(out),
               "--results", str(tmp_path / "rows.jsonl")])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["task"] == "gsm8k" and res["label"] == "after" and res["kind"] == "export"
    assert res["n"] == 2 and res["requests"] == 4  # repeat: accuracy over the first copy only
    row = json.loads((tmp_path / "rows.jsonl").read_text().splitlines()[0])
    assert row["bench"] == "eval" and row["gen_tokens"] == res["gen_tokens"] and "torch" in row
    with pytest.raises(EvalError, match="neither"):
        resolve_model_dir(str(tmp_path))
    adapter = tmp_path / "lora" / "final" / "adapter"  # a LoRA export's adapter folder: points at merged/
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text("{}")
    (tmp_path / "lora" / "final" / "merged").mkdir()
    with pytest.raises(EvalError, match="LoRA adapter only .* give .*merged"):
        resolve_model_dir(str(adapter))
    assert main(["eval", "--model", str(tmp_path / "run"), "--arch", "qwen3-tiny", "--device", "cpu"]) == 2


def test_checkpoint_folder_loads_trained_weights(tmp_path):
    """A run folder with only checkpoints: eval rebuilds the model from the saved config and loads its weights."""
    from safetensors.torch import load_file

    from novatune.commands.cli import main

    run = tmp_path / "run"
    assert main(["train", "--output-dir", str(run), "--set", "train.max_steps=1", "--set", "checkpoint.save_every=1",
                 "--set", "checkpoint.export=false", "--set", "model.patch=false", "--set", "logging.tensorboard=false",
                 "--set", "logging.progress=false", "--set", "data.sources.0.limit=40"]) == 0
    folder, kind = resolve_model_dir(str(run))
    assert kind == "checkpoint" and folder.name == "step_00000001"
    model, _, desc = load_model(str(run), None, None, device="cpu")
    saved = load_file(str(folder / "weights.safetensors"))
    params = dict(model.named_parameters())
    for name in list(saved)[:5]:
        assert torch.equal(params[name].detach(), saved[name]), name
    assert model.config.use_cache and desc["kind"] == "checkpoint"


def test_lora_checkpoint_of_a_patched_run_loads_through_the_run_builder(tmp_path, monkeypatch, reference_backend):
    """A LoRA run trained with the patch and checkpointing: eval rebuilds it with the trainer's builder (LoRA
    wrapped as in training, patch and checkpointing left out for decoding) and merges the trained adapters:
    each merged weight is W + (alpha / r) B A, W the seeded init (which --arch rebuilds: the same builder)."""
    from safetensors.torch import load_file

    from novatune.commands.cli import main

    reference_backend()  # the patched ops' PyTorch references: fast on a CPU
    run = tmp_path / "run"
    assert main(["train", "--output-dir", str(run), "--set", "train.max_steps=1", "--set", "checkpoint.save_every=1",
                 "--set", "checkpoint.export=false", "--set", "method.type=lora", "--set", "method.r=4",
                 "--set", "method.alpha=8", "--set", "train.lr=0.05", "--set", "memory.gradient_checkpointing=true",
                 "--set", "logging.tensorboard=false", "--set", "logging.progress=false",
                 "--set", "data.sources.0.limit=40"]) == 0
    folder, _ = resolve_model_dir(str(run))
    model, _, desc = load_model(str(run), None, None, device="cpu")
    assert type(model).__name__ == "Qwen3ForCausalLM" and not model.is_gradient_checkpointing
    saved = load_file(str(folder / "weights.safetensors"))
    params = dict(model.named_parameters())
    init = dict(load_model(None, "qwen3-tiny", "demo", device="cpu", seed=0)[0].named_parameters())
    keys = [k for k in saved if ".lora_B." in k]
    assert keys and any(saved[k].abs().max() > 0 for k in keys)  # one step at lr 0.05 moved the adapters
    for kb in keys:
        prefix = kb.split(".lora_B.")[0]
        w0 = init[prefix.replace("base_model.model.", "", 1) + ".weight"].detach()
        delta = (8 / 4) * saved[kb] @ saved[kb.replace(".lora_B.", ".lora_A.")]
        name = prefix.replace("base_model.model.", "", 1) + ".weight"
        torch.testing.assert_close(params[name].detach(), w0 + delta, rtol=1e-5, atol=1e-6)
    assert model.config.use_cache and desc["kind"] == "checkpoint"


def test_damaged_checkpoint_is_refused_like_a_resume(tmp_path, capsys):
    """A checkpoint whose weights were changed after saving (a NaN written in) fails its checksum: eval exits 2
    naming the damage instead of evaluating it."""
    from safetensors.torch import load_file, save_file

    from novatune.commands.cli import main

    run = tmp_path / "run"
    assert main(["train", "--output-dir", str(run), "--set", "train.max_steps=1", "--set", "checkpoint.save_every=1",
                 "--set", "checkpoint.export=false", "--set", "model.patch=false", "--set", "logging.tensorboard=false",
                 "--set", "logging.progress=false", "--set", "data.sources.0.limit=40"]) == 0
    folder, _ = resolve_model_dir(str(run))
    weights = load_file(str(folder / "weights.safetensors"))
    name = next(iter(weights))
    weights[name].view(-1)[0] = float("nan")
    save_file(weights, str(folder / "weights.safetensors"), metadata={"step": "1"})
    capsys.readouterr()
    assert main(["eval", "--model", str(run), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "damaged" in err and str(folder) in err


def test_attention_that_cannot_run_here_is_an_eval_error(monkeypatch):
    """--attn flash_attention_2 without flash-attn (or an unknown name) raised from deep inside transformers."""
    import transformers.utils

    from novatune.eval.exact_match import load_model

    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: False)
    with pytest.raises(EvalError, match="--attn=flash_attention_2: flash-attn .* not installed.*use sdpa"):
        load_model(None, "qwen3-tiny", None, device="cpu", attn="flash_attention_2")
    with pytest.raises(EvalError, match="--attn 'bogus': choose one of sdpa"):
        load_model(None, "qwen3-tiny", None, device="cpu", attn="bogus")


def test_a_training_config_naming_missing_flash_attention_is_a_setup_error(monkeypatch):
    import transformers.utils

    from novatune.train.config import ModelConfig
    from novatune.train.model import SetupError, build_model

    monkeypatch.setattr(transformers.utils, "is_flash_attn_3_available", lambda: False)
    with pytest.raises(SetupError, match="model.attention=flash_attention_3"):
        build_model(ModelConfig(arch="qwen3-tiny", arch_overrides={"vocab_size": 64}, attention="flash_attention_3"),
                    torch.device("cpu"), torch.float32)
