"""Pairing the two loads of one checkpoint: the FP8 scaling state and the gradient scaler's mu.

A checkpoint holds the model's FP8 scaling state (:func:`~lightning_fp8.load_fp8_state_dict`) and, beside it, the
:class:`~lightning_fp8.FP8GradScaler` state with the gradient scale mu (``FP8GradScaler.load_state_dict``). The
``grad_output`` scaling states follow mu: when mu changes, the scaler rescales them by the same factor. A scaler load
rescales the live ``grad_output`` states to its mu, except those an FP8 state load filled since their last cast: those
were saved beside that mu and match it already. So that the two loads of one checkpoint work in either order
(Lightning's plugin loads the scaler first, Accelerate the FP8 state), each load records here, per ``grad_output``
state, that it waits for the other, with the state's cast count then: a cast since the load ends the match, as does
mu changing outside a load.

:mod:`lightning_fp8.state` (the FP8 state load) and :mod:`lightning_fp8.grad_scaling.rules` (the scaler's
rescaling) call these functions.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_fp8.scaling import ScalingState

# The grad_output states a checkpoint load filled and not yet matched with the other load of the same checkpoint: by
# which load ("fp8": load_fp8_state_dict, "scaler": FP8GradScaler.load_state_dict) and the state's cast count then.
_PENDING_LOADS: weakref.WeakKeyDictionary[ScalingState, tuple[str, int | None]] = weakref.WeakKeyDictionary()


def _cast_count(state: ScalingState) -> int | None:
    return None if state.casts.is_meta else int(state.casts)


def is_grad_output(name: str) -> bool:
    """Whether the scaling state named ``name`` is a ``grad_output`` one (it scales loss gradients, which carry mu)."""
    return name.endswith("grad_output")


def scaler_load_pending(state: ScalingState) -> bool:
    """Whether a scaler state was loaded since ``state``'s last cast, waiting for an FP8 state load to pair with.

    Asked before an FP8 state load copies its values into ``state`` (the copy changes the cast count)."""
    return _PENDING_LOADS.get(state) == ("scaler", _cast_count(state))


def fp8_state_loaded(state: ScalingState, paired: bool) -> None:
    """An FP8 state load filled ``state`` (a grad_output state). ``paired``: a scaler load was pending for it
    (:func:`scaler_load_pending`, asked before the copy), and the pair is now complete. Otherwise ``state`` matches
    the mu of the scaler state loaded next (if one is, before the next cast)."""
    if paired:
        del _PENDING_LOADS[state]
    else:
        _PENDING_LOADS[state] = ("fp8", _cast_count(state))


def scaler_loaded(state: ScalingState) -> bool:
    """A scaler state was loaded: whether ``state`` (a grad_output state) was filled by an FP8 state load since its
    last cast, and so already matches the loaded mu (it is then not rescaled). Either way the two loads are paired
    now, or this one waits for an FP8 state load to pair with."""
    casts = _cast_count(state)
    if _PENDING_LOADS.get(state) == ("fp8", casts):
        del _PENDING_LOADS[state]
        return True
    _PENDING_LOADS[state] = ("scaler", casts)
    return False


def forget_loads(state: ScalingState) -> None:
    """mu changed and ``state`` was rescaled with it: no earlier load is still to be paired."""
    _PENDING_LOADS.pop(state, None)
