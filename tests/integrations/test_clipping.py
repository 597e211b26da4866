"""lightning_fp8.integrations.clipping against torch's clamp in fp32: gradients that carry mu, fp16 ones included."""

import torch
from torch import nn

from lightning_fp8.integrations.clipping import clip_grad_value_keeping_overflow_

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
