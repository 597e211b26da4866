"""Whom FP8GradScaler(nonfinite_fallback="bf16") blames: rules that a mutation audit found unpinned, against the
rule of lightning_fp8.recovery.fallback_to_high_precision: "the FP8 layers whose gradients of the skipped step were
non-finite"."""

import math
import warnings

import torch
from torch import nn

from lightning_fp8 import FP8AdamW, FP8GradScaler, FP8Linear, convert_to_fp8
from lightning_fp8.recovery import fallen_back_layers


def _model_and_optimizer(fallback_after: int):
    torch.manual_seed(0)
    model = convert_to_fp8(nn.ModuleDict({"a": nn.Linear(32, 32), "b": nn.Linear(32, 32)}))
    scaler = FP8GradScaler(nonfinite_fallback=model, fallback_after=fallback_after)
    return model, scaler, FP8AdamW(model.parameters(), lr=1e-3, grad_scaler=scaler)


def test_a_layer_whose_held_fp8_weight_gradient_alone_was_nonfinite_is_blamed():
    # An inf in a's input: a's weight gradient (held in FP8 by the optimizer, param.grad None) is non-finite, while its
    # bias gradient and its grad_output (the loss is a plain sum) are finite. The layer's non-finite gradient is in
    # what the skipped optimizer kept, and a goes back; b, whose gradients are finite, stays FP8.
    model, scaler, opt = _model_and_optimizer(fallback_after=1)
    x = torch.randn(8, 32)
    x[0, 0] = math.inf
    scaler.scale_loss(model["a"](x).sum() + model["b"](torch.randn(8, 32)).sum()).backward()
    assert model["a"].weight.grad is None and bool(torch.isfinite(model["a"].bias.grad).all())
    assert bool(torch.isfinite(model["a"].fp8_scaling["grad_output"].amax))  # the case: only the weight's is bad
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()
    assert scaler.skipped_steps == 1
    assert fallen_back_layers(model) == ["a"]
    assert isinstance(model["b"], FP8Linear)


def test_a_layer_unused_since_an_earlier_nonfinite_step_is_not_blamed():
    # a overflows at step 0 (its grad_output amax becomes NaN and stays so while a is unused); b overflows at step 1,
    # the second non-finite step in a row, which runs the fallback: a had no gradient in that step, so only b goes back.
    model, scaler, opt = _model_and_optimizer(fallback_after=2)
    for layer in ("a", "b"):
        opt.zero_grad()
        scaler.scale_loss(model[layer](torch.randn(8, 32)).square().mean() * math.nan).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
    assert scaler.skipped_steps == 2
    assert fallen_back_layers(model) == ["b"]
    assert isinstance(model["a"], FP8Linear)
    assert not bool(torch.isfinite(model["a"].fp8_scaling["grad_output"].amax))  # the case: a's stale amax
