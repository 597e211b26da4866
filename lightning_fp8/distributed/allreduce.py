"""FP8 all-reduces (the mean over ranks) for DDP buckets: portable and native, optionally pipelined.

- :func:`all_reduce_fp8` (gloo and NCCL): the portable reduce-scatter of :mod:`~.comm` (FP8 all-to-all, fp32
  sum), the mean requantized with fresh per-piece scales, and an FP8 all-gather.
- :func:`all_reduce_fp8_native` (NCCL >= 2.24 on Hopper, where torch passes float8 tensors): the sum itself
  runs in FP8, so the 1/N is split: the cast pre-scales by ``2**-h`` with ``h = ceil(log2(N) / 2)`` (about
  1/sqrt(N)) and the decode post-scales by ``2**h / N``. Sums that overflow are counted as saturated and mark
  the step non-finite (every rank receives the same sum, so every rank agrees).

Both cut a large buffer into ``slices`` pieces reduced as a pipeline: the casts of later slices run while
earlier slices are on the wire (asynchronous collectives), which hides most of the casting time. The scales
are shared over the whole buffer (one MAX all-reduce), so slicing changes no value.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from lightning_fp8.distributed.comm import (
    CastStats,
    all_gather_bytes,
    cast_stats,
    decode_gathered,
    pad_bytes,
    requantize_chunk,
    shared_scales,
)
from lightning_fp8.distributed.layout import SegmentLayout, device_layout
from lightning_fp8.distributed.quantize import kernel
from lightning_fp8.formats import fp8_max


def _slice_bounds(numel: int, slices: int) -> list[tuple[int, int]]:
    slices = max(1, min(slices, numel))
    cuts = [numel * i // slices for i in range(slices + 1)]
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:], strict=True) if b > a] or [(0, numel)]


def _check(x: torch.Tensor, layout: SegmentLayout, out: torch.Tensor | None) -> torch.Tensor:
    if layout.numel != x.numel():
        raise ValueError(f"FP8 all-reduce: buffer of {x.numel()} elements but a layout of {layout.numel}")
    if out is not None and (out.numel() != x.numel() or not out.is_contiguous()):
        raise ValueError(f"FP8 all-reduce: out must be contiguous with {x.numel()} elements, got {tuple(out.shape)}")
    return x.reshape(-1)


def all_reduce_fp8(
    x: torch.Tensor,
    layout: SegmentLayout,
    group: dist.ProcessGroup | None,
    fp8_dtype: torch.dtype,
    *,
    margin: int = 0,
    compiled: bool = False,
    slices: int = 1,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, CastStats]:
    """Mean over ranks of flat ``x`` through FP8 bytes (portable: FP8 all-to-all, fp32 sum, FP8 all-gather).

    Args:
        x: this rank's flat buffer (any float dtype); the result has its dtype.
        layout: the segments and scale groups of ``x`` (one group per tensor).
        group: the process group.
        fp8_dtype: the wire format.
        margin: binades of headroom in the cast scales.
        compiled: run the elementwise kernels under ``torch.compile``.
        slices: pipeline the buffer in this many slices.
        out: write the mean here (may be ``x`` itself) instead of a new tensor.

    Returns:
        ``(mean, stats)``; every rank gets the same bytes.
    """
    flat = _check(x, layout, out)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    amax, scale = shared_scales(flat, layout, group, fp8_dtype, margin)
    scale = torch.cat([scale, scale.new_ones(1)])  # the padding group of every slice: index layout.num_groups
    scale_inv = scale.reciprocal() / world  # the 1/N of the mean, folded into the decode of the fp32 sum
    out = torch.empty_like(flat) if out is None else out.view(-1)
    n_sat = torch.zeros((), dtype=torch.int64, device=flat.device)
    flights = []
    for a, b in _slice_bounds(flat.numel(), slices):  # stage 1: cast and all-to-all every slice
        sub = layout.slice(a, b)
        chunk = math.ceil((b - a) / world)
        dl = device_layout(sub.padded(chunk * world), world, rank, flat.device)
        nseg = len(sub.lengths)
        q, n = kernel("quantize", compiled)(flat[a:b], dl.seg_ends[:nseg], scale[dl.seg_groups[:nseg]], fp8_dtype)
        send = pad_bytes(q, chunk * world)
        received = torch.empty_like(send)
        work = dist.all_to_all_single(received, send, group=group, async_op=True)
        flights.append([a, b, dl, chunk, received, work])
        n_sat += n
    for flight in flights:  # stage 2: sum in fp32, requantize the mean, all-gather it
        a, b, dl, chunk, received, work = flight
        work.wait()
        rows = received.view(world, chunk).view(fp8_dtype)
        mean = kernel("dequant_sum", compiled)(rows, dl.chunk_ends, scale_inv[dl.chunk_groups])
        send, n = requantize_chunk(mean, dl, fp8_dtype, margin, compiled)
        flight[4:] = all_gather_bytes(send, group, async_op=True)
        n_sat += n
    for a, b, dl, _chunk, gathered, work in flights:  # stage 3: decode
        if work is not None:
            work.wait()
        out[a:b].copy_(decode_gathered(gathered, dl, fp8_dtype, out.dtype, compiled)[: b - a])
    return out, cast_stats(amax, n_sat, flat.numel())


def native_prescale_exponent(world_size: int) -> int:
    """``h`` of the native FP8 sum's pre-scale ``2**-h``: a power of two near ``1/sqrt(world_size)``."""
    return math.ceil(math.log2(world_size) / 2) if world_size > 1 else 0


def all_reduce_fp8_native(
    x: torch.Tensor,
    layout: SegmentLayout,
    group: dist.ProcessGroup | None,
    fp8_dtype: torch.dtype,
    *,
    margin: int = 0,
    extra_headroom: torch.Tensor | int = 0,
    compiled: bool = False,
    slices: int = 1,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, CastStats]:
    """Mean over ranks of flat ``x`` with the sum in FP8 (NCCL's float8 all-reduce); returns ``x.dtype``.

    The cast scale is pre-multiplied by ``2**-(h + extra_headroom)`` (``h`` from
    :func:`native_prescale_exponent`) and the decode post-multiplies by ``2**(h + extra_headroom) / N``. FP8
    sums that overflowed (non-finite, or at the format maximum) are counted in ``n_saturated``; a non-finite
    sum marks ``found_nonfinite`` on every rank. Other arguments as :func:`all_reduce_fp8`.
    """
    flat = _check(x, layout, out)
    world = dist.get_world_size(group)
    amax, scale = shared_scales(flat, layout, group, fp8_dtype, margin)
    # A power of two: exp2 of an integer exponent is exact.
    exponent = torch.as_tensor(extra_headroom, device=flat.device) + native_prescale_exponent(world)
    pre_scale = scale * torch.exp2(-exponent.float())
    post_scale_inv = (pre_scale * world).reciprocal()
    out = torch.empty_like(flat) if out is None else out.view(-1)
    n_sat = torch.zeros((), dtype=torch.int64, device=flat.device)
    found = ~torch.isfinite(amax).all()
    flights = []
    for a, b in _slice_bounds(flat.numel(), slices):
        dl = device_layout(layout.slice(a, b), 1, 0, flat.device)
        q, n = kernel("quantize", compiled)(flat[a:b], dl.seg_ends, pre_scale[dl.seg_groups], fp8_dtype)
        flights.append((a, b, dl, q, dist.all_reduce(q, op=dist.ReduceOp.SUM, group=group, async_op=True)))
        n_sat += n
    for a, b, dl, q, work in flights:
        if work is not None:
            work.wait()
        mean, n_overflow, nonfinite = kernel("dequantize_checked", compiled)(
            q, dl.seg_ends, post_scale_inv[dl.seg_groups], out.dtype, fp8_max(fp8_dtype)
        )
        out[a:b].copy_(mean)
        n_sat += n_overflow
        found = found | nonfinite
    stats = cast_stats(amax, n_sat, flat.numel())
    return out, CastStats(stats.amax, stats.n_saturated, stats.numel, found)
