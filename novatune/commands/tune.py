"""novatune tune CONFIG: profile a training step of the configured model and batch, find the ops worth tuning,
validate and time every candidate implementation at the real shapes, pick (noise-aware), check that a whole
training step is not slower with the picks, and record them in the tune cache that `novatune.patch` reads.

Writes (under --out, default <checkpoint.output_dir>/tune): trace_before.json / trace_after.json (Chrome /
Perfetto), tune_report.md, tune_entries.json; rows to --results (bench/results/tune.jsonl); the cache to --cache
(default ~/.cache/novatune/tune.json or $NOVATUNE_TUNE_CACHE). The last printed line is a JSON summary.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

HELP = "choose the fastest validated kernel per op for a config's shapes (writes the tune cache)"
EPILOG = """examples:
  novatune tune examples/qwen3-4b-seed.yaml                       # the headline workload (< 5 min on an H100/H200)
  novatune tune examples/qwen3-4b-seed.yaml --families eager,default,triton,cuda --budget 120
  novatune tune my.yaml --out /tmp/tune --results /tmp/tune.jsonl --cache /tmp/tune.json
  novatune train my.yaml                                          # patch() then uses the recorded choices

families: eager (HF formula), native (torch fused op), default (novatune's current kernels), triton (other
launch configs), compile (torch.compile of the reference), cuda (PyBind11 CUDA kernels, built on first use).
"""
FAMILIES = ("eager", "native", "default", "triton", "compile", "cuda")


def add_arguments(p) -> None:
    from novatune.commands.cli import add_config_args

    add_config_args(p, optional=False)
    p.add_argument("--out", help="folder for traces and the report (default <checkpoint.output_dir>/tune)")
    p.add_argument("--results", default="bench/results/tune.jsonl", help="JSON-lines file rows are appended to")
    p.add_argument("--cache", help="tune cache file (default $NOVATUNE_TUNE_CACHE or ~/.cache/novatune/tune.json)")
    p.add_argument("--families", default=",".join(FAMILIES), help=f"candidate families to try ({','.join(FAMILIES)})")
    p.add_argument("--iters", type=int, default=100, help="timed fwd+bwd calls per candidate (median of these)")
    p.add_argument("--budget", type=float, default=200.0,
                   help="seconds after which no new candidate is started (the run then finishes its checks)")
    p.add_argument("--profile-micro", type=int, default=2, help="micro-batches in the profiled step")
    p.add_argument("--check-reps", type=int, default=3, help="alternated default/tuned full steps in the final check")
    p.add_argument("--allow-more-memory", action="store_true",
                   help="let a linear cross-entropy mode be chosen even if its peak memory exceeds the default "
                        "mode's (by default it is not: peak memory <= the default's is part of the promise)")


def _families(text: str) -> set[str]:
    from novatune.train.config import ConfigError

    fam = {f.strip() for f in text.split(",") if f.strip()}
    bad = fam - set(FAMILIES)
    if bad:
        raise ConfigError("--families", f"unknown families {sorted(bad)}", f"choose from {', '.join(FAMILIES)}")
    return fam | {"eager", "default"}  # the stock bound and the default's timing are always needed


def run(args) -> int:
    import torch

    from novatune.commands.cli import load_config
    from novatune.data.dataset import BatchStream, build_data
    from novatune.measure.timing import copy_bandwidth_gbps
    from novatune.train.loop import _packed_kwargs_mode, forward_backward
    from novatune.train.model import (
        apply_patch,
        build_model,
        load_tokenizer,
        model_config,
        pick_device,
        pick_dtype,
        prepare,
    )
    from novatune.train.optim import build_optimizer
    from novatune.tune import model_choices, select
    from novatune.tune import report as rep
    from novatune.tune.cache import TuneCache, environment
    from novatune.tune.engine import choice_line, step_check, tune_op
    from novatune.tune.opspecs import OPS
    from novatune.tune.profile import profile_steps, rank_targets

    t_start = time.perf_counter()
    cfg, base = load_config(args)
    families = _families(args.families)
    out_dir = Path(args.out or Path(cfg.checkpoint.output_dir) / "tune")
    out_dir.mkdir(parents=True, exist_ok=True)
    device = pick_device(cfg.model.device)
    dtype = pick_dtype(cfg.model.dtype, device)
    notes: list[str] = []
    build_future = None
    if device.type == "cuda" and "cuda" in families:
        from novatune.kernels import cuda as nt_cuda

        why = nt_cuda.unavailable_reason()
        if why is None:
            build_future = nt_cuda.load_in_background()  # nvcc runs while the model is built and profiled
        else:
            notes.append(f"CUDA candidates skipped: {why}")
    cache, note = TuneCache.load_or_reset(args.cache)
    if note:
        notes.append(note)

    torch.manual_seed(cfg.train.seed)
    tokenizer = load_tokenizer(cfg.model, base)
    mconf = model_config(cfg.model, tokenizer, base)
    data = build_data(cfg.data, tokenizer, mconf.vocab_size, base)
    model = prepare(build_model(cfg.model, device, dtype, tokenizer, base, seed=cfg.train.seed,
                                qlora=cfg.method.type == "qlora"), cfg)
    patch_report = apply_patch(model, cfg.model)
    select.install(None)  # time the built-in defaults first, whatever an older cache selected
    if patch_report is not None and patch_report.choices:
        notes.append(f"{len(patch_report.choices)} choice(s) from the existing cache were set aside for this run")
        patch_report.choices.clear()
    opt = build_optimizer(model, cfg.train, device)
    stream = BatchStream(data.rows, cfg.train.micro_batch, cfg.train.seed, cfg.data.shuffle,
                         pad_id=(tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id
                                 is not None else 0))
    mbs = [stream.next() for _ in range(cfg.train.grad_accum)]  # the same data for every timed step
    mode = _packed_kwargs_mode(cfg, patch_report)
    params = [p for p in model.parameters() if p.requires_grad]

    def make_step(micro):
        def step():
            forward_backward(model, micro, device, mode)
            torch.nn.utils.clip_grad_norm_(params, cfg.train.max_grad_norm or float("inf"))
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    prof_step, full_step = make_step(mbs[:max(1, args.profile_micro)]), make_step(mbs)
    bw = copy_bandwidth_gbps() if device.type == "cuda" else None
    print(f"novatune tune: {args.config} on {device} ({torch.cuda.get_device_name() if bw else 'cpu'})"
          + (f", copy bandwidth {bw:.0f} GB/s" if bw else ""), flush=True)
    with select.recording() as recd:
        before = profile_steps(prof_step, model, steps=1, trace=str(out_dir / "trace_before.json"), warmup=1)
    print(before.table(), flush=True)

    env = environment(device)
    deadline = t_start + args.budget
    entries, table, floors = [], {}, {}
    work = [(op, shape, dt, count / 2)  # recorded over the warm-up and the profiled step
            for (op, shape, dt, _dev), count in sorted(recd.seen.items(), key=lambda kv: -kv[1]) if op in OPS]
    # model-level ops (CE mode, attention backend): shapes from the config and the first micro-batch's documents
    mb0 = mbs[0]
    tokens = int(mb0["input_ids"].numel())
    docs = int((mb0["position_ids"] == 0).sum()) if "position_ids" in mb0 else int(mb0["input_ids"].shape[0])
    n_layers = int(getattr(model.config, "num_hidden_layers", 1))
    work += [(op, shape, dt, 1.0 if op == "linear_cross_entropy" else float(n_layers))
             for op, shape, dt in model_choices.model_op_shapes(model, tokens, docs)]
    for op, shape, dt, calls in work:
        entry, cands = tune_op(op, shape, getattr(torch, dt.split("/")[0]), device, families=families,
                               iters=args.iters, bandwidth_gbps=bw, deadline=deadline, env=env,
                               allow_more_memory=args.allow_more_memory)
        entry["calls_per_step"] = calls
        entries.append(entry)
        kind = {"rms_norm": "norm", "swiglu": "activation", "linear_cross_entropy": "loss",
                "attention": "attention", "rope": "RoPE", "qk_norm_rope": "RoPE"}.get(op, op)
        if entry.get("floor_us"):
            floors[kind] = floors.get(kind, 0.0) + entry["floor_us"] * entry["calls_per_step"]
        if entry["choice"] != "novatune_default" and not model_choices.is_model_level(op):
            table[(op, tuple(shape), dt, device.type)] = cands[entry["choice"]].functional()
    picked = model_choices.pick_entries(entries, model, tokens)
    settings = model_choices.toggler(model, picked) if any(
        model_choices.setting_of(e) for e in picked.values()) else None
    if not entries:
        notes.append("the profiled step dispatched no tunable op (is model.patch on?)")
    targets = rank_targets(before, floors)

    select.install(select.Dispatcher(table))
    if settings:
        settings(True)
    after = profile_steps(prof_step, model, steps=1, trace=str(out_dir / "trace_after.json"), warmup=1)
    select.install(None)
    if settings:
        settings(False)
    print("after tuning:\n" + after.table(), flush=True)
    check = None
    if table or settings:
        check = step_check(full_step, table, reps=args.check_reps, settings=settings)
        print(f"whole-step check: {check['reason']}", flush=True)
        for e in entries:
            e.update(kept=check["kept"], kept_reason=check["reason"], step_check=check)
    for e in entries:
        cache.put(e)
    cache_path = cache.save()
    if patch_report is not None and check is not None and check["kept"]:
        patch_report.choices.extend(entries)
    tune_s = time.perf_counter() - t_start

    build = {}
    if build_future is not None:
        from novatune.kernels import cuda as nt_cuda

        try:
            build_future.result(timeout=0)
            build = dict(nt_cuda.BUILD_INFO)
        except Exception as e:  # noqa: BLE001 - reported; the candidates already recorded the same reason
            build = {"error": str(e)[:300]}
    extra = {"config": args.config, "tune_s": round(tune_s, 1), "step_check": check, "copy_gbps": bw}
    rep.write_rows(args.results, entries, extra)
    (out_dir / "tune_entries.json").write_text(json.dumps(entries, indent=1))
    md = rep.markdown(config=args.config, device=env["device"], before=before, after=after, targets=targets,
                      entries=entries, check=check, tune_s=tune_s,
                      patch_report=str(patch_report) if patch_report is not None else "(model.patch is off)",
                      cache_path=str(cache_path), build=build, notes=notes)
    (out_dir / "tune_report.md").write_text(md)
    for e in entries:
        print("  " + choice_line(e))
    for n in notes:
        print(f"note: {n}")
    print(rep.summary_table(entries, check, tune_s))
    print(f"report {out_dir / 'tune_report.md'}, traces in {out_dir}, cache {cache_path}, rows {args.results}")
    print(json.dumps({"tune_s": round(tune_s, 1), "ops": rep.summary_rows(entries),
                      "step": check, "cache": str(cache_path), "report": str(out_dir / "tune_report.md")}))
    return 0
