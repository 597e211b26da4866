"""Single-process tests: segment layouts, the block tables of the pipelined collectives, state validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_fp8.distributed import FP8CommState, SegmentLayout
from lightning_fp8.distributed.layout import all_reduce_plan, reduce_scatter_plan


def test_chunk_pieces_cut_segments_at_chunk_boundaries():
    layout = SegmentLayout.per_tensor([5, 0, 4, 3]).padded(14)
    assert layout.lengths == (5, 0, 4, 3, 2) and layout.groups == (0, 1, 2, 3, 4)
    # chunks of 7: [p0 x5, p2 x2 | p2 x2, p3 x3, pad x2]; the empty p1 has no piece
    assert layout.chunk_pieces(2) == [[(5, 0), (2, 2)], [(2, 2), (3, 3), (2, 4)]]


def test_rows_layout_shares_groups_across_rows():
    layout = SegmentLayout.rows(3, [4, 0, 2])
    assert layout.numel == 18 and layout.num_groups == 3
    assert layout.groups == (0, 1, 2) * 3


def test_blocks_layout_and_validation():
    assert SegmentLayout.blocks(10, 4).lengths == (4, 4, 2)
    with pytest.raises(ValueError, match="range"):
        SegmentLayout((1, 2), (0, 2), 2)
    with pytest.raises(ValueError, match="equal chunks"):
        SegmentLayout.per_tensor([5]).chunk_pieces(2)
    with pytest.raises(ValueError, match="block size"):
        SegmentLayout.blocks(10, 0)


def test_element_counts_must_be_non_negative_ints():
    # int() used to truncate 2.5 to 2, and divmod(-1, 4) == (-1, 3) made blocks(-1, 4) a layout of 3 elements.
    with pytest.raises(TypeError, match=r"per_tensor\(numels=...\): expected an int, got float 2.5"):
        SegmentLayout.per_tensor([3, 2.5])
    with pytest.raises(TypeError, match="expected an int, got bool"):
        SegmentLayout.per_tensor([True])
    with pytest.raises(ValueError, match=r"blocks\(numel=...\): must be >= 0, got -1"):
        SegmentLayout.blocks(-1, 4)
    with pytest.raises(TypeError, match=r"blocks\(block=...\): expected an int"):
        SegmentLayout.blocks(10, 3.0)
    with pytest.raises(ValueError, match="at least one rank"):
        SegmentLayout.rows(0, [3])
    with pytest.raises(ValueError, match=r"rows\(columns=...\): must be >= 0"):
        SegmentLayout.rows(2, [-1, 3])
    # NumPy and 0-dim tensor integers are ints
    assert SegmentLayout.per_tensor([torch.tensor(3), np.int64(2)]).lengths == (3, 2)


def test_parts_cut_segments_at_a_range_and_skip_empty_ones():
    layout = SegmentLayout.per_tensor([5, 0, 4, 3])
    assert layout.parts(3, 11) == [(3, 2, 0), (5, 4, 2), (9, 2, 3)]
    assert layout.parts(5, 5) == [] and layout.parts(0, 12)[-1] == (9, 3, 3)
    assert layout.ordered() and not SegmentLayout.rows(2, [3, 4]).ordered()


def test_portable_all_reduce_plan_tables():
    # 192 elements, 2 ranks, rank 1: chunks [0, 96) and [96, 192); pieces of chunk 0: g0 x80, g2 x16; chunk 1: g2 x48,
    # g3 x48. Tiles of at most 64 elements; everything lies on multiples of 16 (aligned tiles only).
    (plan,) = all_reduce_plan(SegmentLayout.per_tensor([80, 0, 64, 48]), 2, 1, 1, False, torch.device("cpu"), 64)
    assert plan.row == 96 and plan.pad == () and plan.amax_offset == 96 and plan.gather_row_bytes == 112
    assert plan.cast.rows.tolist() == [[0, 0, 64, 0, 0], [64, 64, 16, 0, 0], [80, 80, 64, 2, 2], [144, 144, 48, 3, 3]]
    assert plan.cast.aligned == 4
    # this rank's chunk: src = dst = offset in the chunk, value = group, out = piece
    assert plan.sum.rows.tolist() == [[0, 0, 48, 2, 0], [48, 48, 48, 3, 1]]
    # every chunk into the output: src in the gathered rows (112 bytes each), value = float index of the piece amax
    assert plan.decode.rows.tolist() == [
        [0, 0, 64, 24, 24], [64, 64, 16, 24, 24], [80, 80, 16, 25, 25], [112, 96, 48, 52, 52], [160, 144, 48, 53, 53],
    ]  # fmt: skip


def test_block_table_splits_ragged_edges_from_aligned_tiles():
    from lightning_fp8.kernels.comm_table import block_table

    # segment 0: head 3 (to 16), body 32, tail 5; segment 1: src and dst disagree modulo 16: unaligned tiles only
    table = block_table([13, 100], [29, 7], [40, 20], [0, 1], block=16)
    assert table.aligned == 2 and table.edge_block == 16 and table.numel == 60
    assert table.rows.tolist() == [
        [16, 32, 16, 0, 0], [32, 48, 16, 0, 0],  # aligned
        [13, 29, 3, 0, 0], [48, 64, 5, 0, 0], [100, 7, 16, 1, 1], [116, 23, 4, 1, 1],  # edges
    ]  # fmt: skip


def test_portable_plan_pads_the_last_chunk():
    plans = all_reduce_plan(SegmentLayout.per_tensor([100, 60]), 4, 0, 2, False, torch.device("cpu"))
    assert [(p.start, p.end, p.row, p.pad) for p in plans] == [(0, 80, 32, ((80, 48),)), (80, 160, 32, ((80, 48),))]


def test_amax_stages_follow_the_tensors_of_an_ordered_layout():
    layout = SegmentLayout.per_tensor([160, 48, 480, 0, 112])  # slices of 160: [g0] [g1 g2] [g2] [g2] [g2 g4]
    plans = all_reduce_plan(layout, 2, 0, 5, True, torch.device("cpu"))
    # slice k's cast needs the groups that reach into it; a tensor's amax needs every slice it spans
    assert [(p.groups, p.amax_through) for p in plans] == [
        ((0, 1), 0), ((1, 3), 4), ((3, 3), -1), ((3, 3), -1), ((3, 5), 4),
    ]  # fmt: skip
    rows = all_reduce_plan(SegmentLayout.rows(2, [80, 80]), 2, 0, 2, True, torch.device("cpu"))
    assert [(p.groups, p.amax_through) for p in rows] == [((0, 2), 1), ((2, 2), -1)]  # every group first


def test_reduce_scatter_plan_slices_every_chunk_alike():
    layout = SegmentLayout.rows(2, [48, 80])  # 256 elements, chunks of 128: [g0 x48, g1 x80] twice
    amax, plans = reduce_scatter_plan(layout, 2, 1, 2, torch.device("cpu"))
    assert amax.numel == 256
    first, second = plans
    assert (first.start, first.end, first.row) == (0, 64, 64) and (second.start, second.end) == (64, 128)
    # send rows: slice [0, 64) of chunk 0, then of chunk 1
    assert first.cast.rows.tolist() == [[0, 0, 48, 0, 0], [48, 48, 16, 1, 1], [128, 64, 48, 0, 0], [176, 112, 16, 1, 1]]
    assert second.sum.rows.tolist() == [[0, 64, 64, 1, 1]]  # rank 1's row of slice 1 -> output [64, 128)


def test_comm_state_rejects_bad_arguments():
    with pytest.raises(ValueError, match="algorithm"):
        FP8CommState(algorithm="fast")
    with pytest.raises(ValueError, match="FP8 dtype"):
        FP8CommState(fp8_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="margin"):
        FP8CommState(margin=-1)
    with pytest.raises(TypeError, match="FP8GradScaler"):
        FP8CommState(grad_scaler=object())
    with pytest.raises(ValueError, match="slice_numel"):
        FP8CommState(slice_numel=0)
    for name, value in (("margin", 1.5), ("margin", "1"), ("slice_numel", 2.0), ("slice_numel", True)):
        with pytest.raises(TypeError, match=f"{name}=.*must be an int"):  # as the docstring says (was ValueError)
            FP8CommState(**{name: value})
    with pytest.raises(TypeError, match="amax_group"):
        FP8CommState(amax_group="world")
    with pytest.raises(TypeError, match="process_group=.*str"):
        FP8CommState(process_group="world")
    with pytest.raises(TypeError, match="fused='yes'"):
        FP8CommState(fused="yes")


def test_check_step_reads_and_clears_the_flag():
    from lightning_fp8.distributed import CastStats

    state = FP8CommState()
    assert state.check_step()
    zero = torch.zeros(())
    state.record(CastStats(torch.tensor(float("inf")), zero.long(), 3, torch.tensor(True)))
    state.record(CastStats(torch.tensor(1.0), zero.long(), 3, torch.tensor(False)))
    assert bool(state.found_nonfinite)
    assert not state.check_step()
    assert state.check_step()


@pytest.mark.parametrize("flag", ["reduce_scatter", "weight_all_gather"])
def test_enable_fp8_fsdp2_flags_must_be_bools(flag):
    # Found by a sweep: reduce_scatter="no" (a true string) installed the FP8 reduce-scatter. Checked before anything
    # else, so no fully_shard is needed to see it.
    from torch import nn

    from lightning_fp8.distributed import enable_fp8_fsdp2

    with pytest.raises(TypeError, match=rf"enable_fp8_fsdp2\({flag}='no'\): must be True or False"):
        enable_fp8_fsdp2(nn.Linear(2, 2), **{flag: "no"})
