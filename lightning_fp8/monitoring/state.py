"""The checks of a saved :class:`~lightning_fp8.health.HealthMonitor` state, before it is loaded.

``HealthMonitor.state_dict()`` holds plain lists and dicts (it loads with ``torch.load(weights_only=True)``).
:func:`_checked_state` checks every entry of one and converts it back (series points to tuples, events to
:class:`~lightning_fp8.monitoring.events.HealthEvent`) before any is loaded, with errors that name the entry and what
was expected, so that a corrupt checkpoint leaves the monitor as it was.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

from lightning_fp8.monitoring.events import ACTIONS, EVENT_KINDS, SERIES, HealthEvent

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
        negative = next((v for v in out[key] if v < 0), None) if key != "plateau_loss" else None
        if negative is not None:  # gradient norms, which observe() refuses below 0
            raise _state_error(ValueError, f"an entry of {key!r} is {negative}, expected a gradient norm >= 0")
    if len(out["plateau_loss"]) != len(out["plateau_grad"]):  # one entry of each per step: the plateau test pairs them
        raise _state_error(
            ValueError,
            f"'plateau_loss' has {len(out['plateau_loss'])} entries but 'plateau_grad' {len(out['plateau_grad'])}, "
            "expected one of each per step",
        )
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
