"""Checks before the model is built: what would otherwise surface as a run that silently takes hours."""
from __future__ import annotations

import torch

# a generous CPU matmul rate (a busy many-core server); real laptops are slower, so the estimate is a lower bound
CPU_FLOPS = 2e11
SLOW_STEP_S = 60.0


def estimated_params(model_config) -> int:
    from novatune.train.arch import count_matmul_params

    embed = model_config.vocab_size * model_config.hidden_size
    tied = getattr(model_config, "tie_word_embeddings", False)
    return count_matmul_params(model_config) + (0 if tied else embed)


def cpu_step_warning(model_config, device: torch.device, tokens_per_step: int) -> str | None:
    """A warning when one optimizer step of this model on the CPU takes longer than SLOW_STEP_S (else None)."""
    if device.type != "cpu":
        return None
    n = estimated_params(model_config)
    seconds = 6 * n * tokens_per_step / CPU_FLOPS
    if seconds < SLOW_STEP_S:
        return None
    return (f"WARNING: training a {n / 1e9:.1f}B-parameter model on the CPU: about {seconds / 60:,.0f} minutes or more "
            f"per optimizer step ({tokens_per_step:,} tokens), plus building the model. Use a GPU, or a small model "
            f"(e.g. --set model.arch=qwen3-tiny, or model.arch_overrides) to try the pipeline")
