"""Over-long documents and best-fit-decreasing packing into rows of `max_length` tokens.

Packing puts several documents in one row; the collator gives each document its own position_ids (restarting at
0) and a -100 label on its first token, so no token is trained to predict across a document boundary and
attention (HF's packed-sequence detection, or novatune's varlen/flex backends through cu_seqlens) stays inside
each document.

Best-fit decreasing: documents sorted longest first, each placed in the open row with the least room that still
fits it (a new row when none does). It is deterministic (ties broken by document index) and, for the log-normal
lengths of real chat data, fills rows to > 95%. O(n log n) search with an O(rows) list insert - fine for 10^5 docs.
"""
from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass, field

from novatune.data.formats import Doc


@dataclass
class PackStats:
    docs_in: int = 0  # documents after tokenization
    dropped: int = 0  # over-long documents dropped (overlong: drop)
    split: int = 0  # over-long documents cut into max_length pieces (overlong: split)
    truncated: int = 0  # over-long documents cut to max_length (overlong: truncate)
    row_end_cuts: int = 0  # documents cut at a row's end, their rest continuing the next row (greedy packing)
    empty: int = 0  # documents with fewer than 2 tokens or no target token, skipped
    docs: int = 0  # documents (pieces) placed in rows
    rows: int = 0
    tokens: int = 0  # real tokens in rows
    targets: int = 0  # tokens that carry a loss (labels != -100)
    max_length: int = 0
    longest: int = 0  # longest document before handling over-long ones
    notes: list[str] = field(default_factory=list)

    @property
    def efficiency(self) -> float:
        """Real tokens / (rows x max_length): 1.0 means no padding at all."""
        return self.tokens / max(1, self.rows * self.max_length)

    def summary(self) -> str:
        pieces = f" ({self.docs} pieces)" if self.split or self.row_end_cuts else ""
        s = (f"{self.docs_in} documents{pieces} -> {self.rows} rows of {self.max_length} tokens, packing efficiency "
             f"{100 * self.efficiency:.1f}%, {self.tokens:,} tokens ({self.targets:,} with loss)")
        extra = [f"{n} {what}" for n, what in ((self.split, "over-long documents split"),
                                                (self.row_end_cuts, "documents cut at a row end (greedy packing)"),
                                                (self.dropped, "over-long documents dropped"),
                                                (self.truncated, "over-long documents truncated"),
                                                (self.empty, "documents or pieces with nothing to train "
                                                             "(under 2 tokens, or no target token) skipped")) if n]
        return s + ("; " + ", ".join(extra) if extra else "")

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "notes"}
        d["efficiency"] = round(self.efficiency, 4)
        return d


def handle_overlong(docs: list[Doc], max_length: int, mode: str, stats: PackStats) -> list[Doc]:
    """Apply `overlong` (split | drop | truncate) to documents longer than max_length; skip useless ones."""
    out: list[Doc] = []
    for ids, mask in docs:
        stats.longest = max(stats.longest, len(ids))
        if len(ids) > max_length:
            if mode == "drop":
                stats.dropped += 1
                continue
            if mode == "truncate":
                stats.truncated += 1
                pieces = [(ids[:max_length], mask[:max_length])]
            else:
                stats.split += 1
                pieces = [(ids[i:i + max_length], mask[i:i + max_length]) for i in range(0, len(ids), max_length)]
        else:
            pieces = [(ids, mask)]
        for p_ids, p_mask in pieces:
            # the first token of a document never carries a loss (nothing before it in the document predicts it)
            if len(p_ids) < 2 or not any(p_mask[1:]):
                stats.empty += 1
                continue
            out.append((p_ids, p_mask))
    return out


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins (lists of item indices) of total length <= capacity; every length must be <= capacity."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (room left, bin id) of bins that still have room
    for i in order:
        n = lengths[i]
        j = bisect_left(free, (n, -1))  # the tightest bin with room >= n
        if j == len(free):
            bins.append([i])
            room, b = capacity - n, len(bins) - 1
        else:
            room, b = free.pop(j)
            bins[b].append(i)
            room -= n
        if room > 0:
            insort(free, (room, b))
    return bins


def greedy_rows(docs: list[Doc], max_length: int, stats: PackStats) -> list[list[Doc]]:
    """Documents in their order, filling each row to the brim; a document that does not fit is cut at the row's end
    and its rest starts the next row as a document of its own (TRL's "wrapped" packing; docs/BENCHMARKS.md's reference
    rows). Rows are 100% full except the last; pieces shorter than 2 tokens carry no loss and are dropped."""
    rows: list[list[Doc]] = []
    row: list[Doc] = []
    used = 0
    for ids, mask in docs:
        cut = False
        while ids:
            room = max_length - used
            if room < 2:
                rows.append(row)
                row, used, room = [], 0, max_length
            piece, ids, pmask, mask = ids[:room], ids[room:], mask[:room], mask[room:]
            cut |= bool(ids)
            if len(piece) >= 2 and any(pmask[1:]):
                row.append((piece, pmask))
                used += len(piece)
            if ids:
                rows.append(row)
                row, used = [], 0
        stats.row_end_cuts += cut
    if row:
        rows.append(row)
    return [r for r in rows if r]


def pack(docs: list[Doc], max_length: int, packing: bool = True, overlong: str = "split", strategy: str = "bfd"
         ) -> tuple[list[list[Doc]], PackStats]:
    """Rows of documents (each row a list of docs, total length <= max_length) and the statistics.
    strategy: "bfd" (best-fit decreasing, whole documents) or "greedy" (in order, cut at row ends)."""
    stats = PackStats(docs_in=len(docs), max_length=max_length)
    docs = handle_overlong(docs, max_length, overlong, stats)
    if packing and strategy == "greedy":
        rows = greedy_rows(docs, max_length, stats)
        docs = [d for r in rows for d in r]
    elif packing:
        rows = [[docs[i] for i in b] for b in best_fit_decreasing([len(d[0]) for d in docs], max_length)]
    else:
        rows = [[d] for d in docs]
    stats.docs = len(docs)
    stats.rows = len(rows)
    stats.tokens = sum(len(d[0]) for d in docs)
    stats.targets = sum(sum(m[1:]) for _, m in docs)
    return rows, stats
