"""FP8GradScaler.update() after unscale_() without a step, judged as torch.amp.GradScaler judges it: a loop that finds
an overflow after unscale_ (or clipping) and skips its step must still see mu halve, or every later iteration
overflows again. update() threw the unscale_ flags away (mu unchanged, nothing counted)."""

import torch
from torch import nn

from lightning_fp8 import FP8GradScaler


def _iteration(scaler, model, opt, seed, poison=False, step=False):
    loss = model(torch.randn(2, 4, generator=torch.Generator().manual_seed(seed))).sum()
    (scaler.scale(loss) if isinstance(scaler, torch.amp.GradScaler) else scaler.scale_loss(loss)).backward()
    if poison:
        model.weight.grad[0, 0] = float("inf")
    scaler.unscale_(opt)
    if step:
        scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def _pair():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_mu_follows_torch_amp_when_unscale_finds_inf_and_the_loop_skips_the_step():
    pattern = [True, False, False, False, True, True, False, False, False, False]  # poisoned iterations
    ours = FP8GradScaler(init_scale=2.0**10, growth_interval=3)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    scales = {}
    for scaler in (ours, theirs):
        model, opt = _pair()
        scales[scaler] = []
        for i, poison in enumerate(pattern):
            _iteration(scaler, model, opt, i, poison=poison)
            scales[scaler].append(float(scaler.get_scale()))
    assert scales[ours] == scales[theirs], scales
    assert ours.skipped_steps == sum(pattern)


def test_an_optimizer_not_stepped_after_inf_counts_as_skipped_for_the_fallback():
    """Two optimizers: one steps, the other's loop skips its step on the inf unscale_ found. The fallback (lower_lr
    after one failure) acts on the one whose step was skipped."""
    scaler = FP8GradScaler(init_scale=2.0**10, nonfinite_fallback="lower_lr", fallback_after=1, lr_factor=0.5)
    a_model, a_opt = _pair()
    b_model, b_opt = _pair()
    for model in (a_model, b_model):
        scaler.scale_loss(model(torch.randn(2, 4)).sum()).backward()
    b_model.weight.grad[0, 0] = float("nan")
    scaler.unscale_(b_opt)
    assert scaler.step(a_opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**9
    assert b_opt.param_groups[0]["lr"] == 0.05 and a_opt.param_groups[0]["lr"] == 0.1


def test_update_with_nothing_recorded_still_does_nothing():
    scaler = FP8GradScaler(init_scale=8.0, growth_interval=1)
    scaler.update()
    scaler.update()
    assert scaler.get_scale() == 8.0 and scaler.skipped_steps == 0


def _shared_scaler_setup(poison):
    from lightning_fp8 import FP8AdamW, convert_to_fp8

    torch.manual_seed(0)
    scaler = FP8GradScaler(init_scale=2.0**10, nonfinite_fallback="lower_lr", fallback_after=2, lr_factor=0.5)
    fp8_model = convert_to_fp8(nn.Sequential(nn.Linear(16, 16)))
    head = nn.Linear(16, 4)
    fp8_opt = FP8AdamW(fp8_model.parameters(), lr=1e-3, grad_scaler=scaler)
    sgd = torch.optim.SGD(head.parameters(), lr=1.0)
    scaler.scale_loss(head(fp8_model(torch.randn(8, 16))).square().mean()).backward()
    if poison:
        head.weight.grad[0, 0] = float("inf")
    return scaler, fp8_opt, sgd, head


def test_another_optimizers_step_update_leaves_an_unscaled_optimizer_to_its_own_step():
    """unscale_(sgd), then an FP8AdamW(grad_scaler=scaler).step() (which updates mu itself), then scaler.step(sgd) and
    update(): the FP8AdamW's update judged the SGD too and forgot it was unscaled, so its step unscaled the gradients
    a second time (the SGD stepped on g / mu), and an inf there halved mu twice and counted two failures."""
    scaler, fp8_opt, sgd, head = _shared_scaler_setup(poison=False)
    true_grads = [p.grad.clone() / 2.0**10 for p in head.parameters()]
    start = [p.detach().clone() for p in head.parameters()]
    scaler.unscale_(sgd)
    fp8_opt.step()
    assert scaler.step(sgd)
    scaler.update()
    for p, p0, g in zip(head.parameters(), start, true_grads, strict=True):
        assert torch.allclose(p.detach(), p0 - g, rtol=1e-6, atol=1e-7)  # SGD, lr 1, on the true gradient

    scaler, fp8_opt, sgd, head = _shared_scaler_setup(poison=True)
    scaler.unscale_(sgd)
    fp8_opt.step()
    assert not scaler.step(sgd)
    scaler.update()
    assert scaler.get_scale() == 2.0**9 and scaler.skipped_steps == 1
    assert sgd.param_groups[0]["lr"] == 1.0  # one failure: the fallback waits for two


def test_growth_counts_a_finite_unscale_even_when_the_loop_zeroes_the_gradients_before_update():
    scales = {}
    for scaler in (FP8GradScaler(init_scale=2.0**10, growth_interval=2),
                   torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)):  # fmt: skip
        model, opt = _pair()
        scales[scaler] = []
        for i in range(6):
            loss = model(torch.randn(2, 4, generator=torch.Generator().manual_seed(i))).sum()
            (scaler.scale(loss) if isinstance(scaler, torch.amp.GradScaler) else scaler.scale_loss(loss)).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()  # the loop steps the unscaled gradients itself
            opt.zero_grad()
            scaler.update()
            scales[scaler].append(float(scaler.get_scale()))
    first, second = scales.values()
    assert first == second == [1024.0, 2048.0, 2048.0, 4096.0, 4096.0, 8192.0], scales
