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

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SegmentLayout:
    """A flat buffer cut into consecutive segments, each quantized with the scale of its group.

    Args:
        lengths: element count of each segment (zero allowed: empty tensors and empty shards).
        groups: the scale group of each segment, in ``range(num_groups)``.
        num_groups: the number of scale groups (a group may own several segments, e.g. one parameter's
            column block in every row of an FSDP2 reduce-scatter buffer).
    """

    lengths: tuple[int, ...]
    groups: tuple[int, ...]
    num_groups: int

    def __post_init__(self) -> None:
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
        numels = tuple(int(n) for n in numels)
        return cls(numels, tuple(range(len(numels))), len(numels))

    @classmethod
    def blocks(cls, numel: int, block: int) -> SegmentLayout:
        """Fixed-size blocks with one scale each (used when tensor boundaries are unknown)."""
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
        columns = tuple(int(n) for n in columns)
        return cls(columns * world_size, tuple(range(len(columns))) * world_size, len(columns))

    @property
    def numel(self) -> int:
        return sum(self.lengths)

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


@dataclass(frozen=True)
class DeviceLayout:
    """The device tensors a layout needs at run time (cached: built once per layout, world size and device)."""

    seg_ends: torch.Tensor  # (segments,) int64: exclusive end offset of each segment
    seg_groups: torch.Tensor  # (segments,) int64
    # Of this rank's chunk: its pieces' lengths (host), ends (relative to the chunk) and groups.
    chunk_lengths: tuple[int, ...]
    chunk_ends: torch.Tensor
    chunk_groups: torch.Tensor
    # All chunks' pieces, chunk after chunk, for decoding an all-gather whose chunks carry per-piece scales:
    # the ends (over the whole buffer) and each piece's index into the gathered (world_size, max_pieces) table.
    all_piece_ends: torch.Tensor
    all_piece_index: torch.Tensor
    max_pieces: int
    chunk_numel: int


@functools.lru_cache(maxsize=256)
def device_layout(layout: SegmentLayout, world_size: int, rank: int, device: torch.device) -> DeviceLayout:
    """Build (once) the run-time tensors of ``layout`` chunked over ``world_size`` ranks, for ``rank``."""
    ends, pos = [], 0
    for length in layout.lengths:
        pos += length
        ends.append(pos)
    pieces = layout.chunk_pieces(world_size)
    max_pieces = max(1, max(len(p) for p in pieces))
    chunk_numel = layout.numel // world_size
    all_ends, all_index, pos = [], [], 0
    for r, chunk in enumerate(pieces):
        for j, (length, _group) in enumerate(chunk):
            pos += length
            all_ends.append(pos)
            all_index.append(r * max_pieces + j)
    mine = pieces[rank]
    mine_ends, pos = [], 0
    for length, _group in mine:
        pos += length
        mine_ends.append(pos)

    def as_long(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return DeviceLayout(
        seg_ends=as_long(ends),
        seg_groups=as_long(list(layout.groups)),
        chunk_lengths=tuple(length for length, _ in mine),
        chunk_ends=as_long(mine_ends),
        chunk_groups=as_long([g for _, g in mine]),
        all_piece_ends=as_long(all_ends),
        all_piece_index=as_long(all_index),
        max_pieces=max_pieces,
        chunk_numel=chunk_numel,
    )
