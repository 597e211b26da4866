"""The thresholds of :class:`~lightning_fp8.health.HealthMonitor`: when a gradient norm is a spike and a loss a
plateau, and how long the monitor waits before it judges either.

A frozen, keyword-only dataclass, checked when it is built, so that a monitor never runs on a threshold it cannot use.
"""

from __future__ import annotations

import math
import numbers
import sys
from dataclasses import dataclass

from lightning_fp8.recipe import ArgumentTypeError, as_count


class MonitorArgumentTypeError(ArgumentTypeError):
    """A monitor argument of the wrong type: a ``TypeError``, and a ``ValueError`` as the monitors raised for every bad
    argument before (callers may catch either). A value of the right type out of range raises ``ValueError``."""


@dataclass(frozen=True, kw_only=True)
class HealthConfig:
    """Thresholds of :class:`HealthMonitor`.

    Args:
        window: steps of recent history the spike test compares against.
        warmup_steps: observations before any spike or plateau alert (early training is noisy by nature).
        spike_zscore: a gradient norm is a spike when it exceeds the window's mean by this many standard
            deviations (a finite number >= 0) ...
        spike_ratio: ... and is also this many times the window's mean (a z-score alone fires when the norm
            is nearly constant; a finite number >= 1). While the window's mean is 0 (zero gradient norms only) there
            is no level to compare against, and no norm is a spike.
        spike_patience: spikes in a row after which the gradient norm is taken to have settled at a new level.
            A spike stays out of the baseline; when ``spike_patience`` consecutive observed gradient norms are
            all spikes (each reported), the baseline window is replaced by those values, so the steps after
            them are judged against the new level. A lasting change of level is thus reported on its first
            ``spike_patience`` steps, an isolated spike once (it never enters the baseline). An ordinary
            (non-spike) gradient norm resets the count; steps without a finite gradient norm neither count nor
            reset it.
        plateau_window: steps over which the loss must improve; the halves of the window are compared (their
            medians: one bad batch does not flatten a falling loss). A step with a gradient-norm spike is left out.
        plateau_min_improvement: relative loss improvement between the halves below which the loss has plateaued
            (a fraction in [0, 1): 0.01 is 1%).
        plateau_grad_norm_drop: a plateau is only reported if the gradient norm fell by less than this fraction
            between the halves (a falling gradient norm means convergence; a fraction in [0, 1]).

    Raises:
        ValueError: for a value out of its range; :class:`MonitorArgumentTypeError` (a ``TypeError`` and a
            ``ValueError``) for a value of another type: a bool, a string, a count that is not an integer (a Python or
            NumPy int).
    """

    window: int = 50
    warmup_steps: int = 20
    spike_zscore: float = 6.0
    spike_ratio: float = 3.0
    spike_patience: int = 5
    plateau_window: int = 200
    plateau_min_improvement: float = 0.01
    plateau_grad_norm_drop: float = 0.1

    def __post_init__(self) -> None:
        minimum = {"window": 2, "warmup_steps": 0, "plateau_window": 2, "spike_patience": 1}
        # The windows are the lengths of the monitor's deques, which hold at most sys.maxsize entries.
        maximum = {"window": sys.maxsize, "plateau_window": sys.maxsize}
        for name, low in minimum.items():
            value = as_count(getattr(self, name))  # a NumPy integer (a config read with NumPy) as an int
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                count = isinstance(value, int) and not isinstance(value, bool)
                error = ValueError if count else MonitorArgumentTypeError
                raise error(f"HealthConfig({name}={value!r}) must be an int >= {low} (a Python or NumPy integer)")
            if value > maximum.get(name, value):
                raise ValueError(f"HealthConfig({name}={value!r}) must be an int from {low} to sys.maxsize (a window)")
            object.__setattr__(self, name, value)
        # (low, high, high_included) of each threshold: a value outside its range cannot do what the field says.
        ranges = {
            "spike_zscore": (0.0, math.inf, False),
            # A spike is already above the window's mean (spike_zscore >= 0): a ratio below 1 would test nothing.
            "spike_ratio": (1.0, math.inf, False),
            # A relative improvement of a positive loss is at most 1 (the loss fell to 0): a threshold of 1 or more
            # would report every window as a plateau.
            "plateau_min_improvement": (0.0, 1.0, False),
            # A fraction of a gradient norm (never negative): it cannot fall by more than all of it.
            "plateau_grad_norm_drop": (0.0, 1.0, True),
        }
        for name, (low, high, high_included) in ranges.items():
            value = getattr(self, name)
            number = not isinstance(value, bool) and isinstance(value, numbers.Real)
            if not number or not (low <= value < high or (high_included and value == high)):
                allowed = f"in [{low:g}, {high:g}{']' if high_included else ')'}" if high < math.inf else f">= {low:g}"
                raise (ValueError if number else MonitorArgumentTypeError)(
                    f"HealthConfig({name}={value!r}) must be a finite number {allowed} (see HealthConfig's docstring "
                    "for what it means)"
                )
            object.__setattr__(self, name, float(value))
