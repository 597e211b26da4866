"""FP8CommState.state_dict / load_state_dict: the native path's extra headroom, grown after FP8 sums that overflowed,
used to be lost on resume (the resumed run overflowed, and skipped steps, until it had grown back)."""

from __future__ import annotations

import io

import pytest
import torch

from lightning_fp8.distributed import FP8CommState
from lightning_fp8.distributed.comm import cast_stats
from lightning_fp8.distributed.comm_state import MAX_EXTRA_HEADROOM

CPU = torch.device("cpu")


def _native_step(state: FP8CommState, overflowed: bool) -> None:
    """What the DDP hook does with one native FP8 sum: take the headroom, then record the sum's statistics (a finite
    amax with a non-finite sum is an overflow of the sum, which grows the headroom)."""
    state.extra_headroom(CPU)
    amax = torch.rand(3) + 0.5
    stats = cast_stats(amax, torch.zeros((), dtype=torch.int64), 100, found=torch.tensor(overflowed))
    state.record(stats, native_overflow=True)
    state.check_step()


def _round_trip(state_dict: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


OVERFLOWS = [True, False, True, True, False, False, True, False]


def test_a_resumed_state_continues_the_uninterrupted_one():
    whole = FP8CommState()
    for overflowed in OVERFLOWS:
        _native_step(whole, overflowed)

    first = FP8CommState()
    for overflowed in OVERFLOWS[:5]:
        _native_step(first, overflowed)
    saved = _round_trip(first.state_dict())
    assert saved == {"extra_headroom": 3, "reductions": 5}
    resumed = FP8CommState()  # a fresh process: no native sum yet, the headroom not on any device
    resumed.load_state_dict(saved)
    for overflowed in OVERFLOWS[5:]:
        _native_step(resumed, overflowed)

    assert resumed.state_dict() == whole.state_dict() == {"extra_headroom": 4, "reductions": 8}
    assert torch.equal(resumed.extra_headroom(CPU), whole.extra_headroom(CPU))


def test_a_fresh_state_saves_zero_and_loads_into_a_used_one():
    assert FP8CommState().state_dict() == {"extra_headroom": 0, "reductions": 0}
    used = FP8CommState()
    _native_step(used, True)
    headroom = used.extra_headroom(CPU)
    used.load_state_dict({"extra_headroom": 2, "reductions": 7})
    assert used.extra_headroom(CPU) is headroom and int(headroom) == 2  # the same tensor, which the hooks hold
    used.load_state_dict(FP8CommState().state_dict())
    assert int(used.extra_headroom(CPU)) == 0 and used.reductions == 0


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        ([("extra_headroom", 1)], TypeError, "got a list, not a dict"),
        ({"extra_headroom": 1}, KeyError, r"missing entries \['reductions'\]"),
        ({"extra_headroom": 1, "reductions": 2, "scale": 1.0}, KeyError, r"unknown entries \['scale'\]"),
        ({"extra_headroom": 1.0, "reductions": 2}, TypeError, "'extra_headroom' is 1.0, not an int"),
        ({"extra_headroom": True, "reductions": 2}, TypeError, "'extra_headroom' is True, not an int"),
        ({"extra_headroom": torch.tensor(1), "reductions": 2}, TypeError, "'extra_headroom' is tensor"),
        ({"extra_headroom": MAX_EXTRA_HEADROOM + 1, "reductions": 2}, ValueError, "expected an int from 0 to 8"),
        ({"extra_headroom": -1, "reductions": 2}, ValueError, "'extra_headroom' is -1"),
        ({"extra_headroom": 1, "reductions": -2}, ValueError, "'reductions' is -2, expected an int >= 0"),
    ],
)
def test_a_corrupt_state_dict_is_refused_and_changes_nothing(bad, error, match):
    state = FP8CommState()
    _native_step(state, True)
    before = state.state_dict()
    with pytest.raises(error, match=match) as info:
        state.load_state_dict(bad)
    assert "Nothing was loaded" in str(info.value)
    with pytest.raises(error, match=match):
        state.check_state_dict(bad)
    assert state.state_dict() == before
