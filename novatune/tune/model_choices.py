"""Model-level choices: ops whose implementation is a setting on the patched model, not a per-call dispatch
(their SPEC's `setting`: the module attribute patch reads and the candidate parameter holding its value; e.g. the
causal LM's cross-entropy mode, each attention module's backend).

These ops are not called through the dispatch table, so their real shapes come from the model's config and the
run's batch (SPEC.model_shape), and a choice becomes a novatune.ops.dispatch.Setting, applied by the Selection
where patch left "auto" (an explicit setting wins, with a note). An entry matches a model when its shape is the
model's at the entry's token count and the dtype is the model's; among several token counts the one equal to
`tokens` is used, else the largest (memory matters most there).
"""
from __future__ import annotations

import torch

from novatune.ops.dispatch import Selection, Setting
from novatune.ops.registry import OPS
from novatune.tune.calls import model_level, shape_str


def _modules_with(model: torch.nn.Module, attr: str) -> list[torch.nn.Module]:
    return [m for m in model.modules() if attr in m.__dict__]


def _dtype(model) -> str:
    return str(next(model.parameters()).dtype)[6:]


def model_op_shapes(model: torch.nn.Module, tokens: int, docs: int = 1) -> list[tuple[str, tuple, str]]:
    """[(op, shape, dtype string)] of the model-level ops this patched model runs on `tokens` tokens per micro-batch
    holding `docs` documents (only the ops patch replaced: their setting attribute is on some module)."""
    return [(spec.name, tuple(spec.model_shape(model.config, tokens, docs)), _dtype(model))
            for spec in OPS.values() if spec.setting is not None and _modules_with(model, spec.setting[0])]


def _matches(entry: dict, model) -> bool:
    spec, shape = OPS[entry["op"]], tuple(entry["shape"])
    return entry["dtype"] == _dtype(model) and tuple(spec.model_shape(model.config, shape[0], shape[-1])) == shape


def pick_entries(entries: list[dict], model, tokens: int) -> dict[str, dict]:
    """{op: entry} among kept model-level entries matching `model` (exact token count first, else the largest)."""
    best: dict[str, dict] = {}
    for e in entries:
        if not model_level(e.get("op", "")) or not e.get("kept", False) or not _matches(e, model):
            continue
        cur = best.get(e["op"])
        rank = (e["shape"][0] == tokens, e["shape"][0])
        if cur is None or rank > (cur["shape"][0] == tokens, cur["shape"][0]):
            best[e["op"]] = e
    return best


def setting_of(entry: dict):
    """The value patch sets for this entry's choice (None for the default: nothing to change)."""
    if entry["choice"] == "novatune_default":
        return None
    return (entry.get("params") or {}).get(OPS[entry["op"]].setting[1])


def selection(entries: dict[str, dict]) -> Selection:
    """The settings of the picked entries, as a Selection (no table: these ops are not dispatched per call)."""
    settings = []
    for op, e in entries.items():
        value = setting_of(e)
        if value is None:
            continue
        attr, param = OPS[op].setting
        settings.append(Setting(op, attr, value, f"tune: {op} {shape_str(e['shape'])}: {param} {value!r} "
                                                 f"({e['reason']})", entry=e))
    return Selection(settings=tuple(settings))


def toggler(model: torch.nn.Module, entries: dict[str, dict]):
    """settings(on) for engine.step_check: the tuned settings on, or back to "auto"."""
    from novatune.patch.report import PatchReport

    state = {"report": None}
    sel = selection(entries)

    def settings(on: bool) -> None:
        if state["report"] is not None:
            state["report"].revert()
            state["report"] = None
        if on:
            state["report"] = PatchReport(family=None, model_class=type(model).__name__)
            sel.apply(model, state["report"])
    return settings
