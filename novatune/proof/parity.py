"""Training parity, stock vs novatune, judged against a measured noise floor (`novatune validate`, part a-c).

The noise floor: two *stock* runs that differ only in an equally valid kernel choice - HF's `sdpa` attention (the
reference run) and HF's `eager` attention (the floor run). Both are correct; they differ only in rounding (eager
rounds the scores to the model dtype and takes the softmax in fp32, sdpa fuses both in one kernel), which is the
kind of difference novatune's kernels make, so "stock vs novatune" should look like "sdpa vs eager", not larger by
orders of magnitude. Eager rather than sdpa's math backend: it is a config switch of the trainer itself
(model.attention), works on every device, and uses the same packed-document mask HF builds from position_ids.

Tolerance = max(FACTOR x floor, MIN[dtype]) per compared quantity, FACTOR = 10: novatune replaces ~5 kinds of ops
where the floor pair differs in one (attention); independent rounding differences add roughly in quadrature
(sqrt 5 = 2.2x), and per-step values scatter ~2-3x around their typical size. Real bugs (a wrong eps, attention
across documents, a mis-normalised loss) move these figures by orders of magnitude over the floor
(tests/proof plants each one). MIN keeps a floor that happens to come out ~0 from failing everything:
  fp32: floors measured on the tiny CPU test model: loss ~9e-8 (one fp32 ulp of the loss), grad norm ~2e-7,
        weight update ~3e-5 (AdamW's first step moves every weight by lr x sign(g), so a near-zero gradient whose
        sign flips moves that weight by 2 lr). MIN: 1e-6, 1e-5, 1e-3 - well above those, far below the planted
        faults (wrong eps: 7e-5 loss, 1e-2 grad norm, 6e-2 weights);
  bf16: the loss is a mean of fp32 cross-entropies over bf16 logits: a systematic rounding of 2^-8 on logits of
        size ~1 moves it by up to ~3e-4 relative -> MIN 5e-4 (on the H200, bench/results/e2e.jsonl: stock vs
        novatune per-step losses differ by <= 6e-5, and two stock runs by up to 4e-5: GPU backward kernels are not
        deterministic); the grad norm takes bf16 gradients (2^-9 per element, partly systematic) -> 5e-3; an
        update of lr=1e-5 is below half an ulp of most bf16 weights, so whether a weight moves at all is decided
        by rounding and sign flips weigh heavily -> 0.25 (the table's CHANGED columns still must hold).

Files written by `novatune validate` (schema; the report builder reads them):

  <run_dir>/validate.json   {time, device, capability, cuda, torch, triton, transformers, liger_kernel, peft,
                             git_sha (measure/results.environment()), config: str, overrides: [str], steps: int,
                             dtype: str, device_type: str, layers: [int], factor: float, passed: bool,
                             noise_floor: {reference: "stock (sdpa)", alternative: "stock (eager)", why: str},
                             checks: [{name: str, passed: bool, message: str, ...details below}],
                             runs: {stock|stock_eager|novatune: {losses: [float], grad_norms: [float],
                                    output_dir: str, attention: str, patch: PatchReport.to_dict() | null}}}
    checks, in order, with their details:
      same_init       mismatched: [param names whose initial weights differ between the runs]
      loss_parity     floor: float, tolerance: float, max_rel_diff: float, per_step: [{step, stock, stock_eager,
                      novatune, floor_rel, novatune_rel}]
      weight_change   floor: float, tolerance: float, max_update_rel_diff: float, unchanged: [str], rows: (the
                      weight_change.json rows)
      grad_norm       floor, tolerance, max_rel_diff, per_step: [{step, stock, stock_eager, novatune, floor_rel,
                      novatune_rel}]
      packing_contamination   (proof/checks.py) tolerance, rows: [{stack, perturbed_doc, own_change,
                      max_leak, leak_rel, docs, tokens}] for novatune and for stock (the check's sanity run)
      grad_accum_invariance   (proof/checks.py) floor (stock's error), tolerance, novatune: {grad_rel_err,
                      loss_rel_err, tokens: [target tokens per micro-batch]}, stock: {...}
  <run_dir>/weight_change.json   [{layer: int, param: str (e.g. "self_attn.q_proj.weight"),
                             stock_vs_base: "CHANGED" | "UNCHANGED", stock_update_rel: ||Ws-W0||/||W0||,
                             stock_changed_frac: fraction of elements that moved, novatune_vs_base, novatune_update_rel,
                             novatune_changed_frac, stock_vs_novatune_max_abs: max|Ws-Wn|,
                             stock_vs_novatune_max_rel: max|Ws-Wn| / max|Ws-W0| (largest disagreement in units of
                             the largest update), stock_vs_novatune_update_rel: ||Ws-Wn|| / ||Ws-W0||,
                             floor_update_rel: ||Ws-We|| / ||Ws-W0|| (eager run), verdict: "MATCH" | "DIFFER"}]
  <run_dir>/<run>/           each training run's own output (config.yaml, metrics.jsonl, summary.json, train.log)
"""
from __future__ import annotations

import re

import torch

FACTOR = 10.0
MIN_TOL = {
    "loss": {"float32": 1e-6, "bfloat16": 5e-4},
    "grad_norm": {"float32": 1e-5, "bfloat16": 5e-3},
    "weight_update": {"float32": 1e-3, "bfloat16": 0.25},
}
NOISE_FLOOR_WHY = ("two stock runs differing only in an equally valid attention kernel (HF sdpa vs HF eager): "
                   "their difference is pure rounding, the yardstick for novatune's kernels")


def min_tol(kind: str, dtype: str) -> float:
    table = MIN_TOL[kind]
    return table.get(dtype, table["bfloat16"])  # fp16 and others: the low-precision figure


def tolerance(floor: float, kind: str, dtype: str) -> float:
    return max(FACTOR * floor, min_tol(kind, dtype))


def rel_diffs(values: list[float], ref: list[float]) -> list[float]:
    if len(values) != len(ref):
        raise ValueError(f"runs logged different step counts ({len(values)} vs {len(ref)})")
    return [abs(v - r) / max(abs(r), 1e-30) for v, r in zip(values, ref)]


def series_check(name: str, kind: str, what: str, ref: list[float], alt: list[float], cand: list[float],
                 dtype: str) -> dict:
    """Per-step parity of one logged series (loss, grad norm): candidate vs reference within the floor's tolerance."""
    floor_rel, cand_rel = rel_diffs(alt, ref), rel_diffs(cand, ref)
    floor = max(floor_rel)
    tol = tolerance(floor, kind, dtype)
    worst = max(cand_rel)
    bad = [i + 1 for i, x in enumerate(cand_rel) if not x <= tol]  # NaN fails too
    per_step = [{"step": i + 1, "stock": r, "stock_eager": a, "novatune": c, "floor_rel": f, "novatune_rel": x}
                for i, (r, a, c, f, x) in enumerate(zip(ref, alt, cand, floor_rel, cand_rel))]
    if bad:
        msg = (f"{what}: novatune differs from stock by up to {worst:.2e} relative (steps {bad}), over the "
               f"tolerance {tol:.2e} = max({FACTOR:g} x floor {floor:.2e}, min {min_tol(kind, dtype):.0e})")
    else:
        msg = (f"{what}: max relative difference {worst:.2e} <= tolerance {tol:.2e} (floor {floor:.2e}: stock "
               f"eager vs sdpa)")
    return {"name": name, "passed": not bad, "message": msg, "floor": floor, "tolerance": tol,
            "max_rel_diff": worst, "per_step": per_step}


# ------------------------------------------------------------------------------------------ weight snapshots
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")


def layer_params(model, layers: list[int]) -> dict[tuple[int, str], torch.nn.Parameter]:
    """The trainable matrices (every projection; LoRA: the adapters) of the chosen decoder layers, keyed
    (layer, name inside the layer). 1-D weights (norms) are left out: a bf16 weight of 1.0 has an ulp of 2^-7,
    which no fine-tuning learning rate moves in a few steps, so "UNCHANGED" there says nothing."""
    out = {}
    for name, p in model.named_parameters():
        m = _LAYER.search(name)
        if m and int(m.group(1)) in layers and p.requires_grad and p.dim() == 2:
            out[(int(m.group(1)), m.group(2))] = p
    return out


def snapshot(model, layers: list[int]) -> dict[tuple[int, str], torch.Tensor]:
    """CPU copies (in the weights' own dtype) of the chosen layers' matrices: the headline model is 4B parameters,
    so only these layers are kept, and off the GPU."""
    return {k: p.detach().to("cpu", copy=True) for k, p in layer_params(model, layers).items()}


def _norm(x: torch.Tensor) -> float:
    return torch.linalg.vector_norm(x, dtype=torch.float64).item()  # fp64 accumulation of a 25M-element matrix


def _stats(w: torch.Tensor, w0: torch.Tensor) -> tuple[float, float, float]:
    # differences of bf16 (or fp32) weights are exact or nearly so in fp32; fp64 copies of 4B-model layers
    # would only cost time
    d = w.float() - w0.float()
    return _norm(d) / max(_norm(w0.float()), 1e-30), (d != 0).float().mean().item(), d.abs().max().item()


def weight_change_check(base: dict, stock: dict, alt: dict, nova: dict, dtype: str) -> dict:
    """The weight-change table for every matrix of the chosen layers, plus the comparison with the floor run."""
    rows = []
    for key in sorted(base):
        w0, ws, we, wn = base[key], stock[key], alt[key], nova[key]
        s_rel, s_frac, s_max = _stats(ws, w0)
        n_rel, n_frac, _ = _stats(wn, w0)
        upd = max(_norm(ws.float() - w0.float()), 1e-30)
        diff = ws.float() - wn.float()
        rows.append({"layer": key[0], "param": key[1],
                     "stock_vs_base": "CHANGED" if s_frac > 0 else "UNCHANGED", "stock_update_rel": s_rel,
                     "stock_changed_frac": s_frac,
                     "novatune_vs_base": "CHANGED" if n_frac > 0 else "UNCHANGED", "novatune_update_rel": n_rel,
                     "novatune_changed_frac": n_frac,
                     "stock_vs_novatune_max_abs": diff.abs().max().item(),
                     "stock_vs_novatune_max_rel": diff.abs().max().item() / max(s_max, 1e-30),
                     "stock_vs_novatune_update_rel": _norm(diff) / upd,
                     "floor_update_rel": _norm(ws.float() - we.float()) / upd})
    floor = max(r["floor_update_rel"] for r in rows)
    tol = tolerance(floor, "weight_update", dtype)
    for r in rows:
        r["verdict"] = "MATCH" if r["stock_vs_novatune_update_rel"] <= tol else "DIFFER"  # NaN: DIFFER
    unchanged = [f"layer {r['layer']} {r['param']} ({run})" for r in rows for run in ("stock", "novatune")
                 if r[f"{run}_vs_base"] != "CHANGED"]
    differ = [f"layer {r['layer']} {r['param']}" for r in rows if r["verdict"] != "MATCH"]
    worst = max(r["stock_vs_novatune_update_rel"] for r in rows)
    problems = []
    if unchanged:
        problems.append(f"not updated by training: {', '.join(unchanged[:6])}" + (" ..." if len(unchanged) > 6 else ""))
    if differ:
        problems.append(f"stock and novatune updates differ by up to {worst:.2e} (||Ws-Wn||/||Ws-W0||) in "
                        f"{', '.join(differ[:6])}" + (" ..." if len(differ) > 6 else "")
                        + f", over the tolerance {tol:.2e} (floor {floor:.2e})")
    msg = "; ".join(problems) if problems else (
        f"{len(rows)} matrices CHANGED in both runs; stock vs novatune update difference {worst:.2e} <= "
        f"tolerance {tol:.2e} (floor {floor:.2e}: stock eager vs sdpa)")
    return {"name": "weight_change", "passed": not problems, "message": msg, "floor": floor, "tolerance": tol,
            "max_update_rel_diff": worst, "unchanged": unchanged, "rows": rows}


def same_init_check(bases: dict[str, dict]) -> dict:
    """Every run must start from the same weights (same seed -> same init); otherwise nothing else compares."""
    names = list(bases)
    ref = bases[names[0]]
    mismatched = sorted({f"{k[0]}:{k[1]} ({n})" for n in names[1:] for k in ref
                         if k not in bases[n] or not torch.equal(bases[n][k], ref[k])})
    msg = (f"initial weights of the chosen layers are identical in {', '.join(names)}" if not mismatched else
           f"initial weights differ between runs: {', '.join(mismatched[:6])}")
    return {"name": "same_init", "passed": not mismatched, "message": msg, "mismatched": mismatched}


def render_weight_table(rows: list[dict]) -> str:
    """The weight-change table: one line per matrix, stock vs base, novatune vs base, stock vs novatune."""
    lines = [(f"{'layer':>5s} {'param':24s} {'stock vs base':>13s} {'novatune vs base':>16s} "
              f"{'stock vs novatune':>17s} {'(update diff)':>13s} {'floor':>9s}")]
    for r in rows:
        lines.append(f"{r['layer']:5d} {r['param'][:24]:24s} {r['stock_vs_base']:>13s} {r['novatune_vs_base']:>16s} "
                     f"{r['verdict'] + ' ' + format(r['stock_vs_novatune_max_rel'], '.1e'):>17s} "
                     f"{r['stock_vs_novatune_update_rel']:13.2e} {r['floor_update_rel']:9.2e}")
    return "\n".join(lines)
