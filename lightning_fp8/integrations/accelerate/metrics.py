"""Flat ``{name: number}`` FP8 and health statistics for ``accelerator.log``.

The names are those the Lightning callbacks (``FP8ScaleMonitor``, ``TrainingHealthMonitor``) log. The values come
from :func:`lightning_fp8.fp8_stats` (scales, amaxes, saturation per role; optimizer-state scales; mu) and
:class:`lightning_fp8.health.HealthMonitor` (the ``health/*`` values ``TrainingHealthMonitor`` logs:
:mod:`lightning_fp8.monitoring.report`):

=====================================  ==========================================================================
``fp8/<role>/<stat>``                  role ``input``/``weight``/``grad_output``; stat ``scale_min``,
                                       ``scale_max``, ``amax_max``, ``saturation_max``, ``saturation_mean``,
                                       ``nonfinite_count`` (over all FP8 layers)
``fp8/layers/<layer>/<role>/<stat>``   per layer (``scale``, ``amax``, ``saturation``), only with ``layers=True``
``fp8/optimizer/<key>/min|max``        scales of the FP8AdamW states (``exp_avg_scale``...) over all parameters
``fp8/grad_scaler/<stat>``             ``scale`` (mu), ``skipped_steps``, ``last_saturation``,
                                       ``nonfinite_events``
``health/<series>``                    ``loss``, ``grad_norm`` (unscaled, before any clipping), ``param_norm``
                                       (before the step), ``memory_gib`` (peak) of the last optimizer step (a key
                                       is absent where that step had none; a skipped step logs its non-finite
                                       ``grad_norm``); ``loss_smooth``, ``samples_per_sec``,
                                       ``tokens_per_sec``: running means over 20 steps (this process's work: the
                                       training forwards of the first prepared model that runs one,
                                       :mod:`.step_work`)
``health/events/<kind>``               counts of ``grad_norm_spike``, ``loss_plateau``, ``nonfinite_loss``,
                                       ``nonfinite_grad``
``fp8/alerts/scale_{drops,rises}``     layers whose scale moved 16x or more since the previous log (from step
                                       100 on; :mod:`lightning_fp8.monitoring.scale_jumps`), each kept in
                                       ``accelerator.fp8_scale_jumps.alerts`` (several models: layers named
                                       ``model<i>.<layer>``)
=====================================  ==========================================================================
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from typing_extensions import override

from lightning_fp8.monitoring.report import health_log_values
from lightning_fp8.monitoring.scale_jumps import ScaleJumps
from lightning_fp8.recipe import check_flag
from lightning_fp8.stats import fp8_stats

# The steps of the running means (health/loss_smooth, health/*_per_sec): TrainingHealthMonitor's default.
SMOOTHING_WINDOW = 20


def new_scale_jumps(settings_of: ScaleJumps | None = None) -> ScaleJumps:
    """The accelerator's scale-jump alerts: with FP8ScaleMonitor's defaults (16x, none before step 100), or the
    settings of ``settings_of`` (``free_memory``: a new training keeps the settings, not the alerts)."""
    factor, after = (16.0, 100) if settings_of is None else (settings_of.jump_factor, settings_of.alert_after_steps)
    return ScaleJumps(factor, after, "accelerator.fp8_scale_jumps", "accelerator.fp8_scale_jumps.alerts")


_LAYER_STATS = ("scale", "amax", "saturation")


def _number(value: Any) -> float | int | None:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    return None


def fp8_log_values(
    models: list[nn.Module],
    optimizer: torch.optim.Optimizer | None = None,
    grad_scaler: Any | None = None,
    health: Any | None = None,
    layers: bool = False,
    health_step: int | None = None,
    scale_jumps: ScaleJumps | None = None,
    record_jumps: bool = False,
) -> dict[str, float | int]:
    """The statistics above for ``models`` (one model: no prefix; several: ``fp8/model<i>/...``); the ``health/*``
    values of :func:`lightning_fp8.monitoring.report.health_log_values` at ``health_step`` (the last optimizer step:
    a skipped step's gradient norm is not in the health series, which ``LoggingMixin`` adds, and the one of an
    earlier step is not logged as its own);
    ``fp8/alerts/*`` counts the scale jumps since the last log (``record_jumps``: this is a log, whose scales the
    next one compares against)."""
    values: dict[str, float | int] = {}
    scales: dict[str, Any] = {}  # every model's layers, for the scale-jump alerts
    mu = None
    for i, model in enumerate(models):
        prefix = "fp8" if len(models) == 1 else f"fp8/model{i}"
        stats = fp8_stats(model, optimizer if i == 0 else None, grad_scaler if i == 0 else None)
        scales.update({(name if len(models) == 1 else f"model{i}.{name}"): r for name, r in stats["layers"].items()})
        mu = stats.get("grad_scaler", {}).get("scale", mu)
        for role, summary in stats["summary"].items():
            values.update({f"{prefix}/{role}/{k}": v for k, v in summary.items()})
        if layers:
            for layer, roles in stats["layers"].items():
                for role, entry in roles.items():
                    values.update({f"{prefix}/layers/{layer}/{role}/{k}": entry[k] for k in _LAYER_STATS})
        for key, minmax in stats.get("optimizer", {}).get("summary", {}).items():
            values.update({f"{prefix}/optimizer/{key}/{k}": v for k, v in minmax.items()})
        for key, value in stats.get("grad_scaler", {}).items():
            if _number(value) is not None:
                values[f"{prefix}/grad_scaler/{key}"] = _number(value)
    if scale_jumps is not None:  # as FP8ScaleMonitor: at the number of steps taken, the jumps since the last log
        jumps = scale_jumps.flag(scales, (health_step or 0) + 1, mu, record=record_jumps)
        for i in range(len(models)):  # each model's under its prefix, as its other statistics
            prefix, named = ("fp8", "") if len(models) == 1 else (f"fp8/model{i}", f"model{i}.")
            new = [kind for layer, kind in jumps if layer.startswith(named)]
            values.update({f"{prefix}/alerts/scale_drops": new.count("drop"), f"{prefix}/alerts/scale_rises":
                           new.count("rise")})  # fmt: skip
    if health is not None:
        values.update(health_log_values(health, health_step, SMOOTHING_WINDOW))
    return values


class LoggingMixin:
    """``accelerator.log`` with the FP8 statistics: a base class of :class:`~lightning_fp8.accelerate.Accelerator`
    (it uses the accelerator's FP8 attributes); not usable on its own."""

    def fp8_log_values(self, layers: bool = False) -> dict[str, float | int]:
        """The FP8 and health statistics as flat ``{name: number}`` (names in :mod:`.metrics`); ``{}`` when off. A
        look at the values: the scale jumps counted are those since the last log, which this call does not move."""
        check_flag("accelerator.fp8_log_values", "layers", layers)
        return self._fp8_values(layers, record_jumps=False)

    def _fp8_values(self, layers: bool, record_jumps: bool) -> dict[str, float | int]:
        if self.fp8_lm_config is None or not self._fp8_models:
            return {}
        inner = self._fp8_optimizer.optimizer if self._fp8_optimizer is not None else None
        values = fp8_log_values(
            self._fp8_models, inner, self.fp8_grad_scaler, self.fp8_health, layers=layers,
            health_step=self._fp8_steps - 1, scale_jumps=self.fp8_scale_jumps, record_jumps=record_jumps,
        )  # fmt: skip
        skipped = self._fp8_skipped_grad_norm
        if skipped is not None and skipped[0] == self._fp8_steps - 1:
            # The last step was skipped: its non-finite norm, left out of the health series, is still its value (as
            # TrainingHealthMonitor logs it: a tracker or a check watching health/grad_norm finds this step's).
            values["health/grad_norm"] = skipped[1]
        return values

    def log_fp8_stats(self, step: int | None = None, layers: bool = False) -> dict[str, float | int]:
        """Log the FP8 and health statistics to the trackers (main process) and return them.

        Args:
            step: the step to log at (as ``accelerator.log``).
            layers: also log per-layer scales, amaxes and saturation (many values for a large model).

        Raises:
            TypeError: for a ``layers`` that is not a bool.
        """
        check_flag("accelerator.log_fp8_stats", "layers", layers)  # a truthy "no" would log every layer
        values = self._fp8_values(layers, record_jumps=True)
        if values:
            super().log(values, step=step)
        return values

    @override
    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None) -> None:
        if self.fp8_stats_in_log and self.is_main_process:  # a value the script passes under a statistic's name wins
            values = {**self._fp8_values(False, record_jumps=True), **values}
        super().log(values, step=step, log_kwargs=log_kwargs)
