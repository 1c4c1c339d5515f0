"""GSM8K-style evaluation by generation: k-shot chain-of-thought prompts, batched greedy decoding, exact match.

Data: JSONL with `question` and `answer`, the answer's last line `#### N` (GSM8K's format). The prompt is k solved
problems then the question, each as `Question: ...\\nAnswer: <reasoning>\\n#### N` (the calculator annotations
`<<48/2=24>>` are removed), ending with `Answer:` (or, with `chat=True`, the same turns through the tokenizer's chat
template). Shots come from the start of the shots file with the evaluated problem itself left out.

Decoding is HF `generate`: greedy (a fresh GenerationConfig, so a checkpoint's sampling defaults or repetition
penalty do not leak in), KV cache on, left padding, stopping at EOS or at the next "Question:" (HF stop_strings).
Requests are batched in order of prompt length (less padding) and results are put back in file order.

Measured, per request: the output tokens (up to and including the EOS or the token completing the stop string;
padding after a finished sequence is not counted) and the latency (the synchronised wall time of the `generate`
call that served it: in a batch every request returns when the batch does). Reported: accuracy with its 95% Wilson
interval, average output tokens, average latency per request, average per-request throughput (output tokens /
latency, the table's "Avg throughput") and the aggregate generated tokens/s (all output tokens / all generate time,
the figure batching raises). One warm-up generate call (a few tokens) runs first and is not timed.

The answer extracted from an output is the number after the first `####`; else the number after the last "answer
is"; else the last number in the text; the text is first cut at the first stop string. Numbers compare by value
(commas, `$`, trailing `.` and `.00` dropped).
"""
from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path

SAMPLE = Path(__file__).resolve().parent.parent / "assets" / "gsm8k_sample.jsonl"
DEFAULT_STOPS = ("Question:",)
_NUM = r"-?\$?\s?\d[\d,]*(?:\.\d+)?"
_ANNOT = re.compile(r"<<[^>]*>>")


class EvalError(ValueError):
    """A bad eval input (file, option); the message names it and the fix."""


# ------------------------------------------------------------------------------------------------- answers
def normalize_number(text: str | None) -> str | None:
    """'1,234.50' -> '1234.5', '$18.' -> '18', '-0' -> '0'; None when it is not a number."""
    if text is None:
        return None
    t = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        d = Decimal(t)
    except InvalidOperation:
        return None
    if not d.is_finite():
        return None
    d = d.normalize()
    if d == 0:
        return "0"
    # normalize() writes 400 as 4E+2: format as a plain decimal
    return format(d, "f")


def gold_answer(answer: str) -> str:
    """The normalized number after the last `####` of a GSM8K answer."""
    if "####" not in answer:
        raise EvalError(f"answer has no '#### N' line: {answer[-80:]!r}")
    tail = answer.rsplit("####", 1)[1].strip()
    n = normalize_number(tail.split()[0]) if tail else None
    if n is None:
        raise EvalError(f"answer's '####' is not followed by a number: {answer[-80:]!r}")
    return n


def cut_at_stop(text: str, stops=DEFAULT_STOPS) -> str:
    """The text before the first stop string (the model starting the next few-shot question)."""
    cut = len(text)
    for s in stops:
        i = text.find(s)
        if i != -1:
            cut = min(cut, i)
    return text[:cut]


def extract_answer(text: str, stops=DEFAULT_STOPS) -> str | None:
    """The model's final number (normalized), or None when there is none."""
    text = cut_at_stop(text, stops)
    m = re.search(r"####\s*(" + _NUM + ")", text)
    if m:
        return normalize_number(m.group(1))
    found = re.findall(r"answer is\s*:?\s*(" + _NUM + ")", text, flags=re.IGNORECASE)
    if found:
        return normalize_number(found[-1])
    nums = re.findall(_NUM, text)
    return normalize_number(nums[-1]) if nums else None


def is_correct(pred: str | None, gold: str) -> bool:
    return pred is not None and Decimal(pred) == Decimal(gold)


def wilson_interval(correct: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval for a binomial proportion (sane at 0/n and n/n, unlike the normal one)."""
    if n <= 0:
        raise ValueError("wilson_interval needs n > 0")
    p = correct / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # at 0/n and n/n the bound is exactly 0 / 1 (rounding would leave 1e-17 / 0.99999...)
    lo = 0.0 if correct == 0 else max(0.0, center - half)
    hi = 1.0 if correct == n else min(1.0, center + half)
    return lo, hi


# ------------------------------------------------------------------------------------------------- prompts
def load_problems(path: str | Path, limit: int | None = None) -> list[dict]:
    """[{question, answer, gold}] from a GSM8K-format JSONL file."""
    p = Path(path)
    if limit is not None and limit < 1:
        raise EvalError(f"--limit {limit}: evaluate at least 1 problem (leave --limit out for all of them)")
    if not p.is_file():
        raise EvalError(f"--data: {p} is not a file; give a GSM8K-format JSONL (question, answer ending '#### N')")
    out = []
    for i, line in enumerate(p.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            q, a = rec["question"], rec["answer"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise EvalError(f"{p}:{i + 1}: not a GSM8K record ({type(e).__name__}: {e}); each line needs "
                            f"'question' and 'answer'") from None
        try:
            gold = gold_answer(a)
        except EvalError as e:
            raise EvalError(f"{p}:{i + 1}: {e}") from None
        out.append({"question": q.strip(), "answer": a.strip(), "gold": gold})
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise EvalError(f"--data: {p} holds no problems")
    return out


def clean_solution(answer: str) -> str:
    """A shot's worked answer as shown in the prompt: calculator annotations removed, `#### N` kept."""
    return _ANNOT.sub("", answer).strip()


def pick_shots(shots: list[dict], question: str, k: int) -> list[dict]:
    """The first k shots that are not the evaluated question (no problem is shown its own solution)."""
    picked = [s for s in shots if s["question"] != question][:k]
    if len(picked) < k:
        raise EvalError(f"--k-shot {k}: the shots file has only {len(picked)} other problems; lower --k-shot or give "
                        f"--shots-file")
    return picked


def build_prompt(question: str, shots: list[dict]) -> str:
    parts = [f"Question: {s['question']}\nAnswer: {clean_solution(s['answer'])}\n\n" for s in shots]
    return "".join(parts) + f"Question: {question}\nAnswer:"


def build_chat_prompt(tokenizer, question: str, shots: list[dict]) -> str:
    """The shots as earlier user/assistant turns (lm-eval's 'fewshot as multiturn'), then the question."""
    if not getattr(tokenizer, "chat_template", None):
        raise EvalError("--chat: this tokenizer has no chat template; drop --chat (plain k-shot prompt)")
    msgs = []
    for s in shots:
        msgs += [{"role": "user", "content": f"Question: {s['question']}"},
                 {"role": "assistant", "content": clean_solution(s["answer"])}]
    msgs.append({"role": "user", "content": f"Question: {question}"})
    return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


# ------------------------------------------------------------------------------------------------- decoding
@dataclass
class EvalSettings:
    k_shot: int = 4
    batch_size: int = 32
    max_new_tokens: int = 256
    chat: bool = False
    stops: tuple = DEFAULT_STOPS
    warmup: bool = True
    repeat: int = 1  # each problem this many times (throughput runs); accuracy counts copy 0 only
    notes: list = field(default_factory=list)


def output_length(new_ids: list[int], eos_ids: set[int], tokenizer, stops) -> tuple[int, str]:
    """(tokens the model generated for this request, its text). HF pads a finished sequence up to the batch's
    length, so count up to the first EOS (inclusive) or the token that completes a stop string, whichever is first."""
    n = len(new_ids)
    for j, t in enumerate(new_ids):
        if t in eos_ids:
            n = j + 1
            break

    def text(k):
        return tokenizer.decode(new_ids[:k], skip_special_tokens=True)

    if stops and any(s in text(n) for s in stops):
        lo, hi = 1, n  # the shortest prefix whose text holds a stop string (its presence is monotone in k)
        while lo < hi:
            mid = (lo + hi) // 2
            if any(s in text(mid) for s in stops):
                hi = mid
            else:
                lo = mid + 1
        n = lo
    return n, text(n)


def _eos_ids(model, tokenizer) -> list[int]:
    ids = []
    for src in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        for t in (src if isinstance(src, (list, tuple)) else [src]):
            if t is not None and t not in ids:
                ids.append(int(t))
    return ids


def generate_batch(model, tokenizer, prompts: list[str], max_new_tokens: int, stops, add_special: bool,
                   eos_ids: list[int]):
    """One greedy `generate` call: (per-request new token id lists, synchronised wall seconds)."""
    import torch
    from transformers import GenerationConfig

    from novatune.memory.host_embedding import compute_device

    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=add_special)
    device = compute_device(model)  # HF's model.device is the first parameter's: cpu for a host-resident table
    enc = {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
    gcfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, use_cache=True, num_beams=1,
                            eos_token_id=eos_ids or None, pad_token_id=tokenizer.pad_token_id,
                            stop_strings=list(stops) if stops else None)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**enc, generation_config=gcfg, tokenizer=tokenizer)
    sync()
    dt = time.perf_counter() - t0
    plen = enc["input_ids"].shape[1]  # left padding: every prompt ends at column plen
    return out[:, plen:].tolist(), dt


def evaluate(model, tokenizer, problems: list[dict], shots: list[dict], settings: EvalSettings,
             progress=None) -> dict:
    """Run the evaluation; returns the summary dict with one entry per request under 'problems'."""
    tokenizer.padding_side = "left"  # decoder-only batches: every prompt must end where generation starts
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise EvalError("the tokenizer has neither a pad nor an EOS token; give a tokenizer that has one")
        tokenizer.pad_token = tokenizer.eos_token
        settings.notes.append("tokenizer had no pad token: padding with its EOS token")
    eos = _eos_ids(model, tokenizer)
    requests = []
    for copy in range(settings.repeat):
        for i, p in enumerate(problems):
            sh = pick_shots(shots, p["question"], settings.k_shot)
            prompt = build_chat_prompt(tokenizer, p["question"], sh) if settings.chat else \
                build_prompt(p["question"], sh)
            requests.append({"index": i, "copy": copy, "prompt": prompt})
    lengths = [len(ids) for ids in tokenizer([r["prompt"] for r in requests], add_special_tokens=not settings.chat)
               ["input_ids"]]
    for r, n in zip(requests, lengths):
        r["prompt_tokens"] = n
    order = sorted(range(len(requests)), key=lambda j: -lengths[j])  # longest first: an OOM shows up at once
    bs = settings.batch_size
    if settings.warmup:  # first call pays CUDA context/kernel selection costs: untimed
        generate_batch(model, tokenizer, [requests[order[0]]["prompt"]], min(4, settings.max_new_tokens),
                       settings.stops, not settings.chat, eos)
    total_time = 0.0
    for b in range(0, len(order), bs):
        idx = order[b:b + bs]
        new, dt = generate_batch(model, tokenizer, [requests[j]["prompt"] for j in idx], settings.max_new_tokens,
                                 settings.stops, not settings.chat, eos)
        total_time += dt
        for j, ids in zip(idx, new):
            n, text = output_length(ids, set(eos), tokenizer, settings.stops)
            r = requests[j]
            gold = problems[r["index"]]["gold"]
            pred = extract_answer(text, settings.stops)
            r.update(output_tokens=n, latency_s=round(dt, 4), batch_size=len(idx), text=cut_at_stop(text,
                     settings.stops), pred=pred, gold=gold, correct=is_correct(pred, gold),
                     hit_max_new_tokens=n >= settings.max_new_tokens)
        if progress is not None:
            progress(min(b + bs, len(order)), len(order), dt)
    return summarize(requests, total_time, settings)


def summarize(requests: list[dict], total_time: float, settings: EvalSettings) -> dict:
    scored = [r for r in requests if r["copy"] == 0]
    n, correct = len(scored), sum(r["correct"] for r in scored)
    lo, hi = wilson_interval(correct, n)
    toks = sum(r["output_tokens"] for r in requests)
    out = {
        "n": n, "correct": correct, "accuracy": correct / n, "ci95": [round(lo, 4), round(hi, 4)],
        "requests": len(requests),
        "avg_output_tokens": toks / len(requests),
        "avg_prompt_tokens": sum(r["prompt_tokens"] for r in requests) / len(requests),
        "avg_latency_s": sum(r["latency_s"] for r in requests) / len(requests),
        "avg_request_tokens_per_s": sum(r["output_tokens"] / r["latency_s"] for r in requests) / len(requests),
        "gen_tokens": toks, "gen_time_s": round(total_time, 4), "gen_tokens_per_s": toks / total_time,
        "hit_max_new_tokens": sum(r["hit_max_new_tokens"] for r in requests),
        "k_shot": settings.k_shot, "batch_size": settings.batch_size, "max_new_tokens": settings.max_new_tokens,
        "chat": settings.chat, "stops": list(settings.stops), "repeat": settings.repeat, "warmup": settings.warmup,
        "notes": list(settings.notes),
    }
    if settings.repeat > 1:
        out["notes"].append(f"each problem ran {settings.repeat} times (throughput); accuracy counts the first copy")
    out["problems"] = [{k: r[k] for k in ("index", "copy", "gold", "pred", "correct", "output_tokens",
                                         "prompt_tokens", "latency_s", "batch_size", "text")} for r in requests]
    return out


def render_table(results: list[dict]) -> str:
    """The results table: one column per evaluated model."""
    labels = [r.get("label") or r.get("model") or "?" for r in results]
    rows = [("Accuracy", lambda r: f"{r['accuracy']:.3f} ({r['correct']}/{r['n']})"),
            ("95% interval (Wilson)", lambda r: f"{r['ci95'][0]:.3f}-{r['ci95'][1]:.3f}"),
            ("Avg throughput / req (tok/s)", lambda r: f"{r['avg_request_tokens_per_s']:.2f}"),
            ("Generated tok/s (all requests)", lambda r: f"{r['gen_tokens_per_s']:,.1f}"),
            ("Avg latency / req (s)", lambda r: f"{r['avg_latency_s']:.3f}"),
            ("Avg output tokens", lambda r: f"{r['avg_output_tokens']:.2f}")]
    lines = ["| Metric | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for name, fn in rows:
        lines.append(f"| {name} | " + " | ".join(fn(r) for r in results) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- models
def resolve_model_dir(path: str) -> tuple[Path, str]:
    """A from_pretrained folder, a novatune run/export folder (its final/ or final/merged/), or a checkpoint
    (checkpoints/step_N, or a run folder without an export: its newest checkpoint). Returns (folder, kind)."""
    from novatune.data.sources import resolve_path
    from novatune.train.checkpoint import latest

    p = resolve_path(path)
    if (p / "config.json").is_file():
        return p, "pretrained"
    for sub in ("final", "final/merged"):
        if (p / sub / "config.json").is_file():
            return p / sub, "export"
    if (p / "final" / "adapter").is_dir():
        raise EvalError(f"--model: {p}/final holds a LoRA adapter but no merged model; export with merged=True or "
                        f"give the checkpoint folder {p}/checkpoints/step_N")
    if (p / "state.json").is_file():
        return p, "checkpoint"
    ck = latest(p) if p.is_dir() else None
    if ck is not None:
        return ck, "checkpoint"
    if (p / "adapter_config.json").is_file():  # a LoRA export's adapter alone: its base is elsewhere
        merged = p.parent / "merged"
        hint = f"give {merged} (the merged model) or the run folder" if merged.is_dir() else \
            "give the merged model (merged/ beside it) or the run folder"
        raise EvalError(f"--model: {p} holds a LoRA adapter only (adapter_config.json); {hint}")
    raise EvalError(f"--model: {p} is neither a from_pretrained folder (config.json), a novatune export "
                    f"(final/) nor a checkpoint (state.json); for random weights use --arch NAME instead")


def _tokenizer(name: str, base_dir: Path | None = None):
    from types import SimpleNamespace

    from novatune.train.model import load_tokenizer

    return load_tokenizer(SimpleNamespace(tokenizer=name, name=None), base_dir)


def _from_checkpoint(ck: Path, device, dtype, tokenizer_name: str | None, attn: str):
    """Rebuild the run's model from the config saved in the checkpoint, exactly as the trainer built it (the run
    builder's build_patched_model: QLoRA's NF4 linears and embedding, LoRA), without the patch or checkpointing
    (decoding needs neither); load its trained weights and merge LoRA."""
    import dataclasses

    import yaml
    from safetensors.torch import load_file

    from novatune.train.checkpoint import is_sharded, verify
    from novatune.train.config import from_dict
    from novatune.train.nonfinite import nonfinite_names
    from novatune.train.session import build_patched_model
    from novatune.tune.patching import selection_for

    problems = verify(ck)  # the checks a resume makes: sizes, checksums, the step across files
    if problems:
        raise EvalError(f"--model: checkpoint {ck} is damaged: {'; '.join(problems)}; give an intact checkpoint "
                        f"(another checkpoints/step_N) or the run's export (final/)")
    state = json.loads((ck / "state.json").read_text())
    if "config" not in state:
        raise EvalError(f"--model: {ck}/state.json has no saved config; give the run's export (final/) instead")
    cfg = from_dict(yaml.safe_load(state["config"]))
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention=attn, patch=False),
                              memory=dataclasses.replace(cfg.memory, gradient_checkpointing=False, policy=None,
                                                layers=[], budget_gib=None, embeddings_on_host=False,
                                                embedding_grad="dense"))
    mcfg = cfg.model
    tok = _tokenizer(tokenizer_name) if tokenizer_name else _tokenizer(mcfg.tokenizer or mcfg.name, Path.cwd())
    model, _ = build_patched_model(cfg, device, dtype, tok, Path.cwd(), select=selection_for)
    if is_sharded(ck):  # a multi-process run's checkpoint (DCP shards): read into this one-process model
        from novatune.train.checkpoint import CheckpointError
        from novatune.train.sharded_checkpoint import read_model_weights

        try:
            weights = read_model_weights(ck, model)
        except CheckpointError as e:
            raise EvalError(f"--model: {e}; give an intact checkpoint or the run's export (final/)") from None
    else:
        weights = load_file(str(ck / "weights.safetensors"), device=str(device))
    bad = nonfinite_names(weights)
    if bad:
        raise EvalError(f"--model: checkpoint {ck} is damaged: {len(bad)} tensor(s) hold NaN/inf ({bad[0]}, ...); "
                        f"give an intact checkpoint or the run's export (final/)")
    params = dict(model.named_parameters())
    missing = sorted(set(weights) - set(params))
    if missing:
        raise EvalError(f"--model: {ck} does not match the model its config builds (e.g. {missing[:3]})")
    import torch

    with torch.no_grad():
        for name, t in weights.items():
            if t.data_ptr() != params[name].data_ptr():  # DCP already read a sharded checkpoint into these tensors
                params[name].copy_(t)
    if cfg.method.type == "qlora":  # dense merge (NF4 dequantised + delta): decoding then runs plain GEMMs
        from novatune.train.qlora import merged_model

        model = merged_model(model, dtype).to(device)
    elif cfg.method.type == "lora":
        model = model.merge_and_unload()
    return model, tok


ATTN_CHOICES = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")  # transformers' own


def load_model(model_path: str | None, arch: str | None, tokenizer_name: str | None, device: str = "auto",
               dtype: str = "auto", attn: str = "sdpa", arch_overrides: dict | None = None, seed: int = 0):
    """(model in eval mode with use_cache on, tokenizer, description). Exactly one of model_path / arch."""

    from novatune.train.model import SetupError, check_attention_installed, pick_device, pick_dtype

    if (model_path is None) == (arch is None):
        raise EvalError("give exactly one of --model PATH (local model, novatune export or checkpoint) and --arch NAME "
                        "(random init, speed tests)")
    if attn not in ATTN_CHOICES:
        raise EvalError(f"--attn {attn!r}: choose one of {', '.join(ATTN_CHOICES)}")
    try:
        check_attention_installed(attn, "--attn")
    except SetupError as err:
        raise EvalError(str(err)) from None
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    if arch is not None:
        from novatune.train.config import ModelConfig
        from novatune.train.model import build_model

        tok_name = tokenizer_name or "demo"
        tok = _tokenizer(tok_name)
        mcfg = ModelConfig(arch=arch, arch_overrides=dict(arch_overrides or {}), tokenizer=tok_name, attention=attn)
        try:  # the trainer's model builder: built on the device in its dtype, seeded
            model = build_model(mcfg, dev, dt, tok, seed=seed)
        except SetupError as e:
            raise EvalError(f"--arch: {e}") from None
        desc = {"model": f"{arch} (random init, seed {seed})", "tokenizer": tok_name, "kind": "random"}
    else:
        folder, kind = resolve_model_dir(model_path)
        if kind == "checkpoint":
            model, tok = _from_checkpoint(folder, dev, dt, tokenizer_name, attn)
        else:
            from transformers import AutoModelForCausalLM

            tok = _tokenizer(tokenizer_name or str(folder))
            model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dt, attn_implementation=attn).to(dev)
        desc = {"model": str(folder), "tokenizer": tokenizer_name or str(folder), "kind": kind}
    if tok is None:
        raise EvalError("no tokenizer: give --tokenizer PATH (or 'demo')")
    if len(tok) > model.config.vocab_size:
        raise EvalError(f"the tokenizer has {len(tok)} tokens but the model's vocab_size is {model.config.vocab_size}; "
                        f"give the model's own tokenizer")
    model.config.use_cache = True
    model.eval()
    desc.update(device=str(dev), dtype=str(dt).replace("torch.", ""), attn_implementation=attn,
                params=sum(p.numel() for p in model.parameters()))
    return model, tok, desc
