"""FP8AdamW behaviour that a mutation audit found unpinned, each against torch.optim.AdamW (float64) fed the same
gradients, or against what torch.optim.AdamW does with the same call."""

import copy

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, FP8GradScaler, convert_to_fp8

# The FP8 (E5M2, 2 significand bits) gradient rounds each element by up to 2**-3 relative: the first moment of one
# step is 0.1 g, so it is that far from torch's (about 4% RMS); the second moment (g squared) twice as far. The
# bounds leave margin over that and catch any factor of mu (a power of two >= 2) left in the moments.
EXP_AVG_RTOL, EXP_AVG_SQ_RTOL = 0.1, 0.2


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny tensor ops on one thread


def _rel(actual: torch.Tensor, reference: torch.Tensor) -> float:
    return ((actual.double() - reference).norm() / reference.norm()).item()


@pytest.mark.parametrize("mu", [2.0**-6, 2.0**10])
def test_fp8_gradients_are_unscaled_by_mu_before_the_moments_take_them(mu):
    # Adam's update is nearly invariant to a factor on the gradient, so weights alone barely tell whether the step
    # unscaled the FP8 gradients by 1/mu; the moments do: a resumed or exported run (to_adamw_state_dict), and every
    # step after mu changes, read them in true units. O1 keeps fp32 moments, so the only rounding is the gradient's.
    torch.manual_seed(0)
    base = convert_to_fp8(nn.Sequential(nn.Linear(32, 16)), recipe="fp8-lm-o1")
    x, y = torch.randn(16, 32), torch.randn(16, 16)
    ref_model = copy.deepcopy(base)
    ((ref_model(x) - y).square().mean()).backward()  # the same FP8 GEMMs, no mu: the true gradient in fp32
    weight = ref_model[0].weight
    reference = weight.detach().double().clone().requires_grad_()
    reference.grad = weight.grad.double()
    ref_opt = torch.optim.AdamW([reference], lr=1e-2, weight_decay=0.1)
    ref_opt.step()

    model = copy.deepcopy(base)
    scaler = FP8GradScaler(init_scale=mu, model=model)
    opt = FP8AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, opt_level="O1", grad_scaler=scaler)
    scaler.scale_loss((model(x) - y).square().mean()).backward()
    assert opt.holds_fp8_grads and model[0].weight.grad is None  # the gradient is held in FP8 (the case under test)
    opt.step()
    assert scaler.skipped_steps == 0
    state, expected = opt.to_adamw_state_dict()["state"][0], ref_opt.state[reference]
    assert _rel(state["exp_avg"], expected["exp_avg"]) < EXP_AVG_RTOL
    assert _rel(state["exp_avg_sq"], expected["exp_avg_sq"]) < EXP_AVG_SQ_RTOL
    torch.testing.assert_close(model[0].weight.detach().double(), reference.detach(), rtol=0, atol=1e-2 * 0.05)


def _frozen_then_unfrozen():
    # An FP8 weight frozen as the optimizer is built keeps its fp32 storage and gets an fp16 master kept apart.
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16)))
    model[0].weight.requires_grad_(False)
    opt = FP8AdamW(model.parameters(), lr=0.0, weight_decay=0.1)
    model[0].weight.requires_grad_(True)
    return model, opt


def _released():
    # After release_weights() the weights hold their unscaled values again and the fp16 masters are kept apart.
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16)))
    opt = FP8AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model(torch.randn(8, 32)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    opt.release_weights()
    for group in opt.param_groups:
        group["lr"] = 0.0
    return model, opt


@pytest.mark.parametrize("make", [_frozen_then_unfrozen, _released], ids=["unfrozen", "released"])
def test_a_step_at_lr_zero_leaves_every_weight_as_it_is(make):
    # torch.optim.AdamW at lr 0 changes no weight (the decay is lr * weight_decay): a step at lr 0 (a warm-up
    # schedule's first step, torch.distributed.checkpoint's state-making step) must not write the master kept apart,
    # rounded to fp16, into an fp32 weight.
    model, opt = make()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    references = {name: p.detach().double().requires_grad_() for name, p in model.named_parameters()}
    for reference in references.values():
        reference.grad = torch.randn_like(reference)
    torch.optim.AdamW(list(references.values()), lr=0.0, weight_decay=0.1).step()
    model(torch.randn(8, 32)).square().mean().backward()
    opt.step()
    assert model[0].weight.dtype == torch.float32  # the case under test: an fp32 weight with its master apart
    for name, p in model.named_parameters():
        assert torch.equal(references[name].detach(), before[name].double())  # torch's step at lr 0 (in float64)
        assert torch.equal(p.detach(), before[name]), name


@pytest.mark.parametrize("scale_update", ["one_pass", "two_pass"])
def test_an_fp8_gradient_handed_over_with_a_large_scale_inv_keeps_the_moments_unsaturated(scale_update):
    # accumulate_fp8_grad(p, grad_fp8, scale_inv) (what the FP8 communication hooks do): the true gradient is
    # grad_fp8 * scale_inv, here up to ~1e7, far past E5M2's 57344. The one-pass scale update bounds the new moments
    # from the gradient's amax, which must be that of the true values: taken from the stored FP8 values alone, the
    # bound fell 256x short and the E4M3 first moment saturated. Reference: float64 torch.optim.AdamW on the same
    # (dequantized) gradient; O2's E4M3 m and fp16 v round by 2**-4 and 2**-11 relative.
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 16, bias=False)))
    opt = FP8AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, scale_update=scale_update)
    weight = model[0].weight
    scale_inv = torch.tensor(2.0**8)
    grad_fp8 = (torch.randn(16, 32) * 1e4).to(torch.float8_e5m2)
    grad = grad_fp8.double() * scale_inv.double()
    assert grad.abs().max() > 57344 * 64  # the case under test: true values far past the format's maximum
    reference = model.state_dict()["0.weight"].double().requires_grad_()  # the unscaled weight
    reference.grad = grad.clone()
    ref_opt = torch.optim.AdamW([reference], lr=1e-3, weight_decay=0.0)
    ref_opt.step()
    opt.accumulate_fp8_grad(weight, grad_fp8, scale_inv)
    opt.step()
    state, expected = opt.to_adamw_state_dict()["state"][0], ref_opt.state[reference]
    assert _rel(state["exp_avg"], expected["exp_avg"]) < 0.05
    assert _rel(state["exp_avg_sq"], expected["exp_avg_sq"]) < 1e-2
