"""FSDP1 (``FullyShardedDataParallel``, what Lightning's ``FSDPStrategy`` uses): an FP8 reduce-scatter hook.

::

    from lightning_fp8.distributed import enable_fp8_fsdp1

    model = FullyShardedDataParallel(model, ...)
    state = enable_fp8_fsdp1(model)          # registers fp8_reduce_scatter_hook with per-parameter scales

FSDP1 gives its hook the flat, padded gradient of one FSDP unit and the shard to fill; with a hook, FSDP does
not divide by the world size, so the hook does (``output = sum_i chunk_i / N``). The hook does not know which
unit a gradient belongs to; :func:`enable_fp8_fsdp1` records each unit's parameter boundaries by the size of
its flat gradient so the hook can use one scale per parameter. A gradient of unknown size falls back to one
scale per block of 65,536 elements. Every gradient of an FSDP1 unit travels in FP8 (``fp8_params`` applies to
DDP and FSDP2 only).
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_fp8.distributed.allreduce import all_reduce_fp8
from lightning_fp8.distributed.comm import reduce_scatter_fp8
from lightning_fp8.distributed.comm_state import FP8CommState, check_state
from lightning_fp8.distributed.comm_state_checks import refuse_layer_swaps
from lightning_fp8.distributed.layout import SegmentLayout
from lightning_fp8.warnings import warn_once

_FALLBACK_BLOCK = 1 << 16


def fp8_reduce_scatter_hook(state: FP8CommState, grad: torch.Tensor, output: torch.Tensor | None = None) -> None:
    """FSDP1 communication hook: reduce-scatter (or, without ``output``, all-reduce) ``grad`` through FP8.

    Register through :func:`enable_fp8_fsdp1` (per-parameter scales; it checks that the state's group is the
    model's) or directly with ``fsdp_model.register_comm_hook(FP8CommState(fsdp_model.process_group),
    fp8_reduce_scatter_hook)`` (per-block scales; a state over a group of another size raises at the first backward).

    Args:
        state: the :class:`FP8CommState`.
        grad: the flat, padded unsharded gradient of one FSDP unit (``world_size * shard`` elements).
        output: this rank's shard, filled with the mean over ranks; ``None`` for ``NO_SHARD``, where ``grad``
            itself is replaced by the mean.
    """
    if not isinstance(state, FP8CommState):
        raise TypeError(
            f"fp8_reduce_scatter_hook needs an FP8CommState as its state, got {type(state).__name__}: "
            "use enable_fp8_fsdp1(model) or model.register_comm_hook(FP8CommState(model.process_group), "
            "fp8_reduce_scatter_hook)"
        )
    layout = _layout_for(state, grad.numel())
    slices = state.slices(grad.numel())
    common = {"margin": state.margin, "fused": state.use_fused(grad.device), "slices": slices}
    group = state.process_group
    world = torch.distributed.get_world_size(group)
    if output is not None and grad.numel() != world * output.numel():
        # Registered directly with a state over a group of another size than FSDP's (enable_fp8_fsdp1 checks ranks).
        raise ValueError(
            f"fp8_reduce_scatter_hook: FSDP hands a gradient of {grad.numel()} elements for a shard of "
            f"{output.numel()}, a group of {grad.numel() // max(output.numel(), 1)} ranks, but FP8CommState("
            f"process_group=...) has {world}: build the state with the model's group, "
            "FP8CommState(model.process_group), or register through enable_fp8_fsdp1(model)"
        )
    if output is None:
        _, stats = all_reduce_fp8(grad.view(-1), layout, group, state.fp8_dtype, out=grad.view(-1), **common)
    else:
        # The mean written straight into FSDP's shard (the 1/N folded into the decode's scale).
        _, stats = reduce_scatter_fp8(
            grad.reshape(-1), layout, group, state.fp8_dtype, out=output.view(-1), divisor=world, **common
        )
    state.record(stats)


def _layout_for(state: FP8CommState, numel: int) -> SegmentLayout:
    layout = state._fsdp1_layouts.get(numel)
    if layout is not None:
        return layout
    warn_once(
        f"fp8_reduce_scatter_hook: no parameter boundaries known for a flat gradient of {numel} elements; using one "
        f"FP8 scale per block of {_FALLBACK_BLOCK} elements (register with enable_fp8_fsdp1 for one per parameter)"
    )
    return SegmentLayout.blocks(numel, _FALLBACK_BLOCK)


def enable_fp8_fsdp1(model: nn.Module, state: FP8CommState | None = None) -> FP8CommState:
    """Register :func:`fp8_reduce_scatter_hook` on an FSDP1 model, with one FP8 scale per parameter.

    Call once, on the root ``FullyShardedDataParallel`` module, before the first forward.

    Args:
        model: the root ``torch.distributed.fsdp.FullyShardedDataParallel`` module.
        state: the communication state (default: ``FP8CommState(model.process_group)``). One state may serve several
            FSDP1 models, each registered through this function: every model's units keep their boundaries.

    Returns:
        The state (read its ``found_nonfinite`` / call ``check_step`` per step, or give it a grad scaler).

    Raises:
        TypeError: if ``model`` is not an FSDP1 module, or ``state`` not an FP8CommState.
        ValueError: if ``state.process_group`` (the world when not given) has other ranks than
            ``model.process_group``, or ``state.grad_scaler`` has ``nonfinite_fallback="bf16"``, which cannot swap the
            layers of a wrapped model, or a unit shards with ``HYBRID_SHARD`` (FSDP1 takes no communication hook
            for hybrid strategies); raised before the hook is registered.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if not isinstance(model, FSDP):
        raise TypeError(
            f"enable_fp8_fsdp1 expects the root FullyShardedDataParallel module, got {type(model).__name__}; "
            "for fully_shard (FSDP2) models use enable_fp8_fsdp2"
        )
    state = state if state is not None else FP8CommState(model.process_group)
    check_state(state, "enable_fp8_fsdp1")
    state.check_wrapper_group(model.process_group, "enable_fp8_fsdp1")
    refuse_layer_swaps(
        state, "enable_fp8_fsdp1", "FullyShardedDataParallel holds the parameters of the modules it wraps"
    )
    _refuse_hybrid_sharding(model)
    world = torch.distributed.get_world_size(state.process_group)
    # Kept: the boundaries of another model's units registered on this state (one state may serve several models).
    layouts = dict(state._fsdp1_layouts)
    for unit in FSDP.fsdp_modules(model):
        handle = getattr(unit, "_handle", None)
        if handle is None:
            continue
        flat = handle.flat_param
        # _numels_with_padding: each parameter and each alignment gap, in flat order; the flat gradient the
        # hook sees is then padded to a multiple of the world size where it is sharded (NO_SHARD: as it is).
        numels = list(getattr(flat, "_numels_with_padding", None) or [flat.numel()])
        total = -(-sum(numels) // world) * world if handle.uses_sharded_strategy else sum(numels)
        layout = SegmentLayout.per_tensor(numels).padded(total)
        layouts[total] = _refine(layouts[total], layout) if total in layouts else layout
    state._fsdp1_layouts = layouts
    model.register_comm_hook(state, fp8_reduce_scatter_hook)
    return state


def _refuse_hybrid_sharding(model: nn.Module) -> None:
    """Raise a ValueError, before anything is recorded on the state, where a unit of ``model`` shards hybrid: FSDP1
    takes no communication hook for ``HYBRID_SHARD`` / ``_HYBRID_SHARD_ZERO2`` (its ``register_comm_hook`` raises an
    AssertionError), so those gradients cannot travel in FP8."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    hybrid = {
        str(unit.sharding_strategy) for unit in FSDP.fsdp_modules(model) if "HYBRID" in unit.sharding_strategy.name
    }
    if hybrid:
        raise ValueError(
            f"enable_fp8_fsdp1: the model shards with {', '.join(sorted(hybrid))}, for which FSDP1 takes no "
            "communication hook, so its gradients cannot be reduced in FP8. Use ShardingStrategy.FULL_SHARD or "
            "SHARD_GRAD_OP, or FSDP2 (fully_shard over a 2-D DeviceMesh) with enable_fp8_fsdp2"
        )


def _refine(a: SegmentLayout, b: SegmentLayout) -> SegmentLayout:
    """Two units with flat gradients of the same size: cut at the boundaries of both (each piece then lies
    inside one parameter of either unit, so a scale per piece is at least as fine as a scale per parameter)."""
    cuts: set[int] = set()
    for layout in (a, b):
        pos = 0
        for length in layout.lengths:
            pos += length
            cuts.add(pos)
    ends = sorted(cuts)
    lengths = [end - start for start, end in zip([0, *ends[:-1]], ends, strict=True)]
    return SegmentLayout.per_tensor(lengths)
