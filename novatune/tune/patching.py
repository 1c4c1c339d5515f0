"""`novatune.patch(model, tune=...)`: read the tune cache (default) or tune the model's ops now, install the
selection, and list every choice in the PatchReport. The model-level choices (linear cross-entropy mode,
attention backend: novatune.tune.model_choices) are set on the patched model itself where patch left "auto".

The selection is process-wide (the ops' dispatch hook is keyed by op, shape, dtype and device, like a kernel
autotuner's cache), so a second patched model with the same shapes shares it; report.revert() restores the hook
that was installed before this patch.
"""
from __future__ import annotations

import time

import torch

from novatune.tune import select
from novatune.tune.cache import CacheError, TuneCache, environment, selection_from_cache

TUNE_BUDGET_S = 240.0  # patch(tune=True): op tuning stops starting new candidates after this long
FAMILIES = None        # patch(tune=True) tries every family (tests narrow this to keep CPU runs short)
ITERS = 100            # timed fwd+bwd calls per candidate
ALLOW_MORE_MEMORY = False  # True: a CE mode may be picked even if its peak memory exceeds the default mode's
DOC_TOKENS = 1024      # patch(tune=True) times attention on rows of tokens // DOC_TOKENS documents


def apply_tuning(model: torch.nn.Module, report, tune, tokens: int) -> None:
    if tune not in (True, "cache"):
        raise ValueError(f"tune={tune!r}: use 'cache' (default), True (tune now) or False")
    device = next(model.parameters()).device
    try:
        cache = TuneCache.load()
    except CacheError as e:
        if tune != "cache":
            cache, note = TuneCache.load_or_reset()
            report.add("", "tune", "note", note)
        else:
            report.add("", "tune", "note", f"{e}; built-in defaults used")
            return
    if tune is True:
        for note in tune_model(model, cache, tokens):
            report.add("", "tune", "note", note)
        cache.save()
    table, used, notes = selection_from_cache(cache, device)
    for note in notes:
        report.add("", "tune", "note", note)
    if table:
        prev = select.installed()
        merged = dict(prev.table if prev else {})
        merged.update(table)
        select.install(select.Dispatcher(merged))
        report.choices.extend(used)
        report._undo.append(lambda: select.install(prev))
    _apply_model_choices(model, report, cache, device, tokens)


def _apply_model_choices(model, report, cache: TuneCache, device, tokens: int) -> None:
    """The cross-entropy mode and attention backend recorded for this model's shapes, set where patch left "auto"."""
    from novatune.tune import model_choices

    picked = model_choices.pick_entries(cache.matching(environment(device)), model, tokens)
    used, notes, undo = model_choices.apply(model, picked)
    for note in notes:
        report.add("", "tune", "note", note)
    report.choices.extend(used)
    report._undo.append(undo)


def _synthetic_batch(model, tokens: int, device) -> dict:
    vocab = int(model.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, tokens), generator=g).to(device)
    return {"input_ids": ids, "labels": ids, "position_ids": torch.arange(tokens, device=device)[None]}


def tune_model(model: torch.nn.Module, cache: TuneCache, tokens: int, budget_s: float = TUNE_BUDGET_S,
               log=print) -> list[str]:
    """Tune every (op, shape) one forward of `model` on `tokens` synthetic tokens dispatches, then check a whole
    forward+backward (the model's .grad are restored afterwards); store the entries in `cache`. Returns notes."""
    from novatune.tune.engine import step_check, tune_op

    device = next(model.parameters()).device
    batch = _synthetic_batch(model, tokens, device)
    with select.recording() as rec, torch.no_grad():
        model(**batch, use_cache=False)
    env = environment(device)
    deadline = time.perf_counter() + budget_s
    entries, table, notes = [], {}, []
    from novatune.tune import model_choices

    seen = [(op, shape, dtype) for op, shape, dtype, _dev in rec.seen]
    # the model-level ops (CE mode, attention backend) at this batch's shapes; docs: a packed-row stand-in
    seen += model_choices.model_op_shapes(model, tokens, docs=max(1, tokens // DOC_TOKENS))
    for op, shape, dtype in seen:
        entry, cands = tune_op(op, shape, getattr(torch, dtype.split("/")[0]), device, env=env, deadline=deadline,
                               families=FAMILIES, iters=ITERS, allow_more_memory=ALLOW_MORE_MEMORY, log=log)
        entries.append(entry)
        if entry["choice"] != "novatune_default" and not model_choices.is_model_level(op):
            table[(op, tuple(shape), dtype, device.type)] = cands[entry["choice"]].functional()
    picked = model_choices.pick_entries(entries, model, tokens)
    settings = model_choices.toggler(model, picked) if any(
        model_choices.setting_of(e) for e in picked.values()) else None
    if table or settings:
        saved = {p: p.grad for p in model.parameters()}

        def step():
            model(**batch, use_cache=False).loss.backward()
            for p in model.parameters():
                p.grad = None
        try:
            check = step_check(step, table, settings=settings)
        finally:
            for p, g in saved.items():
                p.grad = g
        for e in entries:
            e.update(kept=check["kept"], kept_reason=check["reason"], step_check=check)
        notes.append(f"tune: whole-step check: {check['reason']}")
    for e in entries:
        cache.put(e)
    if not rec.seen:
        notes.append("tune: the model's forward dispatched no tunable op (nothing tuned)")
    return notes
