"""FP8GradScaler grows mu at once while fp16 gradients underflow.

At O2 the GEMM writes an FP8 weight's gradient in the parameter's fp16 storage before the optimizer casts it with a
scale of its own: at mu = 1 a small loss (or a late, small gradient) lost every value under fp16's 2**-24. Found by
the fortieth session's sweep: with the loss times 2**-20 every weight gradient was zero, mu stayed 1 and nothing said
so (the run did not learn). Now mu grows 16x per update while every fp16 gradient's mu-scaled amax is under 2**-8.
"""

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, FP8GradScaler, FP8Recipe, convert_to_fp8
from lightning_fp8.formats import E5M2

pytestmark = pytest.mark.usefixtures("one_thread")


def _report(scaler, amax, dtype, n_saturated=0):
    amax = torch.tensor(amax)
    scaler.record_gradient_cast(amax, torch.full(amax.shape, n_saturated), 1000, E5M2, source_dtype=dtype)
    scaler.update()
    return scaler.get_scale()


def test_reported_fp16_amaxes_under_the_threshold_grow_mu_16x_and_others_do_not():
    scaler = FP8GradScaler(growth_interval=1000)
    assert _report(scaler, [1e-3, 2e-4], torch.float16) == 16.0  # every fp16 amax under 2**-8
    assert scaler.history[-1]["action"] == "grow" and scaler.growth_tracker == 0
    assert _report(scaler, [1e-3 * 16, 0.0], torch.float16) == 16.0  # 0.016 >= 2**-8: the usual growth from here
    assert scaler.growth_tracker == 1
    assert _report(scaler, [0.0, 0.0], torch.float16) == 256.0  # flushed whole: grows too
    for dtype in (torch.float32, torch.bfloat16, None):  # these keep small values: the usual growth
        assert _report(scaler, [1e-6], dtype) == 256.0
    assert _report(scaler, [1e-6], torch.float16, n_saturated=500) == 128.0  # saturation halves, as before
    assert _report(scaler, [float("nan")], torch.float16) == 64.0  # non-finite: skip and halve, as before


def test_after_a_skipped_step_the_fast_growth_waits_growth_interval_updates():
    # fp16 activations that overflow at the grown mu while the weight gradients stay small would otherwise make mu
    # grow 16x and fall back at every step, every step skipped.
    scaler = FP8GradScaler(growth_interval=3)
    assert _report(scaler, [1e-3], torch.float16) == 16.0
    assert _report(scaler, [float("inf")], torch.float16) == 8.0  # skipped, halved
    assert [_report(scaler, [1e-3], torch.float16) for _ in range(3)] == [8.0, 8.0, 128.0]  # waits, then grows
    assert scaler.skipped_steps == 1


def _o2_run(opt_level, fp8_grads, loss_factor, steps):
    torch.manual_seed(0)
    model = convert_to_fp8(
        nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)), FP8Recipe(opt_level=opt_level)
    )
    scaler = FP8GradScaler(model=model)
    # eps scaled with the loss: plain AdamW then takes the same steps for any power-of-two loss factor
    opt = FP8AdamW(model.parameters(), lr=1e-3, eps=1e-8 * loss_factor, grad_scaler=scaler, opt_level=opt_level,
                   fp8_grads=fp8_grads)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 32, generator=gen), torch.randn(64, 16, generator=gen)
    zeros, mus = [], []
    for _ in range(steps):
        loss = ((model(x).float() - y) ** 2).mean() * loss_factor
        scaler.scale_loss(loss).backward()
        grad = model[2].weight.grad
        if grad is not None:  # fp8_grads=True takes it out of param.grad when backward ends
            zeros.append(float((grad == 0).float().mean()))
        opt.step()
        opt.zero_grad()
        mus.append(scaler.get_scale())
    return mus, zeros, model


@pytest.mark.parametrize("fp8_grads", [False, True])
def test_o2_weight_gradients_of_a_small_loss_are_kept_once_mu_grew(fp8_grads):
    mus, zeros, _ = _o2_run("O2", fp8_grads, 2.0**-20, steps=8)
    assert mus[:5] == [16.0, 256.0, 4096.0, 65536.0, 2.0**20]  # the amaxes (about 1e-2 * 2**-20 * mu) were small
    assert mus[5:] == [2.0**20] * 3  # then at 2**-8 or above: the usual growth (growth_interval 1000)
    if not fp8_grads:
        assert zeros[0] == 1.0 and zeros[-1] < 0.01  # every value flushed at mu = 1; kept at 2**20


def _loss(model):
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 32, generator=gen), torch.randn(64, 16, generator=gen)
    with torch.no_grad():
        return float(((model(x).float() - y) ** 2).mean())


def test_o2_at_the_grown_mu_trains_as_the_unscaled_loss_does():
    """The small loss learns about as the loss times 1 does, short of the first updates' flushed gradients (before
    the fix every gradient was 0 and the loss did not move)."""
    _, _, start = _o2_run("O2", True, 1.0, steps=0)
    _, _, small = _o2_run("O2", True, 2.0**-20, steps=12)
    _, _, ref = _o2_run("O2", True, 1.0, steps=12)
    drop, drop_ref = _loss(start) - _loss(small), _loss(start) - _loss(ref)
    assert drop_ref > 0 and drop > 0.5 * drop_ref, (drop, drop_ref)


def test_o1_gradients_in_fp32_do_not_grow_mu():
    mus, zeros, _ = _o2_run("O1", False, 2.0**-20, steps=3)
    assert mus == [1.0, 1.0, 1.0] and zeros[0] == 0.0  # fp32 keeps them: nothing to grow for
