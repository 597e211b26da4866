"""When a scaling state has a history: the ``initialized`` flag of :class:`~lightning_fp8.scaling.ScalingState`.

A delayed cast with no history yet uses the tensor's own amax. The first cast whose amax carries information (finite and
> 0) marks the state initialized (:meth:`_FirstCasts.note_cast`); on a GPU that amax is copied to the host without
waiting, and :meth:`_FirstCasts.needs_current_scale` takes it once it arrived (the reads on their way live in
``_SEEN_AMAX``); under ``torch.compile`` the reads are settled at trace time. Apart from :mod:`lightning_fp8.scaling`
because this bookkeeping reads only the flag and two buffers, never casts. :class:`_FirstCasts` is a base of
``ScalingState`` and reads its attributes.
"""

from __future__ import annotations

import math
import weakref

import torch
from torch.utils._python_dispatch import _disable_current_modes

from lightning_fp8.recipe import check_flag
from lightning_fp8.trace_marks import _capturing, _tracing


class _FirstCasts:
    """The ``initialized`` flag and the amax reads that set it (see the module docstring); the attributes
    (``delayed``, ``initialized``, ``marked_by_trace``, the buffers) are ``ScalingState``'s."""

    def needs_current_scale(self) -> bool:
        """True when the next cast must compute its own amax: current scaling, or no history yet."""
        if not self.delayed:
            return True
        if torch.compiler.is_compiling():
            # Traced, the path is baked into the graph and `initialized` becomes a guard: every read still on its
            # way is taken now, at trace time, before dynamo reads any state's flag (tracing the event's query
            # would break the graph at every layer).
            _settle_seen_amaxes()
        elif not self.initialized:
            self._take_seen_amax()
        elif self.marked_by_trace:
            self._check_traced_mark()
        return not self.initialized

    def settle(self) -> bool:
        """:attr:`initialized` once an amax read of :meth:`note_cast` still on its way has arrived (waits for it: for
        a checkpoint, which must save what the next cast will do)."""
        if not self.initialized:
            self._take_seen_amax(wait=True)
        elif self.marked_by_trace:
            self._check_traced_mark()
        return self.initialized

    def _check_traced_mark(self) -> None:
        # Eagerly: a traced forward marked this role (marked_by_trace); until a cast records an amax, the history says
        # nothing and the role is not initialized (a compiled forward whose backward never ran, then eager steps or a
        # checkpoint). Reads the history (a device sync on a GPU), only while the mark stands.
        history = self._buffers["amax_history"]
        if history.is_meta or _tracing(history) or _capturing(history):
            return
        self.marked_by_trace = False
        with _disable_current_modes():  # as _take_seen_amax's read
            if not bool(history.any()):
                self.initialized = False

    def set_initialized(self, flag: bool) -> None:
        """Set :attr:`initialized` from outside the casts (a checkpoint's saved flag): an amax read of
        :meth:`note_cast` still on its way belongs to the casts before and is dropped, not taken by the next cast."""
        check_flag("ScalingState.set_initialized", "flag", flag)  # bool("False") is True
        _SEEN_AMAX.pop(self, None)
        self.initialized = flag

    def _take_seen_amax(self, wait: bool = False) -> None:
        # An earlier cast's amax on its way to the host (note_cast): taken once it arrived, never waited for in a step.
        pending = _SEEN_AMAX.get(self)
        if pending is not None and wait:
            pending[1].synchronize()
        if pending is not None and pending[1].query():
            del _SEEN_AMAX[self]
            with _disable_current_modes():  # a host read: selective checkpointing's recompute would meet it unsaved
                self.initialized = 0.0 < float(pending[0]) < math.inf  # False for NaN

    def note_cast(self, numel: int, by_value: bool = True) -> None:
        """After a cast of ``numel`` elements that this state recorded: mark it :attr:`initialized` when the cast's
        amax (the ``amax`` buffer) is finite and > 0. An amax of 0 (an empty or all-zero tensor: a zero-initialized
        layer's output at step 0) or a non-finite one enters the history as 0 and carries no information: a delayed
        scale from a history of zeros would stay 1, and the next cast must still use its own amax.

        The amax read is the larger of the cast's and the history's (a history that an amax sync filled from other
        ranks counts too). Eagerly on the CPU it is read at once; on a GPU it is copied to the host without waiting,
        and a later :meth:`needs_current_scale` takes it once it arrived (until then the casts keep their own amax,
        which is always right): no device sync, also for a role that sees only zeros for good. Traced by
        ``torch.compile`` or captured in a CUDA graph the value cannot be read: a cast of a non-empty tensor marks
        the state, as the trace decides the next cast's path anyway. ``by_value=False`` keeps that rule eagerly too:
        for casts whose path must be the same on every rank of a group (tensor parallelism, where a cast with its own
        amax is a collective), which a rank's own amax could tell apart."""
        if self.initialized or numel == 0:
            return
        amax = self._buffers["amax"]
        if not by_value or torch.compiler.is_compiling() or amax.is_meta or _tracing(amax) or _capturing(amax):
            self.initialized = True
            if by_value and not torch.compiler.is_compiling() and _tracing(amax):
                # Traced eagerly (make_fx, a FakeTensorMode forward of a real model): what the trace computes never
                # reaches this state's history, so the first cast outside it checks once that a run recorded an amax
                # (_check_traced_mark), instead of scaling by the empty history's 1.
                self.marked_by_trace = True
            return
        with _disable_current_modes():  # bookkeeping: selective checkpointing's modes must not see (or cache) it
            seen = torch.maximum(amax, self._buffers["amax_history"].amax())  # NaN stays NaN
            if seen.device.type != "cuda":
                self.initialized = 0.0 < float(seen) < math.inf
                return
            host = torch.empty((), dtype=torch.float32, device="cpu", pin_memory=True)  # whatever the default device
            host.copy_(seen, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(seen.device))
            _SEEN_AMAX[self] = (host, event)


# ScalingState -> (pinned host copy of an amax, the event after its copy): note_cast's reads on their way (kept off
# the module, which is deep-copied and pickled).
_SEEN_AMAX: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@torch.compiler.assume_constant_result
def _settle_seen_amaxes() -> bool:
    # Called by a traced needs_current_scale: dynamo runs it at trace time instead of tracing it (its result is
    # a constant of the graph), so the first compiled call after eager steps sees the flags those steps' casts set.
    with _disable_current_modes():
        for state in list(_SEEN_AMAX.keys()):
            state.settle()
    return True
