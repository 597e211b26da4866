"""FP8AdamW.release (lightning_fp8/optim/adoption.py) behaviour that a mutation audit found unpinned: a released
weight's gradient is everything the next step would have used, its pending FP8 gradient plus a high-precision one
written to ``weight.grad`` beside it (the step folds the two together). Reference: the gradient of plain autograd on
the same model (fp32), plus the one written."""

import copy

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, FP8GradScaler, convert_to_fp8

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny tensor ops on one thread


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_release_hands_back_the_pending_fp8_gradient_plus_the_one_in_grad(opt_level):
    torch.manual_seed(0)
    base = convert_to_fp8(nn.Sequential(nn.Linear(32, 16)))
    x = torch.randn(8, 32)
    reference = copy.deepcopy(base)
    reference(x).square().mean().backward()  # the same FP8 GEMMs: the true gradient in fp32

    model = copy.deepcopy(base)
    opt = FP8AdamW(model.parameters(), lr=1e-2, opt_level=opt_level)
    weight = model[0].weight
    model(x).square().mean().backward()
    assert opt.holds_fp8_grads and weight.grad is None  # held in FP8 (the case under test)
    extra = torch.randn(16, 32) * reference[0].weight.grad.abs().mean()  # e.g. an auxiliary term written by the user
    weight.grad = extra.to(weight.dtype)
    opt.release(weight)
    assert weight.dtype == torch.float32 and weight.grad.dtype == torch.float32
    expected = reference[0].weight.grad + extra
    # The FP8 (E5M2) gradient rounds each element by up to 2**-3 relative; fp16 storage (O2) rounds `extra` finely.
    assert ((weight.grad.double() - expected.double()).norm() / expected.double().norm()).item() < 0.1


def test_a_released_bf16_parameter_with_low_precision_moments_keeps_its_fp32_master():
    """A bf16 parameter with low_precision_moments="all" has an fp32 master kept apart; released (fp32 states), it
    keeps that master, as any bf16 parameter of FP8AdamW or torch's own mixed-precision recipes: updates of 1e-3 on
    weights near 1 (bf16's spacing there is 2**-8) add up in it. Reference: torch.optim.AdamW in float64."""
    torch.manual_seed(0)
    start = torch.ones(64)  # bf16's spacing is 2**-7 above 1, 2**-8 below
    grads = [torch.rand(64) + 0.5 for _ in range(9)]  # of one sign: each step moves the weights down by about lr
    reference = start.double().clone().requires_grad_()
    ref_opt = torch.optim.AdamW([reference], lr=1e-3, weight_decay=0.0)
    p = nn.Parameter(start.to(torch.bfloat16))
    opt = FP8AdamW([p], lr=1e-3, weight_decay=0.0, low_precision_moments="all")
    for i, g in enumerate(grads):
        if i == 1:
            opt.release(p)
        reference.grad, p.grad = g.double(), g.to(torch.bfloat16)
        ref_opt.step()
        opt.step()
    # the weights moved by about 9e-3, over two bf16 spacings: rounding each update away would leave them where they
    # started; the master keeps them within the last rounding to bf16 (and FP8 moments' rounding of the first step).
    assert (reference.detach() - start.double()).abs().min() > 2 * 2.0**-8
    torch.testing.assert_close(p.detach().double(), reference.detach().to(torch.bfloat16).double(), rtol=0,
                               atol=2.0**-8)  # fmt: skip
    # The master itself (saved with the state, resumed from): within the first step's E4M3 rounding of the moment (a
    # few percent of lr), far below a master taken again from the bf16 weight at the release (up to 2**-9 off).
    master = opt.state_dict()["state"][0]["master"]
    assert master.dtype == torch.float32
    torch.testing.assert_close(master.double(), reference.detach(), rtol=0, atol=3e-4)


def test_gradients_dropped_by_release_weights_no_longer_count_for_the_gradient_scaler():
    """release_weights() drops the gradients not stepped yet, so their casts leave the scaler's check: an overflow in a
    dropped gradient made the next step (on finite gradients) skip and halve the scale. Reference: torch.optim.AdamW
    stepped on the second backward's gradient alone."""
    torch.manual_seed(0)
    base = convert_to_fp8(nn.Sequential(nn.Linear(32, 16, bias=False)))  # no bias: the weight's gradient alone
    x = torch.randn(8, 32)
    model = copy.deepcopy(base)
    scaler = FP8GradScaler(init_scale=2.0**8, model=model)
    opt = FP8AdamW(model.parameters(), lr=1e-2, weight_decay=0.0, grad_scaler=scaler)
    scaler.scale_loss(model(x * float("inf")).square().mean()).backward()  # an overflowing gradient, then dropped
    opt.release_weights()

    reference_model = copy.deepcopy(model)  # the FP8 layer's state after that forward, in fp32: the true gradient
    reference_model(x).square().mean().backward()
    reference = reference_model[0].weight.detach().double().clone().requires_grad_()
    reference.grad = reference_model[0].weight.grad.double()
    torch.optim.AdamW([reference], lr=1e-2, weight_decay=0.0).step()

    scaler.scale_loss(model(x).square().mean()).backward()
    opt.step()
    assert scaler.skipped_steps == 0 and float(scaler.scale) == 2.0**8
    # Adam's first step moves each element by lr * sign(g): within the FP8 gradient's rounding where g is far from 0.
    off = (model[0].weight.detach().double() - reference.detach()).abs() > 1e-2
    assert off.double().mean().item() < 0.05
