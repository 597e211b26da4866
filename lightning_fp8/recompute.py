"""Activation checkpointing of FP8 layers: a recompute casts with the scales its forward used.

torch.utils.checkpoint (use_reentrant=False; Lightning's and FSDP's activation checkpointing) drops what a forward
saved for the backward and runs the forward again inside the backward. A delayed scale has moved since (the forward
recorded its amax), so a plain second forward would cast the input with another scale than the one that produced
the output, and record its statistics twice. Each eager forward that records a graph therefore keeps the scales its
input casts used (:class:`ForwardCall`, held by the graph); a forward that torch.utils.checkpoint runs inside a backward
is such a recompute (a forward of the layer called otherwise inside a backward, in a tensor hook or a custom
autograd.Function's backward, is an ordinary forward: it casts and records as any other):
the recompute of a region repeats the region's forwards of the layer in their order (torch >= 2.8, whose saved-tensor
hooks show the region: micro-batch losses summed into one backward, pipeline schedules, a layer called twice in a
region), and elsewhere, when exactly one forward of the layer is waiting for its backward, it is the one repeated; the
recompute casts with its scales and records nothing (per-block checkpointing with one backward per forward, with
gradient accumulation, nested checkpoints). When several are waiting and no region tells them apart, which one a
recompute repeats is not known from here: it casts with the recomputed input's own amax (current scaling: no
saturation, whatever the delayed scale did meanwhile) and records nothing, and a warning says so once (the gradients
are FP8-accurate, their FP8 bytes may differ from the forward's).
A forward waits for every backward that has not run through it while its graph holds its saved tensors: a second
backward through a graph retained with ``retain_graph=True`` repeats it again, and such a graph makes later recomputes
of the layer ambiguous; a graph whose backward freed it waits for none, even while something still holds it (an
undetached loss kept for logging, autograd's or a compiled region's references until the garbage collector runs). A
forward inside a checkpointed region is recomputed even where it builds no
graph of the layer (a frozen layer with an input that needs no gradient, a forward under no_grad, an output the region
does not use): its call is also kept by the region, while the region's saved tensors live (torch >= 2.8, which shows
the saved-tensor hooks; on older torch such a recompute finds no forward and takes the own-amax path). A
recompute never records: where it finds no forward of the layer waiting, it casts with its own amax and warns too;
so does a reentrant recompute (``use_reentrant=True``), whose forward ran under no_grad and kept nothing. Used by
:class:`~lightning_fp8.FP8Linear` and :class:`~lightning_fp8.FP8MLP`.
"""

from __future__ import annotations

import inspect
import sys
import weakref
from collections.abc import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from lightning_fp8.scaling import ScalingState
from lightning_fp8.warnings import warn_once


class ForwardCall:
    """One eager forward of an FP8 layer that recorded an autograd graph (held by it, as ``ctx.record``) or ran inside a
    checkpointed region (held by the region too: see :data:`_REGION_CALLS`).

    Attributes:
        scale_invs: the ``scale_inv`` of each input cast of the forward, in order.
        currents: whether each input cast of the forward used its tensor's own amax (``current``), in order; a
            recompute's cast does the same (:func:`cast_current`).
        replayed: how many input casts the running recompute has done (:func:`cast_current`, reset by
            :func:`replay_scales`).
        done: the ids of the backward passes (autograd graph tasks) that ran through it.
        node: a weak reference to the autograd node whose backward ran through it (None before): once that backward
            released the node's saved tensors (no ``retain_graph``), no later backward can run through it again.
        repeated: the ids of the backward passes in which a recompute of its checkpointed region repeated it.
    """

    __slots__ = ("scale_invs", "currents", "replayed", "done", "node", "repeated", "__weakref__")

    def __init__(self) -> None:
        self.scale_invs: tuple[torch.Tensor, ...] = ()
        self.currents: list[bool] = []
        self.replayed = 0
        self.done: set[int] = set()
        self.node: weakref.ref | None = None
        self.repeated: set[int] = set()

    def released(self) -> bool:
        """Whether a backward ran through this forward and freed its graph: it waits for no backward any more, even
        while something still holds the node (and through it this call) after its backward."""
        if self.node is None:
            return False
        node = self.node()
        if node is None:
            return True
        try:
            _ = node._raw_saved_tensors  # raises once the backward released them; never unpacks (no recompute)
        except RuntimeError:
            return True
        return False


# Per layer (keyed by its input scaling state): weak references to its ForwardCalls, oldest first; a call is gone once
# its graph is freed.
_CALLS: weakref.WeakKeyDictionary[nn.Module, list[weakref.ref]] = weakref.WeakKeyDictionary()
# The calls of the forwards that ran inside a non-reentrant checkpointed region, keyed by the region's unpack hook: the
# region's saved tensors hold it, so a call lives while the region can still be recomputed, also where nothing of the
# layer's own graph holds it (no graph built, or its output unused in the region: the recompute runs it anyway).
_REGION_CALLS: weakref.WeakKeyDictionary[Callable, list[ForwardCall]] = weakref.WeakKeyDictionary()
# The same calls by the region's torch.utils.checkpoint frame, in the region's forward order, each with its layer's
# input scaling state (weakly): a recompute runs the region's forwards in that order, so the k-th recompute of a layer
# in it repeats the layer's k-th forward there, also where other forwards of the layer wait (the layer twice in the
# region, micro-batch losses summed into one backward, pipeline orders).
_REGION_ORDER: weakref.WeakKeyDictionary[object, list[tuple[weakref.ref, ForwardCall]]] = weakref.WeakKeyDictionary()
# A recompute that cannot be matched to its forward: no kept scales (replay_scales only saves the buffers), its input
# casts use their own amax (cast_current).
_OWN_AMAX = ForwardCall()
# Written by every traced forward of an FP8 layer (forward_call): see there.
_TRACED_FORWARDS = [False]


def forward_call(state: ScalingState) -> tuple[ForwardCall | None, bool]:
    """``(call, replaying)`` for a forward of the layer whose input scaling state is ``state``: a new call to keep
    (``replaying`` False) for an eager forward with grad enabled or inside a checkpointed region that is not a
    recompute (also one inside a backward: a tensor hook's); for a recompute (a forward that torch.utils.checkpoint
    runs again in a backward) the call it repeats (``replaying`` True), or :data:`_OWN_AMAX` where it cannot tell
    (always for a reentrant recompute: its forward kept nothing); ``(None, False)`` under no_grad elsewhere and when
    traced (torch.compile recomputes inside its own graphs)."""
    if torch.compiler.is_compiling():
        # A Python side effect on purpose: dynamo traces a checkpointed region only where its body has none, and
        # traced, the backward's recompute of the input cast would read the delayed scale that the forward has moved
        # since (AOT recomputes from the buffer, not from the value the forward read). So the region runs eagerly,
        # under the rule above; outside regions the store costs one Python assignment after the graph.
        _TRACED_FORWARDS[0] = True
        if getattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint", False):
            _untraced_under_skipped_side_effects()
        return None, False
    region, unpack_hook, frame = _checkpoint_region()
    grad = torch.is_grad_enabled()
    task = torch._C._current_graph_task_id()  # -1 outside a backward; torch.utils.checkpoint's recompute reads it too
    # torch.utils.checkpoint recomputes under enable_grad, but the region may turn grad off (a no_grad forward inside
    # it is recomputed all the same): in a backward, a forward is a recompute where the hooks say so, or where
    # torch.utils.checkpoint is recomputing below it (_recomputing: a nested checkpoint's forward, other saved-tensor
    # hooks on top, torch < 2.8, the reentrant variant). Any other forward in a backward (the layer called in a tensor
    # hook or a custom autograd.Function's backward) is an ordinary one: it casts and records as outside a backward.
    if region == "recompute" or (task != -1 and _recomputing()):
        return _recompute_call(state, task, frame if region == "recompute" else None)
    if not grad and region != "forward":
        return None, False
    call = ForwardCall()
    calls = [c for c in (ref() for ref in _CALLS.get(state, ())) if c is not None]
    _CALLS[state] = [*map(weakref.ref, calls), weakref.ref(call)]
    if region == "forward":
        _REGION_CALLS.setdefault(unpack_hook, []).append(call)
        if frame is not None:
            _REGION_ORDER.setdefault(frame, []).append((weakref.ref(state), call))
    return call, False


@torch._dynamo.disable
def _untraced_under_skipped_side_effects() -> None:
    """A graph break in every traced FP8 forward while dynamo's ``skip_fwd_side_effects_in_bwd_under_checkpoint`` is
    set: that setting lets dynamo trace a checkpointed region past the forward's side effect, whose backward would
    then recompute the casts from moved scales (wrong weight gradients). Broken there, a region runs eagerly."""
    warn_once(
        "torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint is set: FP8 layers break the compiled "
        "graph at each forward (traced inside a checkpointed region, their backward would recompute the casts with "
        "scales the forward has moved since). Unset it to compile them whole; dynamo then runs checkpointed regions "
        "holding FP8 layers eagerly"
    )


def _recompute_call(state: ScalingState, task: int, frame: object | None) -> tuple[ForwardCall | None, bool]:
    if _in_reentrant_recompute():
        warn_once(
            "activation checkpointing with use_reentrant=True: its forward ran under no_grad, so the recompute of an "
            "FP8 layer cannot repeat that forward's casts: it casts with the recomputed input's own amax and records "
            "nothing (the forward recorded). The gradients stay FP8-accurate, but are not bit for bit an unchecked "
            "run's; use_reentrant=False (Lightning's and FSDP's activation checkpointing use it) gives those."
        )
        return _OWN_AMAX, True
    # The recompute of a region repeats the region's forwards in order (frame: the region it recomputes). Without it,
    # selective checkpointing failed where several forwards of a layer waited: the own-amax cast below ran other ops
    # than the forward ("... encountered during backward but not found in storage"), whatever the policy saved.
    for ref, call in _REGION_ORDER.get(frame, ()) if frame is not None else ():
        if ref() is state and task not in call.repeated and task not in call.done:
            call.repeated.add(task)
            return call, True
    calls = [c for c in (ref() for ref in _CALLS.get(state, ())) if c is not None]
    # Forwards this backward has not run through (again, for a retained graph). A graph whose backward released it
    # may still be held a while (by autograd's or a compiled region's references) and is not waiting.
    pending = [c for c in calls if task not in c.done and not c.released()]
    if len(pending) == 1:
        return pending[0], True
    if pending:
        warn_once(
            f"activation checkpointing: {len(pending)} forwards of an FP8 layer wait for their backward (micro-batch "
            "losses summed into one backward, a pipeline schedule, or the layer called twice in one checkpointed "
            "region), so its recompute cannot tell which one it repeats: it casts with the recomputed input's own "
            "amax and records nothing. The gradients stay FP8-accurate, but are not bit for bit an unchecked run's; "
            "one backward per forward is."
        )
    else:
        warn_once(
            "activation checkpointing: an FP8 layer is recomputed but no forward of it is known to wait for this "
            "backward (a forward that built no autograd graph of the layer, under torch < 2.8 or inside other "
            "saved-tensor hooks within the checkpointed region), so the recompute casts with the recomputed input's "
            "own amax and records nothing. The gradients stay FP8-accurate, but are not bit for bit an unchecked run's."
        )
    return _OWN_AMAX, True


def _checkpoint_region() -> tuple[str | None, Callable | None, object | None]:
    # ("forward", its unpack hook, its frame) inside the forward of a non-reentrant torch.utils.checkpoint region,
    # ("recompute", None, the frame it recomputes) inside its recompute, (None, None, None) under other saved-tensor
    # hooks or none, ("unknown", None, None) where torch cannot show its hooks (< 2.8). The frame (torch's
    # _CheckpointFrame, from the hooks' closures) is None where torch's internals moved.
    top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top_hooks is None:
        return "unknown", None, None
    hooks = top_hooks(False)
    if hooks is None:
        return None, None, None
    pack_hook, unpack_hook = hooks
    if getattr(pack_hook, "__module__", None) != "torch.utils.checkpoint":
        return None, None, None
    qualname = getattr(pack_hook, "__qualname__", "")
    if qualname.startswith("_checkpoint_hook."):
        return "forward", unpack_hook, _closure_value(pack_hook, "frame")
    if qualname.startswith("_recomputation_hook."):
        frame_ref = _closure_value(pack_hook, "target_frame_ref")
        return "recompute", None, frame_ref() if isinstance(frame_ref, weakref.ref) else None
    return None, None, None


def _closure_value(fn: Callable, name: str) -> object | None:
    # The value of the free variable ``name`` of the closure ``fn`` (under its decorators: the recompute's pack hook is
    # torch._dynamo.disable'd), or None where it has none of that name.
    fn = inspect.unwrap(fn)
    code, closure = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or closure is None or name not in code.co_freevars:
        return None
    try:
        return closure[code.co_freevars.index(name)].cell_contents
    except ValueError:  # an empty cell
        return None


def _recomputing() -> bool:
    # Inside a backward, where the top saved-tensor hooks are not torch.utils.checkpoint's recompute hooks: whether
    # torch.utils.checkpoint recomputes a region all the same, below this forward. Reentrant: inside its backward node.
    # Non-reentrant: its recompute_fn is on the Python stack (called by the region's unpack hook, on the thread that
    # runs the backward); its hooks are not on top inside a nested checkpoint's forward, under other saved-tensor hooks
    # the region pushed, and on torch < 2.8, which cannot show them. Walks the stack only for forwards in a backward.
    if _in_reentrant_recompute():
        return True
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "recompute_fn" and frame.f_globals.get("__name__") == "torch.utils.checkpoint":
            return True
        frame = frame.f_back
    return False


def _in_reentrant_recompute() -> bool:
    # torch.utils.checkpoint(use_reentrant=True) runs its forward under no_grad (no ForwardCall is kept) and recomputes
    # it inside its own backward node: there is no kept forward to repeat (another graph's would be the wrong one).
    node = torch._C._current_autograd_node()
    return node is not None and type(node).__name__ == "CheckpointFunctionBackward"


def cast_current(flag: bool, call: tuple[ForwardCall | None, bool]) -> bool:
    """The ``current`` argument of an input cast in a forward given ``call`` (from :func:`forward_call`), called once
    per input cast in the forward's order: ``flag`` outside a recompute (kept in the call); in a replay what the
    forward's cast did; in a recompute that cannot be matched True.

    A replay of a cast that used its own amax (the first cast of delayed scaling, current scaling) takes the amax
    again rather than the kept scale: the same input gives the same scale and bytes, and the recompute runs the
    forward's ops in the forward's order, which selective checkpointing (``context_fn``) relies on to hand it the
    outputs the forward saved (with the kept scale instead, a policy saving ``aten.amax`` gave wrong gradients, one
    saving ``aten.mul`` failed inside the cast)."""
    record, replaying = call
    if not replaying:
        if record is not None:
            record.currents.append(flag)
        return flag
    if record is _OWN_AMAX:
        return True
    index, record.replayed = record.replayed, record.replayed + 1
    return record.currents[index] if index < len(record.currents) else False


def backward_ran(call: ForwardCall | None) -> None:
    """Note that the current backward ran through ``call``'s graph (its recompute, if any, is over)."""
    if call is not None:
        call.done.add(torch._C._current_graph_task_id())
        node = torch._C._current_autograd_node()  # the layer's autograd.Function node (ctx), running this backward
        if node is not None and call.node is None:
            call.node = weakref.ref(node)


def replay_scales(call: ForwardCall, states: tuple[ScalingState, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Before the casts of a recompute of ``call``: the first ``len(call.scale_invs)`` of ``states`` (the input
    states, in the order of the forward's casts) take the scales ``call`` used, to be cast with them without current
    scaling (a cast that used its own amax takes it again: :func:`cast_current`). Returns the buffers of every state
    with their values, for :func:`restore_buffers` after the casts: the recompute's FP8 copies are the forward's bytes
    (a weight's current scaling gives them anyway) and no statistics are recorded twice. Eager only (a recompute is
    never traced)."""
    call.replayed = 0  # cast_current's count of this recompute's casts
    with _disable_current_modes():  # the forward made none of these ops: selective checkpointing must not see them
        saved = [(buf, buf.clone()) for state in states for buf in state.cast_buffers()]
        for state, scale_inv in zip(states, call.scale_invs, strict=False):
            state.scale.copy_(scale_inv.reciprocal())
    return saved


def restore_buffers(saved: list[tuple[torch.Tensor, torch.Tensor]] | None) -> None:
    """Put back what :func:`replay_scales` saved (nothing for None: every forward that is not a recompute, compiled
    ones too, which must not enter the mode-disabling context)."""
    if not saved:
        return
    with _disable_current_modes():
        for buf, value in saved:
            buf.copy_(value)
