"""lightning_fp8.optim.swap behaviour that a mutation audit found unpinned: which AdamW/Adam the swap refuses (one
with state, Adam's coupled L2 weight decay of any size), and LR schedulers rebound to the FP8AdamW (nested in
SequentialLR; torch's check that the optimizer stepped before the scheduler), each against what torch's own optimizer
and schedulers do when built directly."""

import warnings

import pytest
import torch
from torch import nn

from lightning_fp8.optim.swap import rebind_scheduler, to_fp8_adamw

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny tensor ops on one thread


def _params() -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(16, 16)), nn.Parameter(torch.randn(16))]


def test_an_optimizer_with_state_is_refused_and_a_fresh_one_swapped():
    # Its moments would be dropped without a word: the swap takes fresh optimizers only.
    params = _params()
    opt = torch.optim.AdamW(params, lr=1e-2)
    assert to_fp8_adamw(opt, opt_level="O1") is not opt  # fresh: swapped
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    with pytest.raises(ValueError, match=r"already has state for 2 parameter\(s\)"):
        to_fp8_adamw(opt, source="the test", opt_level="O1")


@pytest.mark.parametrize("weight_decay", [0.5, 1e-2, 2.0])
def test_adam_coupled_weight_decay_of_any_size_is_refused(weight_decay):
    # torch.optim.Adam adds weight_decay * p to the gradient (L2), which FP8AdamW's decoupled decay is not.
    with pytest.raises(ValueError, match=r"adds an L2 term"):
        to_fp8_adamw(torch.optim.Adam(_params(), weight_decay=weight_decay))
    assert to_fp8_adamw(torch.optim.Adam(_params(), weight_decay=0.0), opt_level="O1") is not None


def _sequential(optimizer):
    return torch.optim.lr_scheduler.SequentialLR(
        optimizer,
        [
            torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.25, total_iters=3),
            torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5),
        ],
        milestones=[3],
    )


def _lrs(scheduler, optimizer) -> list[float]:
    lrs = []
    for _ in range(6):
        optimizer.step()
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


def test_schedulers_nested_in_sequential_lr_drive_the_swapped_optimizer():
    # Reference: the same SequentialLR built on a torch.optim.AdamW that steps itself.
    reference = torch.optim.AdamW(_params(), lr=1e-2)
    expected = _lrs(_sequential(reference), reference)
    old = torch.optim.AdamW(_params(), lr=1e-2)
    scheduler = _sequential(old)  # built before the swap, as a script (or configure_optimizers) builds it
    new = to_fp8_adamw(old, opt_level="O1")
    rebind_scheduler(scheduler, {id(old): new})
    old.param_groups = [dict(g) for g in old.param_groups]  # the old optimizer's groups no longer reach the new one
    assert _lrs(scheduler, new) == pytest.approx(expected, rel=1e-12)
    assert expected[0] != expected[-1]  # the schedule changes the lr (the test would pass without a scheduler else)


def test_a_rebound_scheduler_sees_the_new_optimizer_step_first():
    # torch warns "Detected call of `lr_scheduler.step()` before `optimizer.step()`" when the optimizer the scheduler
    # watches has not stepped; a scheduler built on the FP8AdamW itself does not warn (the reference).
    old = torch.optim.AdamW(_params(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(old, step_size=1, gamma=0.5)
    new = to_fp8_adamw(old, opt_level="O1")
    rebind_scheduler(scheduler, {id(old): new})
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*lr_scheduler.step.*before.*optimizer.step")
        new.step()
        scheduler.step()
    assert new.param_groups[0]["lr"] == pytest.approx(0.5e-2, rel=1e-12)


def test_an_fp8adamw_is_kept_as_it_is():
    # The user's own FP8AdamW (its opt level, grad_scaler, dtypes...) is not rebuilt from its groups.
    from lightning_fp8 import FP8AdamW

    opt = FP8AdamW(_params(), lr=1e-2, opt_level="O1")
    assert to_fp8_adamw(opt, opt_level="O2") is opt
