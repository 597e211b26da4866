"""FP8GradScaler's argument bounds, scaled_losses and the no-model warning: behaviours of
lightning_fp8/grad_scaling/{arguments,losses,model}.py that a mutation audit found unpinned. References: the bounds as
the errors and docs/concepts/gradient-scaling.md state them (mu a power of two from 2**-126 to 2**127, fp32's normal
range; saturation_threshold in [0, 1); lr_factor in (0, 1); growth_interval and fallback_after ints >= 1), the
docstring of scaled_losses (one-value losses scaled after mark ``since`` and until mark ``until``, each with the mu it
was multiplied by) and of _warn_if_no_model ("warn once")."""

import warnings

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, FP8GradScaler, convert_to_fp8
from lightning_fp8.formats import E5M2


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        # 2**-127 is an fp32 subnormal: below the documented range of mu.
        ({"min_scale": 2.0**-127}, ValueError, r"min_scale=.*from 2\*\*-126 to 2\*\*127"),
        ({"init_scale": 2.0**-127, "min_scale": 2.0**-127}, ValueError, r"from 2\*\*-126 to 2\*\*127"),
        ({"saturation_threshold": 1.0}, ValueError, r"saturation_threshold=1.0\): must be in \[0, 1\)"),
        ({"lr_factor": 1.0}, ValueError, r"lr_factor=1.0\): must be in \(0, 1\)"),
        ({"lr_factor": 0.0}, ValueError, r"lr_factor=0.0\): must be in \(0, 1\)"),
        ({"growth_interval": 2.5}, TypeError, r"growth_interval=2.5\): must be an int >= 1, got float"),
        ({"fallback_after": 1.0}, TypeError, r"fallback_after=1.0\): must be an int >= 1, got float"),
        ({"fallback_after": 0}, ValueError, r"fallback_after=0\): must be an int >= 1"),
    ],
)
def test_an_argument_just_outside_its_range_is_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        FP8GradScaler(**kwargs)


def test_the_edges_of_each_range_are_taken():
    scaler = FP8GradScaler(
        init_scale=2.0**-126, min_scale=2.0**-126, saturation_threshold=0.0, lr_factor=0.5, fallback_after=1,
        growth_interval=1,
    )  # fmt: skip
    assert (scaler.get_scale(), scaler.saturation_threshold, scaler.fallback_after) == (2.0**-126, 0.0, 1)


def test_scaled_losses_are_the_one_value_losses_between_the_marks_with_their_mu():
    scaler = FP8GradScaler(init_scale=4.0, growth_interval=1)
    w = torch.ones(3, requires_grad=True)
    start = scaler.losses_scaled
    first = scaler.scale_loss((w * 2.0).sum())  # 6 * 4
    scaler.scale_loss(w * 1.0)  # not one value (backward with a gradient): counted, not kept
    mark = scaler.losses_scaled
    assert mark == start + 2
    # An update between the two backwards: one cast with headroom, growth_interval=1: mu doubles to 8.
    scaler.record_gradient_cast(torch.tensor(1.0), torch.tensor(0), 10, E5M2)
    scaler.update()
    assert scaler.get_scale() == 8.0
    second = scaler.scale_loss((w * 3.0).sum())  # 9 * 8
    got = scaler.scaled_losses(since=start)
    assert [(t.item(), mu) for t, mu in got] == [(24.0, 4.0), (72.0, 8.0)]
    assert got[0][0].item() == first.item() and got[1][0].item() == second.item()
    assert not got[0][0].requires_grad  # detached: no graph kept
    assert [(t.item(), mu) for t, mu in scaler.scaled_losses(since=mark)] == [(72.0, 8.0)]
    assert [(t.item(), mu) for t, mu in scaler.scaled_losses(since=start, until=mark)] == [(24.0, 4.0)]
    both = [(24.0, 4.0), (72.0, 8.0)]
    assert [(t.item(), mu) for t, mu in scaler.scaled_losses(since=start, until=mark + 1)] == both
    assert scaler.scaled_losses(since=mark + 1) == []


def test_a_scaler_without_model_shared_by_two_optimizers_warns_once():
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)))
    scaler = FP8GradScaler()
    opts = [FP8AdamW(model[i].parameters(), lr=1e-3, grad_scaler=scaler) for i in (0, 2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            scaler.scale_loss(model(torch.randn(8, 32)).square().mean()).backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
    assert sum("FP8GradScaler has no model" in str(w.message) for w in caught) == 1
