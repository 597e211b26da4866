"""Block tables of segmented FP8 communication: flat buffers cut into tiles that never straddle a segment.

Pure PyTorch (no Triton): the kernels of :mod:`lightning_fp8.kernels.comm` and their references in
``lightning_fp8/distributed/quantize.py`` read the same table (see kernels/comm.py for the row layout).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Elements per tile (a power of two): 8192 bf16 is 16 KB per program, enough to stream at full bandwidth.
BLOCK = 8192
# A tile whose src, dst and length are multiples of ALIGN elements is read and written in 16-byte vectors; without
# that knowledge Triton emits one load and one store per element (measured on an H200: an FP8 cast of 1B bf16
# elements took 8.4 ms with scalar byte stores). Segment edges that break the alignment go to separate small tiles.
ALIGN = 16


@dataclass(frozen=True)
class BlockTable:
    """Rows ``(src, dst, length, value, out)`` (int64, on the kernels' device): ``aligned`` leading rows whose src,
    dst and length are multiples of :data:`ALIGN` (at most ``block`` elements), then the others (at most
    ``edge_block`` elements: segment edges, or whole segments whose src and dst disagree modulo ALIGN)."""

    rows: torch.Tensor
    aligned: int
    block: int
    edge_block: int
    numel: int  # total elements over all rows (known on the host: no synchronization to size a reference)

    def __len__(self) -> int:
        return self.rows.shape[0]


def _tiles(runs: list[tuple[int, int, int, int, int]], block: int) -> torch.Tensor:
    # Cut runs (src, dst, length, value, out) into tiles of at most `block` elements: (n, 5) int64, on the host
    # (whatever torch.set_default_device says).
    cols = torch.tensor(runs, dtype=torch.int64, device="cpu").reshape(-1, 5).T
    lengths = cols[2]
    tiles = (lengths + block - 1) // block
    seg = torch.repeat_interleave(torch.arange(lengths.numel(), device="cpu"), tiles)
    offset = (torch.arange(seg.numel(), device="cpu") - (torch.cumsum(tiles, 0) - tiles)[seg]) * block
    return torch.stack(
        [cols[0][seg] + offset, cols[1][seg] + offset, torch.clamp(lengths[seg] - offset, max=block), cols[3][seg],
         cols[4][seg]], dim=1,
    )  # fmt: skip


def block_table(
    src: Sequence[int],
    dst: Sequence[int],
    length: Sequence[int],
    value: Sequence[int],
    out: Sequence[int] | None = None,
    *,
    device: torch.device | str = "cpu",
    block: int = BLOCK,
) -> BlockTable:
    """Cut segments ``i`` (``src[i]``, ``dst[i]``, ``length[i]``, ``value[i]``, ``out[i]``) into tiles.

    A segment whose src and dst agree modulo :data:`ALIGN` becomes a ragged head, aligned tiles of at most ``block``
    elements, and a ragged tail; any other segment becomes unaligned tiles of at most ``block`` elements.

    Raises:
        ValueError: if ``block`` is not a power of two >= ALIGN, the columns differ in length, or a length is negative.
    """
    if block < ALIGN or block & (block - 1):
        raise ValueError(f"block_table(block={block}): the tile size must be a power of two >= {ALIGN}")
    out = value if out is None else out
    if not len(src) == len(dst) == len(length) == len(value) == len(out):
        raise ValueError("block_table: src, dst, length, value and out need one entry per segment")
    if any(n < 0 for n in length):
        raise ValueError(f"block_table: segment lengths must be >= 0, got {list(length)}")
    bulk, edges = [], []
    for s, d, n, v, o in zip(src, dst, length, value, out, strict=True):
        if (s - d) % ALIGN:
            edges.append((s, d, n, v, o))
            continue
        head = min(n, -s % ALIGN)
        body = (n - head) // ALIGN * ALIGN
        edges.append((s, d, head, v, o))
        bulk.append((s + head, d + head, body, v, o))
        edges.append((s + head + body, d + head + body, n - head - body, v, o))
    bulk_rows, edge_rows = _tiles(bulk, block), _tiles(edges, block)
    longest = int(edge_rows[:, 2].max()) if len(edge_rows) else 1
    edge_block = max(ALIGN, 1 << (longest - 1).bit_length())
    rows = torch.cat([bulk_rows, edge_rows]).to(device)
    return BlockTable(rows, len(bulk_rows), block, edge_block, sum(int(n) for n in length))


# ------------------------------------------------------------------------------------------------------------- helpers


def check_headroom(headroom: torch.Tensor | None, caller: str) -> None:
    """Raise ValueError unless ``headroom`` is None or one int64 value: the segment kernels (Triton and reference
    alike) shift every segment's scale by the same one."""
    if headroom is not None and (headroom.numel() != 1 or headroom.dtype != torch.int64):
        raise ValueError(
            f"{caller}: headroom must be one int64 value shared by every segment, got {headroom.dtype} of shape "
            f"{tuple(headroom.shape)}; quantize segments with different headrooms in separate calls"
        )
