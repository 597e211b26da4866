"""lightning_fp8.integrations.clipping against torch's clamp in fp32: gradients that carry mu, fp16 ones included."""

import pytest
import torch
from torch import nn

from lightning_fp8.integrations.clipping import (
    clip_grad_norm_fp32,
    clip_grad_value_keeping_overflow_,
    clip_scaled_grad_norm_,
)

FP16_MAX = torch.finfo(torch.float16).max  # 65504


def test_clipping_fp16_gradients_by_a_value_past_their_range_keeps_them_and_their_infs():
    """clip_val * mu = 2^17 passed fp16's max: clamp refused to convert the limit and the fit crashed once mu grew.
    Every finite fp16 value is within such a limit: the result is fp32's clamp rounded back, infinities kept."""
    grad = torch.randn(48, 80, generator=torch.Generator().manual_seed(0)) * 3e4
    grad = grad.to(torch.float16)
    grad.view(-1)[:3] = torch.tensor([float("inf"), -float("inf"), FP16_MAX], dtype=torch.float16)
    param = nn.Parameter(torch.zeros(48, 80, dtype=torch.float16))
    param.grad = grad.clone()
    limit = 2.0**17
    clip_grad_value_keeping_overflow_([param], limit)
    reference = grad.float().clamp(-limit, limit)
    reference = torch.where(grad.isinf(), grad.float(), reference).to(torch.float16)
    assert torch.equal(param.grad, reference)
    assert param.grad.view(-1)[0] == float("inf") and param.grad.view(-1)[1] == -float("inf")


def test_clipping_by_a_value_within_range_clamps_fp16_and_fp32_gradients():
    generator = torch.Generator().manual_seed(1)
    params = [nn.Parameter(torch.zeros(33, 17, dtype=dtype)) for dtype in (torch.float16, torch.float32)]
    for param in params:
        param.grad = (torch.randn(33, 17, generator=generator) * 100).to(param.dtype)
        param.grad.view(-1)[0] = float("inf")
    grads = [p.grad.clone() for p in params]
    clip_grad_value_keeping_overflow_(params, 50.0)
    for param, grad in zip(params, grads, strict=True):
        expected = torch.where(grad.isinf(), grad, grad.clamp(-50.0, 50.0))
        assert torch.equal(param.grad, expected)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("norm_type", [2.0, 3.0])
def test_clipping_by_norm_leaves_gradients_as_they_are_when_the_norm_is_not_finite(norm_type, bad):
    """A step the gradient scaler skips: torch's factor max_norm / norm would make every gradient NaN (or 0), so the
    scaler's "bf16" fallback would find every layer non-finite. The finite gradients keep their values, the bad one
    its own; the returned norm is the non-finite one (so the skip is seen). A finite norm still clips, as torch's
    clip_grad_norm_ of the gradients without mu."""
    mu = 2.0**10
    generator = torch.Generator().manual_seed(2)
    params = [nn.Parameter(torch.zeros(7, 5)) for _ in range(3)]

    def clip():  # the L2 path (Lightning, FP8GradScaler) or any norm_type (Accelerate, FP8GradScaler)
        if norm_type == 2.0:
            return clip_scaled_grad_norm_(params, 0.5, mu) / mu
        return clip_grad_norm_fp32(params, 0.5, norm_type, mu)

    for param in params:
        param.grad = torch.randn(7, 5, generator=generator) * mu
    params[1].grad[2, 3] = bad
    before = [p.grad.clone() for p in params]
    assert not torch.isfinite(clip())
    for param, grad in zip(params, before, strict=True):
        assert torch.equal(param.grad.nan_to_num(), grad.nan_to_num())

    params[1].grad[2, 3] = 0.0
    reference = [nn.Parameter(torch.zeros(7, 5, dtype=torch.float64)) for _ in params]
    for ref, param in zip(reference, params, strict=True):
        ref.grad = param.grad.double() / mu
    expected_norm = torch.nn.utils.clip_grad_norm_(reference, 0.5, norm_type=norm_type)
    torch.testing.assert_close(clip().double(), expected_norm, rtol=1e-5, atol=0)
    for ref, param in zip(reference, params, strict=True):
        torch.testing.assert_close(param.grad.double() / mu, ref.grad, rtol=1e-5, atol=1e-9)
