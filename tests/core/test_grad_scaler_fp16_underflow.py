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
    assert _report(scaler, [1e-4, 0.0], torch.float16) == 256.0  # an all-zero gradient does not stop it
    # All zeros: flushed whole, or gated off (a branch times 0, a zero loss): no evidence either way, no growth
    assert _report(scaler, [0.0, 0.0], torch.float16) == 256.0
    for dtype in (torch.float32, torch.bfloat16, None):  # these keep small values: the usual growth
        assert _report(scaler, [1e-6], dtype) == 256.0
    assert _report(scaler, [1e-2 * 256, 1e-6 * 256], torch.float16) == 256.0  # one at 2**-8 or above: none
    assert scaler.growth_tracker == 5
    assert _report(scaler, [1e-6], torch.float16) == 256.0  # the last verdict was "a large one": held once
    assert _report(scaler, [1e-6], torch.float16) == 4096.0
    assert _report(scaler, [1e-6], torch.float16, n_saturated=500) == 2048.0  # saturation halves, as before
    assert _report(scaler, [float("nan")], torch.float16) == 1024.0  # non-finite: skip and halve, as before


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
    mus, zeros, _ = _o2_run("O2", fp8_grads, 2.0**-14, steps=8)
    assert mus[:3] == [16.0, 256.0, 4096.0]  # the amaxes (about 1e-2 * 2**-14 * mu) were under 2**-8
    assert mus[3:] == [4096.0] * 5  # then at 2**-8 or above: the usual growth (growth_interval 1000)
    if not fp8_grads:
        assert zeros[0] > 0.05 and zeros[-1] == 0.0  # values flushed to zero at mu = 1, none at 4096


def _loss(model):
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 32, generator=gen), torch.randn(64, 16, generator=gen)
    with torch.no_grad():
        return float(((model(x).float() - y) ** 2).mean())


def test_o2_at_the_grown_mu_trains_as_the_unscaled_loss_does():
    """The small loss learns as the loss times 1 does, short of the first updates' flushed values."""
    _, _, start = _o2_run("O2", True, 1.0, steps=0)
    _, _, small = _o2_run("O2", True, 2.0**-14, steps=12)
    _, _, ref = _o2_run("O2", True, 1.0, steps=12)
    drop, drop_ref = _loss(start) - _loss(small), _loss(start) - _loss(ref)
    assert drop_ref > 0 and abs(drop - drop_ref) < 0.02 * drop_ref, (drop, drop_ref)


def test_o1_gradients_in_fp32_do_not_grow_mu():
    mus, zeros, _ = _o2_run("O1", False, 2.0**-20, steps=3)
    assert mus == [1.0, 1.0, 1.0] and zeros[0] == 0.0  # fp32 keeps them: nothing to grow for


def test_batches_of_a_zero_loss_do_not_grow_mu():
    """Found by the session's review: each batch whose loss is exactly 0 (a masked batch, an auxiliary loss weighted
    from 0) gave all-zero fp16 gradients and grew mu 16x, to max_scale in 6 batches; the first real batches then
    overflowed, were skipped and ran the fallback."""
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 16)))
    scaler = FP8GradScaler(model=model, nonfinite_fallback="lower_lr")
    opt = FP8AdamW(model.parameters(), lr=1e-3, grad_scaler=scaler)
    x, y = torch.randn(64, 32), torch.randn(64, 16)
    for weight in [0.0] * 6 + [1.0] * 4:
        scaler.scale_loss(((model(x).float() - y) ** 2).mean() * weight).backward()
        opt.step()
        opt.zero_grad()
    assert scaler.get_scale() == 1.0 and scaler.skipped_steps == 0 and opt.param_groups[0]["lr"] == 1e-3


def test_an_optimizer_with_larger_fp16_gradients_stops_the_growth_another_asks_for():
    """Two FP8AdamW sharing one scaler, each step() updating on its own gradients (found by the session's review):
    one whose fp16 gradients underflow grew mu 16x at every update, past the other's fp16 range (its gradients are
    about 10): the other was skipped step after step and its fallback ran."""
    torch.manual_seed(0)
    a = convert_to_fp8(nn.Sequential(nn.Linear(32, 32, bias=False)))
    b = convert_to_fp8(nn.Sequential(nn.Linear(32, 16, bias=False)))
    scaler = FP8GradScaler(model=nn.ModuleDict({"a": a, "b": b}), nonfinite_fallback="lower_lr")
    opt_a, opt_b = (FP8AdamW(m.parameters(), lr=1e-3, grad_scaler=scaler) for m in (a, b))
    x, y = torch.randn(64, 32), torch.randn(64, 16)
    for _ in range(10):
        loss = ((b(x).float() - y) ** 2).mean() * 64 + a(x).float().pow(2).mean() * 2.0**-16
        scaler.scale_loss(loss).backward()
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
    # One growth before opt_b had reported anything, none after it did.
    assert [e["action"] for e in scaler.history] == ["grow"] and scaler.skipped_steps == 0


def test_an_fp8_branch_gated_off_does_not_grow_mu():
    """Found by the session's sweep: an FP8 branch multiplied by 0 for some steps (a gate, a dead path) while the rest
    of the loss trains gave all-zero fp16 gradients, counted as flushed: mu grew to max_scale, and the first steps
    after the gate opened overflowed and were skipped (the lower_lr fallback ran twice)."""
    torch.manual_seed(0)
    branch = convert_to_fp8(nn.Sequential(nn.Linear(32, 16)))
    other = nn.Linear(32, 16)
    scaler = FP8GradScaler(model=branch, nonfinite_fallback="lower_lr")
    opt = FP8AdamW([*branch.parameters(), *other.parameters()], lr=1e-3, grad_scaler=scaler, fp8_grads=False)
    x, y = torch.randn(64, 32), torch.randn(64, 16)
    for gate in [0.0] * 6 + [1.0] * 4:
        loss = ((branch(x).float() * gate + other(x) - y) ** 2).mean()
        scaler.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()
    assert scaler.get_scale() == 1.0 and scaler.skipped_steps == 0 and opt.param_groups[0]["lr"] == 1e-3


def test_the_last_fp16_verdict_is_saved_with_the_scaler():
    """Two optimizers sharing the scaler, each updating: the one with large fp16 gradients holds the growth back
    through the last verdict, which a resume must keep (found by the session's sweep: a resumed run grew once more
    than the uninterrupted one)."""
    scaler = FP8GradScaler()
    _report(scaler, [1.0], torch.float16)  # a large fp16 gradient (the other optimizer's)
    state = scaler.state_dict()
    assert state["fp16_full"] is True
    resumed = FP8GradScaler()
    resumed.load_state_dict(torch.load(_saved(state), weights_only=True))
    assert _report(resumed, [1e-4], torch.float16) == 1.0  # held back, as the uninterrupted scaler is
    assert _report(scaler, [1e-4], torch.float16) == 1.0
    older = {k: v for k, v in state.items() if k != "fp16_full"}  # saved before the verdict was
    FP8GradScaler().load_state_dict(older)
    with pytest.raises(TypeError, match="entry 'fp16_full' is 'yes', expected True or False"):
        resumed.load_state_dict({**state, "fp16_full": "yes"})


def _saved(state):
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer
