"""Pairing the two loads of one checkpoint: the FP8 scaling state and the gradient scaler's mu.

A checkpoint holds the model's FP8 scaling state (:func:`~lightning_fp8.load_fp8_state_dict`) and, beside it, the
:class:`~lightning_fp8.FP8GradScaler` state with the gradient scale mu (``FP8GradScaler.load_state_dict``). The
``grad_output`` scaling states follow mu: when mu changes, the scaler rescales them by the same factor. A scaler load
rescales the live ``grad_output`` states to its mu, except those an FP8 state load filled since their last cast: those
were saved beside that mu and match it already. So that the two loads of one checkpoint work in either order
(Lightning's plugin loads the scaler first, Accelerate the FP8 state), each load records here, per ``grad_output``
state, that it waits for the other, with the state's cast count then: a cast since the load ends the match, as does
mu changing outside a load.

The scaler may resume from another mu than the saved one (a saved mu outside its ``[min_scale, max_scale]`` is brought
within them): the states saved beside the saved mu are then rescaled, once, by the correction ``loaded mu / saved mu``,
as for every change of mu. A scaler load passes the correction; the FP8 state load that completes the pair, or the
scaler load itself when the FP8 state load came first, applies it (1 when mu was loaded as saved: nothing changes).

Only an FP8 state load that fills a state's ``scale`` and ``amax_history`` (what its next casts use) gives it the saved
mu's values; one that fills neither or only one of them (``strict=False``: counters alone, say) ends any pairing of
that state (:func:`forget_loads`). A completed pair stays pending as a scaler load until the next cast, so that loading
the FP8 state again takes the same correction.

:mod:`lightning_fp8.state` (the FP8 state load) and :mod:`lightning_fp8.grad_scaling.rules` (the scaler's
rescaling) call these functions.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_fp8.scaling import ScalingState

# The grad_output states a checkpoint load filled and not yet matched with the other load of the same checkpoint: by
# which load ("fp8": load_fp8_state_dict, "scaler": FP8GradScaler.load_state_dict), the state's cast count then, and
# (a scaler load's) the correction loaded mu / saved mu that the states saved beside the saved mu still need.
_PENDING_LOADS: weakref.WeakKeyDictionary[ScalingState, tuple[str, int | None, float]] = weakref.WeakKeyDictionary()


def _cast_count(state: ScalingState) -> int | None:
    return None if state.casts.is_meta else int(state.casts)


def is_grad_output(name: str) -> bool:
    """Whether the scaling state named ``name`` is a ``grad_output`` one (it scales loss gradients, which carry mu)."""
    return name.endswith("grad_output")


def scaler_load_pending(state: ScalingState) -> float | None:
    """The correction (loaded mu / saved mu) of a scaler state loaded since ``state``'s last cast, waiting for an FP8
    state load to pair with; ``None`` when none is.

    Asked before an FP8 state load copies its values into ``state`` (the copy changes the cast count); the load
    rescales the values it copied by the correction (when not 1)."""
    pending = _PENDING_LOADS.get(state)
    if pending is not None and pending[:2] == ("scaler", _cast_count(state)):
        return pending[2]
    return None


def fp8_state_loaded(state: ScalingState, correction: float | None) -> None:
    """An FP8 state load filled ``state`` (a grad_output state: its scale and amax history). ``correction``: that of
    the scaler load pending for it (:func:`scaler_load_pending`, asked before the copy), the pair now complete; None
    where none was, and ``state`` matches the saved mu of the scaler state loaded next (if one is, before the next
    cast). A completed pair stays as a scaler load pending: another FP8 state load of the same checkpoint before the
    next cast takes the same correction."""
    if correction is not None:
        _PENDING_LOADS[state] = ("scaler", _cast_count(state), correction)
    else:
        _PENDING_LOADS[state] = ("fp8", _cast_count(state), 1.0)


def scaler_loaded(state: ScalingState, ratio: float, correction: float) -> float:
    """A scaler state was loaded, changing mu by ``ratio`` (loaded mu / mu before the load); ``correction`` is the
    loaded mu / the saved mu. The factor to rescale ``state`` (a grad_output state) by now: ``correction`` when an FP8
    state load filled it since its last cast (it holds the values saved beside the saved mu), else ``ratio`` (it holds
    the live values, of the mu before the load). Either way the two loads are paired now, or this one waits for an
    FP8 state load to pair with (which applies ``correction`` to the values it copies)."""
    casts = _cast_count(state)
    pending = _PENDING_LOADS.get(state)
    if pending is not None and pending[:2] == ("fp8", casts):
        _PENDING_LOADS[state] = ("scaler", casts, correction)  # paired; another FP8 load next takes the correction
        return correction
    _PENDING_LOADS[state] = ("scaler", casts, correction)
    return ratio


def forget_loads(state: ScalingState) -> None:
    """mu changed and ``state`` was rescaled with it, or an FP8 state load filled only some of the buffers a change of
    mu rescales: no earlier load is still to be paired."""
    _PENDING_LOADS.pop(state, None)


# The states load_fp8_state_dict filled, with their cast count then: a load of their layer's weight before their next
# cast (the same checkpoint's weights, loaded second) keeps what was loaded (weight_marks.start_fresh_for_new_weight).
_FILLED: weakref.WeakKeyDictionary[ScalingState, int] = weakref.WeakKeyDictionary()


def fp8_state_filled(state: ScalingState) -> None:
    """An FP8 state load filled some of ``state``'s buffers (any role)."""
    casts = _cast_count(state)
    if casts is not None:
        _FILLED[state] = casts


def loaded_since_last_cast(state: ScalingState) -> bool:
    """Whether a checkpoint load (an FP8 state load; for a grad_output state also a scaler load) filled or rescaled
    ``state`` since its last cast (and since it was last reset)."""
    casts = _cast_count(state)
    pending = _PENDING_LOADS.get(state)
    return casts is not None and (_FILLED.get(state) == casts or pending is not None and pending[1] == casts)


def forget_state(state: ScalingState) -> None:
    """``state`` was reset (its cast count back to 0): no load before is still to be paired or kept (the count
    could climb back to a recorded one)."""
    _PENDING_LOADS.pop(state, None)
    _FILLED.pop(state, None)
