"""Where records come from: local JSONL / JSON / Parquet files, `datasets` folders, or a seeded synthetic source.

Every source yields plain dict records (`{"messages": [...]}`, `{"text": ...}`, ...); the synthetic source yields
pre-tokenized documents (`{"input_ids": [...]}`). Paths may be a file, a directory of such files, or a folder
written by `datasets.Dataset.save_to_disk`. `assets:NAME` names a file shipped in novatune/assets.

A folder of files is split by the files' names as `datasets` splits a data folder: a name with the word train,
test (testing, eval, evaluation) or validation (valid, val, dev) belongs to that split, and the source's `split:`
picks the files (train by default); where no name says a split, every file is train. A `save_to_disk` folder of
one Dataset has no other split.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets"
FILE_TYPES = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".pq": "parquet"}


class DataError(ValueError):
    """A data problem the user can fix; the message names the config key and the fix."""


def resolve_path(path: str, base_dir: Path | None = None) -> Path:
    """`assets:x` -> novatune/assets/x; relative paths: the working directory first, then the config's folder."""
    if path.startswith("assets:"):
        return ASSETS / path[len("assets:"):]
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists() or base_dir is None:
        return p
    alt = Path(base_dir) / p
    return alt if alt.exists() else p


def detect_type(path: Path) -> str | None:
    if path.is_dir():
        if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists() or \
                (path / "state.json").exists():
            return "datasets"
        kinds = {FILE_TYPES.get(f.suffix) for f in path.iterdir() if f.is_file()} - {None}
        return kinds.pop() if len(kinds) == 1 else None
    return FILE_TYPES.get(path.suffix.lower())


# the words that put a data file in a split, as `datasets` reads a data folder's file names
SPLIT_WORDS = {"train": ("train", "training"), "test": ("test", "testing", "eval", "evaluation"),
               "validation": ("validation", "valid", "val", "dev")}


def split_of(file: Path) -> str | None:
    """The split a data file's name says (a whole word of its name: `train.jsonl`, `data-test-00.parquet`)."""
    words = set(re.split(r"[^a-z]+", file.name.lower()))  # digits separate words too, as in datasets: train0
    return next((split for split, names in SPLIT_WORDS.items() if words & set(names)), None)


def _files(path: Path, kind: str, split: str = "train") -> list[Path]:
    """The files of one split: `path` itself, or the folder's files of `kind` whose names say `split` (all of them,
    for train, where no name says a split)."""
    if path.is_file():
        return [path]
    suffixes = [s for s, k in FILE_TYPES.items() if k == kind] or [f".{kind}"]
    files = sorted(f for f in path.iterdir() if f.suffix.lower() in suffixes)
    named = {f: split_of(f) for f in files}
    if not any(named.values()):
        if split != "train" and files:
            raise DataError(f"{path}: no file name says a split (train / test / validation), so every file is "
                            f"train; set split: train, or name the files by split (e.g. test.jsonl)")
        return files
    unnamed = [f.name for f, sp in named.items() if sp is None]
    if unnamed:
        raise DataError(f"{path}: some file names say a split and {', '.join(unnamed[:3])} do not; name every "
                        f"file by its split, or move the others out of the folder")
    chosen = [f for f, sp in named.items() if sp == split]
    if not chosen:
        found = sorted({sp for sp in named.values() if sp})
        raise DataError(f"{path}: no {split} files (the names give: {', '.join(found)}); set split: to one of "
                        f"them, or name the files by split")
    return chosen


def read_jsonl(path: Path) -> Iterator[dict]:
    with open(path, "rb") as f:  # bytes: a bad byte is reported with its line number
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8").strip()  # a byte-order mark may open the file
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{n}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                                f"re-save the file as UTF-8 or fix that line") from None
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not valid JSON ({e.msg}); fix that line or use type: json for a "
                                f"single JSON array") from None


def read_json(path: Path) -> Iterator[dict]:
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))  # a byte-order mark may open the file
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); re-save the "
                        f"file as UTF-8") from None
    except json.JSONDecodeError as e:  # type: json on JSON lines reads as one value with extra data
        raise DataError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}); if it holds one record per line, "
                        f"set type: jsonl (or type: auto) and name it .jsonl") from None
    if isinstance(data, dict):  # {"data": [...]} / {"train": [...]}: the one list inside
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise DataError(f"{path}: expected a JSON list of records (or an object holding one list)")
        data = lists[0]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
    yield from data


def read_parquet(path: Path) -> Iterator[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("reading Parquet needs pyarrow: pip install pyarrow (or novatune[data])") from None
    import pyarrow as pa

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:  # a truncated file, or JSON lines with type: parquet
        raise DataError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0][:160]}); re-create the "
                        f"file, or set the source's type: to its real format (jsonl, json) or auto") from None
    yield from table.to_pylist()


def read_datasets(path: Path, split: str) -> Iterator[dict]:
    """A `save_to_disk` folder (load_from_disk), or local data files read through `datasets.load_dataset`."""
    try:
        import datasets
    except ImportError:
        raise DataError("type: datasets needs the `datasets` package: pip install datasets") from None
    plain = {f.suffix.lower().lstrip(".") for f in path.iterdir() if f.is_file()} & {"csv", "txt"} \
        if path.is_dir() and detect_type(path) is None else set()
    if path.is_file() or detect_type(path) not in (None, "datasets") or len(plain) == 1:
        kind = detect_type(path) or (plain.pop() if plain else path.suffix.lstrip("."))
        builder = {"jsonl": "json", "json": "json", "parquet": "parquet", "csv": "csv", "txt": "text"}.get(kind)
        if builder is None:
            raise DataError(f"{path}: datasets cannot read .{kind} files here; use jsonl, json, parquet, csv or txt")
        files = [str(f) for f in _files(path, kind, split)] if path.is_dir() else [str(path)]
        # CSV: every column as text, and "None" / "N/A" / "nan" kept as the texts they are
        options = {"features": _text_columns(datasets, files[0]), "keep_default_na": False} \
            if builder == "csv" and files else {}
        yield from datasets.load_dataset(builder, data_files=files, split="train", **options)
        return
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"{path}: no split {split!r} (splits: {', '.join(ds)}); set split: to one of them")
        ds = ds[split]
    elif split != "train":
        raise DataError(f"{path}: a save_to_disk folder of one Dataset has no split {split!r}; set split: train, or "
                        f"save a DatasetDict with that split")
    yield from ds


def _text_columns(datasets, csv_file: str):
    """Every column of a CSV file as text: `datasets` infers column types otherwise, and a completion "007" would
    train as 7.0, "1.50" as 1.5."""
    import pandas as pd

    header = pd.read_csv(csv_file, nrows=0, encoding="utf-8-sig").columns  # pandas' names ("Unnamed: 0" ...)
    return datasets.Features({str(name): datasets.Value("string") for name in header})


def synthetic_docs(num_docs: int, vocab_size: int, median_length: int = 600, sigma: float = 0.7,
                   min_length: int = 32, max_length: int | None = None, seed: int = 1) -> Iterator[dict]:
    """Random-token documents with log-normal lengths (median `median_length`), as in docs/BENCHMARKS.md's workload.

    Seeded with its own torch.Generator, so the same config always gives the same documents.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    mu = math.log(median_length)
    for _ in range(num_docs):
        n = int(math.exp(mu + sigma * torch.randn(1, generator=g).item()))
        n = max(min_length, n if max_length is None else min(n, max_length))
        yield {"input_ids": torch.randint(0, vocab_size, (n,), generator=g).tolist()}


def load_source(src, base_dir: Path | None = None, vocab_size: int | None = None, key: str = "data.sources[0]",
                max_length: int | None = None) -> list[dict]:
    """All records of one configured source (a SourceConfig), at most `src.limit`."""
    if src.type == "synthetic":
        if vocab_size is None:
            raise DataError(f"{key}: a synthetic source needs the model's vocab_size")
        recs = synthetic_docs(src.num_docs, vocab_size, src.median_length, src.sigma, src.min_length,
                              max_length, src.seed)
        return list(recs)[: src.limit]
    if not src.path:
        raise DataError(f"{key}.path: missing; set it to a .jsonl/.json/.parquet file or a datasets folder")
    path = resolve_path(src.path, base_dir)
    if not path.exists():
        raise DataError(f"{key}.path: not found: {path}; fix the path (relative paths are tried against the "
                        f"working directory, then the config file's folder)")
    kind = src.type if src.type != "auto" else detect_type(path)
    if kind is None:
        raise DataError(f"{key}.type: cannot tell the format of {path}; set type: to jsonl, json, parquet or "
                        f"datasets (which also reads .csv and .txt files)")
    out: list[dict] = []
    if kind == "datasets":
        it: Iterator[dict] = read_datasets(path, src.split)
    else:
        readers = {"jsonl": read_jsonl, "json": read_json, "parquet": read_parquet}
        files = _files(path, kind, src.split)
        if not files:
            raise DataError(f"{key}.path: {path} holds no .{kind} files; point it at a file or set type:")
        it = (r for f in files for r in readers[kind](f))
    for rec in it:
        if src.limit is not None and len(out) >= src.limit:
            break
        if not isinstance(rec, dict):
            raise DataError(f"{key}: records must be JSON objects, got {type(rec).__name__}: {str(rec)[:80]}")
        out.append(rec)
    if not out:
        raise DataError(f"{key}: {path} holds no records; check the file (and split: for datasets folders)")
    return out
