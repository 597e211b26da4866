"""FP8ScaleMonitor and TrainingHealthMonitor: the documented keys reach CSV and TensorBoard loggers with the
values the core reports; alerts fire on injected spikes, NaNs and scale jumps; no logger warns once."""

import copy
import csv
import math
import os
import time
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

import lightning_fp8.warnings
from lightning_fp8 import FP8AdamW, FP8GradScaler, convert_to_fp8, fp8_stats
from lightning_fp8.callbacks import FP8ScaleMonitor, TrainingHealthMonitor
from lightning_fp8.health import HealthConfig
from lightning_fp8.integrations.lightning import FP8LMPrecision
from lightning_fp8.optim.master import master_scale
from lightning_fp8.scaling import ROLES
from tests.integrations.lightning.gpt_tiny import GPTModule, loader

SUMMARY_KEYS = [
    f"fp8/{role}/{f}"
    for role in ROLES
    for f in ("scale_min", "scale_max", "amax_max", "saturation_max", "saturation_mean", "nonfinite_count")
]
SCALER_KEYS = [f"fp8/grad_scaler/{f}" for f in ("scale", "skipped_steps", "last_saturation", "nonfinite_events")]
ALERT_KEYS = ["fp8/alerts/scale_drops", "fp8/alerts/scale_rises"]
HEALTH_KEYS = [
    "health/loss",
    "health/loss_smooth",
    "health/grad_norm",
    "health/param_norm",
    "health/memory_gib",
    "health/samples_per_sec",
    "health/tokens_per_sec",
] + [f"health/events/{k}" for k in ("grad_norm_spike", "loss_plateau", "nonfinite_loss", "nonfinite_grad")]
# The callback's fp32 sum of squares against the fp64 reference over the same values.
PARAM_NORM_RTOL = 1e-5


def _fit(module, tmp_path, callbacks, logger=None, max_steps=6, data=None, ckpt_path=None, **kwargs):
    options = {
        "precision": "fp8-lm",
        "accelerator": "cpu",
        "max_steps": max_steps,
        "log_every_n_steps": 2,
        "callbacks": callbacks,
        "logger": logger if logger is not None else CSVLogger(tmp_path),
        "enable_progress_bar": False,
        "enable_checkpointing": False,
        "enable_model_summary": False,
        "default_root_dir": tmp_path,
    }
    trainer = L.Trainer(**{**options, **kwargs})
    trainer.fit(module, data if data is not None else loader(), ckpt_path=ckpt_path)
    return trainer


def _rows(trainer) -> list[dict[str, str]]:
    with open(f"{trainer.logger.log_dir}/metrics.csv") as f:
        return list(csv.DictReader(f))


def _column(rows, key) -> dict[int, float]:
    return {int(r["step"]): float(r[key]) for r in rows if r.get(key) not in (None, "")}


def test_scale_monitor_logs_the_documented_keys_and_the_core_values(tmp_path):
    module = GPTModule()
    trainer = _fit(module, tmp_path, [FP8ScaleMonitor(all_layers=True)])
    rows = _rows(trainer)
    keys = set(rows[0])
    layer_keys = [
        f"fp8/layers/model.blocks.1.mlp.0/{role}/{f}" for role in ROLES for f in ("scale", "amax", "saturation")
    ]
    missing = [k for k in SUMMARY_KEYS + SCALER_KEYS + ALERT_KEYS + layer_keys if k not in keys]
    assert not missing
    assert any(k.startswith("fp8/optimizer/") for k in keys), "FP8AdamW's state scales are not logged"
    assert sorted(_column(rows, "fp8/input/scale_min")) == [2, 4, 6]  # every log_every_n_steps optimizer steps
    # The last row is the state the model ends in: it must equal what the core reports now.
    stats = fp8_stats(module, optimizer=trainer.optimizers[0], grad_scaler=trainer.precision_plugin.grad_scaler)
    for role in ROLES:
        for field in ("scale_min", "scale_max", "amax_max", "saturation_max"):
            assert _column(rows, f"fp8/{role}/{field}")[6] == pytest.approx(stats["summary"][role][field], rel=1e-6)
    assert _column(rows, "fp8/grad_scaler/scale")[6] == stats["grad_scaler"]["scale"]
    qkv = stats["layers"]["model.blocks.0.attn.qkv"]["grad_output"]
    assert _column(rows, "fp8/layers/model.blocks.0.attn.qkv/grad_output/amax")[6] == pytest.approx(qkv["amax"])


def test_health_monitor_logs_keys_values_and_plots(tmp_path):
    class Recorded(GPTModule):
        def on_before_optimizer_step(self, optimizer):
            # The values the callback must report for the step about to be taken (numbered after it).
            def norm(tensors):  # in fp64: the FP8 weights and their gradients are fp16
                return torch.linalg.vector_norm(torch.stack([t.double().norm() for t in tensors])).item()

            self.norms[self.global_step + 1] = norm([p.grad for p in self.parameters() if p.grad is not None])
            # fp8-lm is O2: the FP8 weights' storage holds weight * master scale; state_dict() exports the weights.
            state = self.state_dict()
            self.param_norms[self.global_step + 1] = norm([state[n] for n, _ in self.named_parameters()])
            self.adopted = any(master_scale(p) is not None for p in self.parameters())

    module = Recorded()
    module.norms, module.param_norms = {}, {}
    health = TrainingHealthMonitor(smoothing_window=3)
    trainer = _fit(module, tmp_path, [health])
    rows = _rows(trainer)
    assert not [k for k in HEALTH_KEYS if k not in rows[0]]
    for step, value in _column(rows, "health/grad_norm").items():
        assert value == pytest.approx(module.norms[step], rel=1e-5)
    loss = _column(rows, "health/loss")
    assert loss[6] == pytest.approx(module.losses[5], rel=1e-6)
    assert _column(rows, "health/tokens_per_sec")[6] == pytest.approx(
        _column(rows, "health/samples_per_sec")[6] * 24, rel=1e-6
    )  # 24 tokens per sample
    assert module.adopted  # O2 masters in the parameters while training: the case that matters
    assert len(_column(rows, "health/param_norm")) >= 3
    for step, value in _column(rows, "health/param_norm").items():
        assert value == pytest.approx(module.param_norms[step], rel=PARAM_NORM_RTOL)
    assert (tmp_path / "lightning_logs" / "version_0" / "health.png").stat().st_size > 1000


def test_tensorboard_logger_receives_the_keys(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = _fit(
        GPTModule(),
        tmp_path,
        [FP8ScaleMonitor(), TrainingHealthMonitor(plot=False)],
        logger=TensorBoardLogger(tmp_path),
        max_steps=4,
    )
    events = EventAccumulator(trainer.logger.log_dir)
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert set(SUMMARY_KEYS + SCALER_KEYS + ["health/loss", "health/grad_norm"]) <= tags


def test_no_logger_warns_once_and_keeps_the_metrics(tmp_path, monkeypatch):
    monkeypatch.setattr(lightning_fp8.warnings, "_seen", set())
    scale, health = FP8ScaleMonitor(log_every_n_steps=1), TrainingHealthMonitor(log_every_n_steps=1, plot=False)
    with pytest.warns(UserWarning, match="has no logger") as record:
        _fit(GPTModule(), tmp_path, [scale, health], logger=False, max_steps=3)
    assert len([w for w in record if "FP8ScaleMonitor: the Trainer has no logger" in str(w.message)]) == 1
    assert len([w for w in record if "TrainingHealthMonitor: the Trainer has no logger" in str(w.message)]) == 1
    assert set(SUMMARY_KEYS) <= set(scale.last_metrics) and "health/loss" in health.last_metrics


class Faulty(GPTModule):
    """Injects a 300x loss (a gradient-norm spike) and a NaN loss at the given steps."""

    def __init__(self, spike_step: int, nan_step: int) -> None:
        super().__init__()
        self.spike_step, self.nan_step = spike_step, nan_step

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step == self.spike_step:
            return loss * 300
        if self.global_step == self.nan_step:
            return loss * float("nan")
        return loss


def test_spike_and_nan_are_recorded_with_the_recovery_action(tmp_path):
    health = TrainingHealthMonitor(HealthConfig(window=8, warmup_steps=4), log_every_n_steps=1, plot=False)
    module = Faulty(spike_step=9, nan_step=12)
    with pytest.warns(UserWarning, match="gradient norm"):
        trainer = _fit(module, tmp_path, [health, FP8ScaleMonitor(log_every_n_steps=1)], max_steps=14)
    kinds = {(e.kind, e.step, e.action) for e in health.monitor.events}
    assert ("grad_norm_spike", 10, "none") in kinds
    assert ("nonfinite_loss", 13, "none") in kinds and ("nonfinite_grad", 13, "skip_step+lower_mu") in kinds
    rows = _rows(trainer)
    assert (
        _column(rows, "fp8/grad_scaler/skipped_steps")[13] == 1
        and _column(rows, "fp8/grad_scaler/skipped_steps")[12] == 0
    )
    assert _column(rows, "health/events/nonfinite_grad")[14] == 1
    assert _column(rows, "fp8/grad_scaler/scale")[13] == _column(rows, "fp8/grad_scaler/scale")[12] / 2
    assert all(torch.isfinite(p).all() for p in module.parameters())  # the NaN step was skipped


def test_gradient_accumulation_observes_each_optimizer_step_once(tmp_path):
    # health/loss of a step is the mean of its micro-batches' losses (not of Lightning's loss / accumulate), and
    # neither callback observes step 0, before any optimizer step.
    health = TrainingHealthMonitor(log_every_n_steps=1, plot=False)
    scales = FP8ScaleMonitor(log_every_n_steps=1)
    module = GPTModule()
    trainer = _fit(module, tmp_path, [health, scales], max_steps=2, accumulate_grad_batches=3)
    expected = [(step + 1, sum(module.losses[3 * step : 3 * step + 3]) / 3) for step in range(2)]
    assert [s for s, _ in health.monitor.series["loss"]] == [1, 2]
    assert [v for _, v in health.monitor.series["loss"]] == pytest.approx([v for _, v in expected], rel=1e-6)
    assert sorted(_column(_rows(trainer), "fp8/grad_scaler/scale")) == [1, 2]


def test_scale_monitor_rejects_a_bad_jump_factor():
    with pytest.raises(TypeError, match=r"jump_factor='x'\) must be a number > 1 .*got str"):
        FP8ScaleMonitor(jump_factor="x")


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        # Types: a TypeError (also a ValueError, as these were) saying what is expected, not the range message.
        (lambda: FP8ScaleMonitor(jump_factor="16"), TypeError, r"jump_factor='16'\) must be a number > 1"),
        (lambda: FP8ScaleMonitor(log_every_n_steps=5.0), TypeError, r"log_every_n_steps=5.0\) must be an int >= 1"),
        (lambda: FP8ScaleMonitor(alert_after_steps=2.5), TypeError, "alert_after_steps=2.5.*got float"),
        (lambda: FP8ScaleMonitor(all_layers="no"), TypeError, r"all_layers='no'\): must be True or False"),
        (lambda: TrainingHealthMonitor(tokens_fn=5), TypeError, r"tokens_fn=5\) must be a function"),
        (
            lambda: TrainingHealthMonitor(config={"window": 8}),
            TypeError,
            r"TrainingHealthMonitor\(config=\.\.\.\) expects a HealthConfig, got dict: e.g. HealthConfig",
        ),
        (lambda: TrainingHealthMonitor(plot_path=5), TypeError, r"plot_path=5\) must be a path"),
        (lambda: TrainingHealthMonitor(plot="no"), TypeError, r"plot='no'\): must be True or False"),
        (lambda: TrainingHealthMonitor(smoothing_window=2.0), TypeError, "smoothing_window=2.0.*got float"),
        # Ranges: a ValueError. An infinite jump factor is never reached: nothing would ever alert.
        (lambda: FP8ScaleMonitor(jump_factor=math.inf), ValueError, r"jump_factor=inf\) must be a finite number > 1"),
        # an int past float's range: math.isfinite raised OverflowError
        (lambda: FP8ScaleMonitor(jump_factor=10**400), ValueError, r"jump_factor=1000.*\) must be a finite number > 1"),
        (lambda: FP8ScaleMonitor(jump_factor=math.nan), ValueError, "must be a finite number > 1"),
        (lambda: FP8ScaleMonitor(alert_after_steps=-1), ValueError, r"alert_after_steps=-1\) must be an int >= 0"),
        (lambda: TrainingHealthMonitor(plot_path="health.txt"), ValueError, r"cannot write a '\.txt' file"),
    ],
)
def test_monitor_arguments_are_checked_when_the_monitor_is_built(make, error, match):
    # Each was accepted (or refused with the range message) and failed mid-fit, at the end of fit, or never.
    with pytest.raises(error, match=match) as raised:
        make()
    if error is TypeError:
        assert isinstance(raised.value, ValueError)  # what the type errors raised before: callers may catch either
    else:
        assert not isinstance(raised.value, TypeError)


def test_monitors_take_numpy_numbers_as_health_config_does():
    np = pytest.importorskip("numpy")
    # np.float32(4) was refused as "must be > 1", NumPy counts as not ints (HealthConfig takes them).
    monitor = FP8ScaleMonitor(log_every_n_steps=np.int64(5), jump_factor=np.float32(4), alert_after_steps=np.int64(10))
    assert (monitor.log_every_n_steps, monitor.jump_factor, monitor.alert_after_steps) == (5, 4.0, 10)
    kinds = [type(monitor.log_every_n_steps), type(monitor.jump_factor), type(monitor.alert_after_steps)]
    assert kinds == [int, float, int]  # plain Python numbers: the state key and the checkpoint hold them
    assert monitor.state_key == FP8ScaleMonitor(log_every_n_steps=5, jump_factor=4, alert_after_steps=10).state_key
    health = TrainingHealthMonitor(log_every_n_steps=np.int32(2), smoothing_window=np.int64(3))
    assert (health.log_every_n_steps, health.smoothing_window) == (2, 3) and type(health.smoothing_window) is int


def test_a_tokens_fn_that_returns_no_number_is_named_in_the_error(tmp_path):
    # A raw "unsupported operand type(s) for +: 'int' and 'str'" after the first step before.
    def tokens_of(batch):
        return "24"

    with pytest.raises(TypeError, match=r"tokens_fn=.*tokens_of\) returned '24' \(str\) for a batch: it must return"):
        _fit(GPTModule(), tmp_path, [TrainingHealthMonitor(plot=False, tokens_fn=tokens_of)], max_steps=1)
    health = TrainingHealthMonitor(plot=False, log_every_n_steps=1, tokens_fn=lambda batch: torch.tensor(10))
    _fit(GPTModule(), tmp_path / "tensor", [health], max_steps=1)  # a one-element tensor is a count
    assert len(health.monitor.series["tokens_per_sec"]) == 1


@pytest.mark.parametrize("tokens", [float("nan"), float("inf"), -3.0])
def test_a_tokens_fn_that_returns_a_non_finite_or_negative_count_is_named_in_the_error(tokens):
    # NaN and inf reached HealthMonitor.observe, whose error did not name tokens_fn.
    from lightning_fp8.integrations.lightning.health_args import _checked_tokens

    def tokens_of(batch):
        return tokens

    with pytest.raises(ValueError, match=r"tokens_fn=.*tokens_of\) returned .* tokens for a batch, expected a finite"):
        _checked_tokens(tokens_of(None), tokens_of)
    assert _checked_tokens(24, tokens_of) == 24


def _layer_stats(scale_in, scale_grad):
    layer = {
        "input": {"scale": scale_in, "amax": 1.0, "saturation": 0.0},
        "grad_output": {"scale": scale_grad, "amax": 1.0, "saturation": 0.0},
    }
    return {"layers": {"fc": layer}, "summary": {}}


def test_scale_jumps_are_flagged_both_ways():
    monitor = FP8ScaleMonitor(jump_factor=16, alert_after_steps=0)
    stats = _layer_stats

    assert monitor._metrics(stats(64.0, 2.0**10), 1)["fp8/alerts/scale_drops"] == 0
    metrics = monitor._metrics(stats(2.0, 2.0**15), 2)  # input scale / 32: drop; grad scale * 32: rise
    assert metrics["fp8/alerts/scale_drops"] == 1 and metrics["fp8/alerts/scale_rises"] == 1
    assert [(a["layer"], a["role"], a["kind"]) for a in monitor.alerts] == [
        ("fc", "input", "drop"),
        ("fc", "grad_output", "rise"),
    ]
    assert monitor._metrics(stats(4.0, 2.0**16), 3)["fp8/alerts/scale_drops"] == 0  # 2x moves are ordinary
    # mu grown 16x (fp16 gradients underflowing) moves every grad_output scale by 1/16: no amax moved, no alert.
    # Through a save and load (mu is kept beside the scales), and the alerts keep the layers' own scales.
    assert monitor._metrics({**stats(4.0, 2.0**16), "grad_scaler": {"scale": 1.0}}, 4)["fp8/alerts/scale_drops"] == 0
    resumed = FP8ScaleMonitor(jump_factor=16, alert_after_steps=0)
    resumed.load_state_dict(copy.deepcopy(monitor.state_dict()))
    for each in (monitor, resumed):
        grown = each._metrics({**stats(4.0, 2.0**12), "grad_scaler": {"scale": 16.0}}, 5)
        assert grown["fp8/alerts/scale_drops"] == 0 and len(each.alerts) == 2
        shrunk = each._metrics({**stats(4.0, 2.0**4), "grad_scaler": {"scale": 16.0}}, 6)  # the amax jumped 256x
        assert shrunk["fp8/alerts/scale_drops"] == 1 and each.alerts[-1]["from"] == 2.0**12
        assert each.alerts[-1]["to"] == 2.0**4
    with pytest.raises(ValueError, match="jump_factor"):
        FP8ScaleMonitor(jump_factor=1)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="alert_after_steps"):
            FP8ScaleMonitor(alert_after_steps=bad)
    for bad in (0, True):  # a bool is not a period (True would log every step, and name the state key after it)
        for monitor_cls in (TrainingHealthMonitor, FP8ScaleMonitor):
            with pytest.raises(ValueError, match="log_every_n_steps"):
                monitor_cls(log_every_n_steps=bad)
    for name in ("spike_zscore", "spike_ratio", "plateau_min_improvement", "plateau_grad_norm_drop"):
        with pytest.raises(ValueError, match=name):
            HealthConfig(**{name: True})


def test_scale_jumps_are_not_alerted_during_the_warm_up(recwarn, monkeypatch):
    monkeypatch.setattr(lightning_fp8.warnings, "_seen", set())
    monitor = FP8ScaleMonitor(jump_factor=16, alert_after_steps=10)
    assert FP8ScaleMonitor().alert_after_steps == 100  # the documented default
    scales = [(2.0**12, 2.0**3), (2.0**5, 2.0**9), (2.0**11, 2.0**2), (2.0**4, 2.0**8)]  # 2**6..2**7 moves
    for step, (scale_in, scale_grad) in zip(range(3, 10, 2), scales, strict=True):
        metrics = monitor._metrics(_layer_stats(scale_in, scale_grad), step)
        assert metrics["fp8/alerts/scale_drops"] == 0 and metrics["fp8/alerts/scale_rises"] == 0
    assert monitor.alerts == [] and not [w for w in recwarn if "FP8ScaleMonitor" in str(w.message)]
    # From the warm-up's end, against the last scales seen during it (2**4 -> 2**-1: a drop of 32x).
    metrics = monitor._metrics(_layer_stats(0.5, 2.0**8), 10)
    assert metrics["fp8/alerts/scale_drops"] == 1 and [(a["step"], a["kind"]) for a in monitor.alerts] == [(10, "drop")]


def test_scale_alerts_warn_once_per_kind_not_every_step(monkeypatch):
    monkeypatch.setattr(lightning_fp8.warnings, "_seen", set())
    monitor = FP8ScaleMonitor(jump_factor=16, alert_after_steps=0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for step in range(1, 12):  # the input scale falls and the gradient scale rises by 2**5 every step
            monitor._metrics(_layer_stats(2.0 ** (60 - 5 * step), 2.0 ** (-40 + 5 * step)), step)
    texts = [str(w.message) for w in record if "FP8ScaleMonitor" in str(w.message)]
    assert len(texts) == 2 and "scale drop" in texts[0] and "scale rise" in texts[1], texts
    assert len(monitor.alerts) == 2 * 10  # every jump is still recorded


def test_scale_alerts_warn_on_rank_zero_only(monkeypatch):
    monkeypatch.setattr(lightning_fp8.warnings, "_seen", set())
    monkeypatch.setenv("RANK", "1")
    monitor = FP8ScaleMonitor(jump_factor=16, alert_after_steps=0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        monitor._metrics(_layer_stats(2.0**10, 2.0**10), 1)
        monitor._metrics(_layer_stats(2.0**2, 2.0**10), 2)
    assert len(monitor.alerts) == 1 and not [w for w in record if "FP8ScaleMonitor" in str(w.message)]


def test_fit_does_not_alert_scale_moves_of_the_first_steps(tmp_path, monkeypatch):
    monkeypatch.setattr(lightning_fp8.warnings, "_seen", set())
    # The tiny GPT's scales move by 2x in its first steps; a real run's first steps move them much more.
    monitor = FP8ScaleMonitor(log_every_n_steps=1, all_layers=True, jump_factor=2)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = _fit(GPTModule(), tmp_path, [monitor], max_steps=8)
    rows = _rows(trainer)
    ratios = []
    for key in [k for k in rows[0] if k.startswith("fp8/layers/") and k.endswith("/scale")]:
        column = _column(rows, key)
        steps = sorted(column)
        ratios += [column[b] / column[a] for a, b in zip(steps[:-1], steps[1:], strict=True) if column[a] > 0]
    # The first steps do move scales by the alert factor (so, without the warm-up, this run would alert) ...
    assert max(max(ratios), 1 / min(ratios)) >= monitor.jump_factor
    # ... and within the default warm-up nothing is alerted or warned.
    assert monitor.alerts == [] and not [w for w in record if "sudden scale" in str(w.message)]


class TwoOptimizers(GPTModule):
    """Manual optimization with two AdamW (the blocks, the rest), both stepped every batch: ``global_step`` advances
    by 2 per batch. Records the reference gradient norm of every step and logs ``global_step`` with ``self.log``."""

    def __init__(self) -> None:
        super().__init__(manual=True)
        self.true_norms: dict[int, float] = {}
        self.param_norms: dict[int, float] = {}

    def configure_optimizers(self):
        blocks = list(self.model.blocks.parameters())
        rest = [p for p in self.model.parameters() if all(p is not q for q in blocks)]
        return [torch.optim.AdamW(blocks, lr=self.lr), torch.optim.AdamW(rest, lr=self.lr)]

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        first, second = self.optimizers()
        self.manual_backward(loss)
        # The true gradients: divided here by mu (a power of two, so exactly), their norm in fp64.
        mu = self.trainer.precision_plugin.grad_scaler.get_scale()
        norms = [p.grad.double().norm() / mu for p in self.parameters() if p.grad is not None]
        self.true_norms[self.global_step + 2] = torch.linalg.vector_norm(torch.stack(norms)).item()
        state = self.state_dict()  # the weights the loss came from (O2's storage holds weight * master scale)
        weights = [state[n].double().norm() for n, _ in self.named_parameters()]
        self.param_norms[self.global_step + 2] = torch.linalg.vector_norm(torch.stack(weights)).item()
        first.step()
        second.step()
        first.zero_grad()
        second.zero_grad()
        self.log("stepped_to", float(self.global_step))  # Lightning's own logging: at the batches it picks
        return loss


def test_grad_norm_with_two_optimizers_is_the_norm_of_the_unscaled_gradients(tmp_path):
    # Each optimizer's gradients are unscaled only around its own step: the other's still carry mu = 256.
    health = TrainingHealthMonitor(log_every_n_steps=1, plot=False)
    module = TwoOptimizers()
    plugin = FP8LMPrecision(grad_scaler={"init_scale": 2.0**8})
    _fit(module, tmp_path, [health], precision=None, plugins=[plugin], max_steps=8)
    assert plugin.grad_scaler.get_scale() == 2.0**8  # the case that matters: mu != 1 throughout
    logged = dict(health.monitor.series["grad_norm"])
    assert sorted(logged) == [2, 4, 6, 8]
    for step, value in logged.items():
        assert value == pytest.approx(module.true_norms[step], rel=1e-5)
    # The parameter norm is taken before the batch's first optimizer steps (the second's was after the first's step).
    param_norms = dict(health.monitor.series["param_norm"])
    assert sorted(param_norms) == [2, 4, 6, 8]
    for step, value in param_norms.items():
        assert value == pytest.approx(module.param_norms[step], rel=PARAM_NORM_RTOL)


def test_log_period_counts_batches_as_lightnings_own_logging_does(tmp_path):
    # Trainer(log_every_n_steps=2): Lightning logs self.log values every 2 batches, whatever the optimizer count.
    scales, health = FP8ScaleMonitor(), TrainingHealthMonitor(plot=False)
    trainer = _fit(TwoOptimizers(), tmp_path, [scales, health], max_steps=12)
    rows = _rows(trainer)
    lightning_logged = sorted(_column(rows, "stepped_to").values())
    assert lightning_logged == [4.0, 8.0, 12.0]  # batches 2, 4, 6
    assert sorted(_column(rows, "fp8/input/scale_min")) == lightning_logged
    assert sorted(_column(rows, "health/loss")) == lightning_logged


def test_trainer_log_every_n_steps_zero_logs_nothing_as_lightning_does(tmp_path, monkeypatch):
    # Trainer(log_every_n_steps=0) (and barebones=True) turns Lightning's logging off; the monitors took it as 1.
    import lightning_fp8.integrations.lightning.callbacks as callbacks

    calls = []
    monkeypatch.setattr(callbacks, "fp8_stats", lambda *a, **k: calls.append(1) or fp8_stats(*a, **k))
    scales, health = FP8ScaleMonitor(), TrainingHealthMonitor(plot=False)
    trainer = _fit(TwoOptimizers(), tmp_path, [scales, health], log_every_n_steps=0)
    rows = _rows(trainer) if (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").exists() else []
    assert not [r for r in rows if any(k.startswith(("fp8/", "health/", "stepped_to")) and r[k] for k in r)]
    assert not calls  # no statistics read (a host sync each) for logs nobody writes
    assert len(health.monitor.series["loss"]) == 3  # the health checks still observe every batch
    # A monitor's own period still logs (the callbacks write to the logger themselves).
    trainer = _fit(TwoOptimizers(), tmp_path / "own", [FP8ScaleMonitor(log_every_n_steps=1)], log_every_n_steps=0)
    assert sorted(_column(_rows(trainer), "fp8/input/scale_min")) == [2, 4, 6]


class StepsEveryOtherBatch(GPTModule):
    """Manual optimization that steps on batches 1, 3, 5 (counting from 1) only."""

    def __init__(self) -> None:
        super().__init__(manual=True)

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        if batch_idx % 2 == 0:
            optimizer = self.optimizers()
            self.manual_backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        return loss


def test_a_batch_that_steps_nothing_does_not_make_the_callback_miss_its_turn(tmp_path):
    # Every 2 batches: the multiples 2 and 4 fall on batches that stepped nothing; the next step logs instead.
    trainer = _fit(StepsEveryOtherBatch(), tmp_path, [FP8ScaleMonitor(log_every_n_steps=2)], max_steps=3)
    assert sorted(_column(_rows(trainer), "fp8/input/scale_min")) == [2, 3]  # at batches 3 and 5


PAUSE_S = 0.3  # each validation and checkpoint save: 10x a toy training step


class Paused(GPTModule):
    """Validation that takes a while; records when each validation or checkpoint save began and ended."""

    def __init__(self) -> None:
        super().__init__()
        self.pauses: list[list[float]] = []

    def validation_step(self, batch, batch_idx):
        time.sleep(PAUSE_S / 2)
        return self.loss(batch)

    def val_dataloader(self):
        return loader(n=12)

    def on_validation_start(self):
        self.pauses.append([time.perf_counter()])

    def on_validation_end(self):
        self.pauses[-1].append(time.perf_counter())

    def on_save_checkpoint(self, checkpoint):  # called after the callbacks' hooks, SlowSave's sleep included
        self.pauses[-1].append(time.perf_counter())


class SlowSave(Callback):
    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        pl_module.pauses.append([time.perf_counter()])
        time.sleep(PAUSE_S)


def test_throughput_leaves_out_validation_and_checkpoint_saving(tmp_path):
    health = TrainingHealthMonitor(log_every_n_steps=1, plot=False, smoothing_window=1)
    module = Paused()
    saving = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    _fit(module, tmp_path, [health, SlowSave(), saving], max_steps=6, val_check_interval=2, limit_val_batches=2,
         num_sanity_val_steps=0, enable_checkpointing=True)  # fmt: skip
    seconds = [6 / value for _, value in health.monitor.series["samples_per_sec"]]  # 6 samples a batch
    assert len(seconds) == 6 and len(module.pauses) == 5  # validation after steps 2, 4, 6; saves after 3 and 6
    # The steps after a pause (3, 4 and 5) took a toy step's time, not the pause's too (the old count: 0.3 s more).
    pause_lengths = [end - begin for begin, end in module.pauses]
    assert min(pause_lengths) >= PAUSE_S
    assert max(seconds[2:5]) < min(pause_lengths), seconds


class NaNAt(GPTModule):
    def __init__(self, steps) -> None:
        super().__init__()
        self.nan_steps = steps

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step in self.nan_steps else loss


def test_a_scaler_fallback_is_the_action_of_its_skipped_step_not_another_event(tmp_path):
    health = TrainingHealthMonitor(log_every_n_steps=1, plot=False)
    plugin = FP8LMPrecision(grad_scaler={"nonfinite_fallback": "lower_lr", "fallback_after": 2})
    with pytest.warns(UserWarning, match="non-finite"):
        trainer = _fit(NaNAt((2, 3)), tmp_path, [health], precision=None, plugins=[plugin], max_steps=5)
    scaler = plugin.grad_scaler
    assert [e["action"] for e in scaler.history if e["action"] == "fallback"] == ["fallback"]  # it did run
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(GPTModule().lr * 0.5)
    grad_events = [(e.step, e.action) for e in health.monitor.events if e.kind == "nonfinite_grad"]
    assert grad_events == [(3, "skip_step+lower_mu"), (4, "skip_step+lower_mu+lower_lr")]
    assert scaler.nonfinite_events == 2
    assert _column(_rows(trainer), "health/events/nonfinite_grad")[5] == scaler.nonfinite_events


class StepIndexed(GPTModule):
    """Trains on batch number ``global_step``, whatever the loader yields: the data then depends only on state the
    checkpoint restores (Lightning re-runs part of an epoch when resuming from a plain DataLoader)."""

    batches = list(loader())

    def training_step(self, batch, batch_idx):
        return super().training_step(self.batches[self.global_step], batch_idx)


def test_a_resumed_run_logs_what_the_uninterrupted_run_logs(tmp_path):
    # Scales move by 2x in the tiny GPT's first steps: jump_factor=2 alerts on them, from the first comparison.
    def run(name, ckpt_path=None, saving=()):
        torch.manual_seed(0 if ckpt_path is None else 123)  # the resumed run takes nothing from its own init
        health = TrainingHealthMonitor(log_every_n_steps=1, plot=False, smoothing_window=4)
        scales = FP8ScaleMonitor(log_every_n_steps=1, jump_factor=2, alert_after_steps=0)
        trainer = _fit(StepIndexed(), tmp_path / name, [health, scales, *saving], max_steps=8, ckpt_path=ckpt_path,
                       log_every_n_steps=1, enable_checkpointing=bool(saving))  # fmt: skip
        return _rows(trainer), health, scales

    saving = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    full_rows, full_health, full_scales = run("full", saving=[saving])
    ckpt = tmp_path / "epoch=0-step=4.ckpt"
    assert torch.load(ckpt, weights_only=True)["callbacks"][full_scales.state_key]["previous_scales"]
    rows, health, scales = run("resumed", ckpt)

    keys = ["health/loss", "health/loss_smooth", "health/grad_norm", "fp8/alerts/scale_drops",
            "fp8/alerts/scale_rises"]  # fmt: skip
    for key in keys:
        expected, got = _column(full_rows, key), _column(rows, key)
        assert got == {step: expected[step] for step in (5, 6, 7, 8)}, key
    assert [a for a in full_scales.alerts if a["step"] == 5] != []  # the first comparison after resuming alerts ...
    assert scales.alerts == full_scales.alerts  # ... and the saved alerts come back with the new ones
    assert health.monitor.series["loss"] == full_health.monitor.series["loss"]
    # Throughput is timing (not reproducible), but its running mean at step 5 spans steps 2..5 across the resume.
    throughput = dict(health.monitor.series["samples_per_sec"])
    assert _column(rows, "health/samples_per_sec")[5] == pytest.approx(sum(throughput[s] for s in (2, 3, 4, 5)) / 4)


def _two_of_each() -> list[Callback]:
    # A summary every step and all layers every other step; two health monitors logging at other periods.
    return [
        FP8ScaleMonitor(log_every_n_steps=1, jump_factor=2, alert_after_steps=0),
        FP8ScaleMonitor(log_every_n_steps=2, all_layers=True, jump_factor=2, alert_after_steps=0),
        TrainingHealthMonitor(log_every_n_steps=1, plot=False, smoothing_window=4),
        TrainingHealthMonitor(log_every_n_steps=2, plot=False, config=HealthConfig(warmup_steps=0)),
    ]


def test_two_monitors_of_a_kind_with_other_settings_both_log_and_resume(tmp_path):
    """Two FP8ScaleMonitors (or TrainingHealthMonitors) in one Trainer failed at construction: both filed their state
    under the class name, and Lightning refuses stateful callbacks sharing a state_key. Each has its own key now,
    logs, and resumes its own state; a default monitor keeps the class name, the key of older checkpoints."""
    assert FP8ScaleMonitor().state_key == "FP8ScaleMonitor"
    assert TrainingHealthMonitor(plot=False).state_key == "TrainingHealthMonitor"
    # Monitors told apart by their plot's path alone: Lightning refused the second (one key for both).
    paths = [TrainingHealthMonitor(plot_path=str(tmp_path / f"{name}.png")) for name in ("a", "b")]
    assert paths[0].state_key != paths[1].state_key and "plot_path" in paths[0].state_key

    def run(name, ckpt_path=None, saving=()):
        torch.manual_seed(0 if ckpt_path is None else 123)
        callbacks = _two_of_each()
        _fit(StepIndexed(), tmp_path / name, [*callbacks, *saving], max_steps=8, ckpt_path=ckpt_path,
             log_every_n_steps=1, enable_checkpointing=bool(saving))  # fmt: skip
        return callbacks

    saving = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    full = run("full", saving=[saving])
    ckpt = tmp_path / "epoch=0-step=4.ckpt"
    assert set(torch.load(ckpt, weights_only=True)["callbacks"]) >= {cb.state_key for cb in full}
    assert full[0].alerts != full[1].alerts  # other periods compare other scales: the states differ
    assert any(key.startswith("fp8/layers/") for key in full[1].last_metrics)
    assert not any(key.startswith("fp8/layers/") for key in full[0].last_metrics)
    assert all(health.last_metrics["health/loss"] > 0 for health in full[2:])

    resumed = run("resumed", ckpt)
    for got, expected in zip(resumed[:2], full[:2], strict=True):
        assert got.alerts == expected.alerts and got.state_dict() == expected.state_dict()
    for got, expected in zip(resumed[2:], full[2:], strict=True):
        assert len(got.monitor.series["loss"]) == 8  # 4 resumed from the checkpoint
        assert got.monitor.series["loss"] == expected.monitor.series["loss"]

    # A checkpoint of an older version: one state per class, under the class name, resumes a non-default monitor.
    checkpoint = torch.load(ckpt, weights_only=True)
    states = checkpoint["callbacks"]
    checkpoint["callbacks"] = {"FP8ScaleMonitor": states[full[0].state_key],
                               "TrainingHealthMonitor": states[full[2].state_key]}  # fmt: skip
    torch.save(checkpoint, tmp_path / "old.ckpt")
    scales, health = _two_of_each()[0], _two_of_each()[2]
    torch.manual_seed(123)
    _fit(StepIndexed(), tmp_path / "old", [scales, health], max_steps=8, ckpt_path=tmp_path / "old.ckpt",
         log_every_n_steps=1)  # fmt: skip
    assert scales.alerts == full[0].alerts
    assert health.monitor.series["loss"] == full[2].monitor.series["loss"]


def test_scale_monitor_state_carries_the_last_scales_to_the_next_comparison():
    uninterrupted = FP8ScaleMonitor(jump_factor=16, alert_after_steps=0)
    uninterrupted._metrics(_layer_stats(2.0**10, 2.0**3), 1)
    saved = FP8ScaleMonitor(jump_factor=16, alert_after_steps=0)
    saved._metrics(_layer_stats(2.0**10, 2.0**3), 1)
    resumed = FP8ScaleMonitor(jump_factor=16, alert_after_steps=0)
    resumed.load_state_dict(saved.state_dict())
    jump = _layer_stats(2.0**4, 2.0**3)  # input scale / 64: a drop
    assert resumed._metrics(jump, 2) == uninterrupted._metrics(jump, 2)
    assert resumed.alerts == uninterrupted.alerts and len(resumed.alerts) == 1


def _scale_monitor_state() -> dict:
    monitor = FP8ScaleMonitor(jump_factor=16, alert_after_steps=0)
    monitor._metrics(_layer_stats(2.0**10, 2.0**3), 1)
    monitor._metrics(_layer_stats(2.0**4, 2.0**3), 2)  # a drop: one alert
    return copy.deepcopy(monitor.state_dict())


def test_scale_monitor_loads_its_own_state_and_the_older_ones():
    state = _scale_monitor_state()
    assert len(state["alerts"]) == 1 and len(state["previous_scales"]) == 2
    for older in (state, {"alerts": state["alerts"]}, {}):  # before 'previous_scales' was saved; a default Callback's
        monitor = FP8ScaleMonitor()
        monitor.load_state_dict(copy.deepcopy(older))
        assert monitor.state_dict() == {"alerts": older.get("alerts", []), "previous_mu": None,
                                        "previous_scales": older.get("previous_scales", []),
                                        "before_jumps": older.get("before_jumps", [])}  # fmt: skip


def _alerted(**fields) -> dict:
    alert = {"step": 2, "layer": "fc", "role": "input", "kind": "drop", "from": 1024.0, "to": 16.0}
    return {"alerts": [{**alert, **fields}], "previous_scales": []}


@pytest.mark.parametrize(
    ("state", "error", "match"),
    [
        ([1, 2], TypeError, "got list, expected a dict"),
        ({"foo": 1}, ValueError, r"unknown entries \['foo'\]"),
        ({"alerts": None}, TypeError, "'alerts' is None, expected a list"),
        ({"alerts": [1, 2]}, TypeError, "alert 0 is 1, expected a dict with keys"),
        (_alerted(kind="jump"), ValueError, "alert 0 has kind 'jump'"),
        (_alerted(role="bias"), ValueError, "alert 0 has role 'bias'"),
        (_alerted(step="3"), TypeError, "alert 0 has step '3'"),
        (_alerted(to=math.inf), ValueError, "the 'to' scale of alert 0 is inf, expected a finite positive scale"),
        ({"previous_scales": "x"}, TypeError, "'previous_scales' is 'x', expected a list"),
        ({"previous_scales": [["fc", 8.0]]}, TypeError, "entry 0 of 'previous_scales' is .*, expected \\[layer, role"),
        ({"previous_scales": [["fc", "input", "abc"]]}, TypeError, "is 'abc', expected a number"),
        ({"previous_scales": [["fc", "input", math.nan]]}, ValueError, "is nan, expected a finite positive scale"),
        ({"previous_scales": [["fc", "input", -4.0]]}, ValueError, "is -4.0, expected a finite positive scale"),
        ({"previous_scales": [["fc", "input", 0]]}, ValueError, "is 0, expected a finite positive scale"),
        ({"previous_scales": [["fc", "amax", 8.0]]}, ValueError, "has role 'amax'"),
        ({"previous_mu": "16"}, TypeError, "'previous_mu' is '16', expected a number"),
        ({"previous_mu": -2.0}, ValueError, "'previous_mu' is -2.0, expected a finite positive scale"),
    ],
)
def test_scale_monitor_refuses_a_corrupt_state_and_keeps_its_own(state, error, match):
    # The alerts were replaced, then unpacking 'previous_scales' failed: half a state loaded. NaN and negative
    # scales loaded as they were, and a wrong dict loaded as an empty state.
    monitor = FP8ScaleMonitor()
    monitor.load_state_dict(_scale_monitor_state())
    before = copy.deepcopy(monitor.state_dict())
    with pytest.raises(error, match=match) as raised:
        monitor.load_state_dict(copy.deepcopy(state))
    assert "Nothing was loaded" in str(raised.value)
    assert monitor.state_dict() == before


@pytest.mark.parametrize(
    ("state", "error", "match"),
    [
        ([1, 2], TypeError, "got list, expected a dict"),
        ({}, KeyError, r"missing entry 'monitor'"),
        ({"series": {}}, KeyError, r"missing entry 'monitor'"),
        ({"monitor": TrainingHealthMonitor().state_dict()["monitor"], "x": 1}, ValueError, r"unknown entries \['x'\]"),
    ],
)
def test_health_monitor_refuses_a_state_without_its_monitor_entry_naming_what_to_load(state, error, match):
    # A bare KeyError('monitor') (or "list indices must be integers"; an unknown entry was ignored), unlike the checked
    # errors of the state inside it and FP8ScaleMonitor's.
    health = TrainingHealthMonitor(plot=False)
    with pytest.raises(error, match=match) as raised:
        health.load_state_dict(state)
    assert "TrainingHealthMonitor.load_state_dict" in str(raised.value) and "Nothing was loaded" in str(raised.value)


def test_scale_monitor_does_not_compare_against_a_scale_it_cannot_divide_by():
    # A non-finite or zero scale was remembered, to be divided by at the next log (ZeroDivisionError) and saved.
    monitor = FP8ScaleMonitor(jump_factor=16, alert_after_steps=0)
    monitor._metrics(_layer_stats(2.0**10, 2.0**3), 1)
    monitor._metrics(_layer_stats(0.0, math.nan), 2)
    assert monitor.state_dict()["previous_scales"] == [["fc", "input", 2.0**10], ["fc", "grad_output", 2.0**3]]
    FP8ScaleMonitor().load_state_dict(monitor.state_dict())
    assert monitor._metrics(_layer_stats(2.0**4, 2.0**3), 3)["fp8/alerts/scale_drops"] == 1


def test_running_means_leave_out_nan_and_the_window_is_checked():
    health = TrainingHealthMonitor(smoothing_window=2, plot=False)
    for step, loss in enumerate([4.0, 2.0, math.nan, 1.0], start=1):
        health.monitor.observe(step, loss=loss)
    health._last_step = 4
    assert health._metrics()["health/loss_smooth"] == 1.0  # the last 2 steps, NaN left out
    # An inf loss (a step the scaler skips) is left out too: it hid the smoothed curve for a whole window (a sweep).
    for step, loss in enumerate([math.inf, -math.inf, 3.0], start=5):
        health.monitor.observe(step, loss=loss)
    health._last_step = 7
    assert health._metrics()["health/loss_smooth"] == 3.0
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="smoothing_window"):
            TrainingHealthMonitor(smoothing_window=bad)


def _fp32_grad_norm(module: GPTModule, batch) -> float:
    # The independent reference: the same weights and batch through plain fp32 autograd, the norm in fp64.
    module.zero_grad()
    module.loss(batch).backward()
    norms = [p.grad.double().norm() for p in module.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms)).item()


@pytest.mark.parametrize("fp8_grads", [True, False])
def test_grad_norm_counts_the_gradients_fp8adamw_holds_in_fp8(tmp_path, fp8_grads):
    # fp8_grads=True: FP8AdamW takes the FP8 weights' gradients out of param.grad (held in FP8 with a scale, and
    # carrying mu = 256): the norm must still be the norm of all the true gradients.
    torch.manual_seed(0)
    module = GPTModule()
    reference = _fp32_grad_norm(copy.deepcopy(module), next(iter(loader())))
    health = TrainingHealthMonitor(log_every_n_steps=1, plot=False)
    plugin = FP8LMPrecision(fp8_grads=fp8_grads, grad_scaler={"init_scale": 2.0**8})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _fit(module, tmp_path, [health], precision=None, plugins=[plugin], max_steps=1)
    assert plugin.grad_scaler.get_scale() == 2.0**8
    assert [step for step, _ in health.monitor.series["grad_norm"]] == [1]
    # FP8 forward/backward rounding: a few percent from the fp32 norm (leaving the FP8 weights out: ~3x smaller).
    assert health.monitor.series["grad_norm"][0][1] == pytest.approx(reference, rel=0.05)


class ScalesItsOwnLoss(GPTModule):
    """A user's own FP8AdamW and FP8GradScaler under a precision without FP8 (the model converted by hand); the
    module scales its loss itself."""

    fp8_grads = True

    def configure_optimizers(self):
        self.scaler = FP8GradScaler(init_scale=2.0**10, growth_interval=10**6)
        return FP8AdamW(self.parameters(), lr=1e-2, fp8_grads=self.fp8_grads, grad_scaler=self.scaler)

    def backward(self, loss, *args, **kwargs):
        self.scaler.scale_loss(loss).backward()


@pytest.mark.parametrize("fp8_grads", [True, False])
def test_grad_norm_divides_out_the_mu_of_a_loss_scaled_by_the_users_own_scaler(tmp_path, fp8_grads):
    # Outside FP8LMPrecision the norm took the gradients as they were: 1024x the true norm here.
    torch.manual_seed(0)
    module = ScalesItsOwnLoss()
    module.fp8_grads = fp8_grads
    reference = _fp32_grad_norm(copy.deepcopy(module), next(iter(loader())))
    convert_to_fp8(module)
    health = TrainingHealthMonitor(log_every_n_steps=1, plot=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _fit(module, tmp_path, [health], precision="32-true", max_steps=1)
    assert module.scaler.loss_was_scaled and module.scaler.get_scale() == 2.0**10
    assert health.monitor.series["grad_norm"][0][1] == pytest.approx(reference, rel=0.05)


class SkipsBatches(GPTModule):
    """Returns None (Lightning's documented skip: no backward) for the batches in ``SKIP``."""

    SKIP = (1, 2, 4)

    def training_step(self, batch, batch_idx):
        return None if batch_idx in self.SKIP else super().training_step(batch, batch_idx)


@pytest.mark.parametrize("precision", ["fp8-lm", "32-true"])
def test_a_skipped_batch_records_no_grad_norm(tmp_path, precision):
    # No gradient at all is no norm (not 0.0, which would also enter the spike baseline), as it is no loss.
    health = TrainingHealthMonitor(log_every_n_steps=1, plot=False)
    _fit(SkipsBatches(), tmp_path, [health], precision=precision, max_steps=6)
    series = health.monitor.series
    assert len(series["grad_norm"]) == len(series["loss"]) == 6 - len(SkipsBatches.SKIP)
    assert len(series["param_norm"]) == 6  # the parameters are there all the same
    assert [s for s, _ in series["grad_norm"]] == [s for s, _ in series["loss"]]
    assert all(value > 0 for _, value in series["grad_norm"])
    assert 0.0 not in health.monitor._grad_norms


class _MetricKeys(L.Callback):
    """Records, after each batch (after the monitors, listed before it), which health values callback_metrics hold."""

    def __init__(self) -> None:
        self.keys: list[set[str]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.keys.append({k for k in trainer.callback_metrics if k in ("health/grad_norm", "health/loss")})


def test_a_skipped_batch_leaves_no_previous_grad_norm_in_callback_metrics(tmp_path):
    """Found by a sweep: the row logged for a step without a gradient norm had none, but callback_metrics (what
    EarlyStopping and ModelCheckpoint(monitor=...) read) kept the previous step's value as if it were this one's."""
    keys = _MetricKeys()
    _fit(SkipsBatches(), tmp_path, [TrainingHealthMonitor(log_every_n_steps=1, plot=False), keys], max_steps=6)
    expected = [set() if i in SkipsBatches.SKIP else {"health/grad_norm", "health/loss"} for i in range(6)]
    assert keys.keys == expected


class _ValidatedFaulty(Faulty):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch))

    def val_dataloader(self):
        return loader()


class _GradNorms(L.Callback):
    """Records, after each batch (after the monitors, listed before it), the health/grad_norm callback_metrics hold."""

    def __init__(self) -> None:
        self.values: list[float | None] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        value = trainer.callback_metrics.get("health/grad_norm")
        self.values.append(None if value is None else float(value))


@pytest.mark.parametrize("watcher", ["early_stopping", "model_checkpoint"])
def test_a_step_the_scaler_skips_publishes_its_non_finite_grad_norm_for_the_callbacks_watching_it(tmp_path, watcher):
    """Found by a sweep: a step the scaler skipped (non-finite gradients, routine under FP8) had no health/grad_norm in
    callback_metrics, so EarlyStopping(monitor="health/grad_norm") raised that the metric is not available (and
    ModelCheckpoint did once a validation had run), ending the fit. The step's norm is non-finite, as its health/loss
    is: published as it is, EarlyStopping stops on it as under precision="bf16-mixed" (check_finite) and
    ModelCheckpoint ranks it last; the monitor's series and events still leave it to the scaler's skipped step."""
    from lightning.pytorch.callbacks import EarlyStopping

    health, norms = TrainingHealthMonitor(log_every_n_steps=1, plot=False), _GradNorms()
    if watcher == "early_stopping":
        watching = EarlyStopping(monitor="health/grad_norm", patience=100, check_on_train_epoch_end=True)
        data, limits = loader(), {"limit_train_batches": 4, "max_steps": 8}  # epoch 1 ends on the skipped step 4
    else:
        watching = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="health/grad_norm", every_n_train_steps=1)
        data, limits = loader(), {"val_check_interval": 2, "limit_val_batches": 1, "max_steps": 6}
        limits["enable_checkpointing"] = True  # ModelCheckpoint raises once a validation ran (_ValidatedFaulty)
    module = (Faulty if watcher == "early_stopping" else _ValidatedFaulty)(spike_step=-1, nan_step=3)
    trainer = _fit(module, tmp_path, [health, norms, watching], data=data, **limits)
    assert trainer.precision_plugin.grad_scaler.skipped_steps == 1
    assert math.isnan(norms.values[3]) and all(math.isfinite(v) for i, v in enumerate(norms.values) if i != 3)
    assert 4 not in [step for step, _ in health.monitor.series["grad_norm"]]  # the series leaves the step out
    assert [(e.kind, e.step) for e in health.monitor.events if e.kind == "nonfinite_grad"] == [("nonfinite_grad", 4)]
    if watcher == "early_stopping":
        assert trainer.global_step == 4 and trainer.should_stop  # stopped on the non-finite norm, not on an error


@pytest.mark.parametrize("limits", [{"max_steps": 0}, {"max_steps": 4, "limit_train_batches": 0}])
def test_a_fit_that_steps_nothing_ends_normally_without_a_plot(tmp_path, limits):
    health = TrainingHealthMonitor()  # plot=True
    _fit(GPTModule(), tmp_path, [health], **limits)
    assert health.plot_file is None
    assert not list(tmp_path.rglob("health.png"))


def test_plot_file_is_the_file_written_whatever_plot_path_names(tmp_path):
    """A plot_path without suffix made matplotlib write `health.png` while .plot_file said `health` (no such file); a
    folder made it write `<folder>.png` beside it. Now a name without suffix gets .png, and a folder (an existing one,
    or a path ending in a separator) gets health.png inside it."""
    (tmp_path / "existing").mkdir()
    paths = [tmp_path / "plots" / "health", tmp_path / "existing", f"{tmp_path / 'new'}/", tmp_path / "curves.svg"]
    monitors = [TrainingHealthMonitor(plot_path=path, log_every_n_steps=1) for path in paths]
    _fit(GPTModule(), tmp_path / "run", monitors, max_steps=1)
    expected = [tmp_path / "plots" / "health.png", tmp_path / "existing" / "health.png",
                tmp_path / "new" / "health.png", tmp_path / "curves.svg"]  # fmt: skip
    assert [monitor.plot_file for monitor in monitors] == [str(path) for path in expected]
    assert all(path.stat().st_size > 1000 for path in expected)
    assert not (tmp_path / "existing.png").exists() and not (tmp_path / "plots" / "health").exists()


def test_plot_health_of_an_empty_monitor_writes_an_empty_plot(tmp_path):
    from lightning_fp8 import HealthMonitor
    from lightning_fp8.integrations.lightning.health_plot import plot_health

    path = tmp_path / "sub" / "empty.png"
    assert plot_health(HealthMonitor(), str(path)) == str(path)
    assert path.stat().st_size > 1000


def test_the_plot_leaves_matplotlibs_backend_alone_and_fast_dev_run_writes_none(tmp_path):
    # The plot module switched the whole process to Agg when imported (a notebook lost its inline backend).
    import matplotlib

    matplotlib.use("pdf")
    try:
        health = TrainingHealthMonitor(log_every_n_steps=1)
        _fit(GPTModule(), tmp_path, [health], max_steps=2)
        assert health.plot_file is not None and os.path.getsize(health.plot_file) > 1000
        assert matplotlib.get_backend() == "pdf"
    finally:
        matplotlib.use("Agg")
    quick = TrainingHealthMonitor()
    _fit(GPTModule(), tmp_path / "quick", [quick], fast_dev_run=2, max_steps=-1)
    assert quick.plot_file is None and not list((tmp_path / "quick").rglob("*.png"))
    assert len(quick.monitor.series["loss"]) == 2  # observed all the same


def test_scale_monitor_says_the_fp8_layers_fell_back_not_that_none_were_converted(tmp_path, monkeypatch):
    # After FP8GradScaler(nonfinite_fallback="bf16") put every layer back, it warned that fp8-lm converted none.
    monkeypatch.setattr(lightning_fp8.warnings, "_seen", set())
    plugin = FP8LMPrecision(grad_scaler={"nonfinite_fallback": "bf16", "fallback_after": 2})
    monitor = FP8ScaleMonitor(log_every_n_steps=1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _fit(NaNAt((1, 2)), tmp_path, [monitor], precision=None, plugins=[plugin], max_steps=5)
    assert [e for e in plugin.grad_scaler.history if e["action"] == "fallback"]  # it did run
    texts = [str(w.message) for w in record if "FP8ScaleMonitor" in str(w.message)]
    assert not [text for text in texts if "converted no linear layer" in text], texts
    fell_back = [text for text in texts if "put back to high precision by the gradient scaler's fallback" in text]
    assert len(fell_back) == 1, texts  # once, although steps 4 and 5 logged without FP8 layers too


class RawText(GPTModule):
    """Batches of strings (a dataset of raw text), tokenized in training_step: no tensor in the batch."""

    def training_step(self, batch, batch_idx):
        texts = batch["text"] if isinstance(batch, dict) else batch
        ids = torch.tensor([[ord(c) % self.cfg.vocab_size for c in text] for text in texts])
        return super().training_step((ids[:, :-1], ids[:, 1:]), batch_idx)


def _texts(n: int = 36) -> list[str]:
    return ["".join(chr(65 + (i * 3 + j) % 26) for j in range(25)) for i in range(n)]  # 24 tokens + target


def test_health_monitor_counts_a_batch_of_strings_and_leaves_out_what_it_cannot_count(tmp_path, monkeypatch):
    """A batch without a tensor crashed the fit: Lightning's extract_batch_size raised about self.log. A list of
    strings counts by its length; a batch with no size to count logs no samples/sec, with a warning, and the rest."""
    from torch.utils.data import DataLoader

    health = TrainingHealthMonitor(log_every_n_steps=1, plot=False)
    trainer = _fit(RawText(), tmp_path / "list", [health], max_steps=3, data=DataLoader(_texts(), batch_size=6))
    assert len(health.monitor.series["samples_per_sec"]) == 3 and not health.monitor.series["tokens_per_sec"]
    assert sorted(_column(_rows(trainer), "health/samples_per_sec")) == [1, 2, 3]

    monkeypatch.setattr(lightning_fp8.warnings, "_seen", set())
    health = TrainingHealthMonitor(log_every_n_steps=1, plot=False)
    as_dict = DataLoader(_texts(), batch_size=6, collate_fn=lambda items: {"text": items, "lang": ["en"] * len(items)})
    with pytest.warns(UserWarning, match="cannot count the samples of a dict batch"):
        trainer = _fit(RawText(), tmp_path / "dict", [health], max_steps=3, data=as_dict)
    assert not health.monitor.series["samples_per_sec"] and len(health.monitor.series["loss"]) == 3
    rows = _rows(trainer)
    assert "health/samples_per_sec" not in rows[-1] and len(_column(rows, "health/loss")) == 3


def test_logged_values_are_callback_metrics_that_early_stopping_and_checkpoints_can_monitor(tmp_path):
    """EarlyStopping and ModelCheckpoint(monitor=...) read trainer.callback_metrics: the monitors' keys are there, with
    the values the loggers got (a sweep found them only in the loggers: EarlyStopping raised "not available")."""
    from lightning.pytorch.callbacks import EarlyStopping

    scale, health = FP8ScaleMonitor(), TrainingHealthMonitor(plot=False)
    stop = EarlyStopping(monitor="health/loss_smooth", check_on_train_epoch_end=True, patience=100)
    best = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="fp8/grad_scaler/scale", mode="max")
    trainer = _fit(GPTModule(), tmp_path, [scale, health, stop, best], max_steps=6, enable_checkpointing=True)
    rows, metrics = _rows(trainer), trainer.callback_metrics
    for key in SUMMARY_KEYS + SCALER_KEYS + ALERT_KEYS + HEALTH_KEYS:
        assert key in metrics, key
        assert metrics[key].item() == pytest.approx(_column(rows, key)[6], rel=1e-6, nan_ok=True), key
    assert stop.best_score.item() == pytest.approx(_column(rows, "health/loss_smooth")[6], rel=1e-6)
    assert best.best_model_path and best.best_model_score.item() == _column(rows, "fp8/grad_scaler/scale")[6]


def test_health_callback_metrics_are_this_steps_between_logged_steps(tmp_path):
    """A check between two logged steps (validation every 2 batches, logging every 50) reads the health values of the
    step just taken: the monitor refreshes trainer.callback_metrics at every step, not only when it logs."""
    from lightning.pytorch.callbacks import EarlyStopping

    class WithValidation(GPTModule):
        def validation_step(self, batch, batch_idx):
            return self.loss(batch)

        def val_dataloader(self):
            return loader(n=12)

    health = TrainingHealthMonitor(log_every_n_steps=50, plot=False)
    stop = EarlyStopping(monitor="health/loss", patience=100)
    seen = []

    class Record(Callback):
        def on_validation_end(self, trainer, pl_module):
            seen.append((trainer.global_step, trainer.callback_metrics["health/loss"].item()))

    module = WithValidation()
    _fit(module, tmp_path, [health, stop, Record()], max_steps=6, val_check_interval=2,
         limit_val_batches=1, num_sanity_val_steps=0)  # fmt: skip
    losses = dict(health.monitor.series["loss"])
    assert [step for step, _ in seen] == [2, 4, 6]
    assert all(value == pytest.approx(losses[step]) for step, value in seen), (seen, losses)
