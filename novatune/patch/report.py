"""PatchReport: what `novatune.patch` replaced, what it skipped and why, and how to undo it."""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class PatchEntry:
    path: str  # module path inside the model, e.g. "model.layers.3.mlp"
    kind: str  # rms_norm | qk_norm | mlp | attention | cross_entropy | packing
    action: str  # "replaced" | "skipped" | "note"
    detail: str  # the implementation used, or why it was skipped


@dataclass
class PatchReport:
    family: str | None
    model_class: str
    entries: list[PatchEntry] = field(default_factory=list)
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)
    reverted: bool = False
    # implementations chosen by `novatune tune` (novatune.tune.engine.tune_op cache entries: op, shape, choice,
    # timings, errors, reason, every candidate's verdict), in effect while this patch is applied
    choices: list[dict] = field(default_factory=list)
    # what actually ran since the patch: "cross_entropy" counts fused-loss forwards, "bypassed_loss" training
    # forwards that reached the decoder without it (someone else computed the loss)
    calls: Counter = field(default_factory=Counter)
    options: dict = field(default_factory=dict)  # the keyword options of the patch() call that made it
    # a report that came with a copy of its model (copy.deepcopy, pickle): its undo steps stayed with the original
    copied: bool = False

    def __getstate__(self) -> dict:
        """A copy (deepcopy, pickle) keeps what was patched but not the undo steps: they are closures over the
        original model's modules, and running them from the copy would un-patch the original."""
        state = dict(self.__dict__)
        state["_undo"], state["copied"] = [], True
        return state

    def add(self, path: str, kind: str, action: str, detail: str) -> None:
        self.entries.append(PatchEntry(path, kind, action, detail))

    def replaced(self, kind: str | None = None) -> list[PatchEntry]:
        return [e for e in self.entries if e.action == "replaced" and (kind is None or e.kind == kind)]

    def skipped(self, kind: str | None = None) -> list[PatchEntry]:
        return [e for e in self.entries if e.action == "skipped" and (kind is None or e.kind == kind)]

    def revert(self) -> None:
        """Restore every patched module and remove every hook, newest first. Safe to call twice."""
        if self.copied and not self.reverted:
            raise RuntimeError("this report came with a copy of a patched model (copy.deepcopy or pickle); its undo "
                               "steps belong to the original model: revert the original before copying it, or "
                               "patch a fresh (unpatched) model instead")
        while self._undo:
            self._undo.pop()()
        self.reverted = True

    def to_dict(self) -> dict:
        return {
            "family": self.family,
            "model_class": self.model_class,
            "reverted": self.reverted,
            "replaced": dict(Counter(e.kind for e in self.replaced())),
            "skipped": [e.__dict__ for e in self.skipped()],
            "notes": [e.detail for e in self.entries if e.action == "note"],
            "calls": dict(self.calls),
            "implementations": sorted({f"{e.kind}: {e.detail}" for e in self.replaced()}),
            "tuned": [{k: c.get(k) for k in ("op", "shape", "dtype", "choice", "family", "params", "chosen_us",
                                             "default_us", "stock_us", "floor_us", "reason", "kept")}
                      | {"error": _max_error(c)} for c in self.choices],
        }

    def __str__(self) -> str:
        lines = [f"novatune.patch: {self.model_class} (family: {self.family or 'unsupported'})"
                 + ("  [reverted]" if self.reverted else "")]
        groups: dict[tuple[str, str], int] = Counter((e.kind, e.detail) for e in self.replaced())
        for (kind, detail), n in sorted(groups.items()):
            lines.append(f"  replaced {n:4d} x {kind:14s} -> {detail}")
        skipped: dict[tuple[str, str], list[str]] = {}
        for e in self.skipped():
            skipped.setdefault((e.kind, e.detail), []).append(e.path)
        for (kind, why), paths in sorted(skipped.items()):
            where = paths[0] + (f" (+{len(paths) - 1} more)" if len(paths) > 1 else "")
            lines.append(f"  skipped  {len(paths):4d} x {kind:14s} at {where}: {why}")
        for e in self.entries:
            if e.action == "note":
                lines.append(f"  note: {e.detail}")
        if self.replaced("cross_entropy") or self.calls:
            lines.append(f"  calls:   fused cross-entropy ran {self.calls['cross_entropy']} times"
                         + (f"; {self.calls['bypassed_loss']} training forwards computed the loss elsewhere"
                            if self.calls["bypassed_loss"] else ""))
        for c in self.choices:
            shape = "x".join(map(str, c["shape"]))
            dflt = f", default {c['default_us']:.1f} µs" if c.get("default_us") else ""
            err = _max_error(c)
            lines.append(f"  tuned    {c['op']} {shape} {c['dtype']}: {c['choice']} {c['chosen_us']:.1f} µs{dflt}"
                         + (f", rel err {err:.1e}" if err is not None else "") + f" ({c['reason']})")
        return "\n".join(lines)


def _max_error(choice: dict) -> float | None:
    """The chosen candidate's largest relative error over outputs, gradients and shapes (from validation)."""
    rec = next((r for r in choice.get("candidates", []) if r.get("name") == choice.get("choice")), None)
    errs = list((rec or {}).get("errors", {}).values())
    return max(errs) if errs else None
