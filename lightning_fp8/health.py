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
import numbers
import operator
import re
import sys
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_fp8.optim.master import master_scale

EVENT_KINDS = ("grad_norm_spike", "loss_plateau", "nonfinite_loss", "nonfinite_grad")
ACTIONS = ("none", "skip_step", "lower_mu", "lower_lr", "fallback_bf16")
# The recovery of a step FP8GradScaler skipped: no update, mu halved.
SKIP_ACTION = "skip_step+lower_mu"
# FP8GradScaler's fallback descriptions -> action names: the phrase that comes first in the description names the
# action (the built-in fallbacks' descriptions begin with it; layer names after it may hold "lr" or "bf16").
_FALLBACK_ACTIONS = re.compile(r"(learning rate|\blr\b)|(high precision|\bbf16\b)")
SERIES = ("loss", "grad_norm", "param_norm", "samples_per_sec", "tokens_per_sec", "memory_gib")


@dataclass(frozen=True, kw_only=True)
class HealthConfig:
    """Thresholds of :class:`HealthMonitor`.

    Args:
        window: steps of recent history the spike test compares against.
        warmup_steps: observations before any spike or plateau alert (early training is noisy by nature).
        spike_zscore: a gradient norm is a spike when it exceeds the window's mean by this many standard
            deviations ...
        spike_ratio: ... and is also this many times the window's mean (a z-score alone fires when the norm
            is nearly constant). While the window's mean is 0 (zero gradient norms only) there is no level to
            compare against, and no norm is a spike.
        spike_patience: spikes in a row after which the gradient norm is taken to have settled at a new level.
            A spike stays out of the baseline; when ``spike_patience`` consecutive observed gradient norms are
            all spikes (each reported), the baseline window is replaced by those values, so the steps after
            them are judged against the new level. A lasting change of level is thus reported on its first
            ``spike_patience`` steps, an isolated spike once (it never enters the baseline). An ordinary
            (non-spike) gradient norm resets the count; steps without a finite gradient norm neither count nor
            reset it.
        plateau_window: steps over which the loss must improve; the halves of the window are compared.
        plateau_min_improvement: relative loss improvement between the halves below which the loss has plateaued.
        plateau_grad_norm_drop: a plateau is only reported if the gradient norm fell by less than this fraction
            between the halves (a falling gradient norm means convergence).
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
        for name, low in minimum.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"HealthConfig({name}={value!r}) must be an int >= {low}")
        for name in ("spike_zscore", "spike_ratio", "plateau_min_improvement", "plateau_grad_norm_drop"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"HealthConfig({name}={value!r}) must be a non-negative number")


@dataclass(frozen=True, kw_only=True)
class HealthEvent:
    """One alert: what happened at which step, the value that triggered it, and the recovery action taken."""

    step: int
    kind: str
    value: float
    message: str
    action: str = "none"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def scaler_fallbacks(history: Iterable[Mapping[str, Any]], after_step: int) -> tuple[list[str], int]:
    """The action names (:data:`ACTIONS`) of the fallbacks an ``FP8GradScaler.history`` records after scaler step
    ``after_step``, and the step of the last one (``after_step`` when there is none): what the integrations add to
    the event of the skipped step that ran them (``"skip_step+lower_mu+lower_lr"``)."""
    actions, last = [], after_step
    for entry in history:
        if entry.get("action") == "fallback" and entry.get("step", 0) > last:
            found = _FALLBACK_ACTIONS.search(str(entry.get("reason", "")).lower())
            actions.append("none" if found is None else "lower_lr" if found.group(1) else "fallback_bf16")
            last = entry["step"]
    return actions, last


def skipped_step_action(fallbacks: Iterable[str]) -> str:
    """The action of a skipped step's event: :data:`SKIP_ACTION` and the fallbacks it ran."""
    return "+".join([SKIP_ACTION, *(a for a in fallbacks if a != "none")])


def _as_step(step: object, caller: str) -> int:
    # Steps are stored as Python ints, so that state_dict() loads with torch.load(weights_only=True) (a NumPy integer
    # would not) and load_state_dict takes it back (a tensor would not).
    try:
        return int(operator.index(step))
    except TypeError:
        raise TypeError(
            f"HealthMonitor.{caller}(step={step!r}): the step must be an integer (a Python or NumPy int, or a 0-dim "
            "integer tensor)"
        ) from None


def _memory_value(value: Any) -> float | None:
    # observe(memory_gib=...) takes a number of GiB or what memory_gib() returns (its "peak" entry).
    if isinstance(value, Mapping):
        if "peak" not in value:
            raise TypeError(
                f"HealthMonitor.observe(memory_gib=...) got a mapping without a 'peak' entry ({sorted(value)}); "
                "pass a number of GiB or the dict memory_gib(device) returns"
            )
        value = value["peak"]
    if value is None:
        return None
    try:
        if isinstance(value, (str, bytes)):  # float("1") would take a string for a number
            raise TypeError
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(
            "HealthMonitor.observe(memory_gib=...) expects a number of GiB or the dict memory_gib(device) returns, "
            f"got {type(value).__name__}"
        ) from None


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
            TypeError: if ``memory_gib`` is neither a number nor a mapping with a ``"peak"`` entry, or ``step`` is not
                an integer (a Python, NumPy or 0-dim tensor integer, stored as a Python int).
        """
        step = _as_step(step, "observe")
        memory_gib = _memory_value(memory_gib)
        self._observations += 1
        events: list[HealthEvent] = []
        values = {"loss": loss, "grad_norm": grad_norm, "param_norm": param_norm, "memory_gib": memory_gib}
        if seconds is not None and seconds > 0:
            values["samples_per_sec"] = None if samples is None else samples / seconds
            values["tokens_per_sec"] = None if tokens is None else tokens / seconds
        values = {k: float(v) for k, v in values.items() if v is not None}
        for name, value in values.items():
            self.series[name].append((step, value))
        for name in ("loss", "grad_norm"):
            if name in values and not math.isfinite(values[name]):
                events.append(self._nonfinite_event(step, name, values[name], "none"))
        grad_ok = "grad_norm" in values and math.isfinite(values["grad_norm"])
        loss_ok = "loss" in values and math.isfinite(values["loss"])
        if grad_ok:
            spike = self._check_spike(step, values["grad_norm"])
            if spike is None:
                self._spike_run.clear()
                self._grad_norms.append(values["grad_norm"])
            else:  # a spike does not enter the baseline it is judged against ...
                events.append(spike)
                self._spike_run.append(values["grad_norm"])
                if len(self._spike_run) >= self.config.spike_patience:
                    # ... unless spike_patience of them in a row: the norm has settled at a new level.
                    self._grad_norms.clear()
                    self._grad_norms.extend(self._spike_run)
                    self._spike_run.clear()
        if grad_ok and loss_ok:
            self._plateau_loss.append(values["loss"])
            self._plateau_grad.append(values["grad_norm"])
            plateau = self._check_plateau(step)
            if plateau is not None:
                events.append(plateau)
        self.events.extend(events)
        return events

    def record_nonfinite(self, step: int, source: str, action: str, value: float = math.nan) -> HealthEvent:
        """Record a non-finite ``source`` (``"loss"`` or ``"grad_norm"``/``"grad"``) and the recovery ``action``.

        Raises:
            ValueError: for an unknown ``action`` (one of ``none``, ``skip_step``, ``lower_mu``, ``lower_lr``,
                ``fallback_bf16``, or several joined by ``+``).
        """
        for part in action.split("+"):
            if part not in ACTIONS:
                raise ValueError(f"record_nonfinite(action={action!r}): each part must be one of {list(ACTIONS)}")
        event = self._nonfinite_event(_as_step(step, "record_nonfinite"), source, float(value), action)
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
        loss_before, loss_after = sum(losses[:half]) / half, sum(losses[half:]) / (n - half)
        grad_before, grad_after = sum(grads[:half]) / half, sum(grads[half:]) / (n - half)
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
                action, a non-finite value in the spike or plateau windows).
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


# The lists of numbers a state dict holds besides its series; observe() only ever puts finite values in them.
_WINDOWS = ("grad_norms", "spike_run", "plateau_loss", "plateau_grad")


def _state_error(kind: type[Exception], what: str) -> Exception:
    return kind(
        f"HealthMonitor.load_state_dict: {what}; load the dict that HealthMonitor.state_dict() returned (the "
        "checkpoint may be corrupt). Nothing was loaded."
    )


def _number(value: Any, where: str, *, integer: bool = False, finite: bool = False) -> float | int:
    """``value`` as a float (an int with ``integer``), or raise naming ``where``."""
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise _state_error(TypeError, f"{where} is {repr(value)[:100]}, expected {'an int' if integer else 'a number'}")
    if finite and not math.isfinite(value):
        raise _state_error(ValueError, f"{where} is {value}, expected a finite number")
    return int(value) if integer else float(value)


def _checked_state(state: Any) -> dict[str, Any]:
    """The entries of a :meth:`HealthMonitor.state_dict`, checked and converted (series points to tuples, events to
    :class:`HealthEvent`); raises as :meth:`HealthMonitor.load_state_dict` documents."""
    if not isinstance(state, Mapping):
        raise _state_error(TypeError, f"got {type(state).__name__}, expected a dict")
    required = ("series", "events", "grad_norms", "plateau_loss", "plateau_grad", "observations")
    missing = [key for key in required if key not in state]  # spike_run is absent from states saved before it
    if missing:
        raise _state_error(KeyError, f"missing entries {missing}")
    out: dict[str, Any] = {"observations": _number(state["observations"], "'observations'", integer=True)}
    if out["observations"] < 0:
        raise _state_error(ValueError, f"'observations' is {out['observations']}, expected an int >= 0")
    series = state["series"]
    if not isinstance(series, Mapping) or not set(series) <= set(SERIES):
        raise _state_error(ValueError, f"'series' is {repr(series)[:100]}, expected a dict with keys from {SERIES}")
    out["series"] = {}
    for name, points in series.items():
        pairs = isinstance(points, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in points)
        if not pairs:
            raise _state_error(TypeError, f"series {name!r} is {repr(points)[:100]}, expected [[step, value], ...]")
        where = f"a point of series {name!r}"  # values may be non-finite: observe() records what it was given
        out["series"][name] = [(_number(s, where, integer=True), _number(v, where)) for s, v in points]
    out["events"] = [_checked_event(i, event) for i, event in enumerate(_as_list(state["events"], "'events'"))]
    for key in _WINDOWS:
        values = _as_list(state.get(key, []), repr(key))
        out[key] = [_number(v, f"an entry of {key!r}", finite=True) for v in values]
    return out


def _as_list(value: Any, where: str) -> list[Any] | tuple[Any, ...]:
    if not isinstance(value, (list, tuple)):
        raise _state_error(TypeError, f"{where} is {repr(value)[:100]}, expected a list")
    return value


def _checked_event(index: int, event: Any) -> HealthEvent:
    where = f"event {index}"
    fields = {"step", "kind", "value", "message", "action"}
    if not isinstance(event, Mapping) or not {"step", "kind", "value", "message"} <= set(event) <= fields:
        raise _state_error(TypeError, f"{where} is {repr(event)[:100]}, expected a dict with keys {sorted(fields)}")
    kind, message, action = event["kind"], event["message"], event.get("action", "none")
    if kind not in EVENT_KINDS:
        raise _state_error(ValueError, f"{where} has kind {kind!r}, expected one of {list(EVENT_KINDS)}")
    if not isinstance(message, str) or not isinstance(action, str) or not set(action.split("+")) <= set(ACTIONS):
        raise _state_error(ValueError, f"{where} has message {message!r} and action {action!r}: expected strings, "
                           f"each part of the action one of {list(ACTIONS)}")  # fmt: skip
    step = _number(event["step"], f"the step of {where}", integer=True)
    value = _number(event["value"], f"the value of {where}")
    return HealthEvent(step=step, kind=kind, value=value, message=message, action=action)


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "full_tensor") and hasattr(t, "placements")


def _unscale_factor(t: torch.Tensor) -> torch.Tensor | None:
    """The scale an O2 master weight's storage carries (FP8AdamW keeps ``weight * scale`` in fp16), else None."""
    scale = master_scale(t)
    if scale is None:
        return None
    return scale.full_tensor() if _is_dtensor(scale) else scale


def global_norm(
    tensors: Iterable[torch.Tensor], group: Any | None = None, sharded: bool = False, device: torch.device | None = None
) -> torch.Tensor:
    """L2 norm over all ``tensors`` as a 0-dim fp32 tensor (inf/NaN if any value is).

    A parameter whose storage is an O2 master of :class:`~lightning_fp8.FP8AdamW` (it holds ``weight * scale``,
    the power-of-two scale attached to the parameter, see :mod:`lightning_fp8.optim.master`) counts with its
    unscaled value ``weight``, so a parameter norm neither reads ~``scale`` times too large nor jumps when the
    scale changes. Gradients carry no such scale and are taken as they are.

    Args:
        tensors: e.g. ``[p.grad for p in model.parameters() if p.grad is not None]`` or ``model.parameters()``.
            DTensors (FSDP2, tensor parallel) are reduced over their mesh by the DTensor norm itself.
        group: the process group plain-tensor shards live in (default: the world), used when ``sharded``.
        sharded: each rank holds a different shard of the plain tensors (FSDP1's flat parameters): sum the squares
            across ranks (a collective on every rank, also one that holds none of them). Replicated tensors (DDP,
            single device) must not be reduced.
        device: where the norm is computed when ``tensors`` is empty (default: the CPU; under ``sharded`` with NCCL,
            the rank's GPU).
    """
    plain, distributed = [], []
    for t in tensors:
        # The scale hangs on the parameter itself: look it up before detach() drops the attribute.
        (distributed if _is_dtensor(t) else plain).append((t.detach(), _unscale_factor(t)))
    if plain or distributed:
        device = (plain or distributed)[0][0].device
    sq = torch.zeros((), dtype=torch.float32, device=device if device is not None else "cpu")
    for t, scale in plain:
        t_sq = t.float().square().sum()
        sq = sq + (t_sq if scale is None else t_sq / scale.float().square().to(t_sq.device)).to(sq.device)
    # Every rank joins the sum, also one without tensors (a rank whose shards of an optimizer's parameters got no
    # gradient): skipping it paired the others' all-reduce with the next collective.
    if sharded and dist.is_available() and dist.is_initialized():
        dist.all_reduce(sq, group=group)
    for t, scale in distributed:
        t_sq = torch.linalg.vector_norm(t.float()).full_tensor().square()
        sq = sq + (t_sq if scale is None else t_sq / scale.float().square().to(t_sq.device)).to(sq.device)
    return sq.sqrt()


def memory_gib(device: torch.device | str) -> dict[str, float]:
    """Memory in GiB: allocated, reserved and peak on a CUDA device; the process's peak RSS on CPU."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        gib = 2.0**30
        return {
            "allocated": torch.cuda.memory_allocated(device) / gib,
            "reserved": torch.cuda.memory_reserved(device) / gib,
            "peak": torch.cuda.max_memory_allocated(device) / gib,
        }
    import resource  # POSIX only; imported here so the core imports everywhere

    # ru_maxrss is in KiB on Linux and bytes on macOS.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return {"peak": peak / 2.0**30}
