"""The embedded demo: what `novatune train` runs with no config.

Everything it needs ships in novatune/assets/demo/ (no download): `demo.yaml` (a 3.3M-parameter Qwen3-architecture
model, random init), `arithmetic.jsonl` (arithmetic word problems in OpenAI messages format, trained on the
assistant turns only) and `tokenizer/` (a 512-token byte-level BPE with a ChatML chat template, wrapped as a
PreTrainedTokenizerFast). `scripts/make_demo_assets.py` regenerates the data and tokenizer from the functions
below; with the same seed they come out byte-identical.
"""
from __future__ import annotations

import random
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets"
DEMO_DIR = ASSETS / "demo"

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

NAMES = ["Ava", "Ben", "Chloe", "Dan", "Emma", "Finn", "Grace", "Hugo", "Iris", "Jack", "Kira", "Leo", "Maya",
         "Noah", "Olga", "Pablo", "Quinn", "Rosa", "Sam", "Tara"]
ITEMS = ["apple", "book", "marble", "pencil", "sticker", "cookie", "shell", "coin", "stamp", "card"]
SYSTEM = "You are a careful math tutor. Show the calculation, then give the answer."


def demo_config_path() -> Path:
    return DEMO_DIR / "demo.yaml"


def _problem(rng: random.Random) -> tuple[str, str]:
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    kind = rng.choice(["add", "sub", "mul", "div"])
    if kind == "add":
        a, b = rng.randint(2, 60), rng.randint(2, 40)
        q = f"{name} has {a} {item}s and gets {b} more from {other}. How many {item}s does {name} have now?"
        return q, f"{name} has {a} + {b} = {a + b} {item}s. The answer is {a + b}."
    if kind == "sub":
        a = rng.randint(10, 80)
        b = rng.randint(1, a - 1)
        q = f"{name} had {a} {item}s and gave {b} to {other}. How many {item}s does {name} have left?"
        return q, f"{name} has {a} - {b} = {a - b} {item}s left. The answer is {a - b}."
    if kind == "mul":
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        q = f"{name} fills {a} bags with {b} {item}s each. How many {item}s is that in total?"
        return q, f"That is {a} x {b} = {a * b} {item}s. The answer is {a * b}."
    b, c = rng.randint(2, 9), rng.randint(2, 12)
    a = b * c
    q = f"{name} shares {a} {item}s equally among {b} friends. How many {item}s does each friend get?"
    return q, f"Each friend gets {a} / {b} = {c} {item}s. The answer is {c}."


def make_records(n: int = 4000, seed: int = 0) -> list[dict]:
    """n conversations in OpenAI messages format; a third start with a system message, a tenth have two turns."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        msgs = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.33 else []
        for _ in range(2 if rng.random() < 0.1 else 1):
            q, a = _problem(rng)
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        out.append({"messages": msgs})
    return out


def build_tokenizer(records: list[dict], vocab_size: int = 512):
    """A byte-level BPE (digits split one by one) trained on the demo texts, as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [m["content"] for r in records for m in r["messages"]] + [m["role"] for m in records[0]["messages"]]
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHATML_TEMPLATE
    return fast


def load_demo_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEMO_DIR / "tokenizer"))
