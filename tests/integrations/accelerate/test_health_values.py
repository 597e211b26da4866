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
from lightning_fp8.monitoring.report import health_log_values, running_mean
from tests.integrations.accelerate.test_accelerator import _fresh_accelerate_state  # noqa: F401 (autouse fixture)
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
    assert accelerator._fp8_work._handles == []  # a new prepare starts counting again


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


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.out = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.fc(x)))


def _scaled_run(accelerator, model, optimizer, magnitudes):
    for magnitude in magnitudes:
        loss = model(torch.randn(8, 32) * magnitude).square().mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()


def _prepared():
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm-current")
    model = Net()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    return accelerator, model, optimizer


def test_scale_jumps_are_alerted_as_fp8_scale_monitor_alerts_them(tmp_path, recwarn):
    accelerator, model, optimizer = _prepared()
    accelerator.fp8_scale_jumps.alert_after_steps = 0  # FP8ScaleMonitor's warm-up (100 steps) is a setting
    _scaled_run(accelerator, model, optimizer, [1.0, 1.0])
    values = accelerator.log_fp8_stats(layers=True)  # a log: the baseline of the next one
    assert values["fp8/alerts/scale_drops"] == 0 and values["fp8/alerts/scale_rises"] == 0  # nothing to compare yet
    scale_before = values["fp8/layers/fc/input/scale"]
    _scaled_run(accelerator, model, optimizer, [2.0**12])  # fc's input amax jumps 4096x: its scale drops as much
    looked = accelerator.fp8_log_values()  # a look: counts the jumps since the last log, records nothing
    assert looked["fp8/alerts/scale_drops"] >= 1 and accelerator.fp8_scale_jumps.alerts == []
    values = accelerator.log_fp8_stats()
    assert values["fp8/alerts/scale_drops"] == looked["fp8/alerts/scale_drops"]
    alert = next(a for a in accelerator.fp8_scale_jumps.alerts if a["layer"] == "fc" and a["role"] == "input")
    assert (alert["step"], alert["kind"], alert["from"]) == (3, "drop", scale_before)
    assert alert["from"] / alert["to"] >= 16
    assert [w for w in recwarn if "accelerator.fp8_scale_jumps: sudden scale drop in" in str(w.message)]
    assert accelerator.log_fp8_stats()["fp8/alerts/scale_drops"] == 0  # counted once: since the previous log

    # save_state / load_state carry the alerts and the scales the next comparison starts from
    accelerator.save_state(str(tmp_path / "ckpt"))
    saved = accelerator.fp8_scale_jumps.state_dict()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    resumed, _, _ = _prepared()
    resumed.load_state(str(tmp_path / "ckpt"))
    assert resumed.fp8_scale_jumps.state_dict() == saved and saved["previous_scales"]


def test_a_checkpoint_without_scale_jumps_loads_and_a_corrupt_one_is_refused(tmp_path):
    accelerator, model, optimizer = _prepared()
    _scaled_run(accelerator, model, optimizer, [1.0])
    accelerator.log_fp8_stats()
    accelerator.save_state(str(tmp_path / "ckpt"))
    path = tmp_path / "ckpt" / "lightning_fp8" / "rank0.pt"
    state = torch.load(path, weights_only=True)
    for corrupt in ({"alerts": "x"}, {"previous_scales": [["fc", "input", -1.0]]}):
        torch.save({**state, "scale_jumps": corrupt}, path)
        with pytest.raises((TypeError, ValueError), match="accelerator.fp8_scale_jumps.load_state_dict: .*Nothing"):
            accelerator.load_state(str(tmp_path / "ckpt"))
    del state["scale_jumps"]  # written before the alerts were saved
    torch.save(state, path)
    accelerator.fp8_scale_jumps.alerts.append({"step": 1, "layer": "fc", "role": "input", "kind": "drop",
                                               "from": 2.0, "to": 1.0})  # fmt: skip
    accelerator.load_state(str(tmp_path / "ckpt"))  # loads; the alerts are left as they were
    assert len(accelerator.fp8_scale_jumps.alerts) == 1


def test_throughput_counts_the_model_that_trains_not_a_teacher_prepared_first():
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    teacher, student = TokenNet(), TokenNet()
    teacher = accelerator.prepare(teacher)
    student, optimizer = accelerator.prepare(student, torch.optim.AdamW(student.parameters(), lr=1e-3))
    teacher.eval()
    for _ in range(3):
        ids = torch.randint(0, 32, (4, 6))
        with torch.no_grad():
            target = teacher(input_ids=ids).softmax(-1)
        accelerator.backward(nn.functional.cross_entropy(student(input_ids=ids).flatten(0, 1), target.flatten(0, 1)))
        optimizer.step()
        optimizer.zero_grad()
    series = accelerator.fp8_health.series
    assert len(series["samples_per_sec"]) == 3  # the teacher's evaluation forwards neither count nor stop the clock
    for (_, samples), (_, tokens) in zip(series["samples_per_sec"], series["tokens_per_sec"], strict=True):
        assert tokens == pytest.approx(6 * samples, rel=1e-9)


def test_a_model_compiled_in_place_trains_with_fullgraph():
    # Its hooks run inside the compiled region (time.perf_counter there failed fullgraph): nothing is counted.
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    model = Net()
    model.compile(backend="eager", fullgraph=True)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    _scaled_run(accelerator, model, optimizer, [1.0, 1.0])
    assert len(accelerator.fp8_health.series["loss"]) == 2 and accelerator.fp8_health.series["samples_per_sec"] == []


@pytest.mark.parametrize("own", ["clip_grad_norm", "clip_grad_value"])
def test_grad_norm_is_taken_before_the_scripts_own_clipping(own):
    accelerator, model, optimizer = _prepared()
    for _ in range(2):
        accelerator.backward(model(torch.randn(8, 32) * 10).square().mean())
        accelerator.unscale_gradients()  # the true gradients, for the script's own clipping
        expected = _norm([p.grad for p in model.parameters() if p.grad is not None])
        if own == "clip_grad_norm":
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3)
        else:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value=1e-6)
        optimizer.step()
        optimizer.zero_grad()
        assert accelerator.fp8_health.series["grad_norm"][-1][1] == pytest.approx(expected, rel=1e-5)
