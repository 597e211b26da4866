"""The collectives of a tensor-parallel FP8 linear layer: all-gather and reduce-scatter, FP8 moving as its bytes.

:class:`~lightning_fp8.distributed.tensor_parallel_linear.TPLinearFn` calls them around its GEMMs (the diagram of
which collective runs where is in :mod:`~lightning_fp8.distributed.tensor_parallel_linear`). They take local tensors
and a process group, and know nothing of scaling states or layers: an FP8 tensor travels as ``uint8`` (gloo refuses
FP8 dtypes), and ``_reduce_scatter_fp8`` casts with one scale shared by all ranks and sums in fp32. Apart from
the autograd function because they are plain collectives of tensors along a dimension.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_fp8 import ops
from lightning_fp8.scale_rule import compute_scale

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _wire(t: torch.Tensor) -> torch.Tensor:
    # Collectives know nothing of FP8 dtypes (gloo refuses them): FP8 travels as its bytes.
    return t.view(torch.uint8) if t.dtype in _FP8_DTYPES else t


def _all_gather(t: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate the equal-sized shards ``t`` of every rank along ``dim``."""
    world = dist.get_world_size(group)
    wire = _wire(t).contiguous()
    out = wire.new_empty(world * wire.numel())
    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, wire.view(-1), group=group)
    full = out.view(world, *t.shape).movedim(0, dim).flatten(dim, dim + 1)  # a copy unless dim == 0
    return full.view(t.dtype)


def _scatter_chunks(t: torch.Tensor, dim: int, world: int) -> torch.Tensor:
    """``(world, *shard)`` contiguous: chunk ``r`` is the slice of ``t`` along ``dim`` that rank ``r`` receives."""
    if t.shape[dim] % world:
        raise ValueError(f"cannot split dimension {dim} of size {t.shape[dim]} evenly over {world} ranks")
    return t.unflatten(dim, (world, t.shape[dim] // world)).movedim(dim, 0).contiguous()


def _reduce_scatter(t: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum ``t`` over the ranks and keep this rank's slice along ``dim``, in ``t``'s dtype."""
    chunks = _scatter_chunks(t, dim, dist.get_world_size(group))
    out = chunks.new_empty(chunks[0].numel())
    getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, chunks.view(-1), group=group)
    return out.view(chunks.shape[1:])


def _reduce_scatter_fp8(
    t: torch.Tensor, dim: int, group: dist.ProcessGroup, fp8_dtype: torch.dtype, out_dtype: torch.dtype
) -> torch.Tensor:
    """:func:`_reduce_scatter` with FP8 on the wire: one shared scale, all-to-all of the FP8 chunks, fp32 sum.

    The scale comes from the MAX-reduced amax of all ranks' ``t``, so no rank's chunk saturates; summing the
    ``world`` dequantized chunks in fp32 cannot overflow either (DESIGN.md, FP8 gradient communication).
    """
    world = dist.get_world_size(group)
    if world == 1:  # the sum over one rank is t itself: no cast (a single process's dx has no such rounding)
        return t.to(out_dtype)
    with torch.no_grad():
        amax = ops.amax(t)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        scale = compute_scale(amax, fp8_dtype)
        t_fp8 = ops.cast_to_fp8(t, scale, fp8_dtype)[0]
        chunks = _scatter_chunks(t_fp8.view(torch.uint8), dim, world)
        received = torch.empty_like(chunks)
        dist.all_to_all_single(received, chunks, group=group)
        received = received.view(fp8_dtype)
        total = received[0].float()
        for r in range(1, world):
            total += received[r].float()
        return (total * scale.reciprocal()).to(out_dtype)
