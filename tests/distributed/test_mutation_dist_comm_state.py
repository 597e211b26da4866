"""What FP8CommState keeps from collective to collective, against its docstrings, in one process (``record`` is what
every hook calls with a collective's statistics; no process group is needed for it or for ``check_step``):

- the step flag is the OR of every collective's since the last ``check_step`` ("True when every gradient reduced
  since the last call was finite"): a finite bucket after a non-finite one must not clear it;
- the native path's ``extra_headroom`` grows by one binade per collective whose FP8 *sum* overflowed (the flag set
  while the shared amax is finite), not when a gradient itself was non-finite (more headroom cannot help there), and
  stays within ``0 .. MAX_EXTRA_HEADROOM``;
- a buffer is cut into slices of about ``slice_numel`` elements.

A mutation audit of the distributed layer found all four unpinned (a flag overwritten by the last bucket, headroom
grown on a NaN gradient, headroom growing without bound, and a state that never sliced passed the suite).
"""

import math

import torch

from lightning_fp8.distributed import FP8CommState
from lightning_fp8.distributed.comm import cast_stats
from lightning_fp8.distributed.comm_state_checks import MAX_EXTRA_HEADROOM


def _stats(amax: float, found: bool | None = None):
    """A collective's statistics: its shared amax and (native path) whether its FP8 sum overflowed."""
    flag = None if found is None else torch.tensor(found)
    return cast_stats(torch.tensor([amax]), torch.zeros((), dtype=torch.int64), 16, flag)


def test_a_finite_bucket_after_a_non_finite_one_keeps_the_step_flag():
    state = FP8CommState()
    state.record(_stats(math.inf))  # the first bucket held an inf on some rank
    state.record(_stats(3.0))  # a later bucket was finite
    assert bool(state.found_nonfinite)
    assert state.check_step() is False
    assert state.check_step() is True  # cleared by the call


def test_native_headroom_grows_only_after_sums_that_overflowed_and_is_bounded():
    state = FP8CommState()
    state.extra_headroom(torch.device("cpu"))  # what the native path does before its first sum
    state.record(_stats(math.nan), native_overflow=True)  # a NaN gradient: the flag, but no overflow of the sum
    assert state.state_dict()["extra_headroom"] == 0
    state.record(_stats(2.0, found=False), native_overflow=True)  # a finite sum
    assert state.state_dict()["extra_headroom"] == 0
    for i in range(MAX_EXTRA_HEADROOM + 3):  # finite gradients whose FP8 sum overflowed, again and again
        state.record(_stats(2.0, found=True), native_overflow=True)
        assert state.state_dict()["extra_headroom"] == min(i + 1, MAX_EXTRA_HEADROOM)


def test_buffers_are_pipelined_in_slices_of_about_slice_numel_elements():
    # The docstring: "a buffer is pipelined in slices of about this many elements ... The default, 2**28, cuts 1B
    # elements into 4 slices". A state that never sliced passed the suite (the results differ only in rounding).
    assert FP8CommState().slices(10**9) == 4
    state = FP8CommState(slice_numel=100)
    assert [state.slices(n) for n in (0, 10, 149, 151, 1000)] == [1, 1, 1, 2, 10]
