"""A bench stack: TRL's SFTTrainer + `novatune.patch(trainer)` on the same model, rows and optimizer as
`novatune train`, so its per-step losses and tokens/s compare with the trainer's own.

    from novatune.bench.trl_stack import run_trl_stack
    result = run_trl_stack(config, steps=8, warmup=2)   # a novatune Config (train.config)
    result["losses"], result["tokens_per_s"], result["peak_gib"]

What is the same as `novatune train`: everything train.session.build makes (the tokenizer, the model with its dtype,
gradient checkpointing and LoRA, the packed rows and their order, micro-batch by micro-batch, the optimizer and the
schedule), and gradient clipping. What TRL does: the loop, its
padding-free collator (one flattened row per micro-batch with per-document position_ids and cu_seq_lens), its
compute_loss through its fused-LM-head contract, which the patched model honours with novatune's fused loss.
Pure bf16 weights without autocast, as the trainer trains (SFTConfig bf16=False: no autocast on top).
"""
from __future__ import annotations

from pathlib import Path

import transformers

from novatune.bench.worker import WarmClock
from novatune.data.dataset import BatchStream
from novatune.train.demo import load_demo_tokenizer


def _examples(stream: BatchStream, micro_batches: int) -> tuple[list[dict], list[int]]:
    """The rows novatune train would draw, in its order, as pre-tokenised TRL examples (seq_lengths per row), and
    the trained tokens of each micro-batch (padding excluded, as the trainer counts them)."""
    out, tokens = [], []
    for _ in range(micro_batches):
        mb = stream.next()
        tokens.append(mb["num_tokens"])
        for ids, pos, lab in zip(mb["input_ids"], mb["position_ids"], mb["labels"]):
            starts = (pos == 0).nonzero().flatten().tolist() + [len(pos)]
            out.append({"input_ids": ids.tolist(), "labels": lab.tolist(),
                        "seq_lengths": [b - a for a, b in zip(starts, starts[1:])]})
    return out, tokens


def run_trl_stack(cfg, steps: int, warmup: int = 2, base_dir: Path | None = None, patch: bool = True,
                  output_dir: str | Path = "/tmp/novatune_trl_stack", dataloader_workers: int = 2,
                  sft_args: dict | None = None) -> dict:
    """Train `steps` optimizer steps with SFTTrainer; tokens/s and peak memory over the steps after `warmup`.

    The model, rows, optimizer and schedule come from the one run builder (train.session.build) with the patch
    off: SFTTrainer receives them as they are and `novatune.patch(trainer)` patches the trainer's model. With the
    patch, the optimizer is the one `novatune train` builds for a patched model (train.adamw_kernel), whose
    clipping the patch folds into its update as the trainer's loop does.
    dataloader_workers: SFTConfig's dataloader_num_workers; 2 collates ahead in worker processes, as the patch
    report advises (with 0 the GPU waits for each step's collation: bench/experiments/exp_trl_gap.py).
    sft_args: more SFTConfig fields (experiments)."""
    import dataclasses

    import datasets
    import trl

    from novatune.patch.apply import patch as novatune_patch
    from novatune.train.optim import build_optimizer, build_scheduler
    from novatune.train.session import build

    # TRL's trainer runs the micro-steps and never says which is a step's last: the embedding's gradient stays dense
    stock_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, patch=False),
                                    memory=dataclasses.replace(cfg.memory, embedding_grad="dense"))
    session = build(stock_cfg, base_dir, total_steps=steps)
    device, ga = session.device, cfg.train.grad_accum
    examples, tokens = _examples(session.stream, steps * ga)
    dataset = datasets.Dataset.from_list(examples)
    args = trl.SFTConfig(output_dir=str(output_dir), max_steps=steps, per_device_train_batch_size=cfg.train.micro_batch,
                         gradient_accumulation_steps=ga, max_grad_norm=cfg.train.max_grad_norm,
                         padding_free=True, max_length=None, dataset_kwargs={"skip_prepare_dataset": True},
                         train_sampling_strategy="sequential", gradient_checkpointing=False, bf16=False,
                         use_cpu=device.type == "cpu", logging_steps=1, report_to=[], save_strategy="no",
                         disable_tqdm=True, seed=cfg.train.seed, dataloader_num_workers=dataloader_workers,
                         **(sft_args or {}))
    # synthetic token rows come without a tokenizer; TRL wants one for its pad token only, and padding-free rows
    # (one flattened row per micro-batch) are never padded: the bundled demo tokenizer stands in
    optimizer, scheduler = session.optimizer, session.scheduler
    if patch:  # the optimizer `novatune train` steps: train.adamw_kernel resolved for a patched model
        optimizer = build_optimizer(session.model, cfg.train, device, patched=True)
        scheduler = build_scheduler(optimizer, cfg.train, steps)
    trainer = trl.SFTTrainer(model=session.model, args=args, train_dataset=dataset,
                             processing_class=session.tokenizer or load_demo_tokenizer(),
                             optimizers=(optimizer, scheduler))
    report = novatune_patch(trainer, **dict(cfg.model.patch_options or {})) if patch else None
    meter = _Meter(WarmClock(device, warmup, steps))
    trainer.add_callback(meter)
    micro_losses = _record_losses(trainer)
    trainer.train()
    micro = [float(x) for x in micro_losses]  # read once, after training: no sync per micro-batch
    losses = [sum(micro[i:i + ga]) for i in range(0, len(micro), ga)]
    per_step = [sum(tokens[i:i + ga]) for i in range(warmup * ga, len(tokens), ga)]
    timed_tokens = sum(per_step)
    timed_s = meter.clock.timed_s
    return {"stack": "trl_sft" + ("+novatune" if patch else ""), "losses": losses,
            "tokens_per_s": timed_tokens / timed_s if timed_s else None, "timed_s": timed_s,
            "timed_tokens": timed_tokens, "peak_gib": meter.clock.peak_gib, "steps": steps, "warmup": warmup,
            "tokens_per_step": per_step, "step_ms": meter.clock.step_ms(),
            "patch_report": str(report) if report is not None else None,
            "trl": trl.__version__, "flops_per_token": session.flops_per_token(0.0)}


def run(spec: dict, cfg, base_dir) -> dict:
    """The bench worker's entry (novatune bench --stacks trl-sft): row fields in the bench schema."""
    res = run_trl_stack(cfg, spec["warm"] + spec["steps"], spec["warm"], base_dir,
                        output_dir=Path(spec["stack_dir"]) / "trl")
    tps = res["tokens_per_s"]
    if not tps:
        raise RuntimeError("the TRL stack timed no step after the warm-up: give more steps than warm-up steps")
    return {"warm": spec["warm"], "steps": spec["steps"], "tok_s": round(tps, 1) if tps else None,
            "timed_s": res["timed_s"], "timed_tokens": res["timed_tokens"], "peak_gib": res["peak_gib"],
            "tokens_per_step": res["tokens_per_step"], "step_ms": res["step_ms"],
            "losses": res["losses"], "trl": res["trl"], "patch_report": res["patch_report"],
            "method": cfg.method.type, "seq": cfg.data.max_length, "grad_accum": cfg.train.grad_accum,
            "micro_batch": cfg.train.micro_batch}


def _record_losses(trainer) -> list[float]:
    losses, compute_loss = [], trainer.compute_loss

    def recording(*args, **kwargs):
        out = compute_loss(*args, **kwargs)
        losses.append((out[0] if isinstance(out, tuple) else out).detach())
        return out

    trainer.compute_loss = recording
    return losses


class _Meter(transformers.TrainerCallback):
    """The warm-up clock (bench/worker.py: WarmClock) read at the Trainer's step ends."""

    def __init__(self, clock):
        self.clock = clock

    def on_step_end(self, args, state, control, **kwargs):
        self.clock.step_end(state.global_step)
