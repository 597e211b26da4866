"""What a mutation audit of kernels/comm_table.py found unpinned: which tiles of ``block_table`` are aligned, checked
against BlockTable's and block_table's docstrings. Every segment is covered once, element by element (src + i goes to
dst + i); the leading ``aligned`` rows have src, dst and length multiples of ALIGN and at most ``block`` elements; a
segment whose src and dst agree modulo ALIGN leaves at most ALIGN - 1 elements at each end to unaligned tiles, and
one whose src and dst disagree gets no aligned tile (its vector accesses would be misaligned on one side).
"""

import pytest
from lightning_fp8.kernels.comm_table import ALIGN, block_table


def _check(src, dst, length, block):
    table = block_table(src, dst, length, list(range(len(src))), block=block)
    rows = table.rows.tolist()
    aligned, others = rows[: table.aligned], rows[table.aligned :]
    for s, d, n, _, _ in aligned:
        assert s % ALIGN == 0 and d % ALIGN == 0 and n % ALIGN == 0 and 0 < n <= block, (s, d, n)
    assert table.edge_block >= ALIGN and table.edge_block & (table.edge_block - 1) == 0
    assert all(n <= table.edge_block for _, _, n, _, _ in others)
    for seg, (s0, d0, n0) in enumerate(zip(src, dst, length, strict=True)):
        mine = [r for r in rows if r[3] == seg]
        covered = sorted(i for s, _, n, _, _ in mine for i in range(s, s + n))
        assert covered == list(range(s0, s0 + n0)), seg  # each element once
        assert all(d - s == d0 - s0 for s, d, _, _, _ in mine), seg
        in_aligned = sum(n for r in aligned if r[3] == seg for n in [r[2]])
        if (s0 - d0) % ALIGN:
            assert in_aligned == 0, seg
        else:
            assert n0 - in_aligned <= 2 * (ALIGN - 1), (seg, n0, in_aligned)
    assert table.numel == sum(length)
    return table


@pytest.mark.parametrize("block", [16, 64])
def test_aligned_tiles_are_aligned_on_both_sides(block):
    """Mixed segments: the aligned tiles, the edge tiles' size, the coverage (see the module docstring)."""
    # src and dst: both aligned; src aligned, dst not; both off by the same amount; neither, and different; a long
    # one of several blocks; an empty one; an unaligned one of 2**5 + 1 elements (the longest unaligned tile: the
    # edge tiles' size must hold it).
    src = [0, 32, 69, 133, 300, 1000, 1400]
    dst = [64, 35, 85, 150, 500, 7, 1401]
    length = [40, 100, 90, 61, 300, 0, 33]
    table = _check(src, dst, length, block)
    assert table.aligned > 0


@pytest.mark.parametrize("block", [24, 48, 8, 0])
def test_a_tile_size_that_is_no_power_of_two_at_least_align_is_refused(block):
    """block_table's Raises: a block that is not a power of two >= ALIGN (24 and 48 are >= ALIGN, not powers of two)."""
    with pytest.raises(ValueError, match=rf"block_table\(block={block}\).*power of two >= {ALIGN}"):
        block_table([0], [0], [40], [0], block=block)


@pytest.mark.parametrize("length", [17, 33, 64, 65])
def test_the_edge_tile_size_holds_the_longest_edge_tile(length):
    """One unaligned segment (src and dst disagree modulo ALIGN) of ``length`` elements, tiles of at most 64: its
    tiles are edge tiles, and ``edge_block`` (the edge kernels' tile size) is the smallest power of two >= ALIGN that
    holds the longest of them (2**k + 1 elements need 2**(k + 1))."""
    table = _check([1400], [1401], [length], 64)
    longest = min(length, 64)
    assert table.aligned == 0 and table.edge_block >= longest
    assert table.edge_block == ALIGN or table.edge_block // 2 < longest  # the smallest such power of two
