"""The scales and amaxes of sharded (DTensor) parameters in :class:`~lightning_fp8.optim.FP8AdamW`'s state dict.

Sharded (DTensor) parameters: each rank's shard of a state has its own scale and amax. The state dict spreads them
over the tensor dimension the parameter is sharded on: a DTensor sharded like the parameter, of the parameter's size
on that dimension and 1 on the others (``(rows, 1)`` under FSDP2), whose every element is the number of the shard
holding that row. Its shape does not depend on the number of ranks, so torch.distributed.checkpoint and full state
dicts reshard it with the states, and ``stored / scale`` (broadcast) is the state's value wherever it lands. A
parameter sharded on several dimensions (FSDP2 over row-parallel tensor parallelism) would need a number per
element: its scales are exported one per rank, which reloads only on the mesh that saved it.

:func:`shard_scalars` exports them so on saving; :func:`_exported_shapes` says which shapes the checks of a loaded
state (:mod:`~lightning_fp8.optim.state_checks`) accept.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from lightning_fp8.optim import shards
from lightning_fp8.optim.state_layout import _param_order

if TYPE_CHECKING:
    from lightning_fp8.optim.adamw import FP8AdamW


def shard_scalars(opt: FP8AdamW, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Export the 0-dim scales and amaxes of sharded (DTensor) parameters as DTensors (see the module docstring).

    They belong to this rank's shard; as plain tensors, torch.distributed.checkpoint would take them for
    replicated values and save (and load on every rank) one rank's only.
    """
    packed = dict(state_dict["state"])
    for index, p in enumerate(_param_order(opt)):
        if index in packed and shards.is_dtensor(p):
            packed[index] = {
                key: _export_scalar(value, p) if _is_shard_scalar(key, value) else value
                for key, value in packed[index].items()
            }
    return {**state_dict, "state": packed}


def _is_shard_scalar(key: str, value: Any) -> bool:
    return key.endswith(("_scale", "_amax")) and isinstance(value, torch.Tensor) and value.dim() == 0


def _sharded_dim(p: torch.Tensor) -> int | None:
    """The one tensor dimension that ``p``'s placements shard; None when they shard none or several."""
    # Not Placement.is_shard(): FSDP2 on top of tensor parallelism shards with _StridedShard, which is no Shard in
    # recent torch; both have the dimension they shard as ``dim``.
    dims = {getattr(placement, "dim", None) for placement in p.placements if not placement.is_replicate()}
    return next(iter(dims)) if len(dims) == 1 and None not in dims else None


def _export_scalar(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    value = value.detach()
    dim = _sharded_dim(p)
    if dim is None:  # replicated (one value everywhere), or sharded on several dimensions: one value per rank
        placements = [Replicate() if placement.is_replicate() else Shard(0) for placement in p.placements]
        return DTensor.from_local(value.reshape(1), p.device_mesh, placements, run_check=False)
    # Sharded on ``dim``: the parameter's size there, 1 elsewhere, sharded exactly like the parameter.
    local_shape, shape = [1] * p.dim(), [1] * p.dim()
    local_shape[dim], shape[dim] = shards.local(p).shape[dim], p.shape[dim]
    local = value.reshape([1] * p.dim()).expand(local_shape).clone()
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=torch.Size(shape), stride=stride
    )


def _exported_shapes(p: torch.Tensor) -> tuple[int, list[tuple[int, ...]]]:
    """How many shards ``p`` has, and the shapes its exported scales may have (:func:`_export_scalar`): one per rank
    (also what a checkpoint of the same sharding written before the per-row layout holds), one per row (column)."""
    ranks = math.prod(p.device_mesh.size(i) for i, placement in enumerate(p.placements) if not placement.is_replicate())
    dim = _sharded_dim(p)
    per_row = [tuple(size if d == dim else 1 for d, size in enumerate(p.shape))] if dim is not None else []
    return ranks, [(ranks,), *per_row]
