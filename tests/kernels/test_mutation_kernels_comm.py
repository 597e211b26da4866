"""What a mutation audit of the FP8 communication kernels (kernels/comm.py, kernels/comm_kernels.py) found unpinned,
checked against the math of kernels/comm.py's docstring written in float64: ``scale(a) = 2 ** (floor(log2(fp8_max /
a)) - margin)`` clamped to [2**-126, 2**127], ``q = RNE(clamp(x * s, +-fp8_max))`` by torch's own FP8 conversion,
``n_sat = #{|x * s| > fp8_max}``, ``out = q / s * inv_divisor``; under TRITON_INTERPRET=1 on CPU, with ragged
segments (tiles of 16 that end mid-segment).
"""

import math

import pytest
import torch
from lightning_fp8.kernels import comm
from lightning_fp8.kernels.comm_table import block_table

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FMAX = {E4M3: 448.0, E5M2: 57344.0}
LENGTHS = [37, 21]


def _scale(amax: float, fp8_dtype: torch.dtype, margin: int = 0) -> float:
    return 2.0 ** min(max(math.floor(math.log2(FMAX[fp8_dtype] / amax)) - margin, -126), 127)


def _table():
    starts = [0, LENGTHS[0]]
    return block_table(starts, starts, LENGTHS, [0, 1], device=DEVICE, block=16)


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_quantize_counts_only_values_past_the_fp8_max_as_saturated(fp8_dtype):
    """``n_sat`` counts ``|x * s| > fp8_max`` (kernels/comm.py): a value landing exactly on the maximum is exact, not
    saturated. Each segment's amax (given) puts its +-amax on the maximum; a few values past it saturate."""
    fmax = FMAX[fp8_dtype]
    gen = torch.Generator().manual_seed(1)
    amax = torch.tensor([1.75 * 2.0**-3, 1.75 * 2.0**4]) * fmax / 448.0  # fp8_max / 2**k exactly
    parts = [torch.rand(n, generator=gen) * a * 0.9 for n, a in zip(LENGTHS, amax.tolist(), strict=True)]
    parts[0][[2, 30, 36]] = torch.tensor([1.0, -1.0, 1.0]) * amax[0]  # on the maximum
    parts[1][[0, 20]] = torch.tensor([-1.0, 1.0]) * amax[1]
    parts[0][5], parts[1][19] = amax[0] * 1.5, -amax[1] * 3.0  # past it
    x = torch.cat(parts)
    out, n_sat = torch.zeros(x.numel(), dtype=torch.uint8).to(DEVICE), torch.zeros((), dtype=torch.int64).to(DEVICE)
    comm.quantize(x.to(DEVICE), _table(), amax.to(DEVICE), fp8_dtype, out, n_sat)
    out = out.cpu()
    s = torch.cat([torch.full((n,), _scale(a, fp8_dtype)) for n, a in zip(LENGTHS, amax.tolist(), strict=True)])
    y = x.double() * s.double()
    assert torch.equal(out, y.clamp(-fmax, fmax).to(fp8_dtype).view(torch.uint8))
    assert n_sat.item() == int((y.abs() > fmax).sum()) == 2


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_dequantize_with_the_largest_scale_decodes_by_its_exact_inverse(fp8_dtype):
    """An amax below ``fp8_max * 2**-127`` (a segment of fp32 values near the bottom of the normal range) gets the
    largest scale, 2**127; decoding multiplies by its inverse 2**-127, an fp32 subnormal, not by 0."""
    gen = torch.Generator().manual_seed(2)
    q = (torch.randn(sum(LENGTHS), generator=gen) * 50).to(fp8_dtype)
    amax = torch.tensor([1e-37, 1.0])
    out = torch.full((q.numel(),), float("nan")).to(DEVICE)
    comm.dequantize(q.view(torch.uint8).to(DEVICE), _table(), amax.to(DEVICE), fp8_dtype, out, inv_divisor=0.5)
    out = out.cpu()
    s = torch.cat([torch.full((n,), _scale(a, fp8_dtype)) for n, a in zip(LENGTHS, amax.tolist(), strict=True)])
    assert s[0].item() == 2.0**127
    want = (q.double() / s.double() * 0.5).float()
    assert want[: LENGTHS[0]].abs().max() > 0
    assert torch.equal(out, want)


def _rows_mean64(rows: torch.Tensor, fp8_dtype, amax, margin: int, inv_divisor: float) -> torch.Tensor:
    """The decoded mean of the rows in float64: sum of the FP8 values over ranks / segment scale * inv_divisor."""
    s = torch.cat([torch.full((n,), _scale(a, fp8_dtype, margin)) for n, a in zip(LENGTHS, amax, strict=True)])
    return rows.view(fp8_dtype).double().sum(0) / s.double() * inv_divisor


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_rows_quantize_scales_each_piece_with_the_margin(fp8_dtype):
    """``rows_quantize``: ``q' = RNE(clamp(mean * scale(piece_amax[out]), +-fp8_max))``, the piece's scale with the
    same margin as the segments' (kernels/comm.py)."""
    gen = torch.Generator().manual_seed(3)
    world, margin, inv = 3, 2, 0.25
    rows = (torch.randn(world, sum(LENGTHS), generator=gen) * 20).to(fp8_dtype).view(torch.uint8)
    amax = [0.75, 300.0]
    piece_amax = torch.zeros(2).to(DEVICE)
    comm.rows_amax(rows.to(DEVICE), _table(), torch.tensor(amax).to(DEVICE), piece_amax, fp8_dtype, margin=margin,
                   inv_divisor=inv)  # fmt: skip
    mean = _rows_mean64(rows, fp8_dtype, amax, margin, inv)
    want_amax = [mean[: LENGTHS[0]].abs().max().item(), mean[LENGTHS[0] :].abs().max().item()]
    assert piece_amax.tolist() == want_amax
    out, n_sat = torch.zeros(sum(LENGTHS), dtype=torch.uint8).to(DEVICE), torch.zeros((), dtype=torch.int64).to(DEVICE)
    comm.rows_quantize(rows.to(DEVICE), _table(), torch.tensor(amax).to(DEVICE), piece_amax, fp8_dtype, out, n_sat,
                       margin=margin, inv_divisor=inv)  # fmt: skip
    out = out.cpu()
    ps = torch.cat([torch.full((n,), _scale(a, fp8_dtype, margin)) for n, a in zip(LENGTHS, want_amax, strict=True)])
    y = mean * ps.double()
    assert torch.equal(out, y.clamp(-FMAX[fp8_dtype], FMAX[fp8_dtype]).to(fp8_dtype).view(torch.uint8))
    assert n_sat.item() == 0


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's numpy
def test_rows_amax_of_a_mean_past_fp32s_range_is_fp32s_maximum():
    """A mean of finite FP8 values whose product with the inverse scale overflows fp32 saturates at fp32's maximum
    (``sat32``, kernels/comm.py): its piece amax is finite, so the piece gets a finite scale, not the fallback of an
    inf amax."""
    fp8_dtype = E4M3
    rows = torch.full((2, sum(LENGTHS)), 1.0).to(fp8_dtype)
    rows[:, 3] = 448.0  # 896 / 2**-120: past fp32's maximum
    rows = rows.view(torch.uint8)
    amax = [3e38, 1.0]
    assert _scale(3e38, fp8_dtype) == 2.0**-120
    piece_amax = torch.zeros(2).to(DEVICE)
    comm.rows_amax(rows.to(DEVICE), _table(), torch.tensor(amax).to(DEVICE), piece_amax, fp8_dtype)
    mean = _rows_mean64(rows, fp8_dtype, amax, 0, 1.0)
    assert mean[3].item() > torch.finfo(torch.float32).max
    assert piece_amax.tolist() == [torch.finfo(torch.float32).max, mean[LENGTHS[0] :].abs().max().item()]


@pytest.mark.parametrize("margin", [0, 3])
def test_rows_sum_decodes_with_the_segments_margin(margin):
    """``rows_sum``: ``out = (q_0 + ... + q_{W-1}) * inv_divisor / scale(amax[value])``, the scale with the margin
    the rows were quantized with (kernels/comm.py)."""
    fp8_dtype = E5M2
    gen = torch.Generator().manual_seed(4)
    rows = (torch.randn(4, sum(LENGTHS), generator=gen) * 100).to(fp8_dtype).view(torch.uint8)
    amax = [3.0, 5e-3]
    out = torch.full((sum(LENGTHS),), float("nan")).to(DEVICE)
    comm.rows_sum(rows.to(DEVICE), _table(), torch.tensor(amax).to(DEVICE), fp8_dtype, out, margin=margin,
                  inv_divisor=0.25)  # fmt: skip
    assert torch.equal(out.cpu().double(), _rows_mean64(rows, fp8_dtype, amax, margin, 0.25))
