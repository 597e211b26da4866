"""Amax synchronization: every rank casts activations and activation gradients with the same scales.

With delayed scaling a cast uses the scale computed from the amax history of earlier casts, and each rank records
the amax of *its* data. Left alone, ranks drift apart: different scales on different ranks (results depend on the
rank layout, and one rank can saturate alone), and in tensor/sequence parallelism an FP8 tensor gathered from
several ranks would mix scales. So once per step the amax histories of every delayed scaling state (the
``input`` and ``grad_output`` roles of each :class:`~lightning_fp8.FP8Linear`) are reduced with MAX across the
data- and tensor-parallel ranks, in ONE collective (all of them stacked into one fp32 vector), and the scales
are recomputed from the reduced histories (:func:`lightning_fp8.scale_rule.compute_scale`)::

    amax_history <- max over ranks of amax_history               # one all-reduce for the whole model
    scale        <- compute_scale(max(amax_history) or amax_history[0], fp8_dtype, margin, prev=scale)
                    # kept where amax_history[0] is 0: no rank's last cast carried information

The whole history, not only its newest entry: since the last sync a state may have cast more than once on one rank
(a layer used twice, two forwards before one backward, an evaluation on that rank alone) and not at all on another
(a branch it skipped), so older entries can differ between ranks too. After the reduction every rank holds the same
history, hence the same scale, which is also the scale a single process would compute on the concatenated data.
Weights are not included: their scale is always computed from the weight itself (current scaling).

:func:`enable_fp8_amax_sync` runs this automatically in a forward pre-hook of the root module, so the amaxes
recorded by step ``t``'s forward and backward are reduced before step ``t + 1`` casts anything.
"""

from __future__ import annotations

import copy
import weakref
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from lightning_fp8.distributed.comm import check_group
from lightning_fp8.scale_rule import compute_scale
from lightning_fp8.scaling import ScalingState
from lightning_fp8.warnings import warn_once

# Scaling states synchronized since their last cast -> the global ranks that now agree on their scale (None: every
# rank). Tensor-parallel layers that gather FP8 data from several ranks consume this token (see claim_shared_scale).
_synced: weakref.WeakKeyDictionary[ScalingState, frozenset[int] | None] = weakref.WeakKeyDictionary()
_NOT_SYNCED = object()
_HOOK_ATTR = "_lightning_fp8_amax_sync_hook"


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    if hasattr(torch, "_foreach_copy_"):  # one launch per group of tensors instead of one per tensor
        torch._foreach_copy_(dst, src)
    else:
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)


def localize_buffers(state: ScalingState) -> None:
    """Turn DTensor buffers of ``state`` back into plain tensors (this rank's values).

    torch's parallel styles (``distribute_module``) replicate every buffer of a module they shard as a DTensor; a
    scaling state is per rank (each rank records the amax of its own data), so it must stay plain.
    """
    if isinstance(state.scale, DTensor):  # distribute_module converts all of them or none
        for name, buf in state._buffers.items():
            if isinstance(buf, DTensor):
                state._buffers[name] = buf.to_local()


def _scale_reference(history: torch.Tensor, algo: str) -> torch.Tensor:
    """Per row of reduced amax histories (one per state), the amax its scale comes from: the max or the newest entry;
    0 (the previous scale is kept: compute_scale) where the newest entry is 0, i.e. no rank's last cast carried
    information, as a single cast whose amax is 0 or non-finite keeps the scale (kernels/reference.py:
    record_cast_ref)."""
    ref = history.amax(dim=1) if algo == "max" else history[:, 0]
    return torch.where(history[:, 0] > 0, ref, torch.zeros_like(ref))


class AmaxSync:
    """The delayed scaling states of a module, grouped for batched scale updates; built once, synced each step.

    Args:
        module: the model (its structure must not change afterwards; build a new ``AmaxSync`` if it does).
        process_group: the ranks that must agree (default: the whole world, i.e. data x tensor parallel).
    """

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"AmaxSync expects an nn.Module, got {type(module).__name__}")
        check_group(process_group, "AmaxSync(process_group=...)", "sync the amaxes only on the ranks of the group")
        self.process_group = process_group
        # modules() visits in registration order, identical on every rank of an identically built model.
        self.states = [m for m in module.modules() if isinstance(m, ScalingState) and m.delayed]
        groups: dict[tuple, list[ScalingState]] = defaultdict(list)
        for state in self.states:
            groups[(state.fp8_dtype, state.margin, state.algo, state.amax_history.numel())].append(state)
        self._groups = list(groups.items())
        self._ranks: frozenset[int] | None = None  # the process group's global ranks, known once it is initialized

    def __len__(self) -> int:
        return len(self.states)

    def __deepcopy__(self, memo: dict) -> AmaxSync:
        # A deep copy of the model (torch.optim.swa_utils.AveragedModel, a teacher or EMA copy) copies the hook of
        # enable_fp8_amax_sync with it: the copy syncs its own states (those of the copied model, through memo), over
        # the same ranks (a process group is not copied).
        new = copy.copy(self)
        new.states = copy.deepcopy(self.states, memo)
        new._groups = [(key, copy.deepcopy(states, memo)) for key, states in self._groups]
        return new

    @torch.no_grad()
    def sync(self) -> None:
        """MAX-reduce the amax history of every state in one collective and recompute the scales."""
        if not self.states or not dist.is_available() or not dist.is_initialized():
            return
        if dist.get_world_size(self.process_group) == 1:
            return
        for state in self.states:
            localize_buffers(state)
        # Per group: stack the histories (one op), reduce them across ranks, recompute the scales and write both
        # back with one multi-tensor copy each: a few launches per group, whatever its size.
        histories = [torch.stack([s.amax_history for s in states]) for _, states in self._groups]
        flat = torch.cat([h.reshape(-1) for h in histories])
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=self.process_group)
        for ((fp8_dtype, margin, algo, _), states), reduced in zip(
            self._groups, flat.split([h.numel() for h in histories]), strict=True
        ):
            history = reduced.view(len(states), -1)
            ref = _scale_reference(history, algo)
            prev = torch.stack([s.scale for s in states])
            _copy_all([s.amax_history for s in states], list(history.unbind(0)))
            _copy_all([s.scale for s in states], list(compute_scale(ref, fp8_dtype, margin, prev).unbind(0)))
        if self.process_group is not None and self._ranks is None:
            self._ranks = frozenset(dist.get_process_group_ranks(self.process_group))
        _synced.update(dict.fromkeys(self.states, self._ranks))


def sync_fp8_amax(module: nn.Module, process_group: dist.ProcessGroup | None = None) -> None:
    """Reduce (MAX) the amax histories of all delayed FP8 scaling states of ``module`` across ranks, in one collective.

    Afterwards every rank of ``process_group`` holds identical amax histories and scales. A no-op without an
    initialized process group or with one rank. Call it at the same point on every rank (it is a collective).

    Call it on every rank right before saving a checkpoint that keeps one copy of the FP8 state: a
    ``torch.distributed.checkpoint`` save of :func:`~lightning_fp8.fp8_state_dict` (plain tensors, which DCP writes
    once), or a ``torch.save`` on rank 0. Until the next forward's sync (:func:`enable_fp8_amax_sync`) each rank holds
    the amaxes of its own last casts; without this call the other ranks' are lost, and the resumed run casts with
    other scales than the uninterrupted one (docs/guides/checkpoints.md, "Sharded checkpoints").

    Args:
        module: the model whose :class:`~lightning_fp8.FP8Linear` layers (any :class:`ScalingState`) to sync.
        process_group: the ranks that must agree; default: the whole world (data x tensor parallel).

    Example (in every process of the run)::

        loss = model(batch).sum(); loss.backward(); optimizer.step()
        sync_fp8_amax(model)   # or let enable_fp8_amax_sync(model) do it before every forward
        dcp.save({"model": ..., "fp8": fp8_state_dict(model)}, checkpoint_id=path)   # the same state on every rank
    """
    AmaxSync(module, process_group).sync()


def enable_fp8_amax_sync(module: nn.Module, process_group: dist.ProcessGroup | None = None) -> RemovableHandle:
    """Sync the FP8 amaxes of ``module`` automatically, before each of its forwards (see :func:`sync_fp8_amax`).

    The hook reduces what the previous forward and backward recorded, so every cast of the coming step uses scales
    identical on all ranks. With gradient accumulation it runs once per micro-batch. Register it on the root module
    after the model is converted to FP8 and parallelized; calling it again replaces the previous hook.

    The hook is a collective in *every* forward of ``module``, in ``eval()`` and under ``torch.no_grad()`` too: those
    forwards cast with the delayed scales and record their amaxes like any other, so skipping their sync would let
    the ranks' scales drift apart. Every rank must run the same forwards: evaluate on all ranks, or remove the hook
    on the rank that evaluates alone (``handle.remove()``, then ``enable_fp8_amax_sync(module)`` again); the next sync
    reduces the whole histories, which makes them identical again. A forward on one rank alone with the hook on waits
    for the other ranks forever. A deep copy of ``module`` (``torch.optim.swa_utils.AveragedModel``, a teacher) keeps a
    hook of its own, which syncs the copy's states over the same ranks.

    Returns:
        The hook's handle (``handle.remove()`` turns the synchronization off).
    """
    sync = AmaxSync(module, process_group)  # checks its arguments before the previous hook goes
    previous = getattr(module, _HOOK_ATTR, None)
    if previous is not None:  # one sync per step, whoever enables it (a strategy and apply_fp8_tensor_parallel)
        previous.remove()

    handle = module.register_forward_pre_hook(_SyncHook(sync))
    setattr(module, _HOOK_ATTR, handle)
    return handle


class _SyncHook:
    """enable_fp8_amax_sync's forward pre-hook: an object, not a closure, so that a deep copy of the model syncs the
    copy's states (AmaxSync.__deepcopy__); a closure would be shared by the copy and sync the original's."""

    def __init__(self, sync: AmaxSync) -> None:
        self.sync = sync

    def __call__(self, _module: nn.Module, _args: tuple) -> None:
        self.sync.sync()


def claim_shared_scale(state: ScalingState, process_group: dist.ProcessGroup | None) -> None:
    """Make sure ``state.scale`` is identical on every rank of ``process_group`` before a cast whose FP8 bytes
    other ranks will read (a tensor-parallel all-gather), then consume that guarantee: the cast records a local
    amax, after which the scale may differ again until the next sync.

    Normally the root's amax sync (:func:`enable_fp8_amax_sync`) already made it so, and this costs nothing.
    Otherwise (no sync enabled, a sync group that leaves out some ranks of ``process_group``, or the layer runs twice
    between syncs, e.g. under activation recomputation) the state's whole amax history is MAX-reduced over
    ``process_group`` here: correct, but one small collective per layer.
    """
    synced_over = _synced.pop(state, _NOT_SYNCED)
    if synced_over is None:  # synced over the whole world (the default): no rank lookup on the common path
        return
    if dist.get_world_size(process_group) == 1:  # one rank (a single process has no amax sync): nothing to share
        return
    if synced_over is not _NOT_SYNCED:
        ranks = frozenset(dist.get_process_group_ranks(process_group))
        if ranks <= synced_over:
            return
        # E.g. amax_sync_group=mesh["dp"].get_group(): the data-parallel ranks agree, this layer's TP ranks do not,
        # and each would decode the others' gathered FP8 bytes with its own scale_inv.
        warn_once(
            f"lightning_fp8: the FP8 amax sync group (ranks {sorted(synced_over)}) does not contain this "
            f"tensor-parallel layer's ranks {sorted(ranks)}, which must cast with identical scales: each such layer "
            "synchronizes its amax over its tensor-parallel group on its own (one small collective per layer); sync "
            "over the whole world (apply_fp8_tensor_parallel's default amax_sync_group=None) or a group that contains "
            "the tensor-parallel ranks"
        )
    else:
        warn_once(
            "lightning_fp8: a tensor-parallel FP8 layer had to synchronize its amax on its own (one small collective "
            "per layer): call lightning_fp8.distributed.amax_sync.enable_fp8_amax_sync(model) on the root module "
            "(done by apply_fp8_tensor_parallel) so that one batched collective per step does it"
        )
    with torch.no_grad():
        dist.all_reduce(state.amax_history, op=dist.ReduceOp.MAX, group=process_group)
        ref = _scale_reference(state.amax_history.unsqueeze(0), state.algo)[0]
        state.scale.copy_(compute_scale(ref, state.fp8_dtype, state.margin, state.scale))
