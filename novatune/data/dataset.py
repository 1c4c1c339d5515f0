"""The data pipeline end to end: sources -> records -> token documents -> packed rows -> micro-batches.

`build_data(cfg.data, tokenizer, vocab_size)` reads and packs everything up front (deterministic, so a resumed run
sees the same rows). `BatchStream` walks the rows in a seeded per-epoch order, `micro_batch` rows at a time,
across epoch boundaries; its state is `(epoch, index)`, saved in every checkpoint so a resumed run continues with
exactly the batch it would have seen.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from novatune.data.collate import collate
from novatune.data.formats import Doc, check_loss_on, detect_format, make_tokenize
from novatune.data.packing import PackStats, pack
from novatune.data.sources import DataError, load_source, resolve_path


@dataclass
class PackedData:
    rows: list[list[Doc]]
    stats: PackStats
    formats: list[str]


def read_chat_template(value: str | None, base_dir: Path | None = None) -> str | None:
    """data.chat_template: jinja text, or a path to a file holding it."""
    if value is None:
        return None
    if "{%" in value or "{{" in value:
        return value
    p = resolve_path(value, base_dir)
    if not p.is_file():
        raise DataError(f"data.chat_template: {value!r} is neither jinja text nor an existing file; give the "
                        f"template text or the path of a .jinja file")
    return p.read_text(encoding="utf-8")


def tokenize_records(records: list[dict], fmt: str, tokenizer, loss_on: str, chat_template: str | None,
                     add_eos: bool, key: str) -> tuple[list[Doc], str]:
    fmt = detect_format(records[0]) if fmt == "auto" else fmt
    check_loss_on(fmt, loss_on)
    f = make_tokenize(fmt, tokenizer, loss_on, chat_template, add_eos)
    docs = []
    for i, rec in enumerate(records):
        try:
            docs.append(f(rec))
        except DataError as e:
            raise DataError(f"{key}: record {i}: {e}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"{key}: record {i} does not fit format {fmt!r} ({type(e).__name__}: {e}); fix the "
                            f"record or set data.format") from None
    return docs, fmt


def build_data(dcfg, tokenizer=None, vocab_size: int | None = None, base_dir: Path | None = None) -> PackedData:
    if not dcfg.sources:
        raise DataError("data.sources: empty; add at least one source, e.g. sources: [{path: train.jsonl}]")
    template = read_chat_template(dcfg.chat_template, base_dir)
    docs: list[Doc] = []
    formats = []
    for i, src in enumerate(dcfg.sources):
        key = f"data.sources[{i}]"
        records = load_source(src, base_dir, vocab_size, key, dcfg.max_length)
        d, fmt = tokenize_records(records, dcfg.format, tokenizer, dcfg.loss_on, template, dcfg.add_eos, key)
        docs += d
        formats.append(fmt)
    if vocab_size is not None:
        top = max((max(ids) for ids, _ in docs if ids), default=0)
        if top >= vocab_size:
            raise DataError(f"model: token id {top} >= the model's vocab_size {vocab_size}; use the model's own "
                            f"tokenizer (model.tokenizer) or raise model.arch_overrides.vocab_size")
    rows, stats = pack(docs, dcfg.max_length, dcfg.packing, dcfg.overlong, dcfg.packing_strategy)
    if not rows:
        why = (f"{stats.dropped} were dropped as longer than data.max_length={dcfg.max_length}"
               if stats.dropped else f"{stats.empty} have no token to train on")
        raise DataError(f"data: no trainable documents left out of {stats.docs_in} ({why}); raise data.max_length, "
                        f"set data.overlong: split, or check data.loss_on")
    return PackedData(rows, stats, formats)


def row_counts(row: list[Doc]) -> tuple[int, int, float]:
    """(target tokens, tokens, attended keys) of one packed row, as collate() counts them for its batch."""
    targets = sum(sum(1 for m in mask[1:] if m) for _, mask in row)
    return targets, sum(len(ids) for ids, _ in row), sum(len(ids) ** 2 / 2 for ids, _ in row)


class BatchStream:
    """Micro-batches of `micro_batch` rows, in a seeded order per epoch, resumable from (epoch, index).

    With `world` processes the stream walks the same global order on every rank, `micro_batch * world` rows at a
    time, and rank r collates rows r, r + world, ... of each global micro-batch. Its micro-batch dict also carries
    the counts of the whole global micro-batch (`global_target_tokens`, `global_tokens`, `global_attn_keys`),
    computed from the rows on every rank without communication: the loss of a step is normalised by the target
    tokens of all ranks. The state (epoch, index) is global, so a checkpoint resumes under another world size. A
    global micro-batch at an epoch's end with fewer rows than ranks still trains them, as one process would: a
    rank left without a row runs a copy of one with no target token (`_idle_row`, marked `idle`: its loss is
    multiplied by 0), so every rank runs the step's forward, backward and collectives while adding nothing to the
    loss, the gradients or the counts."""

    def __init__(self, rows: list[list[Doc]], micro_batch: int, seed: int = 0, shuffle: bool = True,
                 pad_id: int = 0, rank: int = 0, world: int = 1, pad_to: int | None = None):
        self.rows, self.micro_batch, self.seed, self.shuffle, self.pad_id = rows, micro_batch, seed, shuffle, pad_id
        self.pad_to = pad_to  # every micro-batch padded to this many tokens per row (None: its longest row)
        self.rank, self.world = rank, world
        self.epoch, self.index = 0, 0
        self._order = self._make_order(0)
        self._counts: list[tuple[int, int, float]] | None = None  # per row, counted once (multi-process only)

    @property
    def batches_per_epoch(self) -> int:
        """Global micro-batches per epoch (each holds micro_batch rows on every rank; the last may hold fewer)."""
        return -(-len(self.rows) // (self.micro_batch * self.world))

    def left_in_epoch(self) -> int:
        """Global micro-batches left in the current epoch (a used-up epoch: the whole next one)."""
        if self.index >= len(self._order):
            return self.batches_per_epoch
        return -(-(len(self._order) - self.index) // (self.micro_batch * self.world))

    def _make_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.rows)))
        g = torch.Generator().manual_seed(self.seed * 100003 + epoch)
        return torch.randperm(len(self.rows), generator=g).tolist()

    def next(self) -> dict:
        if self.index >= len(self._order):  # the epoch is used up
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._make_order(self.epoch)
        take = self._order[self.index: self.index + self.micro_batch * self.world]
        self.index += len(take)
        if self.world == 1:
            return collate([self.rows[i] for i in take], self.pad_id, self.pad_to)
        mine = [self.rows[i] for i in take[self.rank::self.world]]
        batch = collate(mine or [self._idle_row(self.rows[take[0]])], self.pad_id, self.pad_to)
        if not mine:  # counted nowhere: no token of it is trained, its loss is multiplied by 0 (forward_backward)
            batch.update(idle=True, num_tokens=0, attn_keys=0.0)
        if self._counts is None:  # the rows never change after packing: count them once, not per micro-batch
            self._counts = [row_counts(r) for r in self.rows]
        counts = [self._counts[i] for i in take]
        batch["global_target_tokens"] = sum(c[0] for c in counts)
        batch["global_tokens"] = sum(c[1] for c in counts)
        batch["global_attn_keys"] = sum(c[2] for c in counts)
        return batch

    @staticmethod
    def _idle_row(row: list[Doc]) -> list[Doc]:
        """`row` with no target token: what a rank runs when the global micro-batch has no row left for it."""
        return [(ids, [False] * len(ids)) for ids, _ in row]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "rows": len(self.rows)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("rows", len(self.rows)) != len(self.rows):
            raise DataError(f"resume: the checkpoint was written with {state['rows']} packed rows, the data now "
                            f"gives {len(self.rows)}; resume with the same data config or start a new output_dir")
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._make_order(self.epoch)
