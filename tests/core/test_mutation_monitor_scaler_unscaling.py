"""FP8GradScaler.grad_factor with gradients an FP8AdamW(fp8_grads=True) holds in FP8, and update() after unscale_
without a step on a complex gradient: cases a mutation audit of lightning_fp8/grad_scaling/unscaling.py found
unpinned. As grad_factor's docstring states: the held gradients carry mu (unscale_ refuses an FP8AdamW), so beside
gradients that unscale_ unscaled the set is mixed and refused, and clipping such a set by norm is refused too, rather
than clipped with the held ones taken as unscaled (mu times too large). An inf that unscale_ finds halves mu at an
update without a step, as torch.amp.GradScaler's does, for a complex gradient as for a real one."""

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, FP8GradScaler, convert_to_fp8


def _mixed():
    torch.manual_seed(0)
    fp8 = convert_to_fp8(nn.Sequential(nn.Linear(32, 32, bias=False)))
    plain = nn.Linear(32, 4)
    scaler = FP8GradScaler(init_scale=2.0**8, model=fp8)
    held = FP8AdamW(fp8.parameters(), lr=1e-3, grad_scaler=scaler, fp8_grads=True)
    sgd = torch.optim.SGD(plain.parameters(), lr=0.1)
    scaler.scale_loss(plain(fp8(torch.randn(8, 32))).square().mean()).backward()
    assert fp8[0].weight.grad is None  # held in FP8 by the FP8AdamW
    return fp8, plain, scaler, held, sgd


def test_held_fp8_gradients_beside_unscaled_ones_are_refused():
    fp8, plain, scaler, _, sgd = _mixed()
    assert scaler.grad_factor(fp8.parameters()) == 2.0**8  # held: they carry mu
    assert scaler.grad_factor(plain.parameters()) == 2.0**8
    scaler.unscale_(sgd)
    assert scaler.grad_factor(plain.parameters()) == 1.0  # unscaled by unscale_
    assert scaler.grad_factor(fp8.parameters()) == 2.0**8
    mixed = [*fp8.parameters(), *plain.parameters()]
    with pytest.raises(ValueError, match="some of these gradients were unscaled by unscale_"):
        scaler.grad_factor(mixed)
    before = plain.weight.grad.clone()
    with pytest.raises(ValueError, match="clip the two sets separately"):
        scaler.clip_grad_norm_(mixed, max_norm=1e-6)
    assert torch.equal(plain.weight.grad, before)  # nothing was clipped


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
def test_an_inf_that_unscale_finds_halves_mu_without_a_step_for_complex_gradients_too(dtype):
    # The loop finds the overflow after unscale_ and skips its step: update() halves mu and counts a skipped step,
    # as torch.amp.GradScaler does for real gradients (test_scaler_unscale_without_step.py) and as this scaler's
    # unscale_ flags a complex gradient's inf (torch.amp refuses complex gradients).
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(3, dtype=dtype))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = FP8GradScaler(init_scale=2.0**10)
    scaler.scale_loss((p * p).real.sum()).backward()
    with torch.no_grad():
        p.grad[0] = float("inf")
    scaler.unscale_(opt)
    scaler.update()
    assert (scaler.get_scale(), scaler.skipped_steps) == (2.0**9, 1)


@pytest.mark.parametrize("unscale_first", [False, True])
def test_clip_grad_value_clamps_in_true_units_before_and_after_unscale(unscale_first):
    # The reference: torch.nn.utils.clip_grad_value_ on the true (unscaled) gradients of the same backward.
    torch.manual_seed(0)
    ref, model = nn.Linear(8, 4), nn.Linear(8, 4)
    model.load_state_dict(ref.state_dict())
    x = torch.randn(16, 8)
    ref(x).square().sum().backward()
    torch.nn.utils.clip_grad_value_(ref.parameters(), 0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = FP8GradScaler(init_scale=2.0**6)
    scaler.scale_loss(model(x).square().sum()).backward()
    if unscale_first:
        scaler.unscale_(opt)
    scaler.clip_grad_value_(model.parameters(), 0.5)
    factor = 1.0 if unscale_first else 2.0**6
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert (q.grad.abs() == 0.5).any()  # the clamp bites
        torch.testing.assert_close(p.grad / factor, q.grad, rtol=1e-6, atol=0)
