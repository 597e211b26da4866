"""The DDP communication hook: gradient buckets averaged through FP8 bytes.

::

    from lightning_fp8.distributed import enable_fp8_ddp

    ddp = DistributedDataParallel(model)
    state = enable_fp8_ddp(ddp)        # ddp.register_comm_hook(FP8CommState(ddp.process_group), fp8_allreduce_hook)

A DDP bucket is one flat buffer holding several parameters' gradients back to back. Each parameter is its own
scale group (boundaries from ``bucket.parameters()``); the amaxes of the whole bucket travel in one MAX
all-reduce. Gradients of parameters outside ``FP8CommState(fp8_params=...)`` are averaged in their own dtype
by one all-reduce per bucket; every rank then holds the same sum, so a local check of it sets the step's
non-finite flag alike everywhere, without a collective of its own. So are sparse gradients
(``nn.Embedding(sparse=True)``), which have no flat buffer to cast: as torch's default hook averages them.
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations as objects
# (`bucket: dist.GradBucket`, returning `torch.futures.Future[torch.Tensor]`), not strings.
import torch
import torch.distributed as dist

from lightning_fp8.distributed.allreduce import all_reduce_fp8, all_reduce_fp8_gather, all_reduce_fp8_native
from lightning_fp8.distributed.comm_state import FP8CommState, check_state
from lightning_fp8.distributed.comm_state_checks import empty_fp8_params_message, refuse_layer_swaps
from lightning_fp8.distributed.layout import SegmentLayout
from lightning_fp8.optim import master
from lightning_fp8.warnings import warn_once

# Scale block when a bucket's parameter boundaries cannot be read (elements per scale).
_FALLBACK_BLOCK = 1 << 16


def fp8_allreduce_hook(state: FP8CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a DDP gradient bucket across ranks with FP8 on the wire (1 byte per element plus scales).

    Register with :func:`enable_fp8_ddp` (which checks that the state's group is DDP's) or
    ``ddp.register_comm_hook(FP8CommState(ddp.process_group), fp8_allreduce_hook)``. The result is the mean over
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
            "register it with enable_fp8_ddp(ddp), or ddp.register_comm_hook(FP8CommState(ddp.process_group), "
            "fp8_allreduce_hook)"
        )
    buffer = bucket.buffer()
    if not state._fp8_params_checked:
        _check_fp8_params(state, bucket)
    with state.side_stream(buffer.device):
        if buffer.is_sparse:
            buffer = _reduce_sparse(state, buffer)
        elif dist.get_world_size(state.process_group) == 1:
            state.record_reduced(buffer)  # one rank: nothing to send, but the step must know of a non-finite value
        else:
            _reduce_bucket(state, buffer, bucket.parameters())
        future: torch.futures.Future[torch.Tensor] = (
            torch.futures.Future(devices=[buffer.device]) if buffer.is_cuda else torch.futures.Future()
        )
        future.set_result(buffer)
    return future


def enable_fp8_ddp(model: torch.nn.Module, state: FP8CommState | None = None) -> FP8CommState:
    """Register :func:`fp8_allreduce_hook` on a DDP model, with a state that reduces over the model's own group.

    ``ddp.register_comm_hook(state, fp8_allreduce_hook)`` does the same without the check: the hook cannot see
    which group DDP uses, and a state over other ranks averages the gradients over those ranks, with their scales.

    Args:
        model: a ``torch.nn.parallel.DistributedDataParallel`` module.
        state: the communication state (default: ``FP8CommState(model.process_group)``).

    Returns:
        The state (call ``check_step`` per step, or give it a grad scaler).

    Raises:
        TypeError: if ``model`` is not a DistributedDataParallel module, or ``state`` not an FP8CommState.
        ValueError: if ``state.process_group`` (the world when not given) has other ranks than
            ``model.process_group``, or ``state.grad_scaler`` has ``nonfinite_fallback="bf16"``, which cannot swap the
            layers of a wrapped model; raised before the hook is registered.
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"enable_fp8_ddp expects a DistributedDataParallel module, got {type(model).__name__}; for "
            "FullyShardedDataParallel use enable_fp8_fsdp1, for fully_shard (FSDP2) enable_fp8_fsdp2"
        )
    state = state if state is not None else FP8CommState(model.process_group)
    check_state(state, "enable_fp8_ddp")
    state.check_wrapper_group(model.process_group, "enable_fp8_ddp")
    refuse_layer_swaps(state, "enable_fp8_ddp", "DistributedDataParallel hooked the parameters of the model it wraps")
    model.register_comm_hook(state, fp8_allreduce_hook)
    return state


def _check_fp8_params(state: FP8CommState, bucket: dist.GradBucket) -> None:
    # fp8_params that name no parameter of the model (tensors of another model, or of the model before it was
    # replaced) would send every gradient in its own dtype without a word. The first backward shows every bucket
    # once; a warning, not an error: an exception inside the hook would leave DDP's reducer mid-step.
    params = bucket.parameters()
    state._fp8_params_seen |= state.names_fp8_params(params)
    state._fp8_weights_left_out |= state.leaves_out_fp8_weights(any(map(master.is_fp8_weight, params)))
    if not bucket.is_last():
        return
    state._fp8_params_checked = True
    if state._fp8_weights_left_out:
        warn_once(empty_fp8_params_message("fp8_allreduce_hook"))
    if not state._fp8_params_seen:
        warn_once(
            f"fp8_allreduce_hook: none of the {len(state._fp8_param_ids)} tensors in FP8CommState(fp8_params=...) is a "
            "parameter of this DDP model, so every gradient was reduced in its own dtype; pass the model's own "
            "parameters, e.g. [m.weight for m in ddp.module.modules() if isinstance(m, FP8Linear)]"
        )


def _param_numels(buffer: torch.Tensor, params: list) -> list:
    # A complex parameter's gradient lies in the bucket as its real view: two elements per value.
    numels = [p.numel() * (2 if p.is_complex() else 1) for p in params]
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
    # The high-precision rest: one all-reduce in the bucket's own dtype, divided by the world size before the sum as
    # torch's default hook does (an fp16 sum of N gradients overflows where their mean does not), then checked where
    # it is the same on every rank (a NaN or inf of any rank's gradient reaches the sum).
    packed = torch.cat(other_views)
    packed.div_(dist.get_world_size(state.process_group))
    dist.all_reduce(packed, group=state.process_group)
    state.record_reduced(packed)
    torch._foreach_copy_(other_views, list(packed.split([v.numel() for v in other_views])))


def _reduce_sparse(state: FP8CommState, grad: torch.Tensor) -> torch.Tensor:
    """The mean over ranks of a sparse gradient (``nn.Embedding(sparse=True)``; DDP gives it a bucket of its own)."""
    # A sparse gradient has no flat buffer to cast to FP8: it is averaged in its own dtype as torch's default hook
    # does (divided first, then summed), and checked where the sum is the same on every rank.
    world = dist.get_world_size(state.process_group)
    if world > 1:
        work = dist.all_reduce(grad.div(world), group=state.process_group, async_op=True)
        work.wait()
        grad = work.result()[0]  # a sparse all-reduce returns its sum, not necessarily in place
    state.record_reduced(grad.coalesce().values())
    return grad


def _reduce_fp8(state: FP8CommState, flat: torch.Tensor, layout: SegmentLayout) -> None:
    """Replace ``flat`` (a contiguous 1-D buffer) by its mean over ranks, through FP8."""
    common = {"margin": state.margin, "fused": state.use_fused(flat.device), "slices": state.slices(flat.numel()),
              "amax_group": state.amax_group}  # fmt: skip
    algorithm = state.resolved_algorithm(flat.device)
    if algorithm == "native":
        headroom = state.extra_headroom(flat.device)
        _, stats = all_reduce_fp8_native(
            flat, layout, state.process_group, state.fp8_dtype, extra_headroom=headroom, out=flat, **common
        )
        state.record(stats, native_overflow=True)
    elif algorithm == "gather":
        rows = state.gather_rows(flat.device)
        _, stats = all_reduce_fp8_gather(flat, layout, state.process_group, state.fp8_dtype, out=flat, rows=rows,
                                         **common)  # fmt: skip
        state.record(stats)
    else:
        _, stats = all_reduce_fp8(flat, layout, state.process_group, state.fp8_dtype, out=flat, **common)
        state.record(stats)
