"""A bench stack: `novatune train` itself, the trainer's whole loop (its per-step loss read and non-finite check,
metrics rows, signal handling, GC freeze), on the configured run. The `novatune` stack times the session's step
in the bench worker's own loop, with no host sync inside the timed steps; this one times what a user of the CLI
gets, and it is the yardstick of a stack that brings its own loop (trl-sft: TRL's Trainer with novatune.patch).

Timing: the clock reads after the warm-up steps and after the last step (synchronised), as the TRL stack's; the
tokens are those of the timed steps' micro-batches, padding excluded.
"""
from __future__ import annotations


def run(spec: dict, cfg, base_dir) -> dict:
    """The bench worker's entry (novatune bench --stacks novatune-train): row fields in the bench schema."""
    from novatune.bench.worker import WarmClock
    from novatune.train.loop import train
    from novatune.train.model import pick_device
    from novatune.tune.patching import selection_for  # the tune cache's kernel choices, as the CLI applies them

    warm, steps = spec["warm"], spec["steps"]
    clock = WarmClock(pick_device(cfg.model.device), warm, warm + steps)
    tokens: dict[int, int] = {}

    def meter(step: int, micro_batches: list[dict]) -> None:
        tokens[step] = sum(mb["num_tokens"] for mb in micro_batches)
        clock.step_end(step)

    result = train(cfg, base_dir, step_hook=meter, select=selection_for)
    timed_s = clock.timed_s
    if timed_s is None:
        raise RuntimeError(f"the trainer stopped at step {result.steps} of {warm + steps}: nothing to time")
    timed = range(warm + 1, warm + steps + 1)
    timed_tokens = sum(tokens[s] for s in timed)
    session = result.session
    return {"warm": warm, "steps": steps, "tok_s": round(timed_tokens / timed_s, 1), "timed_s": round(timed_s, 6),
            "timed_tokens": timed_tokens, "tokens_per_step": [tokens[s] for s in timed], "step_ms": clock.step_ms(),
            "losses": [result.losses[s] for s in sorted(result.losses)],
            "peak_gib": round(clock.peak_gib, 3) if clock.peak_gib is not None else None, "method": cfg.method.type,
            "seq": cfg.data.max_length, "grad_accum": cfg.train.grad_accum, "micro_batch": cfg.train.micro_batch,
            "model_type": session.base_config.model_type if session is not None else None}
