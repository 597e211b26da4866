"""This rank's part of sharded (DTensor) parameters, gradients and states, for the optimizer's kernels.

FSDP2 and tensor parallelism make parameters DTensors; the optimizer's kernels work on the local shards and the
optimizer's states are sharded like their parameters.
"""

from __future__ import annotations

import torch


def is_dtensor(t: object) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "device_mesh")


def is_fsdp1_view(p: torch.Tensor) -> bool:
    """Whether FSDP1 flattened ``p``: an original parameter (``use_orig_params=True``), a view of its flat parameter,
    which every forward puts back in the flat parameter's dtype; or a flat parameter itself (torch marks both)."""
    return bool(getattr(p, "_fsdp_flattened", False))


def any_rank(meshes: list, flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` is true on any rank of ``meshes`` (every rank of them calls this, with its meshes in the same
    order): a MAX all-reduce over each dimension of each mesh, of a flag on ``device`` (a local shard's)."""
    import torch.distributed as dist

    value = torch.tensor([int(flag)], device=device)
    for m in meshes:
        for dim in range(m.ndim):
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=m.get_group(dim))
    return bool(value.item())


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (``t`` itself when it is not a DTensor)."""
    return t.to_local() if is_dtensor(t) else t


def like(p: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """``shard`` (this rank's shard) as a tensor sharded like ``p``."""
    if not is_dtensor(p):
        return shard
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(shard, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def reduce_partial_grad_(p: torch.Tensor) -> None:
    """Replace a partial-sum DTensor gradient of ``p`` by its sum (one all-reduce), in ``p.grad``.

    The gradient of a replicated parameter fed by sharded activations (a norm or a row-parallel bias under sequence
    parallelism) arrives as per-rank partial sums: each rank would otherwise step with its own part and the
    replicas would drift apart. Done once per step: the reduced gradient is no longer partial.
    """
    grad = p.grad
    if grad is None or not is_dtensor(grad) or not any(pl.is_partial() for pl in grad.placements):
        return
    from torch.distributed.tensor import Replicate

    p.grad = grad.redistribute(grad.device_mesh, [Replicate() if pl.is_partial() else pl for pl in grad.placements])
