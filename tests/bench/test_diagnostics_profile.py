"""--profile's micro-step: under gradient accumulation it is one whose gradients already exist (micro-steps 2..GA,
which add into `.grad`), not the step's first (which creates them and adds nothing)."""
from types import SimpleNamespace

import pytest
import torch

from novatune.bench.diagnostics import profile_micro_step


class _Recording(torch.nn.Module):
    """A one-weight model that records, at each forward, whether its weight's gradient exists."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(3, 5))
        self.grad_existed: list[bool] = []

    def forward(self, x):
        self.grad_existed.append(self.weight.grad is not None)
        return SimpleNamespace(loss=(x @ self.weight.t()).square().sum())


@pytest.mark.parametrize("accumulating", [False, True])
def test_the_profiled_micro_step_adds_into_existing_gradients_under_accumulation(accumulating, tmp_path):
    model, finished = _Recording(), []
    out = profile_micro_step(model, {"x": torch.randn(7, 5)}, tmp_path / "trace", finish=lambda: finished.append(1),
                             accumulating=accumulating)
    assert model.grad_existed == ([False, True] if accumulating else [False])
    assert len(finished) == 1  # the session's finish_backward once, after the last backward, as a step runs it
    assert model.weight.grad is None  # dropped afterwards, as the next optimizer step expects
    assert out["wall_ms"] > 0 and (tmp_path / "trace.txt").read_text().startswith("wall ")
