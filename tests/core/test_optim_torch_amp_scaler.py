"""FP8AdamW stepped through ``torch.amp.GradScaler.step(optimizer)``: refused with a TypeError that points to
FP8GradScaler, before anything changes. It was accepted silently: torch.amp unscaled ``param.grad``, where the FP8
weights' gradients are not (FP8AdamW holds them), so their update came out mu times too large and torch's overflow
check never saw them; with ``fp8_grads=False`` it failed with torch's bare "Attempting to unscale FP16 gradients"."""

import copy

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, convert_to_fp8

REFUSED = r"FP8AdamW.step\(\) was called by torch.amp.GradScaler.step.*FP8GradScaler.*Nothing was stepped"


def _setup(fp8_grads: bool) -> tuple[nn.Module, FP8AdamW, torch.Tensor]:
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16)))
    return model, FP8AdamW(model.parameters(), lr=1e-2, fp8_grads=fp8_grads), torch.randn(8, 32)


def _snapshot(model: nn.Module, opt: FP8AdamW) -> tuple:
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), grads


def _assert_same(a: tuple, b: tuple) -> None:
    for x, y in zip(a[0].values(), b[0].values(), strict=True):
        assert torch.equal(x, y)
    assert a[1]["state"] == {} and b[1]["state"] == {}  # never stepped
    for x, y in zip(a[2], b[2], strict=True):
        assert (x is None and y is None) or torch.equal(x, y)


def _plain_step_params(fp8_grads: bool) -> list[torch.Tensor]:
    model, opt, x = _setup(fp8_grads)
    model(x).square().mean().backward()
    opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("fp8_grads", [True, False])
def test_torch_amp_step_is_refused_before_anything_changes(fp8_grads):
    model, opt, x = _setup(fp8_grads)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scaler.scale(model(x).square().mean()).backward()
    before = _snapshot(model, opt)
    with pytest.raises(TypeError, match=REFUSED):
        scaler.step(opt)
    _assert_same(before, _snapshot(model, opt))
    # torch.amp's grad_scale / found_inf are not left on the optimizer (they would refuse every later step).
    assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    for p, ref in zip(model.parameters(), _plain_step_params(fp8_grads), strict=True):
        assert torch.equal(p.detach(), ref)


def test_torch_amp_step_after_its_unscale_says_the_gradients_were_divided():
    # torch.amp's unscale_ (for clipping) cannot be intercepted: it divides the gradients left in param.grad (the
    # biases') in place. The step that follows is refused, and says to redo the backward.
    model, opt, x = _setup(fp8_grads=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scaler.scale(model(x).square().mean()).backward()
    scaler.unscale_(opt)
    with pytest.raises(TypeError, match=REFUSED + r".*unscale_\(optimizer\) already divided.*zero_grad"):
        scaler.step(opt)
    assert opt.state_dict()["state"] == {}
    assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")


def test_a_disabled_torch_amp_scaler_steps_as_a_plain_step():
    # A disabled torch.amp.GradScaler calls optimizer.step() as it is (no scale handed over): nothing to refuse.
    model, opt, x = _setup(fp8_grads=True)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    scaler.scale(model(x).square().mean()).backward()
    scaler.step(opt)
    scaler.update()
    for p, ref in zip(model.parameters(), _plain_step_params(True), strict=True):
        assert torch.equal(p.detach(), ref)
