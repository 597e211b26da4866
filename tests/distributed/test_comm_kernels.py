"""The Triton kernels of FP8 communication (kernels/comm.py) against their PyTorch references, bit for bit.

On CPU the kernels run under ``TRITON_INTERPRET=1`` (tests/conftest.py); shapes are small and tiles tiny (16 or 64
elements), so segments span several tiles, tiles end mid-segment, and some segments are empty.
"""

from __future__ import annotations

import pytest
import torch
import triton
from lightning_fp8.kernels.comm_table import block_table
from lightning_fp8.kernels.reference import cast_to_fp8_ref

from lightning_fp8.distributed.quantize import segment_kernels
from lightning_fp8.scaling import compute_scale

# NaN and inf inputs make the interpreter's numpy warn; the results are what is checked.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
REF, TRITON = segment_kernels(False), segment_kernels(True)
LENGTHS = [37, 0, 200, 5, 64, 1, 90]  # uneven, an empty segment, one single element, one of exactly 4 tiles of 16


def _old_interpreter() -> bool:
    # Triton's interpreter before 3.8 (3.6 and 3.7.1 seen on Python 3.10, whose CUDA torch wheel pins 3.7.1) loses the
    # sign of an FP8 zero; the compiled kernels keep it (the GPU runs of this file).
    return tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (FP8 bytes included); any NaN equals any NaN (payloads differ between conversions)."""
    if a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan = a.isnan()
    view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(nan, b.isnan()) and torch.equal(a.view(view)[~nan], b.view(view)[~nan])


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    """CPU: the kernels interpreted; CUDA (GPU runs only): compiled, against the references on the same device."""
    return request.param


def _gradients(dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    """Segments 12 orders of magnitude apart, each spanning 6 more; a NaN, an inf, and FP8 rounding ties."""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(n, generator=g) * 10.0 ** (6 * torch.rand(n, generator=g) - 3 + 2 * i - 6)
             for i, n in enumerate(LENGTHS)]  # fmt: skip
    parts[2][[3, 17]] = torch.tensor([1.0625, -1.1875]) * 2.0**5  # E4M3 ties (3 mantissa bits): to even
    parts[2][40] = float("nan")
    parts[6][7] = float("-inf")
    return torch.cat(parts).to(dtype).to(device)


def _table(device: str, block: int = 16, gap: int = 0):
    """One tile row per segment piece; ``gap`` spreads the segments out in the destination."""
    starts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    dst = [s + i * gap for i, s in enumerate(starts)]
    table = block_table(starts, dst, LENGTHS, [0, 1, 2, 3, 4, 2, 5], device=device, block=block)
    return table, sum(LENGTHS) + gap * len(LENGTHS)


def test_block_table_cuts_segments_into_tiles_that_never_straddle():
    table = block_table([0, 5, 5], [100, 0, 7], [5, 0, 40], [3, 4, 5], [9, 8, 7], block=16)
    assert table.rows.tolist() == [
        [0, 100, 5, 3, 9], [5, 7, 16, 5, 7], [21, 23, 16, 5, 7], [37, 39, 8, 5, 7],
    ]  # fmt: skip  (src and dst disagree modulo 16: unaligned tiles only)
    assert table.numel == 45 and len(table) == 4 and table.aligned == 0
    table = _table("cpu", block=64)[0]  # src == dst: aligned bodies, ragged heads and tails
    assert table.aligned > 0 and table.rows[: table.aligned, :3].remainder(16).eq(0).all()
    assert table.rows[:, 2].sum() == sum(LENGTHS) and table.rows[:, 2].max() <= 64
    with pytest.raises(ValueError, match="power of two"):
        block_table([0], [0], [4], [0], block=12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_segment_amax_matches_reference(dtype, device):
    x = _gradients(dtype, device)
    table, _ = _table(device)
    amaxes = []
    for kernels in (REF, TRITON):
        amax = torch.full((6,), 1e-30, device=device)  # accumulates into what is there
        kernels.segment_amax(x, table, amax)
        amaxes.append(amax)
    assert _same(*amaxes)
    assert amaxes[0][2] == float("inf") and amaxes[0][5] == float("inf")  # NaN counts as inf; -inf too
    assert amaxes[0][1] == 1e-30  # the empty segment leaves its slot alone


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("gap", [3, 32], ids=["unaligned", "aligned"])  # dst - src: 32 keeps aligned (vector) tiles
def test_quantize_matches_reference_and_the_reference_cast(fp8_dtype, dtype, gap, device):
    x = _gradients(dtype, device)
    table, numel = _table(device, gap=gap)
    amax = torch.zeros(6, device=device)
    REF.segment_amax(x, table, amax)
    amax[3] /= 3  # a scale too large for segment 3: its values saturate
    amax[2] = amax[4]  # segment 2's NaN: use a finite amax so its other values cast normally
    for headroom, margin in ((None, 0), (torch.tensor(2, device=device), 1)):
        outs = []
        for kernels in (REF, TRITON):
            q, n_sat = torch.full((numel,), 0xAA, dtype=torch.uint8, device=device), torch.tensor(5, device=device)
            kernels.quantize(x, table, amax, fp8_dtype, q, n_sat, margin=margin, headroom=headroom)
            outs.append((q, n_sat))
        assert _same(outs[0][0], outs[1][0]) and outs[0][1] == outs[1][1]
        assert outs[0][1] > 5 or dtype == torch.float16  # (fp16: segment 3 overflows to inf, nothing saturates)
        assert (outs[0][0] == 0xAA).sum() >= gap * len(LENGTHS)  # the gaps are untouched
    # The reference against the core's reference cast, segment by segment (no headroom, margin 0).
    q = torch.zeros(numel, dtype=torch.uint8, device=device)
    REF.quantize(x, table, amax, fp8_dtype, q, torch.tensor(0, device=device))
    for src, dst, n, value, _ in table.rows.tolist():
        want, _, _, _ = cast_to_fp8_ref(x[src : src + n], compute_scale(amax[value], fp8_dtype), fp8_dtype)
        assert torch.equal(q[dst : dst + n], want.view(torch.uint8))


@pytest.mark.parametrize("kernels", [REF, TRITON], ids=["reference", "triton"])
def test_a_headroom_per_segment_is_refused_by_the_kernels(kernels):
    # The Triton kernels read one shift for every segment: a tensor of several would be read as its first value (the
    # reference broadcast it per segment: the two disagreed).
    x = _gradients(torch.float32, "cpu")
    table, numel = _table("cpu")
    amax, q, n_sat = torch.ones(6), torch.zeros(numel, dtype=torch.uint8), torch.tensor(0)
    for headroom in (torch.tensor([0, 2, 0, 0, 0, 0]), torch.tensor(2.0)):
        with pytest.raises(ValueError, match="one int64 value shared by every segment"):
            kernels.quantize(x, table, amax, E4M3, q, n_sat, headroom=headroom)
        with pytest.raises(ValueError, match="one int64 value shared by every segment"):
            kernels.dequantize(q, table, amax, E4M3, torch.zeros(numel), headroom=headroom)
    assert n_sat == 0 and q.count_nonzero() == 0  # nothing written


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("gap", [2, 16], ids=["unaligned", "aligned"])
def test_dequantize_matches_reference_with_checks(fp8_dtype, out_dtype, gap, device):
    table, numel = _table(device, gap=gap)
    q = torch.randint(0, 256, (numel,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))  # NaN, inf too
    q, amax = q.to(device), torch.tensor([3.0, 0.0, 7e-20, float("inf"), 5e5, 1e-3], device=device)
    for headroom, inv_divisor in ((None, 1.0), (torch.tensor(1, device=device), 1 / 3)):
        outs = []
        for kernels in (REF, TRITON):
            out = torch.full((numel,), 0.5, dtype=out_dtype, device=device)
            counts = torch.tensor([1, 2], device=device)
            kernels.dequantize(q, table, amax, fp8_dtype, out, margin=1, headroom=headroom, inv_divisor=inv_divisor,
                               counts=counts)  # fmt: skip
            outs.append((out, counts))
        assert _same(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
        assert outs[0][1][1] > 2  # random bytes include NaN (and inf) patterns


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("world", [1, 3, 4])
def test_rows_kernels_match_reference(fp8_dtype, world, device):
    """The sum of the received rows (rank order, fp32): its piece amax, its requantization, its decode."""
    g = torch.Generator().manual_seed(world)
    row = 256 if world == 4 else 250  # 256: every row starts aligned (vector loads on a GPU)
    received = torch.randint(0, 256, (world, row), dtype=torch.uint8, generator=g)
    finite = received.view(fp8_dtype).float().isfinite()
    received[~finite] = received[~finite] & 0x80  # finite rows, except the NaN planted next
    received[world - 1, 33] = 0x7F
    received = received.to(device)
    # pieces of the chunk: (offset, length, group); dst leaves gaps of 16 (aligned bodies); out = piece index
    pieces = [(0, 20, 2), (20, 100, 0), (120, 1, 1), (121, 129, 3)]
    table = block_table([o for o, _, _ in pieces], [o + 16 * j for j, (o, _, _) in enumerate(pieces)],
                        [n for _, n, _ in pieces], [gr for _, _, gr in pieces], list(range(4)), device=device,
                        block=64)  # fmt: skip
    amax = torch.tensor([2.0**-3, 5e4, 1e-2, 300.0], device=device)
    piece_amax = []
    for kernels in (REF, TRITON):
        out = torch.zeros(4, device=device)
        kernels.rows_amax(received, table, amax, out, fp8_dtype, margin=0, inv_divisor=1 / world)
        piece_amax.append(out)
    assert _same(*piece_amax) and piece_amax[0][1] == float("inf")  # the NaN lands in piece 1
    qs, sums = [], []
    for kernels in (REF, TRITON):
        q, n_sat = torch.full((row + 64,), 0xAA, dtype=torch.uint8, device=device), torch.tensor(0, device=device)
        kernels.rows_quantize(received, table, amax, piece_amax[0], fp8_dtype, q, n_sat, inv_divisor=1 / world)
        qs.append((q, n_sat))
        out = torch.full((row + 64,), 3.0, dtype=torch.bfloat16, device=device)
        kernels.rows_sum(received, table, amax, fp8_dtype, out, inv_divisor=1 / world)
        sums.append(out)
    if device == "cpu" and _old_interpreter():  # it reads FP8 -0 (0x80, planted above) as +0; compiled code does not
        qs, sums = [(torch.where(q == 0x80, 0, q), n) for q, n in qs], [t + 0.0 for t in sums]  # -0 + 0 = +0
    assert _same(qs[0][0], qs[1][0]) and qs[0][1] == qs[1][1]
    assert _same(*sums)
    # The reference sum against an independent one: float64 sum of the decoded rows times 1 / (scale * world).
    scale = compute_scale(amax, fp8_dtype)
    decoded, sums = received.cpu().view(fp8_dtype).double(), [t.cpu() for t in sums]
    scale = scale.cpu()
    for j, (o, n, gr) in enumerate(pieces):
        rows = decoded[:, o : o + n] / (scale[gr].double() * world)
        got = sums[0][o + 16 * j : o + 16 * j + n].double()
        # bf16 rounding of the result, plus fp32 rounding of the partial sums (cancellation: relative to the rows)
        bound = 2.0**-8 * rows.sum(0).abs() + 2.0**-22 * rows.abs().sum(0)
        ok = ((got - rows.sum(0)).abs() <= bound) | (got.isnan() & rows.sum(0).isnan())
        assert ok.all(), (j, got[~ok], rows.sum(0)[~ok])


@pytest.mark.parametrize(
    ("config", "max_programs"),
    [({"SUB": 16}, 1), ({"SUB": 16, "PROGRAMS_PER_SM": 1}, 2), ({"SUB": 32, "HINT": 16, "num_warps": 4}, 5)],
    ids=["one-program", "two-programs", "five-programs-hint16"],
)
def test_persistent_programs_match_reference(config, max_programs, device, monkeypatch):
    """Fewer programs than rows: each loops over its aligned rows, then its edge rows, each row in several blocks
    (SUB < the table's 64-element tiles); counters folded once per program, amaxes when the scale group changes."""
    from lightning_fp8.kernels import comm

    for name, cfg in comm.CONFIGS.items():
        monkeypatch.setitem(comm.CONFIGS, name, {**cfg, **config})
    monkeypatch.setattr(comm, "MAX_PROGRAMS", max_programs)
    x = _gradients(torch.bfloat16, device, seed=max_programs)
    table, numel = _table(device, block=64, gap=32)
    assert table.aligned > max_programs and len(table) > table.aligned  # every program loops; edge rows too
    results = []
    for kernels in (REF, TRITON):
        amax = torch.zeros(6, device=device)
        kernels.segment_amax(x, table, amax)
        amax[2] = amax[4]  # a finite amax for the NaN's segment
        q, n_sat = torch.full((numel,), 0xAA, dtype=torch.uint8, device=device), torch.tensor(1, device=device)
        kernels.quantize(x, table, amax / 3, E5M2, q, n_sat)  # a third of each amax: values saturate
        out = torch.full((numel,), 0.5, dtype=torch.bfloat16, device=device)
        counts = torch.zeros(2, dtype=torch.int64, device=device)
        kernels.dequantize(q, table, amax, E5M2, out, inv_divisor=1 / 3, counts=counts)
        rows = torch.stack([q[:256], q[64:320]])  # 2 ranks' rows (row stride 256: aligned)
        piece_amax, q2 = torch.zeros(6, device=device), torch.zeros(numel, dtype=torch.uint8, device=device)
        kernels.rows_amax(rows, _rows_table(device), amax, piece_amax, E5M2, inv_divisor=0.5)
        kernels.rows_quantize(rows, _rows_table(device), amax, piece_amax, E5M2, q2, n_sat, inv_divisor=0.5)
        results.append((amax, q, n_sat, out, counts, piece_amax, q2))
    for got, want in zip(results[1], results[0], strict=True):
        assert _same(got, want)
    assert results[0][2] > 1 and results[0][4][0] > 0  # saturated values and FP8 maxima were counted


def _rows_table(device: str):
    # Pieces of a 256-column chunk: aligned bodies of several tiles and ragged edges; out = piece index.
    return block_table([0, 20, 150], [0, 20, 150], [20, 130, 106], [2, 0, 3], [0, 1, 2], device=device, block=64)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_decoded_means_saturate_at_the_output_maximum(out_dtype, device):
    """E5M2's maximum (57344) decoded with a scale whose inverse takes it past the output dtype's range (fp16 from an
    amax of 6e4, bf16 and fp32 from 3e38: 2**128.8, past fp32 too): stored as the dtype's maximum, not inf; a NaN
    byte stays NaN. The same from the decode of one row and from the mean of two. A float64 output (computed in fp32,
    as every output) saturates at fp32's maximum (it raised before: fp64's maximum does not convert to fp32)."""
    amax = torch.tensor([6e4 if out_dtype == torch.float16 else 3e38], device=device)
    received = torch.full((2, 64), 0x7B, dtype=torch.uint8)  # 0x7B: +57344 in E5M2
    received[:, 40:] = 0xFB  # -57344
    received[1, 5] = 0x7F  # NaN
    received = received.to(device)
    table = block_table([0], [0], [64], [0], [0], device=device, block=16)
    want = torch.full((64,), min(torch.finfo(out_dtype).max, torch.finfo(torch.float32).max), dtype=out_dtype)
    want[40:] = -want[40:]
    for kernels in (REF, TRITON):
        mean = torch.zeros(64, dtype=out_dtype, device=device)
        kernels.rows_sum(received, table, amax, E5M2, mean, inv_divisor=0.5)
        one = torch.zeros(64, dtype=out_dtype, device=device)
        kernels.dequantize(received[0], table, amax, E5M2, one)
        assert torch.equal(one.cpu(), want)
        assert mean[5].isnan() and torch.equal(torch.cat([mean[:5], mean[6:]]).cpu(), torch.cat([want[:5], want[6:]]))
