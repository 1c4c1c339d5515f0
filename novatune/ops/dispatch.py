"""The one dispatch table: which implementation runs a call of a registered op.

    ACTIVE is None          -> every public functional runs its default path (one module-global read per call)
    install(Selection(...)) -> ACTIVE looks each call's signature (op, shape, dtype, device type) up in the
                               selection's table and runs the chosen functional, or returns None (default path)
    with recording() as rec -> the same, and every call is recorded (rec.calls: one CallRecord per distinct call:
                               ranks, shapes, strides, dtypes, eps and flags as the model made it)

A Selection is a plain value: `novatune tune` builds one from its cache, `novatune.patch(model, selection=...)`
installs it (`Selection.apply`). Nothing here knows how it was chosen. The call signature of an op comes from its
SPEC (novatune.ops.registry), so the table is keyed exactly as the tune cache is.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

ACTIVE = None  # a _Dispatcher while a selection is installed or calls are recorded; read by every public functional


@dataclass(frozen=True)
class ArgRecord:
    """One argument of a recorded call: a tensor's shape, strides and dtype, or a plain value (eps, flags)."""

    shape: tuple | None = None
    stride: tuple | None = None
    dtype: torch.dtype | None = None
    value: object = None

    @property
    def is_tensor(self) -> bool:
        return self.shape is not None


@dataclass(frozen=True)
class CallRecord:
    """A call as the model made it (what the tuner validates candidates on)."""

    op: str
    signature: tuple           # (op, shape key, dtype string, device type): the table / cache key
    args: tuple                # ArgRecord per positional argument, in call order

    @classmethod
    def of(cls, op: str, signature: tuple, args: tuple) -> CallRecord:
        recs = tuple(ArgRecord(tuple(a.shape), tuple(a.stride()), a.dtype) if isinstance(a, torch.Tensor)
                     else ArgRecord(value=a) for a in args)
        return cls(op, signature, recs)


@dataclass(frozen=True)
class Setting:
    """A model-level choice: set `attr` to `value` on every module holding `attr` == "auto" (e.g. the causal LM's
    cross-entropy mode, each attention module's backend)."""

    op: str
    attr: str
    value: object
    note: str = ""
    entry: dict | None = field(default=None, compare=False)   # the tune cache entry behind it (report.choices)


@dataclass(frozen=True)
class Selection:
    """Tuned implementations as a value: {(op, shape, dtype, device type): functional}, model-level settings,
    the cache entries behind the table (listed in the PatchReport) and notes (why something was not used)."""

    table: dict = field(default_factory=dict)
    settings: tuple = ()
    entries: tuple = ()
    notes: tuple = ()

    def apply(self, model: torch.nn.Module, report) -> None:
        """Install the table (merged over any selection already active) and the settings; report.revert()
        restores both."""
        for note in self.notes:
            report.add("", "tune", "note", note)
        if self.table:
            prev = install(merged(self.table))
            report._undo.append(lambda: install(prev))
        for s in self.settings:
            mods = [m for m in model.modules() if s.attr in m.__dict__]
            if not mods:  # no module of this model takes the setting: nothing applied, nothing reported
                continue
            explicit = [m for m in mods if m.__dict__[s.attr] != "auto"]
            if explicit:
                report.add("", "tune", "note", f"tune: {s.op}: the explicit setting "
                                               f"{explicit[0].__dict__[s.attr]!r} is kept over the tuned {s.value!r}")
                continue
            # a module may name the values it can run (`<attr>_allowed`, e.g. an attention with sinks: only the
            # backends that add them); the tuned value then stays off it, and the report says so
            fits = [m for m in mods if s.value in m.__dict__.get(s.attr + "_allowed", (s.value,))]
            if len(fits) < len(mods):
                report.add("", "tune", "note", f"tune: {s.op}: {s.value!r} not applied to {len(mods) - len(fits)} "
                                               f"module(s) that cannot run it (they keep 'auto')")
            for m in fits:
                m.__dict__[s.attr] = s.value
            report._undo.append(lambda mods=fits, attr=s.attr: [m.__dict__.__setitem__(attr, "auto") for m in mods])
            if s.note:
                report.add("", "tune", "note", s.note)
            if s.entry is not None:
                report.choices.append(s.entry)
        report.choices.extend(self.entries)


class _Dispatcher:
    def __init__(self, table: dict, record: bool = False):
        self.table = dict(table)
        self.seen: Counter | None = Counter() if record else None
        self.calls: dict[tuple, CallRecord] | None = {} if record else None
        from novatune.ops.registry import OPS  # here, not at module level: the registry imports the ops

        self.ops = OPS  # resolved once per dispatcher, not on every op call

    def __call__(self, op: str, *args):
        spec = self.ops.get(op)
        if spec is None:
            return None
        key = spec.call_signature(args)
        if self.seen is not None and self.calls is not None:  # recording: both are set
            self.seen[key] += 1
            rec = CallRecord.of(op, key, args)
            self.calls.setdefault((key, rec.args), rec)
        fn = self.table.get(key)
        return None if fn is None else spec.call_args(fn, args)


def install(table_or_dispatcher) -> object:
    """Make a table ({signature: functional}) or a dispatcher the active one (None or {}: the defaults);
    returns the previous ACTIVE (pass it back to restore)."""
    global ACTIVE
    prev = ACTIVE
    if isinstance(table_or_dispatcher, dict):
        ACTIVE = _Dispatcher(table_or_dispatcher) if table_or_dispatcher else None
    else:
        ACTIVE = table_or_dispatcher
    return prev


def active_table() -> dict:
    return dict(ACTIVE.table) if ACTIVE is not None else {}


def merged(table: dict) -> dict:
    """The active table with `table` laid over it."""
    out = active_table()
    out.update(table)
    return out


class recording:
    """Context manager: record the calls the ops see (keeping the active table); yields the recorder, whose
    `seen` counts calls per signature and `calls` holds one CallRecord per distinct call."""

    def __enter__(self) -> _Dispatcher:
        self.recorder = _Dispatcher(active_table(), record=True)
        self._prev = install(self.recorder)
        return self.recorder

    def __exit__(self, *exc) -> None:
        install(self._prev)


def call(op: str, *args):
    """What the public functionals call first: the selected implementation's result, or None."""
    d = ACTIVE
    return None if d is None else d(op, *args)
