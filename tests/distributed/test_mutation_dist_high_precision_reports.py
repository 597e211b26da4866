"""What FP8CommState reports to an FP8GradScaler for a gradient reduced in high precision (``record_reduced``: the
units without FP8 weights, the one-rank hook): only its non-finite check. Its amax is no FP8 cast's, so it takes no
part in mu's saturation and headroom rules (docs/concepts/gradient-scaling.md: fp32 and bf16 gradients reach 3.4e38,
no finite gradient times mu overflows them). Reference: the same scaler fed the step's FP8 cast alone. A mutation audit
of the distributed layer found the rule unpinned (reporting these checks as FP8 casts of no values passed the suite:
a large fp32 gradient then counted as a cast without headroom and stopped mu's growth)."""

import math

import pytest
import torch

from lightning_fp8 import FP8GradScaler
from lightning_fp8.distributed import FP8CommState
from lightning_fp8.distributed.comm import cast_stats


def _scaler() -> FP8GradScaler:
    return FP8GradScaler(init_scale=2.0**10, growth_interval=1)


def _fp8_cast(state: FP8CommState) -> None:
    """One FP8 all-reduce of 100 values with a shared amax of 1 (far from E5M2's maximum at mu = 2**10)."""
    state.record(cast_stats(torch.tensor([1.0]), torch.zeros((), dtype=torch.int64), 100))


@pytest.mark.parametrize("value", [6.0e4, 3.0e38, 1e-30])
def test_a_high_precision_gradient_leaves_mu_to_the_fp8_casts(value):
    reference = _scaler()
    _fp8_cast(FP8CommState(grad_scaler=reference))
    reference.update()
    scaler = _scaler()
    state = FP8CommState(grad_scaler=scaler)
    _fp8_cast(state)
    state.record_reduced(torch.full((4,), value))
    scaler.update()
    assert reference.scale == 2.0**11  # the premise: a finite step with headroom doubles mu at growth_interval 1
    assert scaler.scale == reference.scale and state.check_step()


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_high_precision_gradient_skips_the_step(bad):
    scaler = _scaler()
    state = FP8CommState(grad_scaler=scaler)
    _fp8_cast(state)
    state.record_reduced(torch.tensor([1.0, bad]))
    scaler.update()
    assert scaler.scale == 2.0**9 and not state.check_step()  # halved, as torch.amp.GradScaler's backoff 0.5
