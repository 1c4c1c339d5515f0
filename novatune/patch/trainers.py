"""Which trainers' loss the fused linear cross-entropy may compute (`novatune.patch(trainer)`).

The loss forward (patch/loss.py) computes HF's causal LM loss, and TRL's fused-head outputs whose gradient is that
of the SUM of the token log-probs. A trainer that derives its loss from the logits itself (label smoothing, a
`compute_loss_func`) or weights tokens individually (TRL's DFT loss, preference and RL trainers) needs something
else: the fused loss is then refused with the reason, and the trainer keeps its own head.
"""
from __future__ import annotations

# TRL trainers whose training loss is the token-count mean (or sum / num_items_in_batch) of -log p(label)
_SUM_OF_LOG_PROBS_TRAINERS = ("SFTTrainer",)


def is_trl(trainer) -> bool:
    return any(c.__module__.split(".")[0] == "trl" for c in type(trainer).__mro__)


def trainer_refusal(trainer, model) -> str | None:
    """None when novatune's fused loss computes exactly what `trainer` trains on, else the reason it does not."""
    if trainer is None:
        return None
    name = type(trainer).__name__
    args = getattr(trainer, "args", None)
    if getattr(trainer, "label_smoother", None) is not None:
        return f"{name} uses label smoothing, computed from the full logits: the trainer keeps the stock loss"
    if is_trl(trainer):
        if not any(c.__name__ in _SUM_OF_LOG_PROBS_TRAINERS for c in type(trainer).__mro__):
            return (f"TRL {name} weights each token's log-prob (or compares models); novatune's fused loss gives "
                    "the gradient of the unweighted sum only: the trainer keeps its own LM head")
        loss_type = getattr(args, "loss_type", "nll")
        if loss_type != "nll":
            return (f"TRL {name} with loss_type={loss_type!r} weights each token's log-prob; novatune's fused loss "
                    "gives the gradient of the unweighted sum (loss_type='nll') only: the trainer keeps its own "
                    "LM head")
        # compute_loss_func: SFTTrainer computes the training loss from the logits of a separate plain forward
        # (stock path) and calls the fused head without gradients for its metrics only: both stay exact
        return None
    if getattr(trainer, "compute_loss_func", None) is not None:
        return (f"{name} has a compute_loss_func, which needs the logits: the model returns them (stock loss "
                "forward)")
    return None
