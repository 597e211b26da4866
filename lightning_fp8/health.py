"""HealthMonitor: training-health statistics and alerts, independent of any trainer.

FP8 training fails in a few recognisable ways (DESIGN.md "Monitoring and health"):

- a *gradient-norm spike*: one step's gradient norm far above its recent level (instability, a bad batch, an
  overflowing scale). A spike is kept out of the baseline it is judged against, so an isolated spike does not
  mask the next one; but ``spike_patience`` spikes in a row are a new level, not a spike: they become the
  baseline, so a lasting change of level is reported for at most ``spike_patience`` steps;
- a *plateau*: the loss stops falling while the gradient norm does not fall either (learning has saturated,
  often because updates underflow); a loss that flattens while the gradient norm falls is convergence, not
  a plateau;
- *non-finite* losses or gradients, and the recovery action taken (skip the step, lower mu, lower the learning
  rate, put a module back to bf16).

The monitor keeps the series it is given (loss, gradient norm, parameter norm, throughput, memory) and returns
:class:`HealthEvent` objects as they happen. It never changes training: integrations decide what to do.

Example:
    >>> monitor = HealthMonitor(HealthConfig(window=8, warmup_steps=4))
    >>> for step in range(10):
    ...     events = monitor.observe(step, loss=2.0 - 0.1 * step, grad_norm=1.0 + 0.01 * step)
    >>> monitor.observe(10, loss=1.0, grad_norm=50.0)[0].kind
    'grad_norm_spike'
"""

from __future__ import annotations

import math
import operator
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from lightning_fp8.monitoring.config import HealthConfig, MonitorArgumentTypeError
from lightning_fp8.monitoring.events import (
    ACTIONS,
    EVENT_KINDS,
    SERIES,
    SKIP_ACTION,
    HealthEvent,
    scaler_fallbacks,
    skipped_step_action,
)
from lightning_fp8.monitoring.measures import global_norm, memory_gib
from lightning_fp8.monitoring.state import _checked_state

# What record_nonfinite records: a loss (a "nonfinite_loss" event) or a gradient ("nonfinite_grad").
_NONFINITE_SOURCES = ("loss", "grad", "grad_norm")

# The public API, documented with this module (docs/api/stats.md); the parts live in lightning_fp8.monitoring.
__all__ = [
    "ACTIONS",
    "EVENT_KINDS",
    "SERIES",
    "SKIP_ACTION",
    "HealthConfig",
    "HealthEvent",
    "HealthMonitor",
    "global_norm",
    "memory_gib",
    "scaler_fallbacks",
    "skipped_step_action",
]


def _as_step(step: object, caller: str) -> int:
    # Steps are stored as Python ints, so that state_dict() loads with torch.load(weights_only=True) (a NumPy integer
    # would not) and load_state_dict takes it back (a tensor would not).
    try:
        if isinstance(step, bool):  # operator.index(True) is 1
            raise TypeError
        return int(operator.index(step))
    except TypeError:
        raise TypeError(
            f"HealthMonitor.{caller}(step={step!r}): the step must be an integer (a Python or NumPy int, or a 0-dim "
            "integer tensor)"
        ) from None


def _as_value(value: Any, name: str, expected: str, caller: str = "observe") -> float | None:
    """``value`` as a float (``None`` stays ``None``), or a TypeError naming ``observe(name=...)``: a number, a NumPy
    number or a one-element tensor converts; a string does not (``float("1")`` would take it for a number), nor a
    bool."""
    if value is None:
        return None
    try:
        if isinstance(value, (str, bytes, bool)):
            raise TypeError
        return float(value)
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of several values
        raise TypeError(
            f"HealthMonitor.{caller}({name}={repr(value)[:100]}) expects {expected}, got {type(value).__name__}"
        ) from None


_NUMBER = "a number (a Python or NumPy number, or a one-element tensor) or None"


def _memory_value(value: Any) -> float | None:
    # observe(memory_gib=...) takes a number of GiB or what memory_gib() returns (its "peak" entry).
    if isinstance(value, Mapping):
        if "peak" not in value:
            raise TypeError(
                f"HealthMonitor.observe(memory_gib=...) got a mapping without a 'peak' entry ({sorted(value)}); "
                "pass a number of GiB or the dict memory_gib(device) returns"
            )
        value = value["peak"]
    return _as_value(value, "memory_gib", "a number of GiB or the dict memory_gib(device) returns")


def _checked_observation(given: dict[str, Any], memory_gib: Any) -> tuple[dict[str, float | None], float | None]:
    """observe's ``given`` values and ``memory_gib`` as floats (or ``None``), checked before anything is recorded."""
    converted = {name: _as_value(value, name, _NUMBER) for name, value in given.items()}
    memory_gib = _memory_value(memory_gib)
    for name in ("samples", "tokens", "seconds"):  # work and time: a negative or non-finite one is a mistake
        if converted[name] is not None and not 0 <= converted[name] < math.inf:
            raise ValueError(
                f"HealthMonitor.observe({name}={given[name]!r}) must be a finite number >= 0 (work done and "
                "wall time since the previous observation); nothing was recorded"
            )
    if memory_gib is not None and not 0 <= memory_gib < math.inf:  # an amount of memory: a mistake otherwise
        raise ValueError(
            f"HealthMonitor.observe(memory_gib={memory_gib!r}) must be a finite number of GiB >= 0; nothing was "
            "recorded"
        )
    for name in ("grad_norm", "param_norm"):  # a norm is never negative (inf and NaN are non-finite events)
        if converted[name] is not None and converted[name] < 0:
            raise ValueError(
                f"HealthMonitor.observe({name}={given[name]!r}) must be >= 0 (a norm); nothing was recorded"
            )
    return converted, memory_gib


def _mean_std(values: Iterable[float]) -> tuple[float, float]:
    vals = list(values)
    mean = sum(vals) / len(vals)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))


class HealthMonitor:
    """Tracks training-health series and reports spikes, plateaus and non-finite events.

    Call :meth:`observe` once per optimizer step with whatever is known; call :meth:`record_nonfinite` when a
    non-finite loss or gradient was seen and something was done about it.

    Attributes:
        series: ``{name: [(step, value), ...]}`` for ``loss``, ``grad_norm``, ``param_norm``,
            ``samples_per_sec``, ``tokens_per_sec``, ``memory_gib``: what a plot of the run needs.
        events: every :class:`HealthEvent` so far, in order.
    """

    def __init__(self, config: HealthConfig | None = None) -> None:
        if config is not None and not isinstance(config, HealthConfig):
            raise TypeError(f"HealthMonitor(config=...) expects a HealthConfig, got {type(config).__name__}")
        self.config = config or HealthConfig()
        self.series: dict[str, list[tuple[int, float]]] = {name: [] for name in SERIES}
        self.events: list[HealthEvent] = []
        self._grad_norms: deque[float] = deque(maxlen=self.config.window)
        # The current run of consecutive spikes (kept out of _grad_norms until it reaches spike_patience).
        self._spike_run: list[float] = []
        self._plateau_loss: deque[float] = deque(maxlen=self.config.plateau_window)
        self._plateau_grad: deque[float] = deque(maxlen=self.config.plateau_window)
        self._observations = 0

    def observe(
        self,
        step: int,
        *,
        loss: float | None = None,
        grad_norm: float | None = None,
        param_norm: float | None = None,
        samples: int | None = None,
        tokens: int | None = None,
        seconds: float | None = None,
        memory_gib: float | Mapping[str, float] | None = None,
    ) -> list[HealthEvent]:
        """Record one step's values; returns the events this step raised (also appended to :attr:`events`).

        Args:
            step: the global step.
            loss, grad_norm, param_norm: this step's values (Python numbers or 0-dim tensors).
            samples, tokens, seconds: work done and wall time since the previous observation; give ``seconds``
                with either count to record throughput.
            memory_gib: memory (GiB): a number, or the dict :func:`memory_gib` returns, of which the ``"peak"``
                entry is recorded (present on CPU and CUDA).

        Raises:
            TypeError: if a value is not a number (a string, a bool; ``None`` leaves it out), ``memory_gib`` is
                neither a number nor a mapping with a ``"peak"`` entry, or ``step`` is not an integer (a Python, NumPy
                or 0-dim tensor integer, stored as a Python int). Nothing is recorded then.
            ValueError: if ``samples``, ``tokens``, ``seconds`` or ``memory_gib`` is negative or not finite, or a norm
                is negative.
                Nothing is recorded then. (``seconds=0`` records no throughput: there is no rate to compute.)
        """
        step = _as_step(step, "observe")
        given = {"loss": loss, "grad_norm": grad_norm, "param_norm": param_norm, "samples": samples, "tokens": tokens,
                 "seconds": seconds}  # fmt: skip
        converted, memory_gib = _checked_observation(given, memory_gib)
        self._observations += 1
        events: list[HealthEvent] = []
        values = self._record_series(step, converted, memory_gib)
        for name in ("loss", "grad_norm"):
            if name in values and not math.isfinite(values[name]):
                events.append(self._nonfinite_event(step, name, values[name], "none"))
        grad_ok = "grad_norm" in values and math.isfinite(values["grad_norm"])
        loss_ok = "loss" in values and math.isfinite(values["loss"])
        spike = self._judge_grad_norm(step, values["grad_norm"]) if grad_ok else None
        if spike is not None:
            events.append(spike)
        if grad_ok and loss_ok and spike is None:  # a spike's step (a bad batch) stays out of the plateau test too
            self._plateau_loss.append(values["loss"])
            self._plateau_grad.append(values["grad_norm"])
            plateau = self._check_plateau(step)
            if plateau is not None:
                events.append(plateau)
        self.events.extend(events)
        return events

    def _record_series(
        self, step: int, converted: dict[str, float | None], memory_gib: float | None
    ) -> dict[str, float]:
        """Append the given values, and the throughput where ``seconds`` allows it, to :attr:`series`; return them."""
        values = {name: converted[name] for name in ("loss", "grad_norm", "param_norm")}
        values["memory_gib"] = memory_gib
        seconds, samples, tokens = converted["seconds"], converted["samples"], converted["tokens"]
        if seconds is not None and seconds > 0:
            values["samples_per_sec"] = None if samples is None else samples / seconds
            values["tokens_per_sec"] = None if tokens is None else tokens / seconds
        values = {k: v for k, v in values.items() if v is not None}
        for name, value in values.items():
            self.series[name].append((step, value))
        return values

    def _judge_grad_norm(self, step: int, grad_norm: float) -> HealthEvent | None:
        """The spike event of a finite ``grad_norm``, if it is one; updates the baseline spikes are judged against."""
        spike = self._check_spike(step, grad_norm)
        if spike is None:
            self._spike_run.clear()
            self._grad_norms.append(grad_norm)
        else:  # a spike does not enter the baseline it is judged against ...
            self._spike_run.append(grad_norm)
            if len(self._spike_run) >= self.config.spike_patience:
                # ... unless spike_patience of them in a row: the norm has settled at a new level.
                self._grad_norms.clear()
                self._grad_norms.extend(self._spike_run)
                self._spike_run.clear()
        return spike

    def record_nonfinite(self, step: int, source: str, action: str, value: float = math.nan) -> HealthEvent:
        """Record a non-finite ``source`` (``"loss"`` or ``"grad_norm"``/``"grad"``) and the recovery ``action``.

        Args:
            step: the global step.
            source: ``"loss"`` (a ``nonfinite_loss`` event), or ``"grad"`` / ``"grad_norm"`` (``nonfinite_grad``).
            action: what was done about it (``"none"`` for nothing).
            value: the value seen: inf, -inf or NaN (NaN, the default, when it is not known).

        Raises:
            ValueError: for an unknown ``source`` or ``action`` (one of ``none``, ``skip_step``, ``lower_mu``,
                ``lower_lr``, ``fallback_bf16``, or several of the others joined by ``+``), or a finite ``value``;
                :class:`MonitorArgumentTypeError` (a ``TypeError`` and a ``ValueError``) for a ``source`` or an
                ``action`` that is not a string.
        """
        if source not in _NONFINITE_SOURCES:
            error = ValueError if isinstance(source, str) else MonitorArgumentTypeError
            raise error(f"record_nonfinite(source={source!r}): must be one of {list(_NONFINITE_SOURCES)}")
        if not isinstance(action, str):
            raise MonitorArgumentTypeError(
                f"record_nonfinite(action={action!r}): pass a string, e.g. 'skip_step' or 'lower_mu'"
            )
        parts = action.split("+")
        for part in parts:
            if part not in ACTIONS:
                raise ValueError(f"record_nonfinite(action={action!r}): each part must be one of {list(ACTIONS)}")
        if "none" in parts and len(parts) > 1:  # "none+skip_step" says both that nothing and something was done
            raise ValueError(
                f"record_nonfinite(action={action!r}): 'none' (nothing was done) cannot be joined with other actions; "
                "pass 'none' alone, or the actions taken"
            )
        value = _as_value(value, "value", "a number", "record_nonfinite")  # the value seen (NaN when unknown)
        if value is None:
            raise TypeError("HealthMonitor.record_nonfinite(value=None): pass the value seen, or leave it out (NaN)")
        if math.isfinite(value):  # the event would read "non-finite loss (1.5)"
            raise ValueError(
                f"HealthMonitor.record_nonfinite(value={value!r}) is finite: it records a non-finite {source}; pass "
                "the inf or NaN seen, or leave value out (NaN: not known). A finite loss or gradient norm goes to "
                "observe()"
            )
        event = self._nonfinite_event(_as_step(step, "record_nonfinite"), source, value, action)
        self.events.append(event)
        return event

    def _nonfinite_event(self, step: int, source: str, value: float, action: str) -> HealthEvent:
        kind = "nonfinite_loss" if source == "loss" else "nonfinite_grad"
        return HealthEvent(
            step=step, kind=kind, value=value, action=action, message=f"step {step}: non-finite {source} ({value})"
        )

    def _check_spike(self, step: int, value: float) -> HealthEvent | None:
        cfg = self.config
        if self._observations <= cfg.warmup_steps or len(self._grad_norms) < 2:
            return None
        mean, std = _mean_std(self._grad_norms)
        if mean <= 0:
            # Only zero norms so far (no gradient reached the parameters): no level to compare against. The norm
            # enters the baseline, and later ones are judged against it.
            return None
        if value > mean + cfg.spike_zscore * std and value > cfg.spike_ratio * mean:
            return HealthEvent(
                step=step,
                kind="grad_norm_spike",
                value=value,
                message=(
                    f"step {step}: gradient norm {value:.4g} is {value / mean:.1f}x its recent mean "
                    f"{mean:.4g} (std {std:.3g}): instability or a bad batch"
                ),
            )
        return None

    def _check_plateau(self, step: int) -> HealthEvent | None:
        cfg = self.config
        n = len(self._plateau_loss)
        if self._observations <= cfg.warmup_steps or n < cfg.plateau_window:
            return None
        half = n // 2
        losses, grads = list(self._plateau_loss), list(self._plateau_grad)
        # Medians: one bad batch (a loss outlier without a gradient-norm spike) does not make a falling loss look flat.
        loss_before, loss_after = statistics.median(losses[:half]), statistics.median(losses[half:])
        grad_before, grad_after = statistics.median(grads[:half]), statistics.median(grads[half:])
        improvement = (loss_before - loss_after) / max(abs(loss_before), 1e-12)
        grad_drop = (grad_before - grad_after) / max(abs(grad_before), 1e-12)
        if improvement >= cfg.plateau_min_improvement or grad_drop >= cfg.plateau_grad_norm_drop:
            return None
        # One alert per window: start collecting afresh.
        self._plateau_loss.clear()
        self._plateau_grad.clear()
        return HealthEvent(
            step=step,
            kind="loss_plateau",
            value=loss_after,
            message=(
                f"step {step}: loss improved {improvement:.2%} over the last {n} steps while the gradient norm "
                f"changed {-grad_drop:+.2%}: learning may have saturated (updates underflowing?)"
                if improvement >= 0
                else f"step {step}: loss rose {-improvement:.2%} over the last {n} steps while the gradient norm "
                f"changed {-grad_drop:+.2%}: not learning (diverging? lower the learning rate)"
            ),
        )

    def summary(self) -> dict[str, Any]:
        """Event counts by kind, the last value of each series, and the recovery actions taken."""
        counts = {kind: sum(e.kind == kind for e in self.events) for kind in EVENT_KINDS}
        last = {name: points[-1][1] for name, points in self.series.items() if points}
        actions = [e.action for e in self.events if e.action != "none"]
        return {"events": counts, "last": last, "actions": actions}

    def state_dict(self) -> dict[str, Any]:
        """Plain lists and dicts (loads with ``torch.load(weights_only=True)``)."""
        return {
            "series": {k: [list(p) for p in v] for k, v in self.series.items()},
            "events": [e.to_dict() for e in self.events],
            "grad_norms": list(self._grad_norms),
            "spike_run": list(self._spike_run),
            "plateau_loss": list(self._plateau_loss),
            "plateau_grad": list(self._plateau_grad),
            "observations": self._observations,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved. Every entry is checked before any is loaded: on an error the
        monitor is left as it was.

        Raises:
            KeyError: when an entry is missing (not a HealthMonitor state dict).
            TypeError: when ``state`` is not a dict, or an entry has the wrong type (a series point that is not a
                ``(step, value)`` pair of numbers, an event that is not a dict of :class:`HealthEvent`'s fields).
            ValueError: for an entry out of range (a negative observation count, an unknown series, event kind or
                action, a non-finite value in the spike or plateau windows, a negative gradient norm there).
        """
        checked = _checked_state(state)
        self.series = {name: [] for name in SERIES}
        self.series.update(checked["series"])
        self.events = checked["events"]
        self._grad_norms.clear()
        self._grad_norms.extend(checked["grad_norms"])
        self._spike_run = checked["spike_run"]
        self._plateau_loss.clear()
        self._plateau_loss.extend(checked["plateau_loss"])
        self._plateau_grad.clear()
        self._plateau_grad.extend(checked["plateau_grad"])
        self._observations = checked["observations"]

    def check_state_dict(self, state: dict[str, Any]) -> None:
        """Raise what :meth:`load_state_dict` would raise for ``state``, changing nothing: so that a load of several
        parts (the FP8 scaling state, mu, this history) checks every part before it loads any."""
        _checked_state(state)
