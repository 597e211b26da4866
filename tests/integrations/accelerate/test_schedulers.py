"""LR schedulers under lightning_fp8's Accelerator: ``prepare`` replaces the script's AdamW by an FP8AdamW, and every
scheduler built on the AdamW must drive the FP8AdamW, prepared or not, in any prepare order.

The reference is plain ``accelerate.Accelerator`` running the same script: the learning rate (and OneCycleLR's
``betas``) that the stepping optimizer holds at each step must be the same, and so must the scheduler warnings.
"""

import warnings
from collections.abc import Callable

import accelerate
import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from torch import nn

from lightning_fp8.accelerate import Accelerator
from lightning_fp8.optim import FP8AdamW
from tests.integrations.accelerate.test_accelerator import _fresh_accelerate_state  # noqa: F401 (autouse fixture)

STEPS = 6
# ReduceLROnPlateau reads a metric: a fixed sequence (not the loss, which FP8 changes) that plateaus at once.
PLATEAU_METRICS = [1.0, 1.0, 1.0, 1.0, 0.5, 0.5]

SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], object]] = {
    "StepLR": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS),
    "LambdaLR": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step)),
    "ReduceLROnPlateau": lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0),
}


def _prepare_unprepared(acc, model, opt, sched):
    model, opt = acc.prepare(model, opt)
    return model, opt, sched


def _prepare_scheduler_then_all(acc, model, opt, sched):
    sched = acc.prepare(sched)
    model, opt = acc.prepare(model, opt)
    return model, opt, sched


def _prepare_model_and_scheduler_then_optimizer(acc, model, opt, sched):
    model, sched = acc.prepare(model, sched)
    opt = acc.prepare(opt)
    return model, opt, sched


def _prepare_scheduler_before_optimizer_in_one_call(acc, model, opt, sched):
    model, sched, opt = acc.prepare(model, sched, opt)
    return model, opt, sched


PREPARE_ORDERS = {
    "not prepared": _prepare_unprepared,
    "prepare(model, scheduler, optimizer)": _prepare_scheduler_before_optimizer_in_one_call,
    "prepare(scheduler); prepare(model, optimizer)": _prepare_scheduler_then_all,
    "prepare(model, scheduler); prepare(optimizer)": _prepare_model_and_scheduler_then_optimizer,
}


def _setup(fp8: bool, scheduler: str, prepare: Callable):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    if fp8:
        acc = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm", mixed_precision="no")
    else:
        acc = accelerate.Accelerator(cpu=True, mixed_precision="no")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99))
    sched = SCHEDULERS[scheduler](opt)
    model, opt, sched = prepare(acc, model, opt, sched)
    if fp8:
        assert isinstance(opt.optimizer, FP8AdamW)
    return acc, model, opt, sched


def _train(acc, model, opt, sched, steps: range, scheduler_first: bool = False) -> list:
    """What the stepping optimizer holds before each step: every group's ``(lr, betas)``.

    ``scheduler_first``: call ``scheduler.step()`` before the first ``optimizer.step()`` (torch warns about it).
    """
    seen = []
    for step in steps:
        acc.backward(model(torch.randn(8, 32)).float().pow(2).mean())
        if scheduler_first and step == 0:
            sched.step()
        seen.append([(g["lr"], g["betas"]) for g in opt.param_groups])
        opt.step()
        assert not acc.optimizer_step_was_skipped  # a skipped step would hold a prepared scheduler only
        opt.zero_grad()
        if isinstance(getattr(sched, "scheduler", sched), torch.optim.lr_scheduler.ReduceLROnPlateau):
            sched.step(PLATEAU_METRICS[step])
        elif not (scheduler_first and step == 0):
            sched.step()
    return seen


def _run(fp8: bool, scheduler: str, prepare: Callable, scheduler_first: bool = False):
    """Train ``STEPS`` steps: ``(_train's list, the scheduler warnings)``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seen = _train(*_setup(fp8, scheduler, prepare), range(STEPS), scheduler_first=scheduler_first)
    return seen, [str(w.message) for w in caught if "scheduler" in str(w.message)]


@pytest.mark.parametrize("scheduler", list(SCHEDULERS))
@pytest.mark.parametrize("order", list(PREPARE_ORDERS))
def test_scheduler_drives_the_fp8_optimizer_as_plain_accelerate(scheduler, order):
    expected, _ = _run(False, scheduler, PREPARE_ORDERS[order])
    assert len({str(lrs) for lrs in expected}) > 1, "the schedule must change the learning rate to test anything"
    got, _ = _run(True, scheduler, PREPARE_ORDERS[order])
    assert got == expected


@pytest.mark.parametrize("scheduler_first", [False, True], ids=["optimizer stepped first", "scheduler stepped first"])
@pytest.mark.parametrize("order", list(PREPARE_ORDERS))
def test_scheduler_warnings_as_plain_accelerate(order, scheduler_first):
    # torch warns when a scheduler steps before its optimizer ever did: only when plain Accelerate does too.
    _, expected = _run(False, "StepLR", PREPARE_ORDERS[order], scheduler_first=scheduler_first)
    _, got = _run(True, "StepLR", PREPARE_ORDERS[order], scheduler_first=scheduler_first)
    assert got == expected
    assert bool(expected) == scheduler_first


@pytest.mark.parametrize("scheduler", ["StepLR", "OneCycleLR"])
@pytest.mark.parametrize("order", ["not prepared", "prepare(model, scheduler); prepare(optimizer)"])
def test_scheduler_drives_the_fp8_optimizer_after_load_state(tmp_path, scheduler, order):
    # load_state gives FP8AdamW new param group dicts: the schedulers built on the replaced AdamW must follow them.
    def resumed(fp8: bool) -> list:
        acc, *run = _setup(fp8, scheduler, PREPARE_ORDERS[order])
        if order == "not prepared":
            acc.register_for_checkpointing(run[-1])  # plain Accelerate's way to save an unprepared scheduler
        _train(acc, *run, range(2))
        acc.save_state(str(tmp_path / ("fp8" if fp8 else "plain")))
        uninterrupted = _train(acc, *run, range(2, STEPS))
        acc, *run = _setup(fp8, scheduler, PREPARE_ORDERS[order])
        if order == "not prepared":
            acc.register_for_checkpointing(run[-1])
        acc.load_state(str(tmp_path / ("fp8" if fp8 else "plain")))
        after_load = _train(acc, *run, range(2, STEPS))
        assert after_load == uninterrupted
        return after_load

    assert resumed(fp8=True) == resumed(fp8=False)


def test_replaced_optimizer_refuses_to_step():
    _, _, opt, _ = _setup(True, "StepLR", PREPARE_ORDERS["not prepared"])
    replaced = opt.replaced[0]
    assert type(replaced) is torch.optim.AdamW and replaced.param_groups is opt.optimizer.param_groups
    with pytest.raises(RuntimeError, match=r"replaced by FP8AdamW in accelerator\.prepare .* step the optimizer that"):
        replaced.step()
