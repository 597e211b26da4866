"""FP8GradScaler refuses to unscale gradients that no scaled loss gave mu (a ``loss.backward()`` in place of
``scaler.scale_loss(loss).backward()``), as torch.amp.GradScaler refuses a step without ``scale()``: dividing them by
mu would make the update 1/mu of what it should be, silently."""

import io

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, FP8GradScaler, convert_to_fp8


def _model():
    torch.manual_seed(0)
    return convert_to_fp8(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16)))


def _optimizer(kind, model, scaler):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1)
    return FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler, fp8_grads=kind == "fp8adamw-fp8-grads")


@pytest.mark.parametrize(
    ("kind", "call"),
    [("sgd", "scaler.step"), ("sgd", "unscale_"),  # (unscale_ refuses FP8AdamW; SGD's step() skips the scaler)
     *((kind, call) for kind in ("fp8adamw", "fp8adamw-fp8-grads") for call in ("scaler.step", "optimizer.step"))],
)  # fmt: skip
def test_unscaling_gradients_of_an_unscaled_loss_raises_and_changes_nothing(kind, call):
    model = _model()
    scaler = FP8GradScaler(init_scale=2.0**10)
    opt = _optimizer(kind, model, scaler)
    model(torch.randn(8, 32)).square().mean().backward()  # forgot scaler.scale_loss
    weights = [p.detach().clone() for p in model.parameters()]
    grads = {p: p.grad.clone() for p in model.parameters() if p.grad is not None}
    step = {"scaler.step": lambda: scaler.step(opt), "optimizer.step": opt.step,
            "unscale_": lambda: scaler.unscale_(opt)}[call]  # fmt: skip
    with pytest.raises(RuntimeError, match=r"no loss was scaled.*scale_loss\(loss\)\.backward\(\)"):
        step()
    assert all(torch.equal(p.detach(), w) for p, w in zip(model.parameters(), weights, strict=True))
    assert all(torch.equal(p.grad, g) for p, g in grads.items())
    assert float(scaler.scale) == 2.0**10 and scaler.skipped_steps == 0 and not scaler.history
    # The loop fixed (the loss scaled): the same call steps.
    opt.zero_grad()
    scaler.scale_loss(model(torch.randn(8, 32)).square().mean()).backward()
    step()
    if call == "unscale_":
        scaler.step(opt)
    assert not all(torch.equal(p.detach(), w) for p, w in zip(model.parameters(), weights, strict=True))


def test_a_step_without_gradients_and_without_a_scaled_loss_is_not_refused():
    """Nothing to unscale (an optimizer whose parameters got no gradient): nothing is wrong, nothing changes."""
    model = _model()
    scaler = FP8GradScaler(init_scale=2.0**10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    weights = [p.detach().clone() for p in model.parameters()]
    assert scaler.step(opt) is True
    scaler.update()
    assert all(torch.equal(p.detach(), w) for p, w in zip(model.parameters(), weights, strict=True))


def test_after_loading_a_state_the_loss_must_be_scaled_again():
    model = _model()
    scaler = FP8GradScaler(init_scale=2.0**4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale_loss(model(torch.randn(8, 32)).square().mean()).backward()
    scaler.step(opt)
    scaler.update()
    buf = io.BytesIO()
    torch.save(scaler.state_dict(), buf)
    buf.seek(0)
    scaler.load_state_dict(torch.load(buf, weights_only=True))
    opt.zero_grad()
    model(torch.randn(8, 32)).square().mean().backward()
    with pytest.raises(RuntimeError, match="no loss was scaled"):
        scaler.step(opt)


def test_the_update_is_that_of_the_true_gradients_once_the_loss_is_scaled():
    """The reference: plain SGD on the unscaled loss. With the refusal the loop is fixed by scale_loss, and the
    update is the same (mu a power of two: exact)."""
    model, ref = _model(), _model()
    scaler = FP8GradScaler(init_scale=2.0**10)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(8, 32)
    scaler.scale_loss(model(x).square().mean()).backward()
    scaler.step(opt)
    ref(x).square().mean().backward()
    ref_opt.step()
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, r)


@pytest.mark.parametrize("loss", [1.0, [torch.ones(())], None])
def test_scale_loss_of_something_other_than_a_tensor_is_a_clear_type_error(loss):
    scaler = FP8GradScaler(init_scale=2.0**4)
    with pytest.raises(TypeError, match="scale_loss takes the loss tensor"):
        scaler.scale_loss(loss)
    assert scaler.losses_scaled == 0 and not scaler.loss_was_scaled
