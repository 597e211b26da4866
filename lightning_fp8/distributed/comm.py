"""FP8 collectives with shared power-of-two scales: the numerics of FP8 gradient communication.

The data-parallel mean ``g = sum_i g_i / N`` overflows FP8 if the division comes after an FP8 sum and
underflows if each ``g_i`` is divided first (DESIGN.md "FP8 gradient communication"). Here:

1. **Shared scales.** Every rank computes the amax of each tensor (scale group) of the buffer; one MAX
   all-reduce of those few floats gives every rank the same amaxes, hence the same power-of-two scales
   ``s = 2 ** floor(log2(fp8_max / amax))`` (:func:`lightning_fp8.scaling.compute_scale`). A non-finite value
   on any rank makes its amax non-finite everywhere: every rank knows before any gradient byte is sent.
2. **Portable reduce-scatter** (gloo and NCCL, :func:`reduce_scatter_fp8`): ``x_fp8 = saturate(x * s)`` viewed
   as uint8, an all-to-all of the chunks, and a local fp32 sum ``sum_i x_fp8_i * s^-1``. The scales are shared,
   so the FP8 values are summed first and the scale applied once; nothing is divided by N before the sum (no
   underflow) and the sum runs in fp32 (no overflow).
3. **All-gather** of reduced chunks (:func:`all_gather_fp8`), requantized with fresh per-piece scales computed
   by the rank that owns the chunk and sent beside its bytes (4 bytes per piece): every rank decodes the same
   bytes with the same scales, so data-parallel replicas stay bit-identical.

The all-reduces built from these (portable, and native on NCCL's float8 sum) live in
:mod:`lightning_fp8.distributed.allreduce`. On the wire: 1 byte per element for the FP8 data, plus 4 bytes per
scale group (amax all-reduce) and per piece. Collectives are looked up on ``torch.distributed`` at call time,
so tests can count the bytes they move.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_fp8.distributed.layout import DeviceLayout, SegmentLayout, device_layout
from lightning_fp8.distributed.quantize import kernel, segment_amax
from lightning_fp8.scaling import compute_scale


@dataclass(frozen=True)
class CastStats:
    """What one quantized collective saw, for the gradient scaler and the communication state.

    ``amax``: 0-dim fp32, the largest shared amax (non-finite when any rank had a non-finite value);
    ``n_saturated``: 0-dim int64, values clipped to the FP8 maximum in this rank's casts (and FP8 sums that
    overflowed or reached the maximum);
    ``numel``: elements this rank cast; ``found_nonfinite``: 0-dim bool, the same on every rank.
    """

    amax: torch.Tensor
    n_saturated: torch.Tensor
    numel: int
    found_nonfinite: torch.Tensor


# ---------------------------------------------------------------------------------------------------- building blocks
def _world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def shared_scales(
    x: torch.Tensor,
    layout: SegmentLayout,
    group: dist.ProcessGroup | None,
    fp8_dtype: torch.dtype,
    margin: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One MAX all-reduce of the group amaxes of ``x``; returns ``(amax, scale)`` per group, equal on all ranks.

    A group whose amax is 0 or non-finite gets scale 1 (:func:`~lightning_fp8.scaling.compute_scale`).
    """
    amax = segment_amax(x, layout.lengths)
    if layout.num_groups != len(layout.lengths) or list(layout.groups) != list(range(layout.num_groups)):
        index = torch.tensor(layout.groups, dtype=torch.int64, device=x.device)
        per_group = torch.zeros(layout.num_groups, dtype=torch.float32, device=x.device)
        amax = per_group.scatter_reduce_(0, index, amax, "amax")
    if dist.get_world_size(group) > 1 and amax.numel():
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax, compute_scale(amax, fp8_dtype, margin)


def cast_stats(amax: torch.Tensor, n_saturated: torch.Tensor, numel: int) -> CastStats:
    top = amax.max() if amax.numel() else torch.zeros((), device=amax.device)
    return CastStats(top, n_saturated.to(torch.int64), numel, ~torch.isfinite(top))


def pad_bytes(q: torch.Tensor, numel: int) -> torch.Tensor:
    q8 = q.view(torch.uint8)
    return torch.nn.functional.pad(q8, (0, numel - q8.numel())) if numel > q8.numel() else q8


# ---------------------------------------------------------------------------------------------------- reduce-scatter
def reduce_scatter_fp8(
    x: torch.Tensor,
    layout: SegmentLayout,
    group: dist.ProcessGroup | None,
    fp8_dtype: torch.dtype,
    *,
    margin: int = 0,
    compiled: bool = False,
) -> tuple[torch.Tensor, CastStats]:
    """Sum-reduce-scatter of flat ``x`` (``world_size * chunk`` elements) through FP8 bytes.

    Args:
        x: this rank's flat buffer; chunk ``r`` (``x[r*chunk:(r+1)*chunk]``) goes to rank ``r``.
        layout: the segments and scale groups of ``x`` (``layout.numel == x.numel()``).
        group: the process group.
        fp8_dtype: the wire format (E4M3 or E5M2).
        margin: binades of headroom in the cast scales.
        compiled: run the elementwise kernels under ``torch.compile``.

    Returns:
        ``(chunk_sum, stats)``: the fp32 sum over ranks of this rank's chunk (not divided by the world size).
    """
    world, rank = _world(group)
    if layout.numel != x.numel() or x.numel() % world:
        raise ValueError(
            f"reduce_scatter_fp8: buffer of {x.numel()} elements, layout of {layout.numel}; both must match and "
            f"split into {world} equal chunks"
        )
    amax, scale = shared_scales(x, layout, group, fp8_dtype, margin)
    dl = device_layout(layout, world, rank, x.device)
    q, n_sat = kernel("quantize", compiled)(x.reshape(-1), dl.seg_ends, scale[dl.seg_groups], fp8_dtype)
    received = torch.empty_like(q.view(torch.uint8))
    if world > 1:
        dist.all_to_all_single(received, q.view(torch.uint8), group=group)
    else:
        received.copy_(q.view(torch.uint8))
    rows = received.view(world, dl.chunk_numel).view(fp8_dtype)
    scale_inv = scale.reciprocal()[dl.chunk_groups]
    chunk_sum = kernel("dequant_sum", compiled)(rows, dl.chunk_ends, scale_inv)
    return chunk_sum, cast_stats(amax, n_sat, x.numel())


def all_gather_fp8(
    chunk: torch.Tensor,
    layout: SegmentLayout,
    group: dist.ProcessGroup | None,
    fp8_dtype: torch.dtype,
    out_dtype: torch.dtype,
    *,
    margin: int = 0,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather this rank's ``chunk`` of a buffer with ``layout``, as FP8 bytes plus one scale per piece.

    Each rank quantizes its own chunk with a fresh scale per piece (its own amax) and sends the scales beside
    the bytes, so no extra collective is needed and every rank decodes exactly the same values.

    Returns:
        ``(full, n_saturated)``: the whole buffer (``layout.numel`` elements) in ``out_dtype``, and the
        saturation count of this rank's cast.
    """
    world, rank = _world(group)
    dl = device_layout(layout, world, rank, chunk.device)
    send, n_sat = requantize_chunk(chunk, dl, fp8_dtype, margin, compiled)
    gathered, _ = all_gather_bytes(send, group)
    return decode_gathered(gathered, dl, fp8_dtype, out_dtype, compiled), n_sat


def requantize_chunk(chunk, dl: DeviceLayout, fp8_dtype, margin, compiled) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's chunk as FP8 bytes with a fresh scale per piece, followed by the pieces' inverse scales."""
    piece_amax = segment_amax(chunk, dl.chunk_lengths)
    scale = compute_scale(piece_amax, fp8_dtype, margin)
    q, n_sat = kernel("quantize", compiled)(chunk, dl.chunk_ends, scale, fp8_dtype)
    scale_inv = torch.ones(dl.max_pieces, dtype=torch.float32, device=chunk.device)
    scale_inv[: scale.numel()] = scale.reciprocal()
    return torch.cat([q.view(torch.uint8), scale_inv.view(torch.uint8)]), n_sat


def all_gather_bytes(send: torch.Tensor, group, async_op: bool = False):
    """All-gather a uint8 buffer; returns ``(gathered (world, len), work or None)``."""
    world = dist.get_world_size(group)
    gathered = torch.empty(world * send.numel(), dtype=torch.uint8, device=send.device)
    work = None
    if world > 1:
        # all_gather_single is the name from torch 2.13 on; all_gather_into_tensor before (same collective).
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = fn(gathered, send, group=group, async_op=async_op)
    else:
        gathered.copy_(send)
    return gathered.view(world, send.numel()), work


def decode_gathered(gathered, dl: DeviceLayout, fp8_dtype, out_dtype, compiled) -> torch.Tensor:
    """Decode ``(world, chunk bytes + scales)`` rows into the whole buffer, each chunk with its pieces' scales."""
    data = gathered[:, : dl.chunk_numel].view(fp8_dtype)
    table = gathered[:, dl.chunk_numel :].contiguous().view(torch.float32).reshape(-1)
    return kernel("dequantize", compiled)(data, dl.all_piece_ends, table[dl.all_piece_index], out_dtype)
