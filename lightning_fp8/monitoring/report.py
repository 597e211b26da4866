"""The ``health/*`` values a :class:`~lightning_fp8.health.HealthMonitor`'s series give a logger: what
``TrainingHealthMonitor`` (Lightning) and the Accelerate integration's ``accelerator.log`` report, under the same
names and with the same meaning.

- ``health/{loss,grad_norm,param_norm,memory_gib}``: the value recorded at the step logged (absent where that step
  had none: a skipped step has no gradient norm, and an earlier step's is not logged as its own);
- ``health/loss_smooth``, ``health/samples_per_sec``, ``health/tokens_per_sec``: running means over the last
  ``smoothing_window`` recorded steps (torchmetrics' ``MeanMetric``), non-finite values left out;
- ``health/events/<kind>``: the count of each kind of event so far.

The running means are taken over the monitor's series, which checkpoints carry: a resumed run continues them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lightning_fp8.health import HealthMonitor

_LAST = ("loss", "grad_norm", "param_norm", "memory_gib")
_RUNNING = (("loss_smooth", "loss"), ("samples_per_sec", "samples_per_sec"), ("tokens_per_sec", "tokens_per_sec"))


def running_mean(points: list[tuple[int, float]], window: int) -> float:
    """Mean of the values of the last ``window`` points, non-finite ones left out (NaN if all are): one inf loss (a
    step the scaler skips) must not hide the curve for a whole window. Computed by torchmetrics' ``MeanMetric`` in
    float64 over the window's values in one update (imported here: ``import lightning_fp8`` does not load
    torchmetrics)."""
    from torchmetrics.aggregation import MeanMetric

    values = torch.tensor([value for _, value in points[-window:]], dtype=torch.float64)
    metric = MeanMetric(nan_strategy="ignore", sync_on_compute=False).set_dtype(torch.float64)
    metric.update(torch.where(torch.isfinite(values), values, math.nan))
    return float(metric.compute())


def health_log_values(monitor: HealthMonitor, step: int, smoothing_window: int) -> dict[str, float]:
    """The ``health/*`` values of ``monitor`` at ``step`` (the names in the module docstring)."""
    values: dict[str, float] = {}
    for name in _LAST:
        points = monitor.series[name]
        if points and points[-1][0] == step:
            values[f"health/{name}"] = points[-1][1]
    for name, source in _RUNNING:
        points = monitor.series[source]
        if points:
            values[f"health/{name}"] = running_mean(points, smoothing_window)
    for kind, count in monitor.summary()["events"].items():
        values[f"health/events/{kind}"] = float(count)
    return values
