"""Where the scales of a flat communication buffer apply: segments, scale groups and chunks.

A collective moves one flat buffer (a DDP bucket, an FSDP flat gradient, an FSDP2 all-gather input). Each
tensor in it must be quantized with its own power-of-two scale, so the buffer is described as consecutive
*segments*, each belonging to a *scale group* (one group per tensor). The groups' scales are shared by every
rank (one MAX all-reduce of the group amaxes), so the FP8 bytes of one rank mean the same to every other rank.

For a reduce-scatter the buffer is cut into ``world_size`` equal *chunks*; rank ``r`` receives chunk ``r`` of
every rank. *Pieces* are the segments cut again at chunk boundaries: the requantized result of rank ``r``
carries one fresh scale per piece of its chunk (see :mod:`lightning_fp8.distributed.comm`).

::

    flat buffer     | p0 ............ | p1 ...... | p2 .................. | pad |
    chunks (W = 2)  | chunk 0 ....................| chunk 1 ........................|
    pieces          | p0 ............ | p1 .......|.| p2 .................. | pad |
"""

from __future__ import annotations

import bisect
import functools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_fp8.kernels.comm_table import ALIGN, BLOCK, BlockTable, block_table


@dataclass(frozen=True)
class SegmentLayout:
    """A flat buffer cut into consecutive segments, each quantized with the scale of its group.

    Args:
        lengths: element count of each segment (zero allowed: empty tensors and empty shards).
        groups: the scale group of each segment, in ``range(num_groups)``.
        num_groups: the number of scale groups (a group may own several segments, e.g. one parameter's
            column block in every row of an FSDP2 reduce-scatter buffer).

    ``lengths`` and ``groups`` are kept as tuples of ints (any sequence of integers is taken).

    Raises:
        TypeError: for a length, group or ``num_groups`` that is no integer (a bool, a float).
        ValueError: for negative counts, one group per segment missing, or a group outside ``range(num_groups)``.
    """

    lengths: tuple[int, ...]
    groups: tuple[int, ...]
    num_groups: int

    def __post_init__(self) -> None:
        # Ints in tuples (lists, NumPy integers too): a float length made float offsets, a list an unhashable layout
        # (the collectives cache their plans by layout).
        object.__setattr__(self, "lengths", tuple(_count(n, "SegmentLayout", "lengths") for n in self.lengths))
        object.__setattr__(self, "groups", tuple(_count(g, "SegmentLayout", "groups") for g in self.groups))
        object.__setattr__(self, "num_groups", _count(self.num_groups, "SegmentLayout", "num_groups"))
        if len(self.lengths) != len(self.groups):
            raise ValueError(
                f"SegmentLayout: {len(self.lengths)} lengths but {len(self.groups)} groups; give one group per segment"
            )
        if any(n < 0 for n in self.lengths):
            raise ValueError(f"SegmentLayout: segment lengths must be >= 0, got {self.lengths}")
        if any(not 0 <= g < self.num_groups for g in self.groups):
            raise ValueError(f"SegmentLayout: groups {self.groups} must lie in range({self.num_groups})")

    @classmethod
    def per_tensor(cls, numels: Sequence[int]) -> SegmentLayout:
        """One segment and one scale group per tensor, in order."""
        numels = tuple(_count(n, "SegmentLayout.per_tensor", "numels") for n in numels)
        return cls(numels, tuple(range(len(numels))), len(numels))

    @classmethod
    def blocks(cls, numel: int, block: int) -> SegmentLayout:
        """Fixed-size blocks with one scale each (used when tensor boundaries are unknown)."""
        numel, block = _count(numel, "SegmentLayout.blocks", "numel"), _count(block, "SegmentLayout.blocks", "block")
        if block < 1:
            raise ValueError(f"SegmentLayout.blocks(block={block}): the block size must be >= 1")
        full, rest = divmod(numel, block)
        lengths = (block,) * full + ((rest,) if rest else ())
        return cls(lengths, tuple(range(len(lengths))), len(lengths))

    @classmethod
    def rows(cls, world_size: int, columns: Sequence[int]) -> SegmentLayout:
        """``world_size`` rows of the same column blocks; block ``j`` of every row shares scale group ``j``.

        This is FSDP2's reduce-scatter buffer: row ``r`` holds every parameter's ``r``-th shard.
        """
        world_size = _count(world_size, "SegmentLayout.rows", "world_size")
        if world_size < 1:
            raise ValueError(f"SegmentLayout.rows(world_size={world_size}): a group has at least one rank")
        columns = tuple(_count(n, "SegmentLayout.rows", "columns") for n in columns)
        return cls(columns * world_size, tuple(range(len(columns))) * world_size, len(columns))

    @property
    def numel(self) -> int:
        return sum(self.lengths)

    @functools.cached_property
    def _ends(self) -> tuple[int, ...]:
        ends, pos = [], 0
        for length in self.lengths:
            pos += length
            ends.append(pos)
        return tuple(ends)

    def parts(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """The non-empty segments cut to elements ``[start, end)``, as ``(offset, length, group)`` in order."""
        out = []
        i = bisect.bisect_right(self._ends, start)
        while i < len(self.lengths) and start < end:
            cut = min(self._ends[i], end)
            if cut > start:
                out.append((start, cut - start, self.groups[i]))
            start = max(start, cut)
            i += 1
        return out

    def ordered(self) -> bool:
        """Whether the groups of the non-empty segments never decrease along the buffer (one tensor after another)."""
        groups = [g for n, g in zip(self.lengths, self.groups, strict=True) if n]
        return all(a <= b for a, b in zip(groups, groups[1:], strict=False))

    def padded(self, numel: int) -> SegmentLayout:
        """This layout followed by a padding segment (its own group, amax 0) up to ``numel`` elements."""
        pad = numel - self.numel
        if pad < 0:
            raise ValueError(f"SegmentLayout.padded({numel}): the layout already has {self.numel} elements")
        if pad == 0:
            return self
        return SegmentLayout(self.lengths + (pad,), self.groups + (self.num_groups,), self.num_groups + 1)

    def slice(self, start: int, end: int) -> SegmentLayout:
        """The layout of elements ``[start, end)``: the segments cut there, keeping their groups (and group count)."""
        lengths, groups, pos = [], [], 0
        for length, group in zip(self.lengths, self.groups, strict=True):
            lo, hi = max(pos, start), min(pos + length, end)
            if hi > lo:
                lengths.append(hi - lo)
                groups.append(group)
            pos += length
        return SegmentLayout(tuple(lengths), tuple(groups), self.num_groups)

    def chunk_pieces(self, world_size: int) -> list[list[tuple[int, int]]]:
        """For each of ``world_size`` equal chunks, its pieces as ``(length, group)``, in order.

        The layout's ``numel`` must be a multiple of ``world_size`` (pad it first).
        """
        total = self.numel
        if total % world_size:
            raise ValueError(f"SegmentLayout: {total} elements do not split into {world_size} equal chunks; pad first")
        chunk = total // world_size
        pieces: list[list[tuple[int, int]]] = [[] for _ in range(world_size)]
        start = 0
        for length, group in zip(self.lengths, self.groups, strict=True):
            end = start + length
            pos = start
            while pos < end:
                r = pos // chunk
                cut = min(end, (r + 1) * chunk)
                pieces[r].append((cut - pos, group))
                pos = cut
            start = end
        return pieces


# ------------------------------------------------------------------------------------------------------------- plans
@dataclass(frozen=True)
class SlicePlan:
    """One slice of a pipelined collective: the block tables of its kernels, built once per layout.

    ``row`` elements per rank travel in the first collective (a slice's chunk); ``cast`` reads the flat input and
    writes the send buffer (its ``pad`` byte ranges are zeroed instead); ``sum`` reads the received rows; ``decode``
    writes the output. ``groups`` are the scale groups whose amax all-reduce must come before this slice's cast, after
    the amax of slices ``0 .. amax_through`` (see :func:`_amax_stages`).
    """

    start: int
    end: int
    row: int
    cast: BlockTable
    pad: tuple[tuple[int, int], ...] = ()
    sum: BlockTable | None = None
    decode: BlockTable | None = None
    gather_row_bytes: int = 0  # portable all-reduce: bytes of one gathered row (FP8 chunk, then piece amaxes)
    amax_offset: int = 0  # ... the byte offset of the piece amaxes in it (4-aligned)
    groups: tuple[int, int] = (0, 0)
    amax_through: int = -1


def _count(value: object, where: str, name: str) -> int:
    """``value`` as a non-negative int (a NumPy or 0-dim tensor integer too): int() would truncate 2.5 to 2, and a
    negative element count would make a layout of another size (divmod(-1, 4) is (-1, 3))."""
    try:
        if isinstance(value, bool):  # operator.index would read True as 1
            raise TypeError
        count = operator.index(value)
    except TypeError:
        raise TypeError(f"{where}({name}=...): expected an int, got {type(value).__name__} {value!r:.40}") from None
    if count < 0:
        raise ValueError(f"{where}({name}=...): must be >= 0, got {count}")
    return count


def slice_bounds(numel: int, slices: int) -> list[tuple[int, int]]:
    """``slices`` near-equal consecutive ranges of ``range(numel)``, cut at multiples of ALIGN (vector tiles)."""
    cuts = [numel * i // max(1, slices) // ALIGN * ALIGN for i in range(max(1, slices))] + [numel]
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:], strict=True) if b > a] or [(0, numel)]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _entries(entries: list[tuple[int, ...]], device, block) -> BlockTable:
    # entries: (src, dst, length, value[, out]) per segment.
    columns = list(zip(*entries, strict=True)) if entries else [(), (), (), ()]
    return block_table(*columns, device=device, block=block)


def _table(parts: list[tuple[int, int, int]], src_base: int, dst_base: int, device, block, out=None) -> BlockTable:
    # parts: (offset, length, group); src = offset - src_base, dst = offset - dst_base, value = group.
    out = out if out is not None else [g for _, _, g in parts]
    entries = [(o - src_base, o - dst_base, n, g, j) for (o, n, g), j in zip(parts, out, strict=True)]
    return _entries(entries, device, block)


def _amax_stages(layout: SegmentLayout, bounds: list[tuple[int, int]]) -> list[tuple[tuple[int, int], int]]:
    """Per slice: the groups ``[lo, hi)`` to all-reduce before its cast, and the last slice their amax needs.

    In an ordered layout (one tensor after another) the scales of slice ``k`` need only the tensors that reach into
    it, so the amax pass and its all-reduce run stage by stage, overlapping the data collectives of earlier slices.
    Otherwise (e.g. FSDP2's rows, where every row holds every tensor) one stage reduces all groups first.
    """
    if not layout.ordered():
        return [((0, layout.num_groups), len(bounds) - 1)] + [((layout.num_groups,) * 2, -1)] * (len(bounds) - 1)
    last_slice: dict[int, int] = {}
    top = []
    for k, (a, b) in enumerate(bounds):
        groups = [g for _, _, g in layout.parts(a, b)]
        top.append(max(groups) + 1 if groups else 0)
        for g in groups:
            last_slice[g] = k
    stages, lo = [], 0
    for k in range(len(bounds)):
        hi = layout.num_groups if k == len(bounds) - 1 else max(lo, top[k])
        through = max((last_slice[g] for g in range(lo, hi) if g in last_slice), default=-1)
        stages.append(((lo, hi), through))
        lo = hi
    return stages


@functools.lru_cache(maxsize=256)
def all_reduce_plan(
    layout: SegmentLayout, world: int, rank: int, slices: int, native: bool, device: torch.device, block: int = BLOCK
) -> tuple[SlicePlan, ...]:
    """The slices of an FP8 all-reduce of a buffer with ``layout``: native (one FP8 sum) or portable.

    Portable: slice ``[a, b)`` is padded to ``world`` chunks of ``row`` elements; rank ``r`` sums chunk ``r`` and
    requantizes it with one scale per *piece* (the segments cut at the chunk's bounds), and sends the pieces' amaxes
    after its FP8 bytes in the all-gather (``gather_row_bytes`` per rank).
    """
    bounds = slice_bounds(layout.numel, slices)
    plans = []
    for (a, b), (groups, through) in zip(bounds, _amax_stages(layout, bounds), strict=True):
        parts = layout.parts(a, b)
        common = {"start": a, "end": b, "groups": groups, "amax_through": through}
        if native:
            cast, decode = _table(parts, 0, a, device, block), _table(parts, a, 0, device, block)
            plans.append(SlicePlan(row=b - a, cast=cast, decode=decode, **common))
            continue
        row = _round_up(math.ceil((b - a) / world), ALIGN)  # rows, chunks and gathered rows stay vector-aligned
        chunks = [layout.parts(min(a + r * row, b), min(a + (r + 1) * row, b)) for r in range(world)]
        pieces = max(1, max(len(c) for c in chunks))
        amax_offset = row
        row_bytes = row + _round_up(4 * pieces, ALIGN)
        base = a + rank * row
        mine, numbered = chunks[rank], list(range(len(chunks[rank])))
        decode = [
            (r * row_bytes + o - (a + r * row), o, n, (r * row_bytes + amax_offset) // 4 + j)
            for r, chunk in enumerate(chunks) for j, (o, n, _) in enumerate(chunk)
        ]  # fmt: skip
        pad = row * world - (b - a)
        plans.append(SlicePlan(
            row=row, cast=_table(parts, 0, a, device, block), pad=((b - a, pad),) if pad else (),
            sum=_table(mine, base, base, device, block, out=numbered),
            decode=_entries(decode, device, block),
            gather_row_bytes=row_bytes, amax_offset=amax_offset, **common,
        ))  # fmt: skip
    return tuple(plans)


@functools.lru_cache(maxsize=256)
def reduce_scatter_plan(
    layout: SegmentLayout, world: int, rank: int, slices: int, device: torch.device, block: int = BLOCK
) -> tuple[BlockTable, tuple[SlicePlan, ...]]:
    """The amax table of the whole buffer and the slices of an FP8 reduce-scatter of it.

    Chunk ``r`` (``layout.numel // world`` elements) goes to rank ``r``; slice ``k`` is the same sub-range
    ``[start, end)`` of every chunk, so each slice is a reduce-scatter of its own and the output is unchanged.
    """
    chunk = layout.numel // world
    amax = _table(layout.parts(0, layout.numel), 0, 0, device, block)
    plans = []
    for c0, c1 in slice_bounds(chunk, slices):
        row = c1 - c0
        cast = []
        for r in range(world):  # row r of the send buffer: slice k of chunk r
            src = r * chunk + c0
            cast += [(o, o - src + r * row, n, g) for o, n, g in layout.parts(src, src + row)]
        base = rank * chunk + c0
        mine = layout.parts(base, base + row)
        plans.append(SlicePlan(start=c0, end=c1, row=row, cast=_entries(cast, device, block),
                               sum=_table(mine, base, base - c0, device, block)))  # fmt: skip
    return amax, tuple(plans)
