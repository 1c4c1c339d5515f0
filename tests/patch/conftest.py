"""Shared by the trainer tests: the demo tokenizer and a tiny in-memory text dataset (module-scoped fixtures)."""
import os
import random
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

WORDS = "apple book marble pencil sticker cookie shell coin stamp card one two three plus minus equals".split()


@pytest.fixture(scope="module")
def tokenizer():
    import transformers

    from novatune.train.demo import DEMO_DIR

    return transformers.AutoTokenizer.from_pretrained(str(DEMO_DIR / "tokenizer"))


@pytest.fixture(scope="module")
def dataset():
    datasets = pytest.importorskip("datasets")
    rng = random.Random(0)
    rows = [{"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 20)))} for _ in range(24)]
    return datasets.Dataset.from_list(rows)
