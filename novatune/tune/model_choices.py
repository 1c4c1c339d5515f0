"""Model-level choices: the linear cross-entropy mode and the attention backend of a patched model.

These ops are not called through the dispatch hook, so their real shapes come from the model's config and the
run's batch (`model_op_shapes`), and a choice is applied as the setting patch itself uses (`apply`):

    linear_cross_entropy (tokens, hidden, vocab)  -> model._novatune_ce_mode        (patch's cross_entropy_mode)
    attention (tokens, hq, hk, head_dim, docs)    -> module._novatune_attn_backend  (patch's attention=)

Only settings the user left on "auto" are replaced (an explicit cross_entropy_mode / attention= wins, with a
note). An entry matches a model when its (hidden, vocab) / (hq, hk, head_dim) and dtype are the model's; among
several token counts the one equal to `tokens` is used, else the largest (memory matters most there).
"""
from __future__ import annotations

import torch

from novatune.tune.opspecs import OPS

SETTING = {"linear_cross_entropy": ("_novatune_ce_mode", "mode"), "attention": ("_novatune_attn_backend", "backend")}


def _targets(model: torch.nn.Module, op: str) -> list[torch.nn.Module]:
    attr = SETTING[op][0]
    if op == "linear_cross_entropy":
        return [model] if attr in model.__dict__ else []
    return [m for m in model.modules() if attr in m.__dict__]


def _dtype(model) -> str:
    return str(next(model.parameters()).dtype)[6:]


def model_op_shapes(model: torch.nn.Module, tokens: int, docs: int = 1) -> list[tuple[str, tuple, str]]:
    """[(op, shape, dtype string)] of the model-level ops this patched model runs on `tokens` tokens per micro-batch
    holding `docs` documents (only the ops patch replaced: a fused CE, novatune attention)."""
    cfg = model.config
    dt = _dtype(model)
    out = []
    if _targets(model, "linear_cross_entropy"):
        out.append(("linear_cross_entropy", (tokens, int(cfg.hidden_size), int(cfg.vocab_size)), dt))
    if _targets(model, "attention"):
        hq = int(cfg.num_attention_heads)
        hk = int(getattr(cfg, "num_key_value_heads", None) or hq)
        d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // hq)
        out.append(("attention", (tokens, hq, hk, d, max(1, min(docs, tokens))), dt))
    return out


def _matches(entry: dict, model) -> bool:
    cfg, shape = model.config, entry["shape"]
    if entry["dtype"] != _dtype(model):
        return False
    if entry["op"] == "linear_cross_entropy":
        return list(shape[1:]) == [int(cfg.hidden_size), int(cfg.vocab_size)]
    hq = int(cfg.num_attention_heads)
    hk = int(getattr(cfg, "num_key_value_heads", None) or hq)
    d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // hq)
    return list(shape[1:4]) == [hq, hk, d]


def pick_entries(entries: list[dict], model, tokens: int) -> dict[str, dict]:
    """{op: entry} among kept model-level entries matching `model` (exact token count first, else the largest)."""
    best: dict[str, dict] = {}
    for e in entries:
        if e.get("op") not in SETTING or not e.get("kept", False) or not _matches(e, model):
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
    return (entry.get("params") or {}).get(SETTING[entry["op"]][1])


def apply(model: torch.nn.Module, entries: dict[str, dict]) -> tuple[list[dict], list[str], callable]:
    """Set each chosen mode/backend on the patched model where it is on "auto". Returns (entries applied, notes,
    undo)."""
    used, notes, undo = [], [], []
    for op, e in entries.items():
        value = setting_of(e)
        if value is None:
            continue
        attr = SETTING[op][0]
        mods = _targets(model, op)
        explicit = [m for m in mods if m.__dict__[attr] != "auto"]
        if explicit:
            notes.append(f"tune: {op}: the explicit setting {explicit[0].__dict__[attr]!r} is kept over the tuned "
                         f"{value!r}")
            continue
        if not mods:
            continue
        for m in mods:
            m.__dict__[attr] = value
        undo.append(lambda mods=mods, attr=attr: [m.__dict__.__setitem__(attr, "auto") for m in mods])
        used.append(e)
        notes.append(f"tune: {op} {'x'.join(map(str, e['shape']))}: {SETTING[op][1]} {value!r} on "
                     f"{len(mods)} module(s) ({e['reason']})")

    def revert():
        while undo:
            undo.pop()()
    return used, notes, revert


def toggler(model: torch.nn.Module, entries: dict[str, dict]):
    """settings(on) for engine.step_check: the tuned settings on, or back to "auto"."""
    state = {"undo": None}

    def settings(on: bool) -> None:
        if state["undo"] is not None:
            state["undo"]()
            state["undo"] = None
        if on:
            state["undo"] = apply(model, entries)[2]
    return settings


def is_model_level(op: str) -> bool:
    return op in OPS and OPS[op].applied_by == "patch"
