"""FP8 all-reduces (the mean over ranks) for DDP buckets: portable and native, pipelined in slices.

- :func:`all_reduce_fp8` (gloo and NCCL): the portable reduce-scatter of :mod:`~.comm` (FP8 all-to-all, fp32
  sum), the mean requantized with fresh per-piece scales, and an FP8 all-gather.
- :func:`all_reduce_fp8_native` (NCCL >= 2.24 on Hopper, where torch passes float8 tensors): the sum itself
  runs in FP8, so the 1/N is split: the cast pre-scales by ``2**-h`` with ``h = ceil(log2(N) / 2)`` (about
  1/sqrt(N)) and the decode post-scales by ``2**h / N``. Sums that overflow are counted as saturated and mark
  the step non-finite (every rank receives the same sum, so every rank agrees).

Both cut a large buffer into ``slices`` consecutive slices run as a pipeline (collectives are asynchronous:
NCCL runs them on its own stream while the kernels of other slices run on the current one)::

    amax(stage k+2) -> all-reduce of those amaxes | cast(k+1) -> collective(k+1) | decode(k-1)

Scales of the cast stay per tensor and shared by every rank. Slicing changes no value of the native path (and of
the gather algorithm); the portable path's mean is requantized with one scale per piece, and pieces follow the
slices, so there another ``slice_numel`` can round an element of a piece differently (a tiny value flushed to 0 in
one and kept in the other). In a layout of consecutive tensors
(DDP buckets) the amax pass is staged too: the amaxes of the tensors that reach into slice ``k`` are reduced
(one small MAX all-reduce) right before slice ``k`` is cast, so only the first slice's amax and cast and the
last slice's decode have no collective to hide behind. A non-finite value is then known on every rank before
the bytes of its tensor are sent; the step's flag (``found_nonfinite``) is the same on every rank as before.
Measured on H200s with the kernels before their rework (benchmarks/results/comm_fp8_h200x2.txt), the kernels and
NCCL slow each other down when they run together: 4 slices hid about 0.6 ms of the 2.9 ms of passes behind the
3.2 ms FP8 collective. The amax all-reduces queue on NCCL's stream between the data collectives unless
``amax_group`` (a second communicator of the same ranks) takes them; ``bench_comm.py --sweep`` measures both.

Passes over memory per element (bf16 gradient, FP8 wire, N ranks): native: amax (read 2 B), cast (2 B + 1 B),
decode (1 B + 2 B); portable: amax, cast, two passes over the N received rows of a chunk (amax of the mean, then
its requantization: 2 x 1 B), decode (1 B + 2 B).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from lightning_fp8.distributed.comm import (
    CastStats,
    all_reduce_max,
    cast_stats,
    check_call,
    check_dtypes,
    wait,
)
from lightning_fp8.distributed.exchange import CollectiveChunks, CollectiveRows, SymmetricChunks, SymmetricRows
from lightning_fp8.distributed.layout import SegmentLayout, SlicePlan, all_reduce_plan
from lightning_fp8.distributed.quantize import segment_kernels
from lightning_fp8.formats import check_fp8_dtype


def _check(x: torch.Tensor, layout: SegmentLayout, out: torch.Tensor | None, fp8_dtype: torch.dtype) -> torch.Tensor:
    # Before any collective: an integer buffer would otherwise pass the amax all-reduce and fail in the decode.
    check_dtypes("FP8 all-reduce", fp8_dtype, x=x.dtype, out=None if out is None else out.dtype)
    if layout.numel != x.numel():
        raise ValueError(f"FP8 all-reduce: buffer of {x.numel()} elements but a layout of {layout.numel}")
    if out is not None and (out.numel() != x.numel() or not out.is_contiguous()):
        raise ValueError(f"FP8 all-reduce: out must be contiguous with {x.numel()} elements, got {tuple(out.shape)}")
    return x.reshape(-1)


def check_amax_group(group: dist.ProcessGroup | None, amax_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group of the amaxes' MAX all-reduces: ``amax_group`` (it must have the ranks of ``group``) or ``group``."""
    if amax_group is None:
        return group
    ranks, want = dist.get_process_group_ranks(amax_group), dist.get_process_group_ranks(group or dist.group.WORLD)
    if ranks != want:
        raise ValueError(f"FP8 all-reduce: amax_group has ranks {ranks}, the group {want}; pass a group of the same "
                         "ranks in the same order")  # fmt: skip
    return amax_group


def check_rows_group(group: dist.ProcessGroup | None, rows) -> None:
    """Raise ValueError if ``rows`` (a transport of :mod:`~.exchange`) exchanges over other ranks than ``group``, or in
    another order: rows would be summed as other ranks' or missed. No collective: each rank compares the groups'
    global ranks, so every rank of ``group`` gets the same answer (a rank outside ``rows.group`` too)."""
    world = dist.group.WORLD
    mine, theirs = group if group is not None else world, rows.group if rows.group is not None else world
    if theirs is mine:
        return
    want = dist.get_process_group_ranks(mine)
    # new_group() gives the ranks outside the new group this marker, not a group.
    ranks = None if theirs is dist.GroupMember.NON_GROUP_MEMBER else dist.get_process_group_ranks(theirs)
    if ranks != want:
        made_for = f"a group of the ranks {ranks}" if ranks is not None else "a group without this rank"
        kind = type(rows).__name__
        raise ValueError(
            f"FP8 all-reduce: the transport (a {kind}) was made for {made_for}, but group has the ranks {want}: the "
            f"bytes would be exchanged over the wrong ranks. Make the transport for this group ({kind}(group, ...)), "
            "or leave it out (the collectives of group)"
        )


class _SharedAmax:
    """The group amaxes of a pipelined all-reduce, computed and all-reduced stage by stage (``SlicePlan.groups``)."""

    def __init__(self, flat: torch.Tensor, plans: tuple[SlicePlan, ...], num_groups: int, group, kernels) -> None:
        self.flat, self.plans, self.group, self.kernels = flat, plans, group, kernels  # group: the amaxes' group
        self.amax = torch.zeros(num_groups, dtype=torch.float32, device=flat.device)
        self.works: list = [None] * len(plans)
        self.done = 0  # slices whose amax has been computed

    def issue(self, k: int) -> None:
        """Compute the amaxes stage ``k`` needs and start its MAX all-reduce (asynchronous)."""
        if k >= len(self.plans):
            return
        plan = self.plans[k]
        while self.done <= plan.amax_through:
            self.kernels.segment_amax(self.flat, self.plans[self.done].cast, self.amax)
            self.done += 1
        lo, hi = plan.groups
        self.works[k] = all_reduce_max(self.amax[lo:hi], self.group, async_op=True) if hi > lo else None

    def wait(self, k: int) -> None:
        """Before the cast of slice ``k``: the stages up to ``k`` have been reduced."""
        for j in range(k + 1):
            wait(self.works[j])
            self.works[j] = None


def _pipeline(n: int, shared: _SharedAmax, start, finish, middle=None) -> None:
    # Host order = order on NCCL's stream (AR: a stage's amax all-reduce, C: a slice's first collective, M: its
    # second, the all-gather of the portable path):  AR0 AR1 C0 | AR2 C1 M0 | AR3 C2 M1 | ...
    # The cast of slice k+1 waits only for AR(k+1), which precedes C(k): it runs while C(k) is on the wire. The decode
    # of slice k-1 is issued after that cast, so it never delays the next collective.
    shared.issue(0)
    shared.issue(1)
    first, second = [start(0)], []
    for k in range(n):
        shared.issue(k + 2)
        if k + 1 < n:
            first.append(start(k + 1))
        second.append(middle(k, first[k]) if middle is not None else first[k])
        if k:
            finish(k - 1, second[k - 1])
    finish(n - 1, second[n - 1])


def _prepare(x, layout, group, out, fp8_dtype, fused: bool, slices: int, native: bool, amax_group):
    """What every all-reduce here starts with: the flat input, its slices' plans (native: one FP8 row per slice),
    the staged shared amaxes (their kernels: ``shared.kernels``), the output and the saturation counter."""
    flat = _check(x, layout, out, fp8_dtype)
    plans = all_reduce_plan(layout, dist.get_world_size(group), dist.get_rank(group), slices, native, flat.device)
    shared = _SharedAmax(flat, plans, layout.num_groups, check_amax_group(group, amax_group), segment_kernels(fused))
    out = torch.empty_like(flat) if out is None else out.view(-1)
    return flat, plans, shared, out, torch.zeros((), dtype=torch.int64, device=flat.device)


def all_reduce_fp8(
    x: torch.Tensor,
    layout: SegmentLayout,
    group: dist.ProcessGroup | None,
    fp8_dtype: torch.dtype,
    *,
    margin: int = 0,
    fused: bool = False,
    slices: int = 1,
    out: torch.Tensor | None = None,
    amax_group: dist.ProcessGroup | None = None,
    chunks: CollectiveChunks | SymmetricChunks | None = None,
) -> tuple[torch.Tensor, CastStats]:
    """Mean over ranks of flat ``x`` through FP8 bytes (portable: FP8 all-to-all, fp32 sum, FP8 all-gather).

    Args:
        x: this rank's flat buffer (any float dtype); the result has its dtype.
        layout: the segments and scale groups of ``x`` (one group per tensor).
        group: the process group.
        fp8_dtype: the wire format.
        margin: binades of headroom in the cast scales.
        fused: run the Triton kernels (CUDA, or CPU under ``TRITON_INTERPRET=1``) instead of the references.
        slices: pipeline the buffer in this many slices.
        out: write the mean here (may be ``x`` itself) instead of a new tensor.
        amax_group: run the amaxes' MAX all-reduces on this group (the same ranks as ``group``: a second NCCL
            communicator, whose stream runs them beside the data collectives of earlier slices instead of queued
            between them); default ``group``.
        chunks: what moves the bytes (:mod:`~lightning_fp8.distributed.exchange`): the all-to-all and all-gather
            of ``group`` (the default), or copy-engine copies out of CUDA symmetric memory
            (:class:`~lightning_fp8.distributed.exchange.SymmetricChunks`, NCCL ranks of one host).

    Returns:
        ``(mean, stats)``; every rank gets the same bytes.

    Raises:
        ValueError: for ``chunks`` made for a group of other ranks than ``group`` (:func:`check_rows_group`).
    """
    check_call("all_reduce_fp8", layout, group, slices, margin=margin)
    if chunks is not None:
        check_rows_group(group, chunks)
    flat, plans, shared, out, n_sat = _prepare(x, layout, group, out, fp8_dtype, fused, slices, False, amax_group)
    world, kernels = dist.get_world_size(group), shared.kernels
    common = {"margin": margin}
    chunks = CollectiveChunks(group) if chunks is None else chunks
    chunks.begin(plans, flat.device)

    def start(k):  # cast with the shared scales, all-to-all of the chunks
        shared.wait(k)
        kernels.quantize(flat, plans[k].cast, shared.amax, fp8_dtype, chunks.chunks(k), n_sat, **common)
        return chunks.scatter(k)

    def middle(k, flight):  # sum this rank's chunk, requantize its mean per piece, all-gather
        plan, rows = plans[k], chunks.scattered(k, flight)
        send = chunks.row(k)
        piece_amax = send[plan.amax_offset :].view(torch.float32).zero_()  # travels beside the bytes
        mean = {"inv_divisor": 1.0 / world, **common}
        kernels.rows_amax(rows, plan.sum, shared.amax, piece_amax, fp8_dtype, **mean)
        kernels.rows_quantize(rows, plan.sum, shared.amax, piece_amax, fp8_dtype, send, n_sat, **mean)
        return chunks.gather(k)

    def finish(k, flight):  # decode every chunk with the piece amaxes that came with it
        gathered = chunks.gathered(k, flight)
        amaxes = gathered.reshape(-1).view(torch.float32)
        kernels.dequantize(gathered, plans[k].decode, amaxes, fp8_dtype, out, **common)

    _pipeline(len(plans), shared, start, finish, middle)
    return out, cast_stats(shared.amax, n_sat, flat.numel())


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
    fused: bool = False,
    slices: int = 1,
    out: torch.Tensor | None = None,
    amax_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, CastStats]:
    """Mean over ranks of flat ``x`` with the sum in FP8 (NCCL's float8 all-reduce); returns ``x.dtype``.

    The cast scale is pre-multiplied by ``2**-(h + extra_headroom)`` (``h`` from
    :func:`native_prescale_exponent`) and the decode post-multiplies by ``2**(h + extra_headroom) / N``. FP8
    sums that overflowed (non-finite, or at the format maximum) are counted in ``n_saturated``; a non-finite
    sum marks ``found_nonfinite`` on every rank. Other arguments as :func:`all_reduce_fp8`.
    """
    check_call("all_reduce_fp8_native", layout, group, slices, margin=margin)
    flat, plans, shared, out, n_sat = _prepare(x, layout, group, out, fp8_dtype, fused, slices, True, amax_group)
    world, kernels = dist.get_world_size(group), shared.kernels
    counts = torch.zeros(2, dtype=torch.int64, device=flat.device)  # sums at/over the maximum, non-finite sums
    h = native_prescale_exponent(world)
    if isinstance(extra_headroom, torch.Tensor):
        headroom = extra_headroom.to(device=flat.device, dtype=torch.int64) + h
    else:  # a fill, not a host-to-device copy (which would wait for the stream)
        headroom = torch.full((), int(extra_headroom) + h, dtype=torch.int64, device=flat.device)
    common = {"margin": margin, "headroom": headroom}

    def start(k):
        shared.wait(k)
        q = torch.empty(plans[k].row, dtype=torch.uint8, device=flat.device)
        kernels.quantize(flat, plans[k].cast, shared.amax, fp8_dtype, q, n_sat, **common)
        work = None
        if world > 1:
            work = dist.all_reduce(q.view(fp8_dtype), op=dist.ReduceOp.SUM, group=group, async_op=True)
        return q, work

    def finish(k, flight):
        q, work = flight
        wait(work)
        kernels.dequantize(q, plans[k].decode, shared.amax, fp8_dtype, out, inv_divisor=1.0 / world, counts=counts,
                           **common)  # fmt: skip

    _pipeline(len(plans), shared, start, finish)
    stats = cast_stats(shared.amax, n_sat + counts[0], flat.numel(), found=counts[1] > 0)
    return out, stats


def all_reduce_fp8_gather(
    x: torch.Tensor,
    layout: SegmentLayout,
    group: dist.ProcessGroup | None,
    fp8_dtype: torch.dtype,
    *,
    margin: int = 0,
    fused: bool = False,
    slices: int = 1,
    out: torch.Tensor | None = None,
    amax_group: dist.ProcessGroup | None = None,
    rows: CollectiveRows | SymmetricRows | None = None,
) -> tuple[torch.Tensor, CastStats]:
    """Mean over ranks of flat ``x``: every rank's FP8 bytes reach every rank, which sums them in fp32, in rank order.

    One rounding (the cast; the sum is exact and its mean is rounded once to ``x.dtype``), identical bytes on every
    rank, no overflow of the sum. Each rank receives ``N - 1`` rows of one byte per element: as many bytes as a
    two-rank ring all-reduce moves, more on more ranks. ``rows`` moves them (:mod:`~lightning_fp8.distributed.
    exchange`): an FP8 all-gather of ``group`` (the default) or copy-engine copies out of CUDA symmetric memory.
    Other arguments as :func:`all_reduce_fp8`.

    Raises:
        ValueError: for ``rows`` made for a group of other ranks than ``group`` (:func:`check_rows_group`).
    """
    check_fp8_dtype(fp8_dtype)  # before the exchange's start-of-call barrier
    check_call("all_reduce_fp8_gather", layout, group, slices, margin=margin)
    if rows is not None:
        check_rows_group(group, rows)
    flat, plans, shared, out, n_sat = _prepare(x, layout, group, out, fp8_dtype, fused, slices, True, amax_group)
    world, kernels = dist.get_world_size(group), shared.kernels
    rows = CollectiveRows(group) if rows is None else rows
    rows.begin(plans, flat.device)

    def start(k):  # cast into this rank's row, start the exchange
        shared.wait(k)
        kernels.quantize(flat, plans[k].cast, shared.amax, fp8_dtype, rows.mine(k), n_sat, margin=margin)
        return rows.send(k)

    def finish(k, flight):  # the mean of every rank's row
        kernels.rows_sum(rows.received(k, flight), plans[k].decode, shared.amax, fp8_dtype, out, margin=margin,
                         inv_divisor=1.0 / world)  # fmt: skip

    _pipeline(len(plans), shared, start, finish)
    return out, cast_stats(shared.amax, n_sat, flat.numel())
