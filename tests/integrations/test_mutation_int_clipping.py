"""lightning_fp8.integrations.clipping, pinned where a mutation audit of the integrations found it unpinned, against
``torch.nn.utils.clip_grad_norm_`` (its documented arguments: a clip coefficient of at most 1, ``max_norm=0`` clips
every gradient to zero, ``error_if_nonfinite`` raises before anything is clipped) and fp32 arithmetic rounded once to
fp16. The norms of order other than 2 (``clip_grad_norm_fp32``, also every order under ``accelerator.clip_grad_norm_``)
once scaled gradients up when they were under ``max_norm``, a max_norm of 0 once was refused, an order-1 norm once
ignored ``error_if_nonfinite``, and ``mul_grads_`` with a Python factor rounds it to fp16 first (2^-25 -> 0): the
suite passed each."""

import math

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8GradScaler
from lightning_fp8.integrations.clipping import UnscaledGradients

MU = 2.0**6


def _scaled_model(seed: int = 0) -> tuple[nn.Module, FP8GradScaler]:
    """A plain fp32 model whose gradients carry mu = 2^6 (an FP8GradScaler's scaled backward)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 5))
    scaler = FP8GradScaler(init_scale=MU)
    x, y = torch.randn(9, 12), torch.randn(9, 5)
    scaler.scale_loss(((model(x) - y) ** 2).mean()).backward()
    return model, scaler


def _torch_reference(model: nn.Module, max_norm: float, norm_type: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """torch's clip_grad_norm_ on float64 copies of the true gradients (mu divided out): its norm and clipped ones."""
    params = [nn.Parameter(p.detach().double()) for p in model.parameters()]
    for ref, p in zip(params, model.parameters(), strict=True):
        ref.grad = p.grad.double() / MU
    total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
    return total, [p.grad for p in params]


@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf, 3.0])
@pytest.mark.parametrize("ratio", [0.25, 4.0])
def test_clip_grad_norm_scales_down_only_as_torch_does(norm_type, ratio):
    """ratio 4: the gradients are under max_norm, so torch's coefficient is clamped to 1 and they stay as they are."""
    model, scaler = _scaled_model()
    want_total, _ = _torch_reference(model, math.inf, norm_type)
    max_norm = float(want_total) * ratio
    want_total, want = _torch_reference(model, max_norm, norm_type)
    before = [p.grad.clone() for p in model.parameters()]
    total = scaler.clip_grad_norm_(model.parameters(), max_norm, norm_type=norm_type)
    torch.testing.assert_close(total.double(), want_total, rtol=1e-5, atol=0)
    for p, g, old in zip(model.parameters(), want, before, strict=True):
        torch.testing.assert_close(p.grad.double() / MU, g, rtol=1e-5, atol=1e-12)
        if ratio > 1:
            assert torch.equal(p.grad, old)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf])
def test_a_max_norm_of_zero_clips_every_gradient_to_zero_as_torch(norm_type):
    model, scaler = _scaled_model(1)
    want_total, want = _torch_reference(model, 0.0, norm_type)
    total = scaler.clip_grad_norm_(model.parameters(), 0.0, norm_type=norm_type)
    torch.testing.assert_close(total.double(), want_total, rtol=1e-5, atol=0)
    assert all(torch.count_nonzero(g) == 0 for g in want)  # torch's own result, for what follows
    for p in model.parameters():
        assert torch.count_nonzero(p.grad) == 0


@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf, 3.0])
def test_error_if_nonfinite_raises_for_every_norm_type_before_clipping(norm_type):
    model, scaler = _scaled_model(2)
    model[0].weight.grad[1, 2] = math.inf
    reference = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
    for ref, p in zip(reference, model.parameters(), strict=True):
        ref.grad = p.grad.clone()
    with pytest.raises(RuntimeError, match="non-finite"):  # torch's own behaviour, first
        torch.nn.utils.clip_grad_norm_(reference, 1e-3, norm_type=norm_type, error_if_nonfinite=True)
    before = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="non-finite"):
        scaler.clip_grad_norm_(model.parameters(), 1e-3, norm_type=norm_type, error_if_nonfinite=True)
    for p, old in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.grad, old)  # nothing clipped


def _fp16_optimizer(values: torch.Tensor) -> tuple[torch.optim.Optimizer, nn.Parameter]:
    param = nn.Parameter(torch.zeros(values.shape, dtype=torch.float16))
    param.grad = values.to(torch.float16)
    return torch.optim.SGD([param], lr=1.0), param


def test_unscaling_fp16_gradients_by_a_mu_past_fp16s_range_rounds_once_in_fp32():
    """1 / 2^25 is 0 in fp16 (its smallest subnormal is 2^-24): the factor must reach the multiplication in fp32."""
    mu = 2.0**25
    values = torch.randn(7, 11, generator=torch.Generator().manual_seed(3)) * 3e4
    opt, param = _fp16_optimizer(values)
    scaled = param.grad.clone()
    region = UnscaledGradients(opt, mu)
    want = (scaled.float() * (1.0 / mu)).to(torch.float16)
    assert torch.count_nonzero(want) > 60  # the true gradients are representable in fp16
    assert torch.equal(param.grad, want)
    region.scale_back()
    assert torch.equal(param.grad, scaled)  # untouched: the kept scaled values come back


def test_scaling_back_fp16_gradients_changed_inside_multiplies_in_fp32():
    """A gradient written inside the region (its version counter moved) is multiplied by mu again, rounded once: 2^16
    is inf in fp16, so the factor must not be rounded to fp16 first."""
    mu = 2.0**16
    values = torch.randn(5, 13, generator=torch.Generator().manual_seed(4)) * 0.5
    opt, param = _fp16_optimizer(values)
    region = UnscaledGradients(opt, mu)
    param.grad.mul_(0.5)  # a hook halves the true gradients
    halved = param.grad.clone()
    region.scale_back()
    want = (halved.float() * mu).to(torch.float16)
    assert torch.isfinite(want).all()
    assert torch.equal(param.grad, want)


def test_gradients_a_hook_zeroes_through_themselves_stay_zero_where_the_unscaled_value_was_zero():
    """Values below fp16's range once unscaled (here 2^-12 * mu^-1 = 2^-28) are 0 inside the region; a hook that zeroes
    the gradient in place writes that same 0, which the version counter tells from an untouched 0: every element is
    then multiplied back (0 stays 0), none gets its kept scaled value back (the hook's zeroing would be undone)."""
    mu = 2.0**16
    values = torch.randn(6, 10, generator=torch.Generator().manual_seed(5))
    values[0, :4] = 2.0**-12  # scaled gradients whose true values (2^-28) fp16 cannot hold
    opt, param = _fp16_optimizer(values)
    region = UnscaledGradients(opt, mu)
    assert torch.count_nonzero(param.grad[0, :4]) == 0
    param.grad.zero_()
    region.scale_back()
    assert torch.count_nonzero(param.grad) == 0
