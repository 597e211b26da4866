"""The checkpoint state of :class:`~lightning_fp8.FP8GradScaler`: its state dict, checked entry by entry, and pickling.

``state_dict()`` holds plain Python values (mu, the counters, the last saturation and the history of actions), so it
loads with ``torch.load(weights_only=True)``. ``load_state_dict()`` checks every entry before it loads any, with
errors that name the entry and what was expected. Pickling (Lightning's spawned processes pickle the precision plugin
and its scaler) leaves out the per-process weak collections of optimizers. :class:`_ScalerState` is a base of the
scaler and reads its attributes.
"""

from __future__ import annotations

import collections
import math
import numbers
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from lightning_fp8.grad_scaling.rules import _rescale_grad_output_states

# Actions kept in `history` (oldest dropped first): enough for monitoring, bounded for long runs.
_HISTORY_LEN = 1000
# Losses kept by `scaled_losses` (values only): the few scaled since a reader's mark, one or two a step.
_SCALED_LOSSES_KEPT = 32
# The state dict entries that count (ints >= 0).
_COUNTERS = ("growth_tracker", "skipped_steps", "nonfinite_events", "consecutive_nonfinite", "steps")
# The entries of torch.amp.GradScaler's state dict (an enabled one) that FP8GradScaler's lacks.
_TORCH_AMP_KEYS = {"scale", "growth_factor", "backoff_factor", "_growth_tracker"}


def _is_power_of_two(x: float) -> bool:
    return x > 0 and math.isfinite(x) and math.frexp(x)[0] == 0.5


class _ScalerState:
    """``state_dict``, ``load_state_dict`` and pickling of the scaler (see the module docstring)."""

    # Pickling (Lightning's spawned processes pickle the precision plugin and its scaler): the weak collections of
    # optimizers are per-process bookkeeping that cannot be pickled; a copy starts with them empty, and every
    # optimizer's non-finite run there starts from the longest one (as after load_state_dict).
    _WEAK = (
        "_owned",
        "_seen",
        "_seen_unbound",
        "_nonfinite_runs",
        "_run_order",
        "_optimizer_index",
        "_unscaled",
        "_unscale_counts",
        "_nonfinite_grad_flags",
    )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in self._WEAK:
            state.pop(name, None)
        state["_last_optimizer"], state["_stepped"] = None, []  # the optimizers are not pickled with the scaler
        runs = self._runs_in_order()
        state["_restored_runs"] = dict(enumerate(runs))
        state["_restored_run"] = 0 if runs else self._longest_nonfinite_run()
        state["_next_serial"] = 0
        state["_scaled_losses"] = collections.deque(maxlen=_SCALED_LOSSES_KEPT)  # tensors of this process's steps
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "model" in state:  # pickled before `model` became a property
            state = {**state, "_model": state["model"], "_model_from_integration": False}
            del state["model"]
        self.__dict__.update(state)
        self.__dict__.setdefault("_restored_run", 0)
        self.__dict__.setdefault("_restored_runs", {})
        self.__dict__.setdefault("_next_serial", 0)
        self.__dict__.setdefault("_scaled_losses", collections.deque(maxlen=_SCALED_LOSSES_KEPT))
        self.__dict__.setdefault("_losses_scaled", 0)
        self._owned = weakref.WeakKeyDictionary()
        self._seen, self._seen_unbound = weakref.WeakSet(), weakref.WeakSet()
        self._nonfinite_runs, self._run_order = weakref.WeakKeyDictionary(), weakref.WeakKeyDictionary()
        self._optimizer_index = weakref.WeakKeyDictionary()
        self._unscaled, self._unscale_counts = weakref.WeakKeyDictionary(), weakref.WeakKeyDictionary()
        self._nonfinite_grad_flags = weakref.WeakKeyDictionary()
        self.__dict__.setdefault("_fp16_full", False)

    def state_dict(self) -> dict[str, Any]:
        """Plain Python values (loads with ``torch.load(weights_only=True)``). ``nonfinite_runs`` are the optimizers'
        runs of consecutive non-finite steps, in the order the optimizers were first stepped: after a load, the first
        optimizer stepped continues the first run, and so on (a training loop steps its optimizers in the same order
        after a resume). ``consecutive_nonfinite`` is the longest of them (a state dict saved without
        ``nonfinite_runs`` starts every optimizer's run there). ``history`` is a tuple: torch.distributed.checkpoint
        keeps it one value (a list of dicts would be flattened into one key per entry, which a fresh scaler's empty
        history cannot take)."""
        runs = self._runs_in_order()
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "skipped_steps": self._skipped_steps,
            "nonfinite_events": self._nonfinite_events,
            "consecutive_nonfinite": max([self._longest_nonfinite_run(), *runs]),
            "nonfinite_runs": runs,
            "steps": self._steps,
            "last_saturation": self._last_saturation,
            "history": tuple(dict(entry) for entry in self._history),
            "fp16_full": self._fp16_full,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved. Every entry is checked before any is loaded: on an error the
        scaler is left as it was.

        Raises:
            KeyError: when an entry is missing (not an FP8GradScaler state dict).
            TypeError: when ``state_dict`` is not a dict, or for an entry of the wrong type (e.g. a counter that is
                not an int).
            ValueError: for an entry out of range (a scale that is not a positive power of two, a negative counter,
                a saturation outside [0, 1]).

        A scale outside this scaler's ``[min_scale, max_scale]`` (saved under other bounds) is brought within them,
        with a warning. The settings (``growth_interval``, the thresholds, the bounds, the fallback) are not saved:
        this scaler's apply, and the loaded ``growth_tracker`` counts toward its ``growth_interval`` (unlike
        ``torch.amp.GradScaler.load_state_dict``, which takes ``growth_interval`` and its factors from the state dict).

        With ``model``, the ``grad_output`` scaling states of its FP8 layers are rescaled from the old mu to the loaded
        one, as for every change of mu, so that the next backward casts with the right scale. The model's FP8 state
        (:func:`~lightning_fp8.load_fp8_state_dict`) loaded from the same checkpoint goes with it in either order:
        loaded after this, it overwrites the rescaled states with the saved ones; loaded before this (with no backward
        between), its states already match the saved mu and are not rescaled (a state that has cast since is). Where
        the saved mu was brought within the bounds, the saved states are rescaled from the saved mu to the loaded one,
        in either order (:mod:`lightning_fp8.load_pairing`).
        """
        scale, counters, saturation, history, runs = self._checked_state(state_dict)
        fp16_full = state_dict.get("fp16_full", False)  # checked by _checked_state; absent: saved before it was
        saved_scale = scale
        if not self.min_scale <= scale <= self.max_scale:  # saved under other bounds: this scaler's apply
            bounded = min(max(scale, self.min_scale), self.max_scale)
            warnings.warn(
                f"FP8GradScaler.load_state_dict: the saved scale {scale} is outside this scaler's [min_scale, "
                f"max_scale] = [{self.min_scale}, {self.max_scale}]; resuming from {bounded}",
                stacklevel=2,
            )
            scale = bounded
        if self.model is not None:  # before any gradient is cast with the new mu (see above)
            _rescale_grad_output_states(self.model, scale / self._scale, loading=True, correction=scale / saved_scale)
        self._scale = scale
        self._loss_scale = None  # a loss scaled before the load no longer tells the gradients' mu
        self._growth_tracker = counters["growth_tracker"]
        self._skipped_steps = counters["skipped_steps"]
        self._nonfinite_events = counters["nonfinite_events"]
        self._nonfinite_runs.clear()
        self._run_order.clear()  # (the integration's order stays: _set_optimizer_order)
        self._next_serial = 0
        # Each optimizer continues its saved run; without them, every optimizer's run starts at the longest.
        self._restored_runs = dict(enumerate(runs)) if runs is not None else {}
        self._restored_run = counters["consecutive_nonfinite"] if runs is None else 0
        # No optimizer counted when saved ([]): the saved run is the reports' own run (updates with no step).
        self._consecutive_nonfinite = counters["consecutive_nonfinite"] if runs == [] else 0
        self._steps = counters["steps"]
        self._last_saturation = saturation
        self._history = collections.deque(history, maxlen=_HISTORY_LEN)
        self._fp16_full = fp16_full

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Raise what :meth:`load_state_dict` would raise for ``state_dict``, changing nothing: so that a load of
        several parts (mu, the FP8 scaling state, ...) checks every part before it loads any."""
        self._checked_state(state_dict)

    def _checked_state(
        self, state_dict: Any
    ) -> tuple[float, dict[str, int], float, list[dict[str, Any]], list[int] | None]:
        """``state_dict``'s scale, counters, saturation, history and runs (``None`` where it has none: saved before
        they were), checked (see :meth:`load_state_dict`)."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"FP8GradScaler.load_state_dict: got {type(state_dict).__name__}, expected the dict that "
                "FP8GradScaler.state_dict() returned (the checkpoint may be corrupt). Nothing was loaded."
            )
        missing = sorted(set(self.state_dict()) - set(state_dict) - {"nonfinite_runs", "fp16_full"})
        if missing and _TORCH_AMP_KEYS <= set(state_dict):
            # A run moving from fp16 AMP to FP8 resumes its checkpoint: torch's scaler has other entries and rules.
            raise KeyError(
                f"FP8GradScaler.load_state_dict: got torch.amp.GradScaler's state dict (scale {state_dict['scale']!r}, "
                f"entries {sorted(state_dict)}), not an FP8GradScaler's: torch's loss scale follows other rules (fp16 "
                "overflows) than mu (FP8 saturation and headroom). Leave it out and let FP8GradScaler start from its "
                "init_scale, or pass a power of two near that scale as FP8GradScaler(init_scale=...). Nothing was "
                "loaded."
            )
        if missing:
            raise KeyError(
                f"FP8GradScaler.load_state_dict: missing entries {missing} (got {sorted(state_dict, key=repr)[:10]}): "
                "load the dict that FP8GradScaler.state_dict() returned (the checkpoint may be corrupt, or this is "
                "another object's state). Nothing was loaded."
            )
        scale = _checked_entry("scale", state_dict["scale"], numbers.Real, "a positive power of two", _is_power_of_two)
        counters = {name: _checked_entry(name, state_dict[name], numbers.Integral, "an int >= 0", lambda n: n >= 0)
                    for name in _COUNTERS}  # fmt: skip
        saturation = _checked_entry("last_saturation", state_dict["last_saturation"], numbers.Real,
                                    "a fraction in [0, 1]", lambda x: 0.0 <= x <= 1.0)  # fmt: skip
        runs = state_dict.get("nonfinite_runs")
        if runs is not None:
            if not isinstance(runs, (list, tuple)):
                raise TypeError(
                    f"FP8GradScaler.load_state_dict: entry 'nonfinite_runs' is {repr(runs)[:200]}, expected a list of "
                    "ints >= 0; load the dict that FP8GradScaler.state_dict() returned (the checkpoint may be "
                    "corrupt). Nothing was loaded."
                )
            runs = [_checked_entry("nonfinite_runs", run, numbers.Integral, "an int >= 0", lambda n: n >= 0)
                    for run in runs]  # fmt: skip
        if not isinstance(state_dict.get("fp16_full", False), bool):
            raise TypeError(
                f"FP8GradScaler.load_state_dict: entry 'fp16_full' is {repr(state_dict['fp16_full'])[:200]}, expected "
                "True or False; load the dict that FP8GradScaler.state_dict() returned (the checkpoint may be "
                "corrupt). Nothing was loaded."
            )
        return scale, counters, saturation, _checked_history(state_dict["history"]), runs


def _checked_entry(name: str, value: Any, kind: type, expected: str, valid: Callable[[Any], bool]) -> Any:
    """``value`` as an int (``kind`` ``numbers.Integral``) or a float (``numbers.Real``) when it is one and
    ``valid``; else a TypeError or ValueError that names the state dict entry ``name``."""
    error = TypeError if isinstance(value, bool) or not isinstance(value, kind) else None
    if error is None:
        try:
            value = int(value) if kind is numbers.Integral else float(value)
        except OverflowError:  # an int beyond fp32's (and float64's) range, e.g. 2**2000
            error = ValueError
        else:
            error = None if valid(value) else ValueError
    if error is not None:
        raise error(
            f"FP8GradScaler.load_state_dict: entry {name!r} is {repr(value)[:200]}, expected {expected}; load the dict "
            "that FP8GradScaler.state_dict() returned (the checkpoint may be corrupt). Nothing was loaded."
        )
    return value


def _checked_history(history: Any) -> list[dict[str, Any]]:
    """The ``history`` entry of a state dict, checked: a list of ``{"step", "action", "reason", "scale"}``."""
    keys = ["action", "reason", "scale", "step"]
    shaped = isinstance(history, (list, tuple)) and all(
        isinstance(e, dict) and sorted(e) == keys and isinstance(e["action"], str) and isinstance(e["reason"], str)
        for e in history
    )
    if not shaped:
        raise TypeError(
            f"FP8GradScaler.load_state_dict: entry 'history' is {repr(history)[:200]}, expected a tuple (or list) of "
            f"dicts with keys {keys} (action and reason strings); load the dict that FP8GradScaler.state_dict() "
            "returned (the checkpoint may be corrupt). Nothing was loaded."
        )
    return [
        {"step": _checked_entry("history step", e["step"], numbers.Integral, "an int >= 0", lambda n: n >= 0),
         "action": e["action"], "reason": e["reason"],
         "scale": _checked_entry("history scale", e["scale"], numbers.Real, "a positive power of two",
                                 _is_power_of_two)}
        for e in history
    ]  # fmt: skip
