"""FP8GradScaler behaviour that a mutation audit found unpinned, each against an independent reference:
torch.amp.GradScaler's growth and backoff where the two are meant to agree, and the documented rules otherwise."""

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, FP8GradScaler, convert_to_fp8
from lightning_fp8.formats import E4M3, E5M2

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny tensor ops on one thread


# Steps whose loss is made infinite: a skip in the middle of a run of clean steps, and two in a row.
_BAD_STEPS = {2, 7, 8}


@pytest.mark.parametrize("growth_interval", [2, 3])
def test_mu_follows_torch_amp_over_clean_and_skipped_steps(growth_interval):
    # fp32 gradients of a plain optimizer are always far under fp32's maximum, so FP8GradScaler's growth is
    # torch.amp.GradScaler's (growth_factor 2, backoff_factor 0.5): a skipped step halves mu AND restarts the count
    # of consecutive clean steps (torch resets its growth tracker on an inf). A count that went on across the skip
    # doubled mu one step after it.
    scales = {}
    for amp in (True, False):
        torch.manual_seed(0)
        lin = nn.Linear(8, 4)
        opt = torch.optim.SGD(lin.parameters(), lr=0.01)
        kwargs = {"init_scale": 2.0**4, "growth_interval": growth_interval}
        scaler = torch.amp.GradScaler("cpu", **kwargs) if amp else FP8GradScaler(**kwargs)
        seen = []
        for step in range(14):
            opt.zero_grad()
            loss = lin(torch.randn(5, 8)).square().mean()
            if step in _BAD_STEPS:
                loss = loss * float("inf")
            (scaler.scale(loss) if amp else scaler.scale_loss(loss)).backward()
            scaler.step(opt)
            scaler.update()
            seen.append(float(scaler.get_scale()))
        scales[amp] = seen
    assert scales[False] == scales[True]
    assert len(set(scales[True])) > 2  # the case grows and backs off


def test_a_backward_discarded_with_optimizer_zero_grad_does_not_skip_the_next_step():
    # docs/concepts/optimizer.md: optimizer.zero_grad() drops the FP8 gradients the optimizer holds, so a discarded
    # backward (a bad batch) does not reach the next step. Its gradient casts reported an overflow to the scaler; they
    # must be dropped with the gradients, as torch.amp.GradScaler, which only looks at param.grad at its step, drops
    # them. Reference: the same clean backward and step without the discarded one before it.
    torch.manual_seed(0)
    x, y = torch.randn(16, 32), torch.randn(16, 16)
    results = []
    for discard_first in (False, True):
        torch.manual_seed(1)
        model = convert_to_fp8(nn.Sequential(nn.Linear(32, 16)))
        scaler = FP8GradScaler(init_scale=1.0, model=model)
        opt = FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler)
        if discard_first:
            scaler.scale_loss((model(x) - y).square().mean() * float("inf")).backward()
            assert opt.holds_fp8_grads
            opt.zero_grad()
        scaler.scale_loss((model(x) - y).square().mean()).backward()
        opt.step()
        results.append((scaler.skipped_steps, scaler.get_scale(), model[0].weight.detach().float().clone()))
    (ref_skipped, ref_scale, ref_w), (skipped, scale, w) = results
    assert ref_skipped == 0
    assert skipped == ref_skipped and scale == ref_scale
    assert torch.equal(w, ref_w)


def _doubles_after_one_report(amax, dtype=E5M2, scale=None, source_dtype=None):
    """Whether mu doubles (growth_interval 1) after one reported cast of ``amax``, nothing saturated."""
    scaler = FP8GradScaler(init_scale=1.0, growth_interval=1)
    scaler.record_gradient_cast(torch.tensor(float(amax)), torch.tensor(0), 1000, dtype, scale,
                                source_dtype=source_dtype)  # fmt: skip
    scaler.update()
    return scaler.get_scale() == 2.0


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_headroom_is_at_least_the_factor_under_the_format_maximum_inclusive(dtype):
    # FP8GradScaler(headroom=...): "mu may double only while every gradient amax is at least this factor under the
    # format maximum": amax * 2 == max has the headroom, anything above it has not.
    fmax = torch.finfo(dtype).max
    assert _doubles_after_one_report(fmax / 2, dtype)
    assert not _doubles_after_one_report(fmax / 2 * (1 + 2**-10), dtype)


def test_headroom_counts_the_casts_own_scale():
    # record_gradient_cast(scale=...): "the cast's own scale, when it used one besides mu (amax * scale is then
    # compared with the format maximum)". 1000 alone has headroom under E5M2's 57344; times 64 it has not.
    assert _doubles_after_one_report(1000.0)
    assert not _doubles_after_one_report(1000.0, scale=64.0)
    assert _doubles_after_one_report(1000.0, scale=16.0)  # 16000 * 2 <= 57344


def test_fp16_fast_growth_needs_every_amax_strictly_under_two_to_the_minus_8():
    # update(): mu is multiplied by 16 "while every fp16 gradient's mu-scaled amax is positive and under 2**-8".
    for amax, grown in ((2.0**-8 * (1 - 2**-10), 16.0), (2.0**-8, 2.0)):  # at 2**-8: only the usual doubling
        scaler = FP8GradScaler(init_scale=1.0, growth_interval=1)
        scaler.record_gradient_cast(torch.tensor(amax), torch.tensor(0), 1000, E5M2, source_dtype=torch.float16)
        scaler.update()
        assert scaler.get_scale() == grown, amax


@pytest.mark.parametrize("report", ["record_nonfinite", "record_gradient_cast"])
def test_a_nonfinite_report_without_owner_skips_the_next_step(report):
    # The FP8 communication hooks report their casts (and non-finite checks) with no owner: "every optimizer stepped
    # before the next update() skips on it", though the optimizer's own param.grad are finite (the hook's reduced
    # gradient is what overflowed). The reference: the same step without the report is taken.
    outcomes = []
    for bad in (False, True):
        p = nn.Parameter(torch.ones(4))
        opt = torch.optim.SGD([p], lr=0.1)
        scaler = FP8GradScaler(init_scale=4.0)
        scaler.scale_loss(torch.zeros(()))  # the planted gradient carries mu, as a scaled backward's does
        p.grad = torch.full_like(p, 4.0)
        if bad and report == "record_nonfinite":
            scaler.record_nonfinite(torch.tensor(1.0))
        elif bad:
            scaler.record_gradient_cast(torch.tensor(float("inf")), torch.tensor(0), 4, E5M2)
        stepped = scaler.step(opt)
        scaler.update()
        outcomes.append((stepped, p.detach().clone(), scaler.get_scale(), scaler.skipped_steps))
    (ref_stepped, ref_p, ref_scale, _), (stepped, w, scale, skipped) = outcomes
    assert ref_stepped and torch.allclose(ref_p, torch.full((4,), 0.9)) and ref_scale == 4.0
    assert not stepped and torch.equal(w, torch.ones(4)) and scale == 2.0 and skipped == 1


def test_an_fp8adamw_reporting_to_no_scaler_still_skips_on_its_nonfinite_fp8_gradients():
    # FP8GradScaler.step(optimizer) decides on "its own gradients (FP8AdamW's FP8 gradients and param.grad)": an
    # FP8AdamW built without grad_scaler reports its casts nowhere (a warning says so), so the scaler must find the
    # overflow in the FP8 gradients it holds, or the step writes NaN into the weights.
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 16, bias=False)))  # no param.grad to find the overflow in
    opt = FP8AdamW(model.parameters(), lr=1e-2)  # no grad_scaler
    scaler = FP8GradScaler(init_scale=4.0, model=model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    scaler.scale_loss(model(torch.randn(8, 32)).square().mean() * float("inf")).backward()
    assert opt.holds_fp8_grads and model[0].weight.grad is None  # the overflow is in the FP8 gradient it holds
    with pytest.warns(UserWarning, match="reports its FP8 gradient casts to no scaler"):
        stepped = scaler.step(opt)
    scaler.update()
    assert not stepped and scaler.skipped_steps == 1 and scaler.get_scale() == 2.0
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
