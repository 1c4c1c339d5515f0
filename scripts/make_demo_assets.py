"""Regenerate the embedded demo's data and tokenizer (novatune/assets/demo/). Deterministic: same seed, same bytes.

    python scripts/make_demo_assets.py            # writes arithmetic.jsonl and tokenizer/
    python scripts/make_demo_assets.py --check    # exits 1 if the shipped files differ from a fresh build
"""
from __future__ import annotations

import argparse
import filecmp
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
from novatune.train.demo import DEMO_DIR, build_tokenizer, make_records

N_RECORDS, SEED, VOCAB = 3000, 0, 512


def write(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    records = make_records(N_RECORDS, SEED)
    data = out / "arithmetic.jsonl"
    data.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
    tok = build_tokenizer(records, VOCAB)
    tok.save_pretrained(str(out / "tokenizer"))
    # the generic class name loads on every transformers version (5.x writes its new alias TokenizersBackend)
    tc = out / "tokenizer" / "tokenizer_config.json"
    tc.write_text(json.dumps({**json.loads(tc.read_text()), "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2)
                  + "\n")
    return [data] + sorted((out / "tokenizer").iterdir())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(DEMO_DIR))
    ap.add_argument("--check", action="store_true", help="compare a fresh build with the files in --out")
    args = ap.parse_args()
    if not args.check:
        for p in write(Path(args.out)):
            print(p)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        bad = [p.name for p in write(Path(tmp)) if not filecmp.cmp(p, Path(args.out) / p.relative_to(tmp),
                                                                  shallow=False)]
    print("differs: " + ", ".join(bad) if bad else "demo assets are up to date")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
