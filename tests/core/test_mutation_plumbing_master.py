"""O2 adoption of an FP8 weight's storage (lightning_fp8/optim/master.py) that a mutation audit found unpinned: a
gradient from a backward run before FP8AdamW took the weight is held once, in FP8, and not also left behind in
``weight.grad`` (in the old dtype), where the next backward would add to it and the step count it twice. Reference:
torch.optim.AdamW (float64) stepped on the sum of the two backwards' gradients."""

import copy

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, convert_to_fp8
from lightning_fp8.optim import master

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny tensor ops on one thread

LR = 1e-2


def test_a_gradient_before_the_takeover_is_counted_once_in_an_accumulated_step():
    torch.manual_seed(0)
    base = convert_to_fp8(nn.Sequential(nn.Linear(32, 16)))
    x = torch.randn(8, 32)
    # The second loss is -1.5 times the first: the sum of the gradients is -0.5 g, a gradient counted twice +0.5 g.
    # Adam's first step moves each element by about lr * sign(g), so the two differ by 2 lr in every element.
    losses = (lambda m: m(x).square().mean(), lambda m: -1.5 * m(x).square().mean())

    ref_model = copy.deepcopy(base)  # the true gradients (the same FP8 GEMMs), summed over both backwards
    for loss in losses:
        loss(ref_model).backward()
    weight = ref_model[0].weight
    reference = weight.detach().double().clone().requires_grad_()
    reference.grad = weight.grad.double()
    torch.optim.AdamW([reference], lr=LR, weight_decay=0.0).step()

    model = copy.deepcopy(base)
    losses[0](model).backward()  # before the optimizer takes the weight's storage (fp32 -> fp16 master)
    opt = FP8AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    assert model[0].weight.dtype == torch.float16  # the storage was taken (the case under test)
    assert model[0].weight.grad is None  # the gradient is held once, in FP8 (FP8AdamW holds FP8 gradients at O2)
    losses[1](model).backward()
    opt.step()
    # Where the sum is far from 0, its sign survives the FP8 rounding and the FP8 GEMMs' noise (which differs a little
    # from the reference's where the forward reads the fp16 master): nearly all elements step as the reference.
    off = (master.export(model[0].weight).double() - reference.detach()).abs() > LR
    assert off.double().mean().item() < 0.05
