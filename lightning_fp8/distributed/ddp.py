"""The DDP communication hook: gradient buckets averaged through FP8 bytes.

::

    from lightning_fp8.distributed import FP8CommState, fp8_allreduce_hook

    ddp = DistributedDataParallel(model)
    state = FP8CommState()
    ddp.register_comm_hook(state, fp8_allreduce_hook)

A DDP bucket is one flat buffer holding several parameters' gradients back to back. Each parameter is its own
scale group (boundaries from ``bucket.parameters()``); the amaxes of the whole bucket travel in one MAX
all-reduce. Gradients of parameters outside ``FP8CommState(fp8_params=...)`` are averaged in their own dtype
by one all-reduce per bucket.
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations as objects
# (`bucket: dist.GradBucket`, returning `torch.futures.Future[torch.Tensor]`), not strings.
import torch
import torch.distributed as dist

from lightning_fp8.distributed.allreduce import all_reduce_fp8, all_reduce_fp8_native
from lightning_fp8.distributed.comm import CastStats
from lightning_fp8.distributed.comm_state import FP8CommState
from lightning_fp8.distributed.layout import SegmentLayout
from lightning_fp8.warnings import warn_once

# Scale block when a bucket's parameter boundaries cannot be read (elements per scale).
_FALLBACK_BLOCK = 1 << 16


def fp8_allreduce_hook(state: FP8CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a DDP gradient bucket across ranks with FP8 on the wire (1 byte per element plus scales).

    Register with ``ddp.register_comm_hook(FP8CommState(), fp8_allreduce_hook)``. The result is the mean over
    ranks, identical on every rank. A non-finite gradient on any rank sets ``state.found_nonfinite`` on every
    rank (and is reported to ``state.grad_scaler``); see :meth:`FP8CommState.check_step`.

    Args:
        state: the :class:`FP8CommState` given to ``register_comm_hook``.
        bucket: DDP's gradient bucket.

    Returns:
        A completed future holding the averaged bucket buffer.
    """
    if not isinstance(state, FP8CommState):
        raise TypeError(
            f"fp8_allreduce_hook needs an FP8CommState as its state, got {type(state).__name__}: "
            "ddp.register_comm_hook(FP8CommState(), fp8_allreduce_hook)"
        )
    buffer = bucket.buffer()
    with state.side_stream(buffer.device):
        if dist.get_world_size(state.process_group) == 1:
            _record_local(state, buffer)
        else:
            _reduce_bucket(state, buffer, bucket.parameters())
        future: torch.futures.Future[torch.Tensor] = (
            torch.futures.Future(devices=[buffer.device]) if buffer.is_cuda else torch.futures.Future()
        )
        future.set_result(buffer)
    return future


def _record_local(state: FP8CommState, buffer: torch.Tensor) -> None:
    # One rank: nothing to send, but the step must still know about a non-finite gradient.
    amax = torch.linalg.vector_norm(buffer, float("inf")).float()
    amax = torch.where(torch.isnan(amax), torch.inf, amax)
    state.record(CastStats(amax, torch.zeros((), dtype=torch.int64, device=buffer.device), 0, ~torch.isfinite(amax)))


def _param_numels(buffer: torch.Tensor, params: list) -> list:
    numels = [p.numel() for p in params]
    return numels if sum(numels) == buffer.numel() else None


def _reduce_bucket(state: FP8CommState, buffer: torch.Tensor, params: list) -> None:
    numels = _param_numels(buffer, params)
    if numels is None:
        warn_once(
            f"fp8_allreduce_hook: a bucket of {buffer.numel()} elements does not match its parameters' sizes; "
            f"using one FP8 scale per block of {_FALLBACK_BLOCK} elements instead of one per parameter"
        )
        _reduce_fp8(state, buffer, SegmentLayout.blocks(buffer.numel(), _FALLBACK_BLOCK))
        return
    fp8_mask = [state.is_fp8(p) for p in params]
    if all(fp8_mask):
        _reduce_fp8(state, buffer, SegmentLayout.per_tensor(numels))
        return
    views = list(buffer.split(numels))
    fp8_views = [v for v, m in zip(views, fp8_mask, strict=True) if m]
    other_views = [v for v, m in zip(views, fp8_mask, strict=True) if not m]
    if fp8_views:
        packed = torch.cat(fp8_views)
        _reduce_fp8(state, packed, SegmentLayout.per_tensor([v.numel() for v in fp8_views]))
        torch._foreach_copy_(fp8_views, list(packed.split([v.numel() for v in fp8_views])))
    # The high-precision rest: one all-reduce in the bucket's own dtype, then the mean.
    packed = torch.cat(other_views)
    dist.all_reduce(packed, group=state.process_group)
    packed.div_(dist.get_world_size(state.process_group))
    torch._foreach_copy_(other_views, list(packed.split([v.numel() for v in other_views])))


def _reduce_fp8(state: FP8CommState, flat: torch.Tensor, layout: SegmentLayout) -> None:
    """Replace ``flat`` (a contiguous 1-D buffer) by its mean over ranks, through FP8."""
    common = {"margin": state.margin, "fused": state.use_fused(flat.device), "slices": state.slices(flat.numel()),
              "amax_group": state.amax_group}  # fmt: skip
    if state.resolved_algorithm() == "native":
        headroom = state.extra_headroom(flat.device)
        _, stats = all_reduce_fp8_native(
            flat, layout, state.process_group, state.fp8_dtype, extra_headroom=headroom, out=flat, **common
        )
        state.record(stats, native_overflow=True)
    else:
        _, stats = all_reduce_fp8(flat, layout, state.process_group, state.fp8_dtype, out=flat, **common)
        state.record(stats)
