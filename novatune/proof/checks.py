"""Adversarial training checks of `novatune validate` (parts d and e), run on a model as the trainer built it.

Packing contamination (d): one packed row of the configured data through the model (no labels: logits), then the
same row with every token of ONE document replaced (the first document: every later document would see a leak
through attention; then the last: every earlier one would see a non-causal leak). The other documents' logits
must not move. Correct packed attention gives bit-identical logits there (the GEMMs, norms and MLP are per token,
attention is per document, masked scores contribute exact zeros), so the tolerance is one rounding of the largest
logit: LEAK_TOL[dtype] x max|logits| (fp32 1e-6, bf16 2^-8). The perturbed document's own logits must move by
more than that, or the check would be vacuous. Run on the real model with one row: a forward without gradients
of one row is cheap even at 4B, and a smaller slice would not exercise the configured shapes.

Gradient-accumulation invariance (e): the gradients (and loss) of one optimizer step are the same whether its rows
come as one micro-batch or as one micro-batch per row (the trainer passes num_items_in_batch = target tokens of
the whole step; a loss normalised per micro-batch breaks this, trl #2175). The two rows get deliberately unequal
target counts (a full row and a row cut to ~1/4) so per-micro-batch normalisation cannot hide behind equal
counts. Error metric: ||g_split - g_joint|| / ||g_joint|| over every trainable parameter. The floor is the same
measurement on the stock model (bf16 gradients accumulate in bf16 across micro-batches: ~1e-3), tolerance
max(10 x floor, MIN) with MIN 1e-5 (fp32) / 1e-2 (bf16); a per-micro-batch mean errs by tens of percent.
"""
from __future__ import annotations

import math

import torch

from novatune.data.collate import IGNORE, collate, model_inputs
from novatune.data.formats import Doc

LEAK_TOL = {"float32": 1e-6, "bfloat16": 2.0 ** -8}
GA_MIN_TOL = {"float32": 1e-5, "bfloat16": 1e-2}
GA_FACTOR = 10.0


def _dtype_key(model) -> str:
    return str(next(model.parameters()).dtype).replace("torch.", "")


def pick_row(rows: list[list[Doc]], min_docs: int = 3, scan: int = 32) -> list[Doc]:
    """A packed row with the most documents among the first `scan` rows; when none holds min_docs (packing off,
    long documents), one row composed of several rows' documents, each cut so that min_docs fit."""
    best = max(rows[:scan], key=len)
    if len(best) >= min_docs:
        return best
    cap = sum(len(d[0]) for d in best)  # the row length the config produces
    docs = [d for r in rows[:scan] for d in r][:min_docs]
    if len(docs) < 2:
        raise ValueError("the data holds fewer than 2 documents: packing contamination cannot be tested")
    each = max(2, cap // len(docs))
    return [(ids[:each], mask[:each]) for ids, mask in docs]


def _logits(model, batch: dict, device, mode) -> torch.Tensor:
    kw = model_inputs(batch, device, mode)
    kw.pop("labels")
    with torch.no_grad():
        return model(**kw, use_cache=False).logits  # (1, T, V)


def contamination(model, row: list[Doc], vocab: int, device, mode, seed: int = 0) -> list[dict]:
    """Per perturbed document (first, last): its own logit change and the largest change anywhere else."""
    was_training = model.training
    model.eval()  # no dropout; novatune's packed path and HF's packed mask both apply with use_cache=False
    try:
        base = _logits(model, collate([row]), device, mode)
        scale = base.abs().max().float().item()
        bounds, at = [], 0
        for ids, _ in row:
            bounds.append((at, at + len(ids)))
            at += len(ids)
        g = torch.Generator().manual_seed(seed)
        out = []
        for j in sorted({0, len(row) - 1}):
            ids, mask = row[j]
            shift = torch.randint(1, vocab, (len(ids),), generator=g)
            new_ids = ((torch.tensor(ids) + shift) % vocab).tolist()  # every token replaced by a different one
            pert = list(row)
            pert[j] = (new_ids, mask)
            logits = _logits(model, collate([pert]), device, mode)
            own, leak = 0.0, 0.0
            for k, (a, b) in enumerate(bounds):
                d = (logits[0, a:b].float() - base[0, a:b].float()).abs().max().item()
                if k == j:
                    own = d
                else:
                    leak = max(leak, d)
            out.append({"perturbed_doc": j, "docs": len(row), "tokens": at, "own_change": own, "max_leak": leak,
                        "leak_rel": leak / max(scale, 1e-30), "own_rel": own / max(scale, 1e-30),
                        "logit_scale": scale})
            del logits
        return out
    finally:
        model.train(was_training)


def contamination_check(results: dict[str, list[dict]], dtype: str) -> dict:
    """results: stack -> contamination() rows; only 'novatune' decides, 'stock' shows the check is not vacuous."""
    tol = LEAK_TOL.get(dtype, LEAK_TOL["bfloat16"])
    rows = [{"stack": s, **r} for s, rs in results.items() for r in rs]
    problems = []
    for r in rows:
        if r["stack"] != "novatune":
            continue
        where = "first" if r["perturbed_doc"] == 0 else "last"
        if not r["leak_rel"] <= tol:
            problems.append(f"changing the {where} document of a packed row moved other documents' logits by "
                            f"{r['max_leak']:.3e} ({r['leak_rel']:.1e} of the largest logit, tolerance {tol:.1e}): "
                            f"attention crosses document boundaries")
        if not r["own_rel"] > tol:
            problems.append(f"changing the {where} document did not change its own logits ({r['own_rel']:.1e}): "
                            f"the check saw nothing")
    nova = [r for r in rows if r["stack"] == "novatune"]
    if not nova:
        problems.append("no novatune rows")
    msg = "; ".join(problems) if problems else (
        f"perturbing one document leaves the other {nova[0]['docs'] - 1} documents' logits unchanged (max "
        f"{max(r['leak_rel'] for r in nova):.1e} of the largest logit, tolerance {tol:.1e})")
    return {"name": "packing_contamination", "passed": not problems, "message": msg, "tolerance": tol, "rows": rows}


def ga_rows(rows: list[list[Doc]], max_length: int) -> tuple[list[Doc], list[Doc]]:
    """A full row and a row cut to ~1/4 of max_length (windows of its documents, each reaching the document's
    first target token), so the two micro-batches carry very different target-token counts."""
    full = max(rows[:32], key=lambda r: sum(len(d[0]) for d in r))
    other = next((r for r in rows[:33] if r is not full), full)  # one row only: its own quarter
    budget, short = max(8, max_length // 4), []
    for ids, mask in other:
        room = budget - sum(len(d[0]) for d in short)
        if room < 2:
            break
        first = next((i for i in range(1, len(mask)) if mask[i]), None)
        if first is None:
            continue
        # a window that ends past the first target (a long masked prompt would leave a prefix with none)
        start = max(0, min(first - 1, first + 1 - room))
        short.append((ids[start:start + room], mask[start:start + room]))
    if not short:
        from novatune.data.sources import DataError

        raise DataError("validate: no row of the data has a document with a training target (a label that is not "
                        "masked): the gradient-accumulation check has nothing to compare; check data.loss_on and the "
                        "data")
    return full, short


def _grads(model, mbs: list[dict], device, mode) -> tuple[float, dict[str, torch.Tensor]]:
    from novatune.train.session import forward_backward

    model.zero_grad(set_to_none=True)
    loss = forward_backward(model, mbs, device, mode)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(loss), grads


def grad_accum_error(model, full: list[Doc], short: list[Doc], device, mode, pad_id: int = 0) -> dict:
    """One step's rows as one micro-batch vs one micro-batch per row: relative gradient and loss error."""
    joint = [collate([full, short], pad_id)]
    split = [collate([full], pad_id), collate([short], pad_id)]
    loss_j, g_j = _grads(model, joint, device, mode)
    loss_s, g_s = _grads(model, split, device, mode)
    if g_j.keys() != g_s.keys() or not g_j:
        raise RuntimeError(f"different parameters got gradients: {sorted(set(g_j) ^ set(g_s))[:4]}")
    num = den = 0.0
    for n in g_j:
        num += (g_s[n].float() - g_j[n].float()).pow(2).sum().item()
        den += g_j[n].float().pow(2).sum().item()
    return {"grad_rel_err": math.sqrt(num) / max(math.sqrt(den), 1e-30),
            "loss_rel_err": abs(loss_s - loss_j) / max(abs(loss_j), 1e-30), "loss_joint": loss_j,
            "loss_split": loss_s, "tokens": [int((b["labels"][:, 1:] != IGNORE).sum()) for b in split]}


def grad_accum_check(nova: dict, stock: dict, dtype: str) -> dict:
    floor = max(stock["grad_rel_err"], stock["loss_rel_err"])
    tol = max(GA_FACTOR * floor, GA_MIN_TOL.get(dtype, GA_MIN_TOL["bfloat16"]))
    worst = max(nova["grad_rel_err"], nova["loss_rel_err"])
    ok = worst <= tol
    t = nova["tokens"]
    msg = (f"rows as one micro-batch vs one per row (target tokens {t[0]} and {t[1]}): gradient error "
           f"{nova['grad_rel_err']:.2e}, loss error {nova['loss_rel_err']:.2e}, tolerance {tol:.2e} (stock: "
           f"{floor:.2e})")
    if not ok:
        msg = ("gradient accumulation is not invariant - the loss is not normalised by the whole step's target "
               "tokens (num_items_in_batch): " + msg)
    return {"name": "grad_accum_invariance", "passed": ok, "message": msg, "floor": floor, "tolerance": tol,
            "novatune": nova, "stock": stock}
