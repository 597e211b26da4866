"""Routes to the monitoring callbacks: the same training reached another way logs the same values.

Here: callback objects reused by a second Trainer (a new training from step 0) against fresh ones, and a second fit of
the same Trainer, which continues the first.
"""

import csv

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_fp8.callbacks import FP8ScaleMonitor, TrainingHealthMonitor
from lightning_fp8.health import HealthConfig
from tests.integrations.lightning.gpt_tiny import GPTModule, loader

STEPS = 4
WINDOW = 3  # smoothing_window: shorter than a fit, so the running mean of a second fit reaches past its start
# The callback's running mean (float64 of the logged fp32 losses) against the mean of the module's own losses.
LOSS_SMOOTH_RTOL = 1e-6


def _callbacks() -> list:
    # Scales move by 2x in the tiny GPT's first steps: jump_factor=2 alerts on them, from the first comparison.
    return [
        FP8ScaleMonitor(log_every_n_steps=1, jump_factor=2, alert_after_steps=0),
        TrainingHealthMonitor(HealthConfig(warmup_steps=0), log_every_n_steps=1, smoothing_window=WINDOW, plot=False),
    ]


def _trainer(tmp_path, callbacks, max_steps=STEPS) -> L.Trainer:
    return L.Trainer(
        precision="fp8-lm",
        accelerator="cpu",
        max_steps=max_steps,
        log_every_n_steps=1,
        callbacks=callbacks,
        logger=CSVLogger(tmp_path),
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )


def _column(trainer: L.Trainer, key: str) -> dict[int, float]:
    with open(f"{trainer.logger.log_dir}/metrics.csv") as f:
        return {int(r["step"]): float(r[key]) for r in csv.DictReader(f) if r.get(key) not in (None, "")}


def _fit(tmp_path, callbacks, seed) -> tuple[L.Trainer, GPTModule]:
    torch.manual_seed(seed)
    module = GPTModule()
    trainer = _trainer(tmp_path, callbacks)
    trainer.fit(module, loader())
    return trainer, module


def test_callbacks_reused_by_a_new_trainer_log_what_fresh_callbacks_log(tmp_path):
    """A second Trainer (step 0, no checkpoint) given the callbacks of an earlier fit continued that fit's series and
    scale comparisons: its running loss mixed the two trainings' losses, its first scales were compared against the
    other model's last ones. A new training starts afresh, as with new callback objects."""
    reused = _callbacks()
    _fit(tmp_path / "first", reused, seed=1)
    trainer, module = _fit(tmp_path / "second", reused, seed=0)
    fresh = _callbacks()
    fresh_trainer, _ = _fit(tmp_path / "fresh", fresh, seed=0)

    losses = module.losses  # the independent reference: this training's own losses
    smooth = _column(trainer, "health/loss_smooth")
    expected = {step: sum(losses[max(0, step - WINDOW) : step]) / min(step, WINDOW) for step in range(1, STEPS + 1)}
    assert smooth == pytest.approx(expected, rel=LOSS_SMOOTH_RTOL)
    health = reused[1].monitor
    assert [step for step, _ in health.series["loss"]] == list(range(1, STEPS + 1))
    assert health.series["loss"] == fresh[1].monitor.series["loss"]
    assert [e.to_dict() for e in health.events] == [e.to_dict() for e in fresh[1].monitor.events]
    assert reused[0].alerts == fresh[0].alerts
    for key in ("fp8/alerts/scale_drops", "fp8/alerts/scale_rises", "health/events/grad_norm_spike"):
        assert _column(trainer, key) == _column(fresh_trainer, key), key


def test_a_second_fit_of_the_same_trainer_continues_the_first(tmp_path):
    torch.manual_seed(0)
    module, callbacks = GPTModule(), _callbacks()
    trainer = _trainer(tmp_path, callbacks)
    trainer.fit(module, loader())
    trainer.fit_loop.epoch_loop.max_steps = 2 * STEPS
    trainer.fit(module, loader())

    health = callbacks[1].monitor
    assert [step for step, _ in health.series["loss"]] == list(range(1, 2 * STEPS + 1))
    # The running mean of step STEPS + 1 spans both fits: one training.
    window = module.losses[STEPS + 1 - WINDOW : STEPS + 1]
    assert _column(trainer, "health/loss_smooth")[STEPS + 1] == pytest.approx(
        sum(window) / WINDOW, rel=LOSS_SMOOTH_RTOL
    )
