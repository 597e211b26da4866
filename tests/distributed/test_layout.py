"""Single-process tests: segment layouts, the elementwise kernels against the reference cast, state validation."""

from __future__ import annotations

import pytest
import torch
from lightning_fp8.kernels.reference import cast_to_fp8_ref

from lightning_fp8.distributed import FP8CommState, SegmentLayout, quantize
from lightning_fp8.distributed.layout import device_layout
from lightning_fp8.scaling import compute_scale

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


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


def test_device_layout_indexes_every_piece_of_every_chunk():
    layout = SegmentLayout.per_tensor([5, 0, 4, 3]).padded(14)
    dl = device_layout(layout, 2, 1, torch.device("cpu"))
    assert dl.chunk_lengths == (2, 3, 2) and dl.max_pieces == 3 and dl.chunk_numel == 7
    assert dl.chunk_groups.tolist() == [2, 3, 4]
    assert dl.all_piece_ends.tolist() == [5, 7, 9, 12, 14]
    assert dl.all_piece_index.tolist() == [0, 1, 3, 4, 5]  # row-major into the (2, max_pieces) scale table


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_quantize_kernel_matches_reference_cast_per_segment(fp8_dtype):
    sizes = [33, 0, 257, 1, 90]
    xs = [torch.randn(n) * 10.0 ** (3 * i - 6) for i, n in enumerate(sizes)]
    xs[2][5] = float("nan")
    xs[4][3] = 1e30  # saturates with a scale made for the rest
    x = torch.cat(xs)
    scale = torch.stack([compute_scale(t.abs().amax() if t.numel() else torch.zeros(()), fp8_dtype) for t in xs])
    scale[4] = compute_scale(torch.cat([xs[4][:3], xs[4][4:]]).abs().amax(), fp8_dtype)
    ends = torch.tensor(sizes).cumsum(0)
    q, n_sat = quantize.kernel("quantize", False)(x, ends, scale, fp8_dtype)
    for t, s, part in zip(xs, scale, q.split(sizes), strict=True):
        ref, _, _, _ = cast_to_fp8_ref(t, s, fp8_dtype)
        assert torch.equal(part.view(torch.uint8), ref.view(torch.uint8))
    assert int(n_sat) == 1


def test_segment_amax_turns_nan_into_inf_and_empty_into_zero():
    x = torch.tensor([1.0, -3.0, float("nan"), 2.0])
    assert quantize.segment_amax(x, (2, 0, 2)).tolist() == [3.0, 0.0, float("inf")]


def test_comm_state_rejects_bad_arguments():
    with pytest.raises(ValueError, match="algorithm"):
        FP8CommState(algorithm="fast")
    with pytest.raises(ValueError, match="FP8 dtype"):
        FP8CommState(fp8_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="margin"):
        FP8CommState(margin=-1)
    with pytest.raises(TypeError, match="FP8GradScaler"):
        FP8CommState(grad_scaler=object())


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


@pytest.mark.parametrize(
    "device", [pytest.param("cpu", marks=pytest.mark.slow), pytest.param("cuda", marks=pytest.mark.gpu)]
)
def test_compiled_kernels_match_eager(device):
    """torch.compile (the CUDA default) expands scales with bucketize instead of repeat_interleave: same bits."""
    torch._dynamo.reset()
    sizes = [300, 0, 700, 777]
    ends = torch.tensor(sizes, device=device).cumsum(0)
    scale = torch.tensor([2.0**3, 2.0**-4, 2.0**10, 0.5], device=device)
    x = torch.randn(sum(sizes), device=device) * 10
    x[5] = float("inf")
    rows = x[:1776].view(2, 888).to(E5M2)
    for name, args in (
        ("quantize", (x, ends, scale, E5M2)),
        ("dequantize", (x.to(E4M3), ends, scale, torch.bfloat16)),
        ("dequantize_checked", (x.to(E5M2), ends, scale, torch.float32, 57344.0)),
        ("dequant_sum", (rows, torch.tensor([100, 100, 888], device=device), scale[:3])),
        ("dequantize", (rows[:, :500], torch.tensor([600, 1000], device=device), scale[:2], torch.float32)),
    ):
        eager = quantize.kernel(name, False)(*args)
        compiled = quantize.kernel(name, True)(*args)
        for e, c in zip(eager if isinstance(eager, tuple) else (eager,),
                        compiled if isinstance(compiled, tuple) else (compiled,), strict=True):
            e, c = (e.view(torch.uint8), c.view(torch.uint8)) if e.dtype in (E4M3, E5M2) else (e, c)
            # Exact, NaN equal to NaN (the inf input becomes NaN in E4M3 on some torch versions).
            torch.testing.assert_close(c, e, rtol=0, atol=0, equal_nan=True, msg=name)
