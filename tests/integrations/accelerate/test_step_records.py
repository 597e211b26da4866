"""What the FP8 Accelerator records per optimizer step (the health monitor's loss) and per training (`fp8_report`,
the scaler's model): a backward with a tensor and `gradient=` steps like the scalar loss it stands for (its mean is the
health loss), a health-side error never makes later steps fail, and `free_memory` starts the next training afresh."""

import pytest
import torch
from torch import nn

from lightning_fp8.accelerate import Accelerator
from tests.integrations.accelerate.test_accelerator import Net
from tests.integrations.accelerate.test_load_state_atomic import _fresh_accelerate_state, _fresh_state  # noqa: F401


def _setup(grad_accum: int = 2):
    _fresh_state()
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm", gradient_accumulation_steps=grad_accum)
    model = Net()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return accelerator, model, optimizer


def _data(sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 48, generator=generator), torch.randn(n, 10, generator=generator)) for n in sizes]


def _per_sample(model, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y, reduction="none").mean(1)


def _window(accelerator, model, optimizer, batches, backward) -> list[float]:
    """One accumulation window: a backward per micro-batch, then the step; the micro-batches' mean losses."""
    losses = []
    for batch in batches:
        with accelerator.accumulate(model):
            per_sample = _per_sample(model, batch)
            backward(accelerator, per_sample)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(per_sample.mean().item())
    return losses


def _vector(accelerator, per_sample):  # d(mean)/d(per_sample), handed as backward's gradient
    accelerator.backward(per_sample, gradient=torch.full_like(per_sample, 1 / len(per_sample)))


def _scalar(accelerator, per_sample):
    accelerator.backward(per_sample.mean())


def _health_losses(accelerator) -> list[tuple[int, float]]:
    return list(accelerator.fp8_health.series["loss"])


def _assert_series(got: list[tuple[int, float]], expected: list[tuple[int, float]]) -> None:
    assert [step for step, _ in got] == [step for step, _ in expected]
    assert [value for _, value in got] == pytest.approx([value for _, value in expected], rel=1e-6)


def test_tensor_losses_of_different_shapes_step_like_their_scalar_means():
    # Micro-batches of 4 and 3 samples: the recorded losses of shapes (4,) and (3,) could not be stacked, and the
    # error (after the FP8 step was applied) stayed with the records, failing every later step.
    windows = [_data([4, 3]), _data([5, 2]), _data([6, 6])]
    runs = {}
    for name, first in (("tensor", _vector), ("scalar", _scalar)):
        accelerator, model, optimizer = _setup()
        weights, losses = [], []
        for i, batches in enumerate(windows):  # the first window as given, the later ones with scalar losses
            losses.append(_window(accelerator, model, optimizer, batches, first if i == 0 else _scalar))
            weights.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        runs[name] = weights, losses, _health_losses(accelerator), accelerator.fp8_grad_scaler.state_dict()
    (tensor_weights, tensor_losses, tensor_health, tensor_scaler) = runs["tensor"]
    (scalar_weights, scalar_losses, scalar_health, scalar_scaler) = runs["scalar"]
    assert tensor_losses == scalar_losses
    for step, (got, expected) in enumerate(zip(tensor_weights, scalar_weights, strict=True)):
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=f"step {step}: {key}")
    assert tensor_scaler == scalar_scaler and tensor_scaler["steps"] == 3
    # The health loss is the mean of the step's losses, a tensor's by its mean (as before the fix, when the shapes
    # matched; found by review: recording one-value losses only lost the tensor ones and their NaN events).
    expected = [(step, torch.tensor(window).mean().item()) for step, window in enumerate(scalar_losses)]
    _assert_series(scalar_health, expected)
    _assert_series(tensor_health, expected)


def test_one_value_losses_of_shapes_0_and_1_average_into_the_health_loss():
    accelerator, model, optimizer = _setup(grad_accum=3)
    losses = []
    for batch, shape in zip(_data([4, 4, 4]), [(), (1,), (1, 1)], strict=True):
        with accelerator.accumulate(model):
            loss = _per_sample(model, batch).mean().reshape(shape)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    assert accelerator.fp8_grad_scaler.state_dict()["steps"] == 1
    _assert_series(_health_losses(accelerator), [(0, sum(losses) / 3)])


def test_a_health_error_at_one_step_does_not_carry_into_the_later_steps(monkeypatch):
    accelerator, model, optimizer = _setup(grad_accum=1)
    observe = accelerator.fp8_health.observe
    calls = []

    def fails_once(*args, **kwargs):
        calls.append(kwargs)
        if len(calls) == 1:
            raise RuntimeError("health monitor failed")
        return observe(*args, **kwargs)

    monkeypatch.setattr(accelerator.fp8_health, "observe", fails_once)
    batches = _data([4, 4, 4])
    with pytest.raises(RuntimeError, match="health monitor failed"):
        _window(accelerator, model, optimizer, batches[:1], _scalar)
    later = [_window(accelerator, model, optimizer, [batch], _scalar)[0] for batch in batches[1:]]
    # Each later step records its own loss only (not the failed step's as well).
    _assert_series(_health_losses(accelerator), [(1, later[0]), (2, later[1])])
    assert accelerator.fp8_grad_scaler.state_dict()["steps"] == 3


def test_free_memory_starts_the_report_of_the_next_training_afresh():
    accelerator, *_ = _setup(grad_accum=1)
    assert accelerator.fp8_report["optimizer"] == "AdamW -> FP8AdamW"
    accelerator.free_memory()
    reference = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    assert accelerator.fp8_report == reference.fp8_report  # the recipe only, as before the first prepare
    accelerator.prepare(nn.Sequential(nn.Linear(32, 16)))  # a new training, without an optimizer
    reference.prepare(nn.Sequential(nn.Linear(32, 16)))
    assert "optimizer" not in accelerator.fp8_report
    assert accelerator.fp8_report == reference.fp8_report


def test_a_non_finite_tensor_loss_is_a_non_finite_loss_event():
    accelerator, model, optimizer = _setup(grad_accum=1)
    for i, batch in enumerate(_data([4, 4, 4])):
        with accelerator.accumulate(model):
            per_sample = _per_sample(model, batch)
            if i == 2:
                per_sample = per_sample * float("nan")
            accelerator.backward(per_sample, gradient=torch.full_like(per_sample, 0.25))
            optimizer.step()
            optimizer.zero_grad()
    kinds = [(event.step, event.kind) for event in accelerator.fp8_health.events]
    assert (2, "nonfinite_loss") in kinds and (2, "nonfinite_grad") in kinds


def test_a_users_scaler_follows_the_next_training_after_free_memory_and_a_given_model_stays():
    # Found by review: the scaler an FP8AdamW brings got the accelerator's model only where it had none, so the same
    # scaler in a new training after free_memory kept the first model (its mu changes rescaled that one's states).
    from lightning_fp8 import FP8AdamW, FP8GradScaler

    _fresh_state()
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    shared = FP8GradScaler()
    for _ in range(2):
        model = accelerator.prepare(Net())
        accelerator.prepare(FP8AdamW(model.parameters(), lr=1e-3, grad_scaler=shared))
        assert accelerator.fp8_grad_scaler is shared and shared.model is model
        accelerator.free_memory()
    first = Net()
    own = FP8GradScaler(model=first)
    model = accelerator.prepare(first)
    accelerator.prepare(FP8AdamW(model.parameters(), lr=1e-3, grad_scaler=own))
    accelerator.prepare(Net())  # a model prepared later: the user's model= stays
    assert own.model is first
