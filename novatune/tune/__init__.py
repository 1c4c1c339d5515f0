"""The kernel engine: profile a training step, validate and time candidate implementations per op, choose
(noise-aware), cache the choice, and let `novatune.patch` use it.

    profile.py     torch.profiler over a few micro-steps -> time per op kind / module type, launch gaps, traces
    opspecs.py     per op: inputs, fp32 reference, HBM floor, poisoned-output call, dispatch signature
    candidates.py  the registry: eager, torch native, novatune default, Triton variants, torch.compile, CUDA C++
    validate.py    forward + every gradient vs the fp32 reference, stock-relative bound, poisoning, NaN, layout,
                   determinism; every rejection with its reason
    measure.py     fwd+bwd timing: CUDA-graph replays timed with events, inputs rotated past the L2
    select.py      the choice (noise margin, simpler wins) and the dispatch hook the ops consult
    cache.py       the JSON cache keyed by op/shape/dtype/layout/GPU/versions
    engine.py      tune_op (one op at one shape) and the whole-step check
    patching.py    novatune.patch(model, tune=...) support
    cli_tune.py    `novatune tune CONFIG`; report.py writes its report and rows
"""
