"""The kernel engine: profile a training step, validate and time the candidate implementations each op's SPEC
declares (novatune.ops.registry), choose (noise-aware), cache the choice, and hand it to `novatune.patch` as a
Selection value (novatune.ops.dispatch). Nothing here names an op.

    profile.py     torch.profiler over a few micro-steps -> time per op kind / module type, launch gaps, traces
    calls.py       helpers over the registry: candidates of an op, incoming gradients, the cache's key
    validate.py    forward + every gradient vs the fp32 reference, stock-relative bound, poisoning, NaN, layout,
                   determinism, then check.py's cases; every rejection with its reason
    check.py       check_implementation(fn, op): the calls models make (recorded or from the SPEC) + adversarial
                   cases; also `novatune tune --check MODULE:FUNCTION --op NAME`
    measure.py     fwd+bwd timing: CUDA-graph replays timed with events, inputs rotated past the L2
    select.py      the choice (noise margin, simpler wins)
    cache.py       the JSON cache keyed by op/shape/dtype/layout/GPU/versions
    engine.py      tune_op (one op at one shape) and the whole-step check
    model_choices.py  ops applied as a setting on the patched model (their SPEC's `setting`)
    patching.py    novatune.patch(model, tune=...): the Selection from the cache or from tuning now
    cli_tune.py    `novatune tune CONFIG`; report.py writes its report and rows

    from novatune.tune import check_implementation
    print(check_implementation(my_fn, op=name))    # Verdict(passed, reasons); name: a registry key
"""


def __getattr__(name: str):
    # lazy: `novatune --help` imports this package's CLI module and must not pay for torch
    if name in ("check_implementation", "Verdict"):
        from novatune.tune import check

        return getattr(check, name)
    raise AttributeError(f"module 'novatune.tune' has no attribute {name!r}")


__all__ = ["check_implementation", "Verdict"]
