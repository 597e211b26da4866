"""HealthConfig's ranges and scaler_fallbacks' step bookkeeping, which a mutation audit of lightning_fp8/monitoring
found unpinned, against HealthConfig's docstring ("spike_ratio: a finite number >= 1", "plateau_min_improvement: a
fraction in [0, 1)", "plateau_grad_norm_drop: a fraction in [0, 1]") and scaler_fallbacks' ("the fallbacks an
FP8GradScaler.history records after scaler step after_step, and the step of the last one (after_step when there is
none)"), read back from the scaler's own history entries."""

import math

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, FP8GradScaler, convert_to_fp8
from lightning_fp8.health import HealthConfig, scaler_fallbacks


@pytest.mark.parametrize(
    ("name", "refused", "taken"),
    [
        # A spike is already above the window's mean: a ratio under 1 tests nothing.
        ("spike_ratio", [0.5, 0.999, -1.0, math.inf, math.nan], [1.0, 1.5, 1e6]),
        # A relative improvement is at most 1: a threshold of 1 would call every window a plateau.
        ("plateau_min_improvement", [1.0, 1.5, -0.01, math.nan], [0.0, 0.5, 0.999]),
        # A fraction of a norm that cannot fall by more than all of it: 1 is taken, past it is not.
        ("plateau_grad_norm_drop", [1.0001, 2.0, -0.01, math.nan], [0.0, 0.5, 1.0]),
        ("spike_zscore", [-0.1, math.inf, math.nan], [0.0, 6.0, 1e9]),
    ],
)
def test_each_threshold_takes_its_documented_range_and_refuses_the_rest(name, refused, taken):
    for value in refused:
        with pytest.raises(ValueError, match=rf"HealthConfig\({name}="):
            HealthConfig(**{name: value})
    for value in taken:
        assert getattr(HealthConfig(**{name: value}), name) == value


def _history_with_two_fallbacks() -> list[dict]:
    # Two skipped steps, each running the 'lower_lr' fallback (fallback_after=1): two fallback entries in the history.
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(16, 16)))
    scaler = FP8GradScaler(nonfinite_fallback="lower_lr", model=model, fallback_after=1)
    opt = FP8AdamW(model.parameters(), lr=1e-3, grad_scaler=scaler)
    for loss_factor in (1.0, float("inf"), 1.0, float("inf"), 1.0):
        scaler.scale_loss(model(torch.randn(4, 16)).square().mean() * loss_factor).backward()
        opt.step()
        opt.zero_grad()
    return list(scaler.history)


def test_scaler_fallbacks_counts_those_strictly_after_the_step_given_and_returns_the_last_ones_step():
    history = _history_with_two_fallbacks()
    steps = [e["step"] for e in history if e["action"] == "fallback"]
    assert len(steps) == 2 and steps[0] < steps[1]
    # The reference: the history's own fallback entries, filtered by the docstring's rule.
    for after in (-1, steps[0] - 1, steps[0], steps[1] - 1, steps[1], steps[1] + 3):
        later = [s for s in steps if s > after]
        names, last = scaler_fallbacks(history, after)
        assert names == ["lower_lr"] * len(later), after
        assert last == (later[-1] if later else after), after
