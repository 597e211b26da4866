"""FP8 collectives with shared power-of-two scales: the numerics of FP8 gradient communication.

The data-parallel mean ``g = sum_i g_i / N`` overflows FP8 if the division comes after an FP8 sum and
underflows if each ``g_i`` is divided first (DESIGN.md "FP8 gradient communication"). Here:

1. **Shared scales.** Every rank computes the amax of each tensor (scale group) of the buffer; one MAX
   all-reduce of those few floats gives every rank the same amaxes, hence the same power-of-two scales
   ``s = 2 ** floor(log2(fp8_max / amax))`` (:func:`lightning_fp8.scale_rule.compute_scale`). A non-finite value
   on any rank makes its amax non-finite everywhere: every rank knows before the tensor's bytes are sent.
2. **Portable reduce-scatter** (gloo and NCCL, :func:`reduce_scatter_fp8`): ``x_fp8 = saturate(x * s)`` as
   bytes, an all-to-all of the chunks, and a local fp32 sum ``sum_i x_fp8_i * s^-1``. The scales are shared,
   so the FP8 values are summed first and the scale applied once; nothing is divided by N before the sum (no
   underflow) and the sum runs in fp32 (no overflow).
3. **All-gather** of reduced chunks (:func:`all_gather_fp8`), requantized with fresh per-piece scales computed
   by the rank that owns the chunk; the pieces' amaxes travel beside its bytes (4 bytes per piece), so every rank
   decodes the same bytes with the same scales and data-parallel replicas stay bit-identical.

The all-reduces built from these (portable, and native on NCCL's float8 sum) live in
:mod:`lightning_fp8.distributed.allreduce`. The elementwise work is done by the segmented kernels of
:mod:`lightning_fp8.distributed.quantize` (Triton on CUDA: one launch per pass over a whole buffer or slice).
On the wire: 1 byte per element for the FP8 data, plus 4 bytes per scale group (amax all-reduce) and per piece.
Collectives are looked up on ``torch.distributed`` at call time, so tests can count the bytes they move.
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_fp8 import ops
from lightning_fp8.distributed.layout import SegmentLayout, reduce_scatter_plan
from lightning_fp8.distributed.quantize import segment_kernels
from lightning_fp8.formats import check_fp8_dtype
from lightning_fp8.kernels.comm_table import ALIGN, BlockTable, block_table
from lightning_fp8.recipe import MAX_MARGIN

# What the collectives read and write: the high-precision values around the FP8 bytes on the wire (the decode
# saturates at the output dtype's finite range, which only floating-point dtypes have).
HIGH_PRECISION_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


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
def check_dtypes(caller: str, fp8_dtype: torch.dtype, **dtypes: torch.dtype | None) -> None:
    """Raise before any collective runs (every rank gets the same answer) unless ``fp8_dtype`` is an FP8 format and
    each of ``dtypes`` (``name=dtype``; None: not given) one of :data:`HIGH_PRECISION_DTYPES`.

    Raises:
        ValueError: for an ``fp8_dtype`` that is not E4M3 or E5M2.
        TypeError: for an integer, complex, bool or FP8 buffer or output dtype.
    """
    check_fp8_dtype(fp8_dtype)
    for name, dtype in dtypes.items():
        if dtype is not None and dtype not in HIGH_PRECISION_DTYPES:
            allowed = ", ".join(str(d) for d in HIGH_PRECISION_DTYPES)
            raise TypeError(
                f"{caller}: {name} is {dtype}, but FP8 collectives read and write high-precision floating-point values "
                f"({allowed}) and do the casts to and from {fp8_dtype} themselves: pass one of those dtypes (convert "
                "an integer or FP8 tensor first, e.g. x.float())"
            )


def check_call(
    caller: str, layout: object, group: object, slices: object = 1, divisor: object = 1.0, margin: object = 0
) -> None:
    """Raise before any collective runs (every rank gets the same answer) for a ``layout`` that is no SegmentLayout, a
    ``group`` that is no process group, ``slices`` that is no int >= 1, a ``divisor`` that is no finite number > 0
    (0 used to raise ZeroDivisionError, a negative one or NaN to flip or poison every gradient without a word) or a
    ``margin`` that is no int in ``[0, MAX_MARGIN]`` (it used to fail in the first cast, after the amax all-reduce,
    naming ``compute_scale``).

    Raises:
        TypeError: for an argument of the wrong type.
        ValueError: for ``slices`` < 1, a ``divisor`` that is not finite and > 0, a ``margin`` out of range, or a
            group without this rank.
    """
    if not isinstance(layout, SegmentLayout):
        raise TypeError(
            f"{caller}(layout=...) got a {type(layout).__name__}: pass a SegmentLayout, e.g. "
            "SegmentLayout.per_tensor([t.numel() for t in tensors])"
        )
    check_group(group, f"{caller}(group=...)", "call the collective only on the ranks of the group")
    if isinstance(slices, bool) or not isinstance(slices, numbers.Integral):
        raise TypeError(f"{caller}(slices={slices!r}): must be an int (pipeline slices)")
    if slices < 1:
        raise ValueError(f"{caller}(slices={slices}): must be >= 1 (pipeline slices; 1 for no pipelining)")
    if isinstance(divisor, bool) or not isinstance(divisor, numbers.Real):
        raise TypeError(f"{caller}(divisor={divisor!r}): must be a number (e.g. the world size, for a mean)")
    if not 0 < divisor < math.inf:
        raise ValueError(f"{caller}(divisor={divisor!r}): must be finite and > 0 (e.g. the world size, for a mean)")
    if isinstance(margin, bool) or not isinstance(margin, numbers.Integral):
        raise TypeError(f"{caller}(margin={margin!r}): must be an int (binades of headroom in the cast scales)")
    if not 0 <= margin <= MAX_MARGIN:
        raise ValueError(
            f"{caller}(margin={margin}): must be in [0, {MAX_MARGIN}] (binades of headroom in the cast scales; 0 maps "
            "the amax into the top binade)"
        )


def check_group(group: object, where: str, not_member: str, passing: str = "or None for the world") -> None:
    """Raise for a ``group`` argument that is neither None nor a process group of this rank's: ValueError for torch's
    ``NON_GROUP_MEMBER`` marker (what ``new_group`` gives the ranks it leaves out; ``not_member`` says what to do),
    TypeError for anything that is no process group (``passing`` ends the hint). ``where``: ``"caller(name=...)"``."""
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"{where}: this rank ({dist.get_rank()}) is not a member of the group (new_group gave it torch's "
            f"NON_GROUP_MEMBER marker): {not_member}"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{where} got a {type(group).__name__}: pass a process group (torch.distributed.new_group, or a "
            f"DeviceMesh's get_group()), {passing}"
        )


def _world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def cast_stats(
    amax: torch.Tensor, n_saturated: torch.Tensor, numel: int, found: torch.Tensor | None = None
) -> CastStats:
    """Statistics of a collective from its shared group amaxes (and an extra non-finite flag, e.g. an FP8 sum's)."""
    top = amax.max() if amax.numel() else torch.zeros((), dtype=amax.dtype, device=amax.device)
    nonfinite = ~torch.isfinite(top)
    return CastStats(top, n_saturated.to(torch.int64), numel, nonfinite if found is None else nonfinite | found)


def local_amax(x: torch.Tensor) -> torch.Tensor:
    """``max|x|`` of this rank's values as 0-dim fp32 (one fused reduction), NaN read as inf: a MAX all-reduce may
    drop a NaN, never an inf. For values that travel in their own dtype: only their non-finite check needs it."""
    return ops.amaxes([x])[0]


def all_reduce_max(amax: torch.Tensor, group, async_op: bool = False):
    """MAX all-reduce of a few amaxes in place (nothing to do on one rank); the work handle when ``async_op``."""
    if dist.get_world_size(group) == 1 or not amax.numel():
        return None
    return dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group, async_op=async_op)


def all_to_all_bytes(send: torch.Tensor, group):
    """Asynchronous all-to-all of equal byte chunks; returns ``(received, work or None)``."""
    if dist.get_world_size(group) == 1:
        return send, None
    received = torch.empty_like(send)
    return received, dist.all_to_all_single(received, send, group=group, async_op=True)


def all_gather_bytes(send: torch.Tensor, group, async_op: bool = False):
    """All-gather a uint8 buffer; returns ``(gathered (world, len), work or None)``."""
    world = dist.get_world_size(group)
    if world == 1:
        return send.view(1, -1), None
    gathered = torch.empty(world * send.numel(), dtype=torch.uint8, device=send.device)
    # all_gather_single is the name from torch 2.13 on; all_gather_into_tensor before (same collective).
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = fn(gathered, send, group=group, async_op=async_op)
    return gathered.view(world, send.numel()), work


def wait(work) -> None:
    if work is not None:
        work.wait()


def send_buffer(plan, world: int, device: torch.device) -> torch.Tensor:
    """The FP8 send buffer of a slice (``world`` rows of ``plan.row`` bytes), its padding zeroed."""
    return zero_padding(torch.empty(world * plan.row, dtype=torch.uint8, device=device), plan)


def zero_padding(send: torch.Tensor, plan) -> torch.Tensor:
    """``send`` (a slice's ``world`` rows of ``plan.row`` bytes), the padding after its last chunk zeroed."""
    for offset, length in plan.pad:
        send[offset : offset + length].zero_()
    return send


# ---------------------------------------------------------------------------------------------------- reduce-scatter
def reduce_scatter_fp8(
    x: torch.Tensor,
    layout: SegmentLayout,
    group: dist.ProcessGroup | None,
    fp8_dtype: torch.dtype,
    *,
    margin: int = 0,
    fused: bool = False,
    slices: int = 1,
    out: torch.Tensor | None = None,
    divisor: float = 1.0,
    other_amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, CastStats]:
    """Sum-reduce-scatter of flat ``x`` (``world_size * chunk`` elements) through FP8 bytes.

    Args:
        x: this rank's flat buffer; chunk ``r`` (``x[r*chunk:(r+1)*chunk]``) goes to rank ``r``.
        layout: the segments and scale groups of ``x`` (``layout.numel == x.numel()``).
        group: the process group.
        fp8_dtype: the wire format (E4M3 or E5M2).
        margin: binades of headroom in the cast scales.
        fused: run the Triton kernels (CUDA, or CPU under ``TRITON_INTERPRET=1``) instead of the references.
        slices: pipeline the chunks in this many slices (the cast of one overlaps the all-to-all of another).
        out: write the result here (``chunk`` elements, contiguous, any float dtype) instead of a new fp32 tensor.
        divisor: divide the sum by this (FSDP1 takes the mean itself: ``world_size``).
        other_amax: the :func:`local_amax` of gradients reduced beside this one in their own dtype; it rides on
            the amaxes' MAX all-reduce (no collective of its own) and only marks ``stats.found_nonfinite``.

    Returns:
        ``(chunk_sum, stats)``: this rank's chunk summed over ranks, divided by ``divisor``.

    Raises:
        TypeError, ValueError: for dtypes :func:`check_dtypes` refuses, sizes that do not match; before any collective.
    """
    check_call("reduce_scatter_fp8", layout, group, slices, divisor, margin)
    check_dtypes("reduce_scatter_fp8", fp8_dtype, x=x.dtype, out=None if out is None else out.dtype)
    world, rank = _world(group)
    if layout.numel != x.numel():
        raise ValueError(
            f"reduce_scatter_fp8: a buffer of {x.numel()} elements with a layout of {layout.numel} elements: pass the "
            "layout of this buffer (layout.numel == x.numel())"
        )
    if x.numel() % world:
        padded = _round_up(x.numel(), world)
        raise ValueError(
            f"reduce_scatter_fp8: a buffer of {x.numel()} elements does not split into {world} equal chunks (one per "
            f"rank): pad the buffer to {padded} elements and its layout with layout.padded({padded})"
        )
    flat = x.reshape(-1)
    chunk = flat.numel() // world
    if out is None:
        out = torch.empty(chunk, dtype=torch.float32, device=flat.device)
    elif out.numel() != chunk or not out.is_contiguous():
        raise ValueError(f"reduce_scatter_fp8: out must be contiguous with {chunk} elements, got {tuple(out.shape)}")
    kernels = segment_kernels(fused)
    amax_table, plans = reduce_scatter_plan(layout, world, rank, slices, flat.device)
    groups = layout.num_groups
    amax = torch.zeros(groups + (other_amax is not None), dtype=torch.float32, device=flat.device)
    kernels.segment_amax(flat, amax_table, amax)
    if other_amax is not None:
        amax[groups:].copy_(other_amax.reshape(1))
    all_reduce_max(amax, group)  # every scale known (and every non-finite value seen) before any byte is sent
    n_sat = torch.zeros((), dtype=torch.int64, device=flat.device)
    common = {"margin": margin}

    def start(plan):
        send = send_buffer(plan, world, flat.device)
        kernels.quantize(flat, plan.cast, amax, fp8_dtype, send, n_sat, **common)
        return all_to_all_bytes(send, group)

    flights = [start(plans[0])]
    for i, plan in enumerate(plans):
        if i + 1 < len(plans):  # cast the next slice while this one is on the wire
            flights.append(start(plans[i + 1]))
        received, work = flights[i]
        wait(work)
        rows = received.view(world, plan.row)
        kernels.rows_sum(rows, plan.sum, amax, fp8_dtype, out.view(-1), inv_divisor=1.0 / divisor, **common)
    other_found = None if other_amax is None else ~torch.isfinite(amax[groups])
    return out, cast_stats(amax[:groups], n_sat, flat.numel(), other_found)


# ---------------------------------------------------------------------------------------------------- all-gather
@dataclass(frozen=True)
class _GatherPlan:
    """The tables of :func:`all_gather_fp8`: ``world`` chunks of exactly ``chunk`` elements, each sent as one row of
    ``row_bytes`` bytes: its FP8 bytes, zeros up to ``amax_offset``, then the amaxes of its pieces (fp32)."""

    cast: BlockTable  # this rank's chunk -> its FP8 bytes; value = out = the piece
    decode: BlockTable  # the gathered rows -> the whole buffer; value = the fp32 index of the piece's amax in the rows
    row_bytes: int
    amax_offset: int


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _rows_table(rows: list[tuple[int, int, int, int]], device: torch.device) -> BlockTable:
    # rows: (src, dst, length, value) per segment.
    return block_table(*(zip(*rows, strict=True) if rows else [()] * 4), device=device)


def _gather_size_message(layout_numel: int, chunk_numel: int, world: int) -> str:
    # The layout describes the whole gathered buffer, world chunks of equal size: say which side to pad.
    given = f"all_gather_fp8: a chunk of {chunk_numel} elements on each of {world} ranks, a layout of {layout_numel}"
    total = world * chunk_numel
    if layout_numel < total:
        return f"{given}: pad the layout to the gathered {total} elements, layout.padded({total})"
    chunk = -(-layout_numel // world)
    return (
        f"{given}: give each rank a chunk of {chunk} elements (padded) and pad the layout to {world * chunk}, "
        f"layout.padded({world * chunk})"
    )


@functools.lru_cache(maxsize=256)
def _gather_plan(layout: SegmentLayout, world: int, rank: int, device: torch.device) -> _GatherPlan:
    # Not all_reduce_plan's portable tables: those round each rank's chunk up to ALIGN elements, while the chunks
    # gathered here are exactly layout.numel / world elements, whatever that is. The rows and the amaxes' offset stay
    # ALIGN-aligned (vector access where a chunk is aligned too; the amaxes are read as fp32).
    chunk = layout.numel // world
    pieces = [layout.parts(r * chunk, (r + 1) * chunk) for r in range(world)]
    amax_offset = _round_up(chunk, ALIGN)
    row_bytes = amax_offset + _round_up(4 * max(1, max(len(p) for p in pieces)), ALIGN)
    base = rank * chunk
    cast = [(o - base, o - base, n, j) for j, (o, n, _) in enumerate(pieces[rank])]
    decode = [
        (r * row_bytes + o - r * chunk, o, n, (r * row_bytes + amax_offset) // 4 + j)
        for r, mine in enumerate(pieces) for j, (o, n, _) in enumerate(mine)
    ]  # fmt: skip
    return _GatherPlan(_rows_table(cast, device), _rows_table(decode, device), row_bytes, amax_offset)


def all_gather_fp8(
    chunk: torch.Tensor,
    layout: SegmentLayout,
    group: dist.ProcessGroup | None,
    fp8_dtype: torch.dtype,
    out_dtype: torch.dtype,
    *,
    margin: int = 0,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather this rank's ``chunk`` of a buffer with ``layout``, as FP8 bytes plus one amax per piece.

    Each rank quantizes its own chunk with a fresh scale per piece (its own amax) and sends the amaxes beside the
    bytes, so no extra collective is needed and every rank decodes exactly the same values. The layout's
    ``numel`` must be ``world_size * chunk.numel()`` (pad it first); a chunk may have any number of elements.

    Returns:
        ``(full, n_saturated)``: the whole buffer (``layout.numel`` elements) in ``out_dtype``, and the
        saturation count of this rank's cast.

    Raises:
        TypeError, ValueError: for dtypes :func:`check_dtypes` refuses, sizes that do not match; before any collective.
    """
    check_call("all_gather_fp8", layout, group, margin=margin)
    check_dtypes("all_gather_fp8", fp8_dtype, chunk=chunk.dtype, out_dtype=out_dtype)
    world, rank = _world(group)
    if layout.numel != world * chunk.numel():
        raise ValueError(_gather_size_message(layout.numel, chunk.numel(), world))
    kernels = segment_kernels(fused)
    plan = _gather_plan(layout, world, rank, chunk.device)
    send = torch.zeros(plan.row_bytes, dtype=torch.uint8, device=chunk.device)
    piece_amax = send[plan.amax_offset :].view(torch.float32)
    n_sat = torch.zeros((), dtype=torch.int64, device=chunk.device)
    flat = chunk.reshape(-1)
    kernels.segment_amax(flat, plan.cast, piece_amax)
    kernels.quantize(flat, plan.cast, piece_amax, fp8_dtype, send, n_sat, margin=margin)
    gathered, work = all_gather_bytes(send, group)
    wait(work)
    full = torch.empty(layout.numel, dtype=out_dtype, device=chunk.device)
    kernels.dequantize(gathered, plan.decode, gathered.view(-1).view(torch.float32), fp8_dtype, full, margin=margin)
    return full, n_sat
