"""What a mutation audit of kernels/cast.py, cast_kernels.py, scaling.py and quantize.py found unpinned, checked against
the cast's math written from its spec (kernels/cast.py's docstring, DESIGN.md's scale convention), not against
kernels/reference.py:

- the saturated count at its boundary (``|x * scale| >= fp8_max`` counts, the next value below does not), with one
  saturated element alone in a ragged tile (a count of 1 must reach the total);
- the power-of-two scale ``2 ** (floor(log2(fp8_max / amax)) - margin)`` at the format max's boundary and with a
  margin, on current scaling's one-pass (speculative) and two-pass paths and on delayed scaling's next scale;
- the current-scaled cast of ``t * unscale`` whose amax carries no information, with speculation off (it casts t with
  t's scale);
- the launch grid: never zero programs (a cast launched on no program writes nothing);
- no read past a ragged tensor (a view followed in memory by other values), in the casts and the amax;
- 64-bit offsets past 2**31 lanes (captured launches of meta tensors);
- the transposed-copy-only cast (the backward's recast) with tensor descriptors enabled.

Shapes are small and ragged (17 x 33) so that the masks of partial tiles matter; under TRITON_INTERPRET=1 on CPU.
"""

import math

import pytest
import torch

pytest.importorskip("triton")

from lightning_fp8.kernels import cast, quantize  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FMAX = {E4M3: 448.0, E5M2: 57344.0}


def spec_cast(x: torch.Tensor, scale: float, fp8_dtype: torch.dtype) -> torch.Tensor:
    """The FP8 bytes of ``RNE(clamp(x * scale, +-fp8_max))``, NaN for non-finite x (float64 products: exact for a
    power-of-two scale; torch's own conversion rounds to nearest even)."""
    y = x.double().cpu() * scale
    y = torch.where(torch.isfinite(x.cpu()), y.clamp(-FMAX[fp8_dtype], FMAX[fp8_dtype]), float("nan"))
    return y.float().to(fp8_dtype).view(torch.uint8)


def spec_scale(amax: float, fp8_dtype: torch.dtype, margin: int) -> float:
    """DESIGN.md: ``2 ** (floor(log2(fp8_max / amax)) - margin)`` (float64; the amaxes below are not near a tie)."""
    return 2.0 ** (math.floor(math.log2(FMAX[fp8_dtype] / amax)) - margin)


def _state(scale):
    f32 = {"dtype": torch.float32, "device": DEVICE}
    i64 = {"dtype": torch.int64, "device": DEVICE}
    return [torch.zeros(1, **f32), torch.tensor(scale, **f32), torch.zeros((), **f32), torch.zeros((), **f32),
            torch.zeros((), **i64), torch.zeros((), **i64)]  # fmt: skip


def _small(shape, gen, bound):
    # Random values with |x| <= bound, none of them zero.
    return (torch.rand(shape, generator=gen) * 0.9 + 0.05) * bound * torch.where(torch.rand(shape, generator=gen) < 0.5,
                                                                                 -1.0, 1.0)  # fmt: skip


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("transpose", [False, True])
def test_one_saturated_element_in_a_ragged_tile_is_counted(fp8_dtype, transpose):
    """One element with ``|x * scale| == fp8_max`` exactly, in the last (partial) tile, and one just below it: the
    cast counts exactly one saturated element (cast_to_fp8's n_sat and a scaling state's saturated fraction), and
    writes both as the spec does."""
    scale, fmax = 2.0**-3, FMAX[fp8_dtype]
    gen = torch.Generator().manual_seed(7)
    x = _small((17, 33), gen, fmax / scale / 4)
    x[16, 32] = -fmax / scale  # exactly at the boundary: saturated
    x[16, 31] = torch.nextafter(torch.tensor(fmax / scale), torch.tensor(0.0))  # just below: not saturated
    x = x.to(DEVICE)
    want_sat = int(((x.double() * scale).abs() >= fmax).sum())
    assert want_sat == 1
    x_fp8, x_fp8_t, amax, n_sat = cast.cast_to_fp8(x, torch.tensor(scale, device=DEVICE), fp8_dtype, transpose)
    assert int(n_sat) == want_sat
    assert amax.item() == x.abs().max().item()
    assert torch.equal(x_fp8.view(torch.uint8).cpu(), spec_cast(x, scale, fp8_dtype))
    if transpose:
        assert torch.equal(x_fp8_t.view(torch.uint8).cpu(), spec_cast(x, scale, fp8_dtype).t().contiguous())
    # A delayed scaling state's cast records the saturated fraction of its cast.
    state = _state(scale)
    quantize.quantize_(x, *state, fp8_dtype, 0, True, True, False, transpose)
    assert state[3].item() == pytest.approx(want_sat / x.numel(), rel=1e-6)


@pytest.mark.parametrize("speculative", [True, False])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("margin", [0, 2])
def test_current_scale_at_the_format_max_boundary(monkeypatch, speculative, fp8_dtype, margin):
    """Current scaling's scale is ``2 ** (floor(log2(fp8_max / amax)) - margin)``: an amax of exactly fp8_max * 2**k
    gets 2**-k (before the margin), the next fp32 above it half that, the one below it the same; on the one-pass
    (speculative) and the two-pass path alike, and the cast uses that scale."""
    monkeypatch.setattr(quantize, "SPECULATIVE_CURRENT_SCALING", speculative)
    fmax = FMAX[fp8_dtype]
    gen = torch.Generator().manual_seed(3)
    state = _state(1.0)
    for k in (-5, 0, 3):
        edge = torch.tensor(fmax * 2.0**k)
        for amax in (edge, torch.nextafter(edge, torch.tensor(math.inf)), torch.nextafter(edge, torch.tensor(0.0))):
            x = _small((17, 33), gen, amax.item() / 2)
            x[16, 30] = -amax
            x = x.to(DEVICE)
            got = quantize.quantize_(x, *state, fp8_dtype, margin, True, False, True, True)
            want = spec_scale(amax.item(), fp8_dtype, margin)
            assert state[1].item() == want, (k, amax.item(), state[1].item(), want)
            assert got[2].item() == 1.0 / want
            assert torch.equal(got[0].view(torch.uint8).cpu(), spec_cast(x, want, fp8_dtype))
            assert torch.equal(got[1].view(torch.uint8).cpu(), spec_cast(x, want, fp8_dtype).t().contiguous())


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_delayed_next_scale_at_the_format_max_boundary(fp8_dtype):
    """Delayed scaling: the cast uses the stored scale, and the next one is the power-of-two scale of this amax (a
    history of one) with the margin, at and just above fp8_max's boundary."""
    fmax, margin = FMAX[fp8_dtype], 1
    gen = torch.Generator().manual_seed(4)
    state = _state(2.0**-4)
    for amax in (torch.tensor(fmax), torch.nextafter(torch.tensor(fmax), torch.tensor(math.inf))):
        used = state[1].item()
        x = _small((17, 33), gen, amax.item() / 2)
        x[0, 32] = amax
        x = x.to(DEVICE)
        got = quantize.quantize_(x, *state, fp8_dtype, margin, True, True, False, False)
        assert got[2].item() == 1.0 / used
        assert torch.equal(got[0].view(torch.uint8).cpu(), spec_cast(x, used, fp8_dtype))
        assert state[1].item() == spec_scale(amax.item(), fp8_dtype, margin)


@pytest.mark.parametrize("unscale", [2.0**10, 2.0**-7])
def test_unscaled_cast_without_information_casts_t_with_speculation_off(monkeypatch, unscale):
    """Current scaling with SPECULATIVE_CURRENT_SCALING off, of x = t * unscale whose amax carries no information (a
    NaN among finite values, all zeros): the stored scale is t's, kept, and the cast is t's cast with it (x's values
    times scale / unscale), 1 / scale its scale_inv (kernels/reference.py: quantize_ref states the rule; here from the
    spec). quantize_ speculates for such casts even so: the two-pass path's amax launch would keep t's scale and
    apply it to x itself."""
    monkeypatch.setattr(quantize, "SPECULATIVE_CURRENT_SCALING", False)
    stored = 2.0**-3
    gen = torch.Generator().manual_seed(5)
    t = _small((17, 33), gen, 100.0)
    t[9, 31] = float("nan")
    for t_step in (t, torch.zeros(17, 33)):
        state = _state(stored)
        x = (t_step * unscale).to(DEVICE)
        got = quantize.quantize_(x, *state, E4M3, 0, True, False, True, True, torch.tensor(unscale, device=DEVICE))
        assert state[1].item() == stored
        assert got[2].item() == 1.0 / stored
        want = spec_cast(t_step, stored, E4M3)
        nan = torch.isnan(want.view(E4M3).float())
        assert torch.equal(torch.isnan(got[0].float().cpu()), nan)
        assert torch.equal(got[0].view(torch.uint8).cpu()[~nan], want[~nan])


def test_the_grid_has_a_program_for_any_work():
    """A launch's persistent grid has at least one program, also for fewer work items than a program's minimum (a
    current-scaled amax launch of one block: MIN_ITEMS 2), and at most PROGRAMS_PER_SM per multiprocessor."""

    class OnGpu:  # what _grid_size reads of a CUDA tensor: its device
        device = torch.device("cuda", 0)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cast, "_multiprocessors", lambda x: 132)
        for work in (1, 2, 3, 264, 10**6):
            for per_sm, min_items in ((2**20, 2), (32, 1), (4, 1)):
                grid = cast._grid_size(OnGpu(), work, per_sm, min_items)
                assert 1 <= grid <= min(max(work // min_items, 1), 132 * per_sm), (work, per_sm, min_items, grid)


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_transposed_recast_with_tensor_descriptors_enabled(monkeypatch, fp8_dtype):
    """recast_transposed (the transposed copy alone) of a shape that fits tensor descriptors, with TMA on in the
    transposed cast's config: the transpose of the spec's cast (there is no row-major output to describe)."""
    monkeypatch.setitem(cast.CONFIGS, "transpose", {**cast.CONFIGS["transpose"], "TMA": True})
    gen = torch.Generator().manual_seed(6)
    x = _small((64, 48), gen, 300.0).to(torch.bfloat16).to(DEVICE)
    scale = 2.0**-1
    got = quantize.recast_transposed(x, torch.tensor(scale, device=DEVICE), fp8_dtype)
    assert got.shape == (48, 64)
    assert torch.equal(got.view(torch.uint8).cpu(), spec_cast(x, scale, fp8_dtype).t().contiguous())


def _inside_larger_buffer(rows, cols, gen, bound, fill):
    """A contiguous (rows, cols) view at the start of a larger buffer whose following elements hold ``fill``: a
    kernel that reads past the view's last element (a dropped mask) sees them."""
    buf = torch.full((rows + 3, cols), fill)
    buf[:rows] = _small((rows, cols), gen, bound)
    return buf.to(DEVICE)[:rows]


@pytest.mark.parametrize("numel", [3 * 1024, 2048 + 5, 33])
def test_amax_reads_nothing_past_the_tensor(numel):
    """amax of a tensor whose size is no multiple of the kernel's block (4096), in a buffer holding 1e30 right after
    it: max |x| of its own elements (torch's amax)."""
    gen = torch.Generator().manual_seed(8)
    x = _inside_larger_buffer(numel, 1, gen, 3.0, 1e30).reshape(-1)
    assert x.is_contiguous() and x.numel() == numel
    assert cast.amax(x).item() == x.abs().max().item()


@pytest.mark.parametrize("transpose", [False, True])
def test_cast_reads_nothing_past_a_ragged_tensor(transpose):
    """The cast of a 17 x 33 view (ragged in both tile sides), followed in memory by values that would saturate: its
    amax, saturated count and bytes are those of its own elements."""
    gen = torch.Generator().manual_seed(9)
    x = _inside_larger_buffer(17, 33, gen, 10.0, 1e6)
    scale = 2.0**2
    x_fp8, x_fp8_t, amax, n_sat = cast.cast_to_fp8(x, torch.tensor(scale, device=DEVICE), E4M3, transpose)
    assert amax.item() == x.abs().max().item() and int(n_sat) == 0
    assert torch.equal(x_fp8.view(torch.uint8).cpu(), spec_cast(x, scale, E4M3))
    if transpose:
        assert torch.equal(x_fp8_t.view(torch.uint8).cpu(), spec_cast(x, scale, E4M3).t().contiguous())


def test_offsets_widen_to_64_bits_past_int32(monkeypatch):
    """Every lane of a launch (up to the tile-padded size) has an offset that must fit the kernel's index type: past
    2**31 the casts and the amax switch to 64-bit offsets. Meta tensors of that size; the launches are captured, not
    run."""
    launched = []
    monkeypatch.setattr(cast, "_launch", lambda kernel, x, work, cfg, *a, **kw: launched.append(kw["INDEX_64"]))
    scale = torch.ones((), device="meta")
    for shape, transpose in [((2**31 + 1,), False), ((2**16 + 1, 2**15), True), ((1000,), False), ((17, 33), True)]:
        x = torch.empty(shape, dtype=torch.bfloat16, device="meta")
        launched.clear()
        cast._cast_with_stats(x, scale, E4M3, transpose, eager=True)
        cast._amax_impl(x.reshape(-1), eager=True)
        assert launched == [x.numel() > 2**31 - 1] * 2, (shape, launched)
