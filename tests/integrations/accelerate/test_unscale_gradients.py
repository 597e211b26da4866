"""accelerator.unscale_gradients under FP8-LM: the script's own clipping (torch.nn.utils.clip_grad_norm_ after it, the
Accelerate idiom of fp16 scripts) sees the true gradients, not mu times them, and the step that follows is the one
accelerator.clip_grad_norm_ gives; the gradients carry mu again before the next backward."""

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from torch import nn

from lightning_fp8.accelerate import Accelerator
from tests.integrations.accelerate.test_accelerator import _fresh_accelerate_state  # noqa: F401 (autouse fixture)

MU = 2.0**10


def _setup(recipe: str, **optimizer_kwargs):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, fp8_lm_recipe=recipe)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, **optimizer_kwargs)
    model, optimizer = accelerator.prepare(model, optimizer)
    scaler = accelerator.fp8_grad_scaler
    scaler.load_state_dict({**scaler.state_dict(), "scale": MU})
    return accelerator, model, optimizer


def _backward(accelerator, model, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 32, generator=gen), torch.randn(8, 16, generator=gen)
    accelerator.backward(((model(x).float() - y) ** 2).mean())


def _true_norm(model) -> torch.Tensor:
    return torch.sqrt(sum((p.grad.float() / MU).square().sum() for p in model.parameters()))


@pytest.mark.parametrize("recipe", ["fp8-lm", "fp8-lm-o1"])
def test_clipping_after_unscale_gradients_clips_the_true_gradients(recipe):
    # Three steps clipped hard (max_norm far below the norm), torch's clip after unscale_gradients: the gradients it
    # clips and the norm it returns against those computed from the mu-carrying gradients in fp32 (mu = 2**10 would
    # make the clip 1024x too strong); at O1 the weights then against a run clipped by accelerator.clip_grad_norm_.
    own, ref = _setup(recipe), _setup(recipe)
    for step in range(3):
        for accelerator, model, _ in (own, ref):
            _backward(accelerator, model, step)
        scaled = [p.grad.float().clone() for p in own[1].parameters()]
        true_norm = torch.sqrt(sum((g / MU).square().sum() for g in scaled))
        coef = min(1.0, 0.05 / true_norm.item())
        own[0].unscale_gradients()
        seen = torch.nn.utils.clip_grad_norm_(own[1].parameters(), 0.05)
        assert torch.allclose(seen, true_norm, rtol=1e-3), (step, seen, true_norm)
        for p, g in zip(own[1].parameters(), scaled, strict=True):
            want = g / MU * coef
            # O2: torch's clip sums the fp16 gradients' norms in fp16 (the factor it clips with is 1e-3 off), and
            # the fp16 ones (the FP8 weights') are unscaled in fp16 storage, rounded to its grid (about one ulp at the
            # top, 2**-10 of the largest), where the small ones lose bits (mu is there for them: the step gets them
            # back). O1: fp32 throughout, the norm summed in another order.
            rtol = 1e-3 if recipe == "fp8-lm" else 1e-5
            atol = want.abs().max().item() * 2**-10 if p.grad.dtype == torch.float16 else 0.0
            assert torch.allclose(p.grad.float(), want, rtol=rtol, atol=atol), step
        ref[0].clip_grad_norm_(ref[1].parameters(), 0.05)
        for _, _, optimizer in (own, ref):
            optimizer.step()
            optimizer.zero_grad()
    if recipe.endswith("o1"):  # fp32 gradients and states: the same steps
        for a, b in zip(own[1].state_dict().values(), ref[1].state_dict().values(), strict=True):
            assert torch.allclose(a.float(), b.float(), rtol=0, atol=1e-6)


def test_unscaled_gradients_carry_mu_again_before_the_next_backward():
    # Unscaled after the first of two accumulated backwards, scaled back before the second: the sum is mu times the
    # true sum, as without the call; a second call changes nothing; the accelerator's clip then sees them unscaled.
    own, ref = _setup("fp8-lm-o1"), _setup("fp8-lm-o1")
    for accelerator, model, _ in (own, ref):
        _backward(accelerator, model, 0)
    own[0].unscale_gradients()
    once = [p.grad.clone() for p in own[1].parameters()]
    own[0].unscale_gradients(own[2])
    assert all(torch.equal(a, p.grad) for a, p in zip(once, own[1].parameters(), strict=True))
    for accelerator, model, _ in (own, ref):
        _backward(accelerator, model, 1)
    for a, b in zip(own[1].parameters(), ref[1].parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    own[0].unscale_gradients()
    norm = own[0].clip_grad_norm_(own[1].parameters(), 1e9)
    assert torch.allclose(norm, _true_norm(ref[1]), rtol=1e-6)


def test_unscale_gradients_refuses_what_it_cannot_unscale():
    accelerator, model, optimizer = _setup("fp8-lm-o1")
    _backward(accelerator, model, 0)
    with pytest.raises(ValueError, match="was not prepared by this accelerator"):
        accelerator.unscale_gradients(torch.optim.SGD(model.parameters(), lr=0.1))


def test_unscale_gradients_refuses_gradients_held_in_fp8():
    # A script's own FP8AdamW(fp8_grads=True) takes the FP8 weights' gradients out of param.grad: a clip after
    # unscale_gradients would miss them (as accelerator.clip_grad_norm_ refuses to).
    from lightning_fp8 import FP8AdamW, convert_to_fp8

    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)))
    model, optimizer = accelerator.prepare(model, FP8AdamW(model.parameters(), lr=1e-2, fp8_grads=True))
    _backward(accelerator, model, 0)
    with pytest.raises(ValueError, match="accelerator.unscale_gradients would miss the FP8 weights' gradients"):
        accelerator.unscale_gradients()
