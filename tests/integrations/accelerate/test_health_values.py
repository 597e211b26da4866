"""accelerator.log's health statistics are those TrainingHealthMonitor logs (issue 6: "accelerator.log of the same
scale and health statistics the Lightning callbacks log"): the parameter norm before each step, memory, the running
means of the loss and the throughput of the training forwards, checked against values computed here."""

import math
import time

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from torch import nn

from lightning_fp8.accelerate import Accelerator
from lightning_fp8.health import HealthMonitor
from lightning_fp8.integrations.accelerate.config import ENV_EXCLUDE, ENV_RECIPE
from lightning_fp8.monitoring.report import health_log_values, running_mean
from tests.integrations.lightning.test_callbacks import HEALTH_KEYS


class TokenNet(nn.Module):
    """A language-model-shaped net: (batch, sequence) token ids in, per-token logits out."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 48)
        self.fc = nn.Linear(48, 64)
        self.head = nn.Linear(64, 32)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc(self.embed(input_ids))))


@pytest.fixture(autouse=True)
def _fresh_accelerate_state(monkeypatch):
    monkeypatch.delenv(ENV_RECIPE, raising=False)
    monkeypatch.delenv(ENV_EXCLUDE, raising=False)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _norm(tensors) -> float:
    return math.sqrt(sum(t.double().square().sum().item() for t in tensors))


def _train(steps: int, batch: int = 4, seq: int = 6, evaluate: bool = False):
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    model = TokenNet()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses, param_norms, grad_norms = [], [], []
    for _ in range(steps):
        ids = torch.randint(0, 32, (batch, seq))
        loss = nn.functional.cross_entropy(model(input_ids=ids).flatten(0, 1), ids.flatten())
        accelerator.backward(loss)
        losses.append(loss.item())
        # O2: the FP8 weights' storage holds weight * master scale; state_dict() exports the weights themselves.
        param_norms.append(_norm(model.state_dict().values()))
        mu = accelerator.fp8_grad_scaler.loss_scale  # the gradients carry it until the step
        grad_norms.append(_norm([p.grad for p in model.parameters() if p.grad is not None]) / mu)
        if evaluate:  # an evaluation between the backward and the step: neither its samples nor its time count
            model.eval()
            with torch.no_grad():
                model(input_ids=torch.randint(0, 32, (64, seq)))
                time.sleep(0.3)
            model.train()
        optimizer.step()
        optimizer.zero_grad()
    return accelerator, losses, param_norms, grad_norms


def test_health_values_are_the_lightning_callbacks_keys_with_their_values():
    accelerator, losses, param_norms, grad_norms = _train(steps=25)
    values = accelerator.fp8_log_values()
    assert not [k for k in HEALTH_KEYS if k not in values]  # every key TrainingHealthMonitor logs
    assert values["health/loss"] == pytest.approx(losses[-1], rel=1e-6)
    assert values["health/loss_smooth"] == pytest.approx(sum(losses[-20:]) / 20, rel=1e-6)  # a 20-step window
    assert values["health/param_norm"] == pytest.approx(param_norms[-1], rel=1e-5)  # before the last step
    # Not clipped: the norm clip_grad_norm_ would have returned, of the true (unscaled) gradients.
    assert [v for _, v in accelerator.fp8_health.series["grad_norm"]] == pytest.approx(grad_norms, rel=1e-5)
    assert values["health/memory_gib"] > 0
    series = accelerator.fp8_health.series
    assert len(series["param_norm"]) == 25 and len(series["samples_per_sec"]) == 25
    # Each step's window held one training forward of 4 samples of 6 tokens.
    for (_, samples), (_, tokens) in zip(series["samples_per_sec"], series["tokens_per_sec"], strict=True):
        assert samples > 0 and tokens == pytest.approx(6 * samples, rel=1e-9)
    assert values["health/tokens_per_sec"] == pytest.approx(6 * values["health/samples_per_sec"], rel=1e-9)


def test_evaluation_forwards_count_neither_samples_nor_time():
    accelerator, *_ = _train(steps=3, evaluate=True)
    series = accelerator.fp8_health.series
    for (_, samples), (_, tokens) in zip(series["samples_per_sec"], series["tokens_per_sec"], strict=True):
        assert tokens == pytest.approx(6 * samples, rel=1e-9)  # the 64-sample evaluation batch is not counted
        assert samples > 4 / 0.3  # the 0.3 s evaluation is not in the window: 4 samples took far less
    accelerator.free_memory()
    assert accelerator._fp8_work._handle is None  # a new prepare starts counting again


def test_running_mean_leaves_out_non_finite_values_and_keeps_the_window():
    points = list(enumerate([1.0, math.inf, 2.0, math.nan, 4.0, 8.0]))
    assert running_mean(points, 3) == pytest.approx((4.0 + 8.0) / 2)
    assert running_mean(points, 5) == pytest.approx((2.0 + 4.0 + 8.0) / 3)
    assert running_mean(points, 100) == pytest.approx((1.0 + 2.0 + 4.0 + 8.0) / 4)
    assert math.isnan(running_mean([(0, math.inf), (1, math.nan)], 2))
    values = [0.1 * i for i in range(30)]
    assert running_mean(list(enumerate(values)), 20) == sum(values[10:]) / 20  # float64, as Python sums


def test_health_log_values_reports_the_step_logged_and_the_running_means():
    monitor = HealthMonitor()
    monitor.observe(0, loss=3.0, grad_norm=1.0, param_norm=5.0, samples=8, tokens=64, seconds=2.0, memory_gib=1.5)
    monitor.observe(1, loss=1.0, samples=8, seconds=1.0)  # no gradient norm or memory at this step
    values = health_log_values(monitor, 1, smoothing_window=2)
    assert values["health/loss"] == 1.0 and values["health/loss_smooth"] == 2.0
    assert "health/grad_norm" not in values and "health/param_norm" not in values  # step 0's are not step 1's
    assert values["health/samples_per_sec"] == (4.0 + 8.0) / 2
    assert values["health/tokens_per_sec"] == 32.0  # step 1 had no token count
    assert values["health/events/nonfinite_loss"] == 0.0
