"""Rules of mu's growth that a mutation audit of lightning_fp8/grad_scaling/rules.py found unpinned, as its docstrings
state them: the fast (16x) growth of underflowing fp16 gradients waits growth_interval updates after any halving of mu
(a saturated step as well as a skipped one); it needs every gradient of the update to have headroom (a cast without
headroom blocks it); an update without fp16 gradients keeps the last fp16 verdict; and mu doubles only after
growth_interval updates with headroom measured (an update that measured nothing is no evidence of headroom)."""

import pytest
import torch

from lightning_fp8 import FP8GradScaler
from lightning_fp8.formats import E5M2

pytestmark = pytest.mark.usefixtures("one_thread")


def _report(scaler, amax, dtype, n_saturated=0, scale=None, update=True):
    amax = torch.tensor(amax)
    scaler.record_gradient_cast(amax, torch.full(amax.shape, n_saturated), 1000, E5M2, scale, source_dtype=dtype)
    if update:
        scaler.update()
    return scaler.get_scale()


def test_after_a_saturated_step_the_fast_growth_waits_growth_interval_updates():
    scaler = FP8GradScaler(growth_interval=3)
    assert _report(scaler, [1e-3], torch.float16, n_saturated=500) == 0.5  # half the values saturated: halved
    assert scaler.history[-1]["action"] == "halve"
    # As after a skipped step (test_grad_scaler_fp16_underflow): two updates wait, the third grows 16x.
    assert [_report(scaler, [1e-3], torch.float16) for _ in range(3)] == [0.5, 0.5, 8.0]


def test_a_cast_without_headroom_in_the_same_update_stops_the_fast_growth():
    scaler = FP8GradScaler(growth_interval=1000)
    _report(scaler, [1e-3], torch.float16, update=False)  # an fp16 gradient that underflows ...
    # ... and, in the same update, a cast whose own scale takes it past E5M2's maximum over the headroom
    _report(scaler, [1.0], torch.float32, scale=2.0**15, update=False)
    scaler.update()
    assert scaler.get_scale() == 1.0 and scaler.growth_tracker == 0
    assert _report(scaler, [1e-3], torch.float16) == 1.0  # that verdict holds the next update back once
    assert _report(scaler, [1e-3], torch.float16) == 16.0


def test_an_update_without_fp16_gradients_keeps_the_last_fp16_verdict():
    scaler = FP8GradScaler(growth_interval=1000)
    assert _report(scaler, [1.0], torch.float16) == 1.0  # a large fp16 gradient: "full"
    assert _report(scaler, [1e-6], torch.float32) == 1.0  # fp32 only: no fp16 verdict, the last one stays
    assert _report(scaler, [1e-4], torch.float16) == 1.0  # held back by it
    assert _report(scaler, [1e-4], torch.float16) == 16.0


def test_updates_that_measured_nothing_do_not_count_toward_growth():
    scaler = FP8GradScaler(growth_interval=2)
    for _ in range(4):
        scaler.record_nonfinite(torch.tensor(0.0))  # a finite check: nothing measured, no headroom known
        scaler.update()
    assert scaler.get_scale() == 1.0 and scaler.growth_tracker == 0
    assert [_report(scaler, [1.0], torch.float32) for _ in range(2)] == [1.0, 2.0]  # measured: grows as usual


def test_the_lower_lr_fallback_lowers_every_optimizer_skipped_in_that_update():
    # Two plain optimizers sharing one scaler, both of whose steps are skipped before one update: the fallback lowers
    # the learning rate of each (not only the last one stepped); a third, whose step was taken, keeps its own.
    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 3) for _ in range(3)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    scaler = FP8GradScaler(init_scale=2.0**10, nonfinite_fallback="lower_lr", fallback_after=1, lr_factor=0.5)
    for model in models:
        scaler.scale_loss(model(torch.randn(2, 4)).sum()).backward()
    for model in models[:2]:
        model.weight.grad[0, 0] = float("inf")
    assert [scaler.step(opt) for opt in opts] == [False, False, True]
    scaler.update()
    assert [opt.param_groups[0]["lr"] for opt in opts] == [0.05, 0.05, 0.1]
    assert scaler.history[-1]["action"] == "fallback" and "in 2 optimizers" in scaler.history[-1]["reason"]


def test_a_saturated_step_restarts_the_count_toward_doubling():
    # As torch.amp.GradScaler's backoff resets its growth tracker: growth_interval *consecutive* steps with headroom.
    scaler = FP8GradScaler(growth_interval=3)
    assert [_report(scaler, [1.0], torch.float32) for _ in range(2)] == [1.0, 1.0]
    assert scaler.growth_tracker == 2
    assert _report(scaler, [1.0], torch.float32, n_saturated=500) == 0.5
    assert scaler.growth_tracker == 0
    assert [_report(scaler, [1.0], torch.float32) for _ in range(3)] == [0.5, 0.5, 1.0]
