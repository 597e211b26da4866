"""What torch.compile's traces of FP8 layers mark, and the trace-time checks that read it.

A traced forward cannot change Python state at run time, so a layer's grad_output role is marked initialized when its
forward is traced (:func:`note_traced_mark`), before the backward that will record its first amax has run.
:func:`backward_cast_pending` tells a trace whether such a mark stands with no amax recorded yet, in which case the
graph casts those output gradients with their own amax (``matmul.current_flags``; docs/concepts/formats.md, "the
compiled first-step rule"). :func:`_tracing` and :func:`_capturing` tell whether a tensor's value cannot be read.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import _disable_current_modes

from lightning_fp8.kernels.reference import traced as _tracing

# Every live ScalingState, for backward_cast_pending; and the trace (torch._guards.TracingContext) that last marked a
# grad_output role (note_traced_mark), weakly.
_STATES: weakref.WeakSet = weakref.WeakSet()
_MARKING_TRACE: list = [None]


def _current_trace() -> object | None:
    from torch._guards import TracingContext

    return TracingContext.try_get()


@torch.compiler.assume_constant_result
def note_traced_mark() -> bool:
    """Called by a traced forward that marks a grad_output role initialized (matmul.note_casts): dynamo runs it at trace
    time instead of tracing it, and it remembers that trace."""
    trace = _current_trace()
    _MARKING_TRACE[0] = None if trace is None else weakref.ref(trace)
    return True


@torch.compiler.assume_constant_result
def backward_cast_pending() -> bool:
    """Run at trace time (dynamo runs it instead of tracing it, and it installs no guard): whether a traced forward
    marked a grad_output role initialized before any backward cast of it, in this trace itself (its mark is only in
    the trace yet) or in a graph that ran (``marked_by_trace``) with no amax recorded since (an empty history). Such
    graphs cast the output gradients of the marked roles with their own amax (matmul.current_flags), and keep it when
    called again."""
    marking = _MARKING_TRACE[0]
    if marking is not None and marking() is not None and marking() is _current_trace():
        return True
    pending = False
    with _disable_current_modes():
        for state in list(_STATES):
            if not state.marked_by_trace or state.casts.is_meta or _tracing(state.casts):
                continue
            # Pending also after casts of all-zero gradients (amax 0), which initialize nothing eagerly either. A mark
            # whose cast recorded an amax is cleared here, before the trace reads any flag (current_flags calls this
            # first), so that a restarted analysis of the frame (after a graph break) reads what the first one read.
            if bool(state.amax_history.any()):
                state.marked_by_trace = False
            else:
                pending = True
    return pending


def _capturing(t: torch.Tensor) -> bool:
    # Inside CUDA graph capture no value can be read (nor a copy to the host waited for).
    return t.is_cuda and torch.cuda.is_current_stream_capturing()
