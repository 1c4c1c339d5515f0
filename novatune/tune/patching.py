"""`novatune.patch(model, tune=...)`: the Selection for a patched model, from the tune cache (default) or from
tuning the model's ops now. The model-level choices (novatune.tune.model_choices) become settings the Selection
applies where patch left "auto". The facade (novatune.patch) installs the value: Selection.apply(model, report).

The installed table is process-wide (keyed by op, shape, dtype and device, like a kernel autotuner's cache), so a
second patched model with the same shapes shares it; report.revert() restores the table active before this patch.
"""
from __future__ import annotations

import time

import torch

from novatune.memory.host_embedding import compute_device
from novatune.ops import dispatch
from novatune.ops.dispatch import Selection
from novatune.tune import model_choices
from novatune.tune.cache import CacheError, TuneCache, environment, selection_from_cache
from novatune.tune.calls import model_level

TUNE_BUDGET_S = 240.0  # patch(tune=True): op tuning stops starting new candidates after this long
FAMILIES = None        # patch(tune=True) tries every family (tests narrow this to keep CPU runs short)
ITERS = 100            # timed fwd+bwd calls per candidate
ALLOW_MORE_MEMORY = False  # True: a CE mode may be picked even if its peak memory exceeds the default mode's
DOC_TOKENS = 1024      # patch(tune=True) times attention on rows of tokens // DOC_TOKENS documents


def selection_for(model: torch.nn.Module, tune, tokens: int) -> Selection:
    """The Selection for this patched model: the cache's choices for its device and versions (tune="cache"), after
    tuning its ops now when tune=True. Notes say what was not used and why; nothing is installed here."""
    if tune not in (True, "cache"):
        raise ValueError(f"tune={tune!r}: use 'cache' (default), True (tune now) or False")
    device = compute_device(model)
    notes: list[str] = []
    try:
        cache = TuneCache.load()
    except CacheError as e:
        if tune != "cache":
            cache, note = TuneCache.load_or_reset()
            notes.append(note)
        else:
            return Selection(notes=(f"{e}; built-in defaults used",))
    if tune is True:
        notes += tune_model(model, cache, tokens)
        cache.save()
    table, used, cache_notes = selection_from_cache(cache, device)
    settings = model_choices.selection(model_choices.pick_entries(cache.matching(environment(device)), model, tokens))
    return Selection(table=table, settings=settings.settings, entries=tuple(used),
                     notes=tuple(notes + cache_notes))


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

    device = compute_device(model)
    batch = _synthetic_batch(model, tokens, device)
    with dispatch.recording() as rec, torch.no_grad():
        model(**batch, use_cache=False)
    env = environment(device)
    deadline = time.perf_counter() + budget_s
    entries, table, notes = [], {}, []
    seen = [(op, shape, dtype) for op, shape, dtype, _dev in rec.seen]
    # the model-level ops (CE mode, attention backend) at this batch's shapes; docs: a packed-row stand-in
    seen += model_choices.model_op_shapes(model, tokens, docs=max(1, tokens // DOC_TOKENS))
    for op, shape, dtype in seen:
        calls = [r for r in rec.calls.values() if r.signature[:3] == (op, tuple(shape), dtype)]
        entry, cands = tune_op(op, shape, getattr(torch, dtype.split("/")[0]), device, env=env, deadline=deadline,
                               families=FAMILIES, iters=ITERS, allow_more_memory=ALLOW_MORE_MEMORY, log=log,
                               calls=calls)
        entries.append(entry)
        if entry["choice"] != "novatune_default" and not model_level(op):
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
