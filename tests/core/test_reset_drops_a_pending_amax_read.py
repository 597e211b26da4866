"""``ScalingState.reset()`` forgets every cast, also an amax read still on its way to the host (on a GPU the first
cast's amax is copied without waiting and taken by a later cast: lightning_fp8/first_casts.py). Kept, the read would
mark the fresh state initialized at its next cast, which would then scale by its empty history (scale 1) instead of
its own amax and saturate. Faked here with a read that has arrived (the CPU has no asynchronous copy)."""

import math

import torch

from lightning_fp8 import E4M3, ScalingState
from lightning_fp8.first_casts import _SEEN_AMAX


class _Arrived:
    """A CUDA event stand-in whose copy has completed."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def test_reset_drops_a_pending_amax_read():
    state = ScalingState(E4M3, 4, 0, "max", True)
    _SEEN_AMAX[state] = (torch.tensor(3.0), _Arrived())  # a cast's amax of 3.0 on its way
    state.reset()
    assert not state.settle() and state not in _SEEN_AMAX
    x = torch.full((4, 8), 768.0)  # 1.5 * 2**9: exact in E4M3 at the scale below
    x_fp8, _, scale_inv = state.quantize(x)
    # The cast used its own amax: the power-of-two scale of 448 / 768 (float64), nothing saturated.
    assert state.scale.item() == 2.0 ** math.floor(math.log2(448 / 768)) and state.saturation.item() == 0.0
    assert torch.equal(x_fp8.float() * scale_inv, x)


def test_set_initialized_drops_a_pending_read_too():
    state = ScalingState(E4M3, 4, 0, "max", True)
    _SEEN_AMAX[state] = (torch.tensor(3.0), _Arrived())
    state.set_initialized(False)
    assert not state.settle() and state.needs_current_scale()
