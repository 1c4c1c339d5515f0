"""A bench stack: `novatune train` itself, the trainer's whole loop (its per-step loss read and non-finite check,
metrics rows, signal handling, GC freeze), on the configured run. The `novatune` stack times the session's step
in the bench worker's own loop, with no host sync inside the timed steps; this one times what a user of the CLI
gets, and it is the yardstick of a stack that brings its own loop (trl-sft: TRL's Trainer with novatune.patch).

Timing: the clock reads after the warm-up steps and after the last step (synchronised), as the TRL stack's; the
tokens are those of the timed steps' micro-batches, padding excluded.
"""
from __future__ import annotations

import time

import torch


def run(spec: dict, cfg, base_dir) -> dict:
    """The bench worker's entry (novatune bench --stacks novatune-train): row fields in the bench schema."""
    from novatune.train.loop import train
    from novatune.tune.patching import selection_for  # the tune cache's kernel choices, as the CLI applies them

    warm, steps = spec["warm"], spec["steps"]
    clock: dict[int, float] = {}
    tokens: dict[int, int] = {}
    peak: list[float] = []

    def meter(step: int, micro_batches: list[dict]) -> None:
        tokens[step] = sum(mb["num_tokens"] for mb in micro_batches)
        if step not in (warm, warm + steps):
            return
        cuda = torch.cuda.is_available() and cfg.model.device != "cpu"
        if cuda:
            torch.cuda.synchronize()
        clock[step] = time.perf_counter()
        if cuda and step == warm:
            torch.cuda.reset_peak_memory_stats()
        elif cuda:
            peak.append(torch.cuda.max_memory_allocated() / 2**30)

    result = train(cfg, base_dir, step_hook=meter, select=selection_for)
    if warm + steps not in clock or warm not in clock:
        raise RuntimeError(f"the trainer stopped at step {result.steps} of {warm + steps}: nothing to time")
    timed_s = clock[warm + steps] - clock[warm]
    timed_tokens = sum(tokens[s] for s in range(warm + 1, warm + steps + 1))
    session = result.session
    return {"warm": warm, "steps": steps, "tok_s": round(timed_tokens / timed_s, 1), "timed_s": round(timed_s, 6),
            "timed_tokens": timed_tokens,
            "tokens_per_step": [tokens[s] for s in range(warm + 1, warm + steps + 1)],
            "losses": [result.losses[s] for s in sorted(result.losses)],
            "peak_gib": round(peak[0], 3) if peak else None, "method": cfg.method.type,
            "seq": cfg.data.max_length, "grad_accum": cfg.train.grad_accum, "micro_batch": cfg.train.micro_batch,
            "model_type": session.base_config.model_type if session is not None else None}
