"""`novatune validate CONFIG`: is training with novatune the same training as stock? (files: proof/parity.py)

Three short runs of the configured workload through the real trainer, in this process, one after another (the
GPU memory of each is released before the next), from the same init and the same data:
  stock        model.patch=false, model.attention=sdpa      the reference
  stock_eager  model.patch=false, model.attention=eager     the noise floor (parity.py says why)
  novatune     model.patch=true                             the candidate
then, on novatune's trained model: the packing-contamination and gradient-accumulation checks (checks.py), and
the same two on that model with the patch reverted (stock) for their sanity run / floor.

Checks: same_init, loss_parity (a), weight_change (b, the weight-change table of the chosen layers' matrices),
grad_norm (c, pre-clip total norm per step), packing_contamination (d), grad_accum_invariance (e).
In-process on purpose: tests plant faults by monkeypatching novatune's ops and run this same code.
Speed at the headline workload (4B): steps default to 4, only the chosen layers' weights are copied (to the CPU).
"""
from __future__ import annotations

import copy
import datetime
import gc
import json
from pathlib import Path

RUNS = {
    "stock": {"patch": False, "attention": "sdpa"},
    "stock_eager": {"patch": False, "attention": "eager"},
    "novatune": {"patch": True, "attention": "sdpa"},
}
CHECK_TITLES = {"same_init": "same init", "loss_parity": "loss parity", "weight_change": "weight change",
                "grad_norm": "grad norm", "packing_contamination": "packing contamination",
                "grad_accum_invariance": "grad-accum invariance"}


def run_config(cfg, name: str, run_dir: Path, steps: int):
    """The config of one validate run: the stack's model settings, a fresh output dir, no checkpoints."""
    c = copy.deepcopy(cfg)
    c.model.patch = RUNS[name]["patch"]
    c.model.attention = RUNS[name]["attention"]
    c.train.max_steps = steps
    c.checkpoint.output_dir = str(run_dir / name)
    c.checkpoint.resume, c.checkpoint.save_every, c.checkpoint.export = "never", 0, False
    c.logging.every, c.logging.progress, c.logging.tensorboard = 1, False, False
    return c


def default_layers(n_layers: int) -> list[int]:
    return sorted({0, n_layers // 2, n_layers - 1})


def _free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_validate(cfg, base_dir: Path | None, run_dir: Path, steps: int = 4, layers: list[int] | None = None,
                 overrides: list[str] | None = None, config_name: str | None = None, log=print) -> dict:
    """Run the three trainings and every check; write validate.json / weight_change.json; return the result."""
    from rich.console import Console

    from novatune.measure.results import environment
    from novatune.proof import checks, parity
    from novatune.train.loop import train
    from novatune.train.model import SetupError
    from novatune.train.session import packed_kwargs_mode, pad_id_of

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    state: dict = {"layers": layers}

    def hook_for(name: str):
        def hook(model):
            if state["layers"] is None:
                state["layers"] = default_layers(model.config.num_hidden_layers)
            bad = [i for i in state["layers"] if not 0 <= i < model.config.num_hidden_layers]
            if bad:
                raise SetupError(f"--layers {bad}: the model has {model.config.num_hidden_layers} layers (0 to "
                                 f"{model.config.num_hidden_layers - 1})")
            state.setdefault("base", {})[name] = parity.snapshot(model, state["layers"])
        return hook

    runs, finals, nova, dtype = {}, {}, None, None
    from novatune.tune.patching import selection_for

    for name in RUNS:
        c = run_config(cfg, name, run_dir, steps)
        log(f"[{name}] training {steps} steps (log: {run_dir / name / 'train.log'})")
        (run_dir / name).mkdir(parents=True, exist_ok=True)
        with open(run_dir / name / "train.log", "w") as f:
            res = train(c, base_dir=base_dir, console=Console(file=f, soft_wrap=True, width=120),
                        model_hook=hook_for(name), select=selection_for)
        metrics = [json.loads(ln) for ln in (run_dir / name / "metrics.jsonl").read_text().splitlines() if ln]
        runs[name] = {"losses": [res.losses[s] for s in sorted(res.losses)],
                      "grad_norms": [r["grad_norm"] for r in metrics], "output_dir": str(run_dir / name),
                      "attention": c.model.attention,
                      "patch": res.patch_report.to_dict() if res.patch_report is not None else None}
        finals[name] = parity.snapshot(res.model, state["layers"])
        dtype = str(next(res.model.parameters()).dtype).replace("torch.", "")
        log(f"[{name}] losses " + " ".join(f"{x:.6f}" for x in runs[name]["losses"]))
        if name == "novatune":
            nova = res.session  # the built run: its model as trained, data, tokenizer, device
        del res
        _free()

    results = [parity.same_init_check(state["base"])]
    results.append(parity.series_check("loss_parity", "loss", "per-step loss", runs["stock"]["losses"],
                                       runs["stock_eager"]["losses"], runs["novatune"]["losses"], dtype))
    results.append(parity.weight_change_check(state["base"]["stock"], finals["stock"], finals["stock_eager"],
                                              finals["novatune"], dtype))
    results.append(parity.series_check("grad_norm", "grad_norm", "per-step gradient norm (pre-clip)",
                                       runs["stock"]["grad_norms"], runs["stock_eager"]["grad_norms"],
                                       runs["novatune"]["grad_norms"], dtype))

    # (d) and (e) on novatune's model as trained, then the same model with the patch reverted (stock)
    nova_model, nova_report, device, rows = nova.model, nova.patch_report, nova.device, nova.data.rows
    vocab, pad_id = nova.base_config.vocab_size, pad_id_of(nova.tokenizer)
    row = checks.pick_row(rows)
    full, short = checks.ga_rows(rows, cfg.data.max_length)
    if nova_report is None:
        raise RuntimeError("the novatune run was not patched (model.patch=true gave no PatchReport)")
    log("[checks] packing contamination and gradient-accumulation invariance (novatune, then stock)")
    leak = {"novatune": checks.contamination(nova_model, row, vocab, device, nova.packed_kwargs)}
    ga_nova = checks.grad_accum_error(nova_model, full, short, device, nova.packed_kwargs, pad_id)
    nova_report.revert()
    scfg = run_config(cfg, "stock", run_dir, steps)
    leak["stock"] = checks.contamination(nova_model, row, vocab, device, packed_kwargs_mode(scfg, None))
    ga_stock = checks.grad_accum_error(nova_model, full, short, device, packed_kwargs_mode(scfg, None), pad_id)
    del nova_model, nova
    _free()
    results.append(checks.contamination_check(leak, dtype))
    results.append(checks.grad_accum_check(ga_nova, ga_stock, dtype))

    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    out = {"time": now, **environment(), "config": config_name or "<demo>", "overrides": list(overrides or []),
           "steps": steps, "dtype": dtype, "device_type": device.type, "layers": state["layers"],
           "factor": parity.FACTOR,
           "passed": all(r["passed"] for r in results),
           "noise_floor": {"reference": "stock (sdpa)", "alternative": "stock (eager)", "why": parity.NOISE_FLOOR_WHY},
           "checks": results, "runs": runs}
    (run_dir / "validate.json").write_text(json.dumps(out, indent=1))
    (run_dir / "weight_change.json").write_text(json.dumps(results[2]["rows"], indent=1))
    return out


def render(result: dict) -> str:
    """The check table, the per-step losses and the weight-change table."""
    from novatune.proof.parity import render_weight_table

    lines = [f"{'check':22s} {'result':6s} detail"]
    for c in result["checks"]:
        lines.append(f"{CHECK_TITLES.get(c['name'], c['name']):22s} {'PASS' if c['passed'] else 'FAIL':6s} "
                     f"{c['message']}")
    lines.append("")
    lines.append(f"{'step':>4s} {'stock':>12s} {'stock eager':>12s} {'novatune':>12s} {'floor rel':>10s} "
                 f"{'novatune rel':>12s}")
    loss = next(c for c in result["checks"] if c["name"] == "loss_parity")
    for r in loss["per_step"]:
        lines.append(f"{r['step']:4d} {r['stock']:12.6f} {r['stock_eager']:12.6f} {r['novatune']:12.6f} "
                     f"{r['floor_rel']:10.2e} {r['novatune_rel']:12.2e}")
    lines.append("")
    wc = next(c for c in result["checks"] if c["name"] == "weight_change")
    lines.append("weight change (stock vs novatune: max|Ws-Wn| / max|Ws-W0|, then the update "
                 "difference ||Ws-Wn|| / ||Ws-W0|| and the same for stock eager):")
    lines.append(render_weight_table(wc["rows"]))
    lines.append("")
    lines.append("validate: " + ("PASSED" if result["passed"] else "FAILED: " + ", ".join(
        c["name"] for c in result["checks"] if not c["passed"])))
    return "\n".join(lines)
