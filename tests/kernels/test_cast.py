"""The Triton casts (kernels/cast.py) against their references (kernels/reference.py), bit for bit.

On CPU the kernels run under ``TRITON_INTERPRET=1`` (tests/conftest.py); on a GPU the same tests run the
compiled kernels, and the ``gpu`` tests add sizes, torch.compile and the custom-op checks.
"""

import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from lightning_fp8.kernels import cast, quantize, reference  # noqa: E402
from lightning_fp8.kernels.reference import amax_ref, cast_to_fp8_ref, column_sum_ref  # noqa: E402
from lightning_fp8.kernels.scaling import _pow2_scale  # noqa: E402

from lightning_fp8 import FP8Linear, ops  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def assert_cast_equal(got, ref):
    """Casts are bit-exact: compare bytes; NaN positions separately (any NaN encoding is a NaN)."""
    for name, g, r in zip(("x_fp8", "x_fp8_t"), got[:2], ref[:2], strict=True):
        assert g.dtype == r.dtype and g.shape == r.shape, (name, g.dtype, g.shape, r.shape)
        g_nan, r_nan = torch.isnan(g.float()), torch.isnan(r.float())
        assert torch.equal(g_nan, r_nan), f"{name}: NaN positions differ"
        diff = (g.view(torch.uint8) != r.view(torch.uint8)) & ~r_nan
        assert not diff.any(), f"{name}: {int(diff.sum())} bytes differ, first at {diff.nonzero()[0].tolist()}"
    amax, n_sat = got[2], got[3]
    assert amax.dtype == torch.float32 and amax.dim() == 0
    assert n_sat.dtype == torch.int64 and n_sat.dim() == 0
    assert torch.equal(amax, ref[2]), (amax, ref[2])
    assert torch.equal(n_sat, ref[3]), (n_sat, ref[3])


def fp8_grid(fp8_dtype):
    """Every finite FP8 value, as fp32."""
    v = torch.arange(256, dtype=torch.uint8).view(fp8_dtype).float()
    return v[torch.isfinite(v)]


def planted_values(fp8_dtype, scale):
    """Hard cases as x values (x * scale lands on them): FP8 rounding ties and their neighbours, the
    subnormal range, saturation, inf, NaN, signed zeros."""
    grid = fp8_grid(fp8_dtype).double().unique()
    ties = (grid[1:] + grid[:-1]) / 2  # exactly between two FP8 values: round to the even one
    ties = torch.cat([ties, -ties]).float()
    near = torch.cat([torch.nextafter(ties, ties + 1), torch.nextafter(ties, ties - 1)])
    smallest_normal = grid[grid > 0].min().item() * 2 ** {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[fp8_dtype]
    subnormal = (torch.rand(200, dtype=torch.float64) * 2 - 1) * smallest_normal
    fmax = grid.max().item()
    special = torch.tensor(
        [fmax, -fmax, fmax * 1.01, -fmax * 3, fmax * 1e6, float("inf"), -float("inf"), float("nan"), 0.0, -0.0,
         1e-30, -1e-30, 7.77, -3.9, 1e38]
    )  # fmt: skip
    y = torch.cat([ties, near, subnormal.float(), special])
    return y / scale


def inputs(shape, dtype, fp8_dtype, scale, planted=True):
    """Random values over many binades, with planted hard cases at random positions."""
    n = torch.Size(shape).numel()
    fmax = fp8_grid(fp8_dtype).max().item()
    # |x * scale| from far below the smallest subnormal to beyond fp8_max (saturation)
    x = torch.randn(n) * torch.exp2(torch.empty(n).uniform_(-20, 8)) * fmax / 64 / scale
    if planted:
        p = planted_values(fp8_dtype, scale)
        x[torch.randperm(n)[: n // 3]] = p[torch.randint(len(p), (n // 3,))]
    return x.reshape(shape).to(dtype).to(DEVICE)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", [(37, 53), (132, 52)])
def test_recast_transposed_is_the_casts_transpose(fp8_dtype, shape):
    """The weight recast of FP8Linear's backward: the reference cast's transposed copy, bit for bit, every time (on a
    GPU the later calls replay the first one's launches), and its statistics go nowhere visible."""
    scale = torch.tensor(2.0**-3, device=DEVICE)
    for step in range(3):
        x = inputs(shape, torch.bfloat16, fp8_dtype, 2.0**-3, planted=step != 1)
        got = quantize.recast_transposed(x, scale, fp8_dtype)
        ref = cast_to_fp8_ref(x, scale, fp8_dtype, transpose=True)[1]
        assert got.dtype == fp8_dtype and got.shape == ref.shape
        assert torch.equal(torch.isnan(got.float()), torch.isnan(ref.float()))
        assert torch.equal(
            got.view(torch.uint8)[~torch.isnan(ref.float())], ref.view(torch.uint8)[~torch.isnan(ref.float())]
        )


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", INPUT_DTYPES)
@pytest.mark.parametrize("shape", [(37, 53), (1, 16), (129, 7), (132, 52)])
@pytest.mark.parametrize("transpose", [False, True])
def test_cast_matches_reference_odd_shapes(fp8_dtype, dtype, shape, transpose):
    scale = torch.tensor(2.0**3, device=DEVICE)
    x = inputs(shape, dtype, fp8_dtype, scale.item())
    assert_cast_equal(cast.cast_to_fp8(x, scale, fp8_dtype, transpose), cast_to_fp8_ref(x, scale, fp8_dtype, transpose))


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", INPUT_DTYPES)
@pytest.mark.parametrize("scale", [2.0**-5, 2.0**4])
def test_cast_rounding_ties_subnormals_saturation(fp8_dtype, dtype, scale):
    # Every planted value once (ties of the whole FP8 grid, both signs), padded with random values.
    if dtype == torch.float16 and fp8_dtype == torch.float8_e5m2:
        scale = max(scale, 1.0)  # fp16 (max 65504) reaches E5M2's saturation (57344) only with scale >= 1
    scale_t = torch.tensor(scale, device=DEVICE)
    p = planted_values(fp8_dtype, scale)
    x = inputs((61, 47), torch.float32, fp8_dtype, scale, planted=False).flatten()
    x[: len(p)] = p.to(DEVICE)
    x = x[torch.randperm(x.numel(), device=DEVICE)].reshape(61, 47).to(dtype)
    ref = cast_to_fp8_ref(x, scale_t, fp8_dtype, transpose=True)
    assert ref[3] > 0 and torch.isnan(ref[0].float()).any()  # the planted cases are there
    assert_cast_equal(cast.cast_to_fp8(x, scale_t, fp8_dtype, transpose=True), ref)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_every_fp8_value_casts_to_itself(fp8_dtype):
    # The interpreter converts values on the FP8 grid exactly (the kernel's rounding relies on it).
    grid = fp8_grid(fp8_dtype).to(DEVICE)
    x_fp8, _, amax, n_sat = cast.cast_to_fp8(grid, torch.tensor(1.0, device=DEVICE), fp8_dtype)
    assert torch.equal(x_fp8.view(torch.uint8), grid.to(fp8_dtype).view(torch.uint8))
    assert amax.item() == grid.abs().max().item() and n_sat.item() == 2  # +-fp8_max


def test_cast_any_shape_and_non_contiguous():
    scale = torch.tensor(0.5, device=DEVICE)
    for x in (
        inputs((3, 5, 7), torch.bfloat16, torch.float8_e4m3fn, 0.5),
        inputs((40, 24), torch.float32, torch.float8_e4m3fn, 0.5).t(),  # non-contiguous
        inputs((5000,), torch.float16, torch.float8_e4m3fn, 0.5),
    ):
        assert_cast_equal(
            cast.cast_to_fp8(x, scale, torch.float8_e4m3fn), cast_to_fp8_ref(x, scale, torch.float8_e4m3fn)
        )
    x = inputs((40, 24), torch.float32, torch.float8_e5m2, 0.5).t()
    assert_cast_equal(
        cast.cast_to_fp8(x, scale, torch.float8_e5m2, True), cast_to_fp8_ref(x, scale, torch.float8_e5m2, True)
    )


@pytest.mark.parametrize("dtype", INPUT_DTYPES)
def test_amax_matches_reference(dtype):
    x = inputs((97, 131), dtype, torch.float8_e4m3fn, 1.0, planted=False)
    assert torch.equal(cast.amax(x), amax_ref(x))
    x.view(-1)[1234] = float("nan")
    assert torch.equal(cast.amax(x), amax_ref(x)) and cast.amax(x).item() == float("inf")
    x.view(-1)[1234] = -float("inf")
    assert cast.amax(x).item() == float("inf")


def test_amaxes_match_amax_one_by_one():
    # FP8AdamW measures the gradient amaxes of a step at once: the same values as ops.amax, NaN as inf, empty as 0.
    gen = torch.Generator().manual_seed(3)
    shapes = [(37, 5), (130,), (0,), (3, 4, 5), (1,)]
    cases = [(shape, dtype) for dtype in INPUT_DTYPES for shape in shapes]
    tensors = [(torch.randn(shape, generator=gen) * 10.0**k).to(dtype).to(DEVICE) for k, (shape, dtype) in
               enumerate(cases)]  # fmt: skip
    tensors[1][7] = float("nan")
    tensors[8].view(-1)[0] = -float("inf")
    got = ops.amaxes(tensors)
    assert len(got) == len(tensors)
    for t, a in zip(tensors, got, strict=True):
        assert a.dtype == torch.float32 and a.dim() == 0 and a.device == t.device
        assert torch.equal(a, amax_ref(t)), (t.dtype, t.shape)
    assert got[1].item() == float("inf") and got[2].item() == 0.0 and ops.amaxes([]) == []
    with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):  # Lightning's manual optimization steps here
        reordered = ops.amaxes(tensors[::-1])  # fp16 first: autocast's promotion rejected that once
    assert all(torch.equal(a, b) for a, b in zip(reordered, got[::-1], strict=True))


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_cast_whole_tiles_and_64_bit_offsets(monkeypatch, fp8_dtype):
    # Shapes the tiles divide take the unmasked path; a lowered limit forces the 64-bit offset path.
    scale = torch.tensor(2.0, device=DEVICE)
    t = cast.CONFIGS["transpose"]
    x = inputs((2 * t["BLOCK_M"], 3 * t["BLOCK_N"]), torch.bfloat16, fp8_dtype, 2.0)
    for limit in (cast.INT32_INDEX_LIMIT, 0):
        monkeypatch.setattr(cast, "INT32_INDEX_LIMIT", limit)
        for transpose in (False, True):
            ref = cast_to_fp8_ref(x, scale, fp8_dtype, transpose)
            assert_cast_equal(cast.cast_to_fp8(x, scale, fp8_dtype, transpose), ref)
        assert torch.equal(cast.amax(x), amax_ref(x))


@pytest.mark.parametrize("stats", ["element", "row", "tile"])
def test_every_statistics_mode_matches_reference(monkeypatch, stats):
    # The running amax and saturation count of each mode (per element, per row, per tile), over several tiles per
    # program (a grid of 4 programs under the interpreter) with masked edges: the same totals as the reference.
    monkeypatch.setitem(cast.CONFIGS, "transpose", {**cast.CONFIGS["transpose"], "STATS": stats})
    if stats != "row":  # 1-D blocks have no rows
        monkeypatch.setitem(cast.CONFIGS, "flat", {**cast.CONFIGS["flat"], "STATS": stats})
    scale = torch.tensor(2.0**-2, device=DEVICE)
    for fp8_dtype in FP8_DTYPES:
        x = inputs((3 * 64 + 5, 2 * 64 + 9), torch.bfloat16, fp8_dtype, scale.item())
        for transpose in (False, True):
            ref = cast_to_fp8_ref(x, scale, fp8_dtype, transpose)
            assert ref[3] > 0
            assert_cast_equal(cast.cast_to_fp8(x, scale, fp8_dtype, transpose), ref)


@pytest.mark.parametrize("group_m", [1, 2, 4])
def test_transposed_cast_any_row_grouping(monkeypatch, group_m):
    # Small casts on a GPU walk fewer row tiles per work item (cast._group_m): the same bytes and statistics for every
    # grouping, over several row groups and column blocks with masked edges.
    monkeypatch.setitem(cast.CONFIGS, "transpose", {**cast.CONFIGS["transpose"], "GROUP_M": group_m})
    scale = torch.tensor(2.0**-2, device=DEVICE)
    x = inputs((5 * 64 + 5, 2 * 64 + 9), torch.bfloat16, torch.float8_e4m3fn, scale.item())
    ref = cast_to_fp8_ref(x, scale, torch.float8_e4m3fn, True)
    assert_cast_equal(cast.cast_to_fp8(x, scale, torch.float8_e4m3fn, True), ref)


def test_row_grouping_of_small_casts():
    # GROUP_M halves until the work items fill each multiprocessor GROUP_M_MIN_ITEMS_PER_SM times, never below 1.
    per_sm = cast.GROUP_M_MIN_ITEMS_PER_SM
    assert cast._group_m(8 * per_sm * 132, 8, 132) == 8  # enough tiles: unchanged
    assert cast._group_m(8 * per_sm * 132 - 1, 8, 132) == 4
    for tiles in (1024, 2000, 3000):  # the largest halving of 8 whose items fill the multiprocessors
        assert cast._group_m(tiles, 8, 132) == max(g for g in (1, 2, 4, 8) if g == 1 or tiles >= g * per_sm * 132)
    assert cast._group_m(1, 8, 132) == 1
    assert cast._group_m(10**6, 16, 132) == 16


def test_empty_tensors():
    scale = torch.tensor(1.0, device=DEVICE)
    e = torch.empty(0, 16, device=DEVICE)
    assert cast.amax(e).item() == 0.0
    assert_cast_equal(
        cast.cast_to_fp8(e, scale, torch.float8_e4m3fn, True), cast_to_fp8_ref(e, scale, torch.float8_e4m3fn, True)
    )


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN * x under the interpreter
def test_nan_products_of_finite_values_stay_nan(fp8_dtype, transpose):
    """A NaN scale passed by hand, and 0 * inf, give NaN where torch.clamp keeps it (the reference); the kernel's
    min/max wrote them as -fp8_max, a finite value in place of the NaN that tells of the bad scale."""
    x = inputs((37, 53), torch.bfloat16, fp8_dtype, 1.0, planted=False)
    x[0, :3] = torch.tensor([0.0, float("inf"), float("nan")])
    for scale in (float("nan"), float("inf")):
        s = torch.tensor(scale, device=DEVICE)
        got, ref = cast.cast_to_fp8(x, s, fp8_dtype, transpose), cast_to_fp8_ref(x, s, fp8_dtype, transpose)
        assert_cast_equal(got, ref)
        nan = torch.isnan(ref[0].float())
        assert nan.all() if scale != scale else nan[0, :3].all() and nan.sum() == 2 + int((x == 0).sum())


def test_bad_arguments_are_named():
    x = torch.randn(4, 16, device=DEVICE)
    one = torch.tensor(1.0, device=DEVICE)
    with pytest.raises(TypeError, match="int64"):
        cast.cast_to_fp8(x.long(), one, torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="fp8_dtype"):
        cast.cast_to_fp8(x, one, torch.bfloat16)
    with pytest.raises(TypeError, match="scale"):
        cast.cast_to_fp8(x, torch.ones(2, device=DEVICE), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="2-D"):
        cast.cast_to_fp8(x.reshape(2, 2, 16), one, torch.float8_e4m3fn, transpose=True)
    for bad in (x.int(), x.double()):  # the message names only the dtypes the kernels read
        with pytest.raises(TypeError, match=rf"casts float16, bfloat16 or float32 values, got {bad.dtype}"):
            cast.amax(bad)
    with pytest.raises(TypeError, match="expects a tensor"):
        cast.amax(x.tolist())
    with pytest.raises(TypeError, match="cast already"):
        cast.amax(x.to(torch.float8_e4m3fn))
    with pytest.raises(TypeError, match="float32 values, got torch.float64"):
        cast.cast_to_fp8(x.double(), one, torch.float8_e4m3fn)


def _linear_step(seed, monkeypatch, kernels):
    monkeypatch.setenv("LIGHTNING_FP8_KERNELS", kernels)
    torch.manual_seed(seed)
    layer = FP8Linear(48, 32, device=DEVICE)
    outs = []
    for _ in range(2):  # the second step uses the delayed scales recorded by the first
        x = torch.randn(3, 13, 48, device=DEVICE, requires_grad=True)
        y = layer(x)
        y.backward(torch.randn_like(y) * 1e-3)
        outs += [y.detach(), x.grad, layer.weight.grad.clone(), layer.bias.grad.clone()]
    outs += [s.amax.clone() for s in layer.fp8_scaling.values()] + [s.scale.clone() for s in layer.fp8_scaling.values()]
    return outs


@pytest.mark.parametrize("fused_bias_grad", [False, True])
def test_fp8_linear_triton_equals_reference(monkeypatch, fused_bias_grad):
    from lightning_fp8 import matmul

    monkeypatch.setattr(matmul, "FUSED_BIAS_GRAD", fused_bias_grad)
    got = _linear_step(7, monkeypatch, "triton")
    ref = _linear_step(7, monkeypatch, "reference")
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        if fused_bias_grad and DEVICE == "cuda" and i % 4 == 3:  # a GPU's column sums: its own reduction tree
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(g, r)


def _state(history_len, scale):
    """The buffers of a ScalingState: history, scale, last amax, saturation, non-finite count, casts."""
    f32 = {"dtype": torch.float32, "device": DEVICE}
    return [torch.zeros(history_len, **f32), torch.tensor(scale, **f32), torch.zeros((), **f32),
            torch.zeros((), **f32), torch.zeros((), dtype=torch.int64, device=DEVICE),
            torch.zeros((), dtype=torch.int64, device=DEVICE)]  # fmt: skip


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize(("delayed", "algo_max", "history_len"), [(True, True, 5), (True, False, 3), (False, True, 1)])
@pytest.mark.parametrize(("shape", "transpose"), [((67, 45), True), ((3, 5, 29), False), ((130, 64), True)])
@pytest.mark.parametrize("unscale", [None, 2.0**-7])
def test_fused_quantize_matches_reference_over_steps(
    fp8_dtype, delayed, algo_max, history_len, shape, transpose, unscale
):
    """The one-launch cast + bookkeeping (kernels/quantize.py: quantize_) against the composition of the references,
    over successive casts of changing magnitude, with a non-finite tensor and an all-zero one among them (the workspace
    must come back zeroed after every launch, the history roll and the next scale must match bit for bit)."""
    from lightning_fp8.kernels.reference import quantize_ref

    got_state, ref_state = _state(history_len, 4.0), _state(history_len, 4.0)
    gen = torch.Generator().manual_seed(3)
    for step, magnitude in enumerate([1.0, 300.0, 0.01, float("nan"), 5.0, 0.0, 2e4]):
        x = torch.randn(shape, generator=gen) * magnitude
        if magnitude != magnitude:  # plant a NaN in an otherwise finite tensor
            x = torch.randn(shape, generator=gen)
            x.view(-1)[7] = float("nan")
        x = x.to(DEVICE)
        current = step == 0 or not delayed
        ms = None if unscale is None else torch.tensor(unscale, device=DEVICE)  # a scaled master in the storage
        args = (fp8_dtype, 1, algo_max, delayed, current, transpose, ms)
        got = quantize.quantize_(x, *got_state, *args)
        ref = quantize_ref(x, *ref_state, *args)
        no_stats = (torch.zeros(()), torch.zeros((), dtype=torch.int64))  # compared through the state below
        assert_cast_equal((*got[:2], *no_stats), (*ref[:2], *no_stats))
        assert torch.equal(got[2], ref[2]), (step, got[2], ref[2])  # scale_inv
        for name, g, r in zip(
            ("history", "scale", "amax", "saturation", "nonfinite", "casts"), got_state, ref_state, strict=True
        ):
            assert torch.equal(g, r), (step, name, g, r)
    assert int(got_state[4]) == 1 and int(got_state[5]) == 7


@pytest.mark.parametrize(("shape", "transpose", "column_sum"), [((67, 45), True, True), ((3, 5, 29), False, False)])
@pytest.mark.parametrize("unscale", [None, 2.0**-7])
def test_speculative_current_scaling(monkeypatch, shape, transpose, column_sum, unscale):
    """Current scaling in one pass when the last cast's scale is still this tensor's (kernels/quantize.py): bit for bit
    the reference when the guess holds, when it does not (the redo pass), for an all-zero tensor and a NaN. Without
    the redo launch the wrong guesses show, and only they: the second launch is what makes them right."""
    from lightning_fp8.kernels.reference import quantize_ref

    monkeypatch.setattr(quantize, "SPECULATIVE_CURRENT_SCALING", True)
    # 1.0 twice (same binade: the guess holds), 300 (a new scale), 300 again (holds), zeros (the amax keeps the stored
    # scale), 1.0 (new again), NaN (keeps it), 1e-3 (new), and 1e-3 again, with a changed unscale where there is one
    # (a new scale for the stored values).
    magnitudes = [1.0, 1.0, 300.0, 300.0, 0.0, 1.0, float("nan"), 1e-3, 1e-3]
    unscales = [unscale] * 8 + [None if unscale is None else unscale * 4]
    real_launch = cast._launch

    def no_redo(kernel, x, work, cfg, *args, **kw):
        if kw.get("SPECULATE") != 2:
            real_launch(kernel, x, work, cfg, *args, **kw)

    # Without the redo launch only under the interpreter: on a GPU the later casts replay the first one's launches
    # (kernels/launch.py), which the patched cast._launch does not see.
    for redo in (True, False) if DEVICE == "cpu" else (True,):
        if not redo:
            monkeypatch.setattr(cast, "_launch", no_redo)
        got_state, ref_state = _state(1, 1.0), _state(1, 1.0)
        gen = torch.Generator().manual_seed(11)
        base = torch.randn(shape, generator=gen)
        wrong, guessed_wrong = [], []
        for step, (magnitude, u) in enumerate(zip(magnitudes, unscales, strict=True)):
            x = base * magnitude if magnitude == magnitude else base.clone()
            if magnitude != magnitude:
                x.view(-1)[3] = float("nan")
            x = x.to(torch.bfloat16).to(DEVICE)
            ms = None if u is None else torch.tensor(u, device=DEVICE)
            guess = got_state[1] / (1.0 if u is None else u)  # the scale the first pass casts the stored values with
            args = (torch.float8_e4m3fn, 0, True, False, True, transpose, ms, column_sum)
            got = quantize.quantize_(x, *got_state, *args)
            ref = quantize_ref(x, *ref_state, *args)
            used = 1.0 / (ref[2] * (1.0 if u is None else u))  # the scale current scaling cast them with
            if not torch.equal(guess, used):
                guessed_wrong.append(step)
            same = torch.equal(got[0].view(torch.uint8), ref[0].view(torch.uint8)) and torch.equal(got[2], ref[2])
            same = same and all(torch.equal(g, r) for g, r in zip(got_state, ref_state, strict=True))
            if not same:
                wrong.append(step)
                got_state = [r.clone() for r in ref_state]  # go on from the right state
            if redo:
                assert same, step
                if column_sum:
                    torch.testing.assert_close(got[3], ref[3], rtol=1e-5, atol=1e-5, equal_nan=True)
        # Both paths ran: the same magnitude again keeps the scale (steps 1, 3), a new one does not (2, 7). The zeros
        # and the NaN (4, 6) keep the scale too: with an unscale the stored scale is t's, which casts the stored values
        # (t * unscale) as scale / unscale, the guess.
        assert {2, 7} <= set(guessed_wrong) and not {1, 3, 4, 6} & set(guessed_wrong), guessed_wrong
        if not redo:
            assert wrong == guessed_wrong


@pytest.mark.parametrize("speculative", [True, False])
@pytest.mark.parametrize("unscale", [2.0**-7, 2.0**18])
def test_casts_of_zeros_with_unscale_keep_the_stored_scale(monkeypatch, speculative, unscale):
    """A weight held as t * unscale (FP8AdamW's scaled master) that becomes all zero: its casts (amax 0) keep the
    scale stored for t, as any cast of zeros keeps the scale (DESIGN.md), in both the one-pass and the two-pass
    current scaling, bit for bit the reference; a later nonzero weight gets its own scale again. Before, each cast of
    zeros multiplied the stored scale by unscale once more (an all-zero weight's scale reached inf: NaN outputs)."""
    from lightning_fp8.kernels.reference import quantize_ref

    monkeypatch.setattr(quantize, "SPECULATIVE_CURRENT_SCALING", speculative)
    got_state, ref_state = _state(1, 2.0**-3), _state(1, 2.0**-3)
    ms = torch.tensor(unscale, device=DEVICE)
    args = (torch.float8_e4m3fn, 0, True, False, True, True, ms, False)
    t = torch.randn(48, 32, generator=torch.Generator().manual_seed(5))
    for step, x in enumerate([t * 3.0] + [torch.zeros(48, 32)] * 3 + [t * 0.01]):
        x = (x * unscale).to(torch.bfloat16).to(DEVICE)
        got = quantize.quantize_(x, *got_state, *args)
        ref = quantize_ref(x, *ref_state, *args)
        assert torch.equal(got[0].view(torch.uint8), ref[0].view(torch.uint8)), step
        assert all(torch.equal(g, r) for g, r in zip(got_state, ref_state, strict=True)), step
        want = 448.0 / (3.0 * t.abs().max()) if step < 4 else 448.0 / (0.01 * t.abs().max())
        want = 2.0 ** math.floor(math.log2(want))  # t's own power-of-two scale (the zeros' casts keep step 0's)
        assert got_state[1].item() == want, (step, got_state[1].item(), want)
        assert torch.isfinite(got[2]).all() and (got[0].float() == 0).all() == (1 <= step <= 3), step


@pytest.mark.parametrize(
    ("current", "transpose", "unscale", "column_sum"),
    [(True, True, None, True), (False, True, 2.0**-7, False), (False, False, None, False)],
)
def test_traced_quantize_op_matches_reference(current, transpose, unscale, column_sum):
    """The triton_op that torch.compile records for a cast on a GPU (kernels/quantize.py: quantize_op): the same
    launches as quantize_ with a fresh workspace per call and the fixed four-output schema, against the references, over
    successive casts (called as it is here; the compiled GPU path is checked by benchmarks/check_compile.py)."""
    got_state, ref_state = _state(4, 4.0), _state(4, 4.0)
    gen = torch.Generator().manual_seed(5)
    for step, magnitude in enumerate([1.0, 300.0, 0.0, 2e4]):
        x = (torch.randn(67, 48, generator=gen) * magnitude).to(torch.bfloat16).to(DEVICE)
        ms = None if unscale is None else torch.tensor(unscale, device=DEVICE)
        args = (torch.float8_e5m2, 1, True, True, current or step == 0, transpose, ms, column_sum)
        got = quantize.quantize_op(x, *got_state, *args)
        ref = reference.quantize_ref(x, *ref_state, *args)
        no_stats = (torch.zeros(()), torch.zeros((), dtype=torch.int64))
        assert_cast_equal((*got[:2], *no_stats), (*ref[:2], *no_stats))
        assert torch.equal(got[2], ref[2]), (step, got[2], ref[2])
        assert got[3].shape == ((48,) if column_sum else (0,))
        if column_sum and DEVICE == "cpu":
            assert torch.equal(got[3], ref[3])
        for g, r in zip(got_state, ref_state, strict=True):
            assert torch.equal(g, r), (step, g, r)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize(("delayed", "algo_max", "history_len"), [(True, True, 5), (True, False, 3), (False, True, 1)])
def test_record_op_matches_reference_over_steps(fp8_dtype, delayed, algo_max, history_len):
    """The bookkeeping of a cast whose data pass torch.compile generates (kernels/record.py: record_op, and the scale
    copy used_scale_op) against record_cast_ref, over amaxes of changing magnitude with inf and 0 among them (the
    history roll, the next scale, the statistics, 1 / scale, bit for bit)."""
    from lightning_fp8.kernels import record

    got_state, ref_state = _state(history_len, 4.0), _state(history_len, 4.0)
    fmax = reference._FP8_MAX[fp8_dtype]
    numel = 1000
    for step, amax in enumerate([1.0, 300.0, 0.01, float("inf"), 5.0, 0.0, 2e4, 3e-3]):
        amax_t = torch.tensor(amax, device=DEVICE)
        n_sat = torch.tensor(step * 7, dtype=torch.int64, device=DEVICE)
        used = record.used_scale_op(got_state[1])
        assert torch.equal(used, got_state[1]) and used.data_ptr() != got_state[1].data_ptr()
        if step % 3 == 0:  # a current-scaled cast: the scale of this amax, which the state keeps without delay
            used = reference.pow2_scale_ref(amax_t, fmax, 1, used)
        args = (fp8_dtype, 1, algo_max, delayed)
        got = record.record_op(amax_t, n_sat, used, *got_state, numel, *args)
        if not delayed:
            ref_state[1].copy_(used)  # quantize_ref's current_scale_ref
        ref = reference.record_cast_ref(amax_t, n_sat, numel, used.clone(), *ref_state, fmax, 1, algo_max, delayed)
        assert torch.equal(got, ref), (step, got, ref)
        for name, g, r in zip(
            ("history", "scale", "amax", "saturation", "nonfinite", "casts"), got_state, ref_state, strict=True
        ):
            assert torch.equal(g, r), (step, name, g, r)
    assert int(got_state[4]) == 1 and int(got_state[5]) == 8
    with pytest.raises(ValueError, match="empty tensor"):
        record.record_op(amax_t, n_sat, used, *got_state, 0, *args)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", [(64, 48), (160, 96), (67, 48), (64, 40)])  # the last two: no descriptors
def test_tma_transposed_cast_matches_reference(monkeypatch, fp8_dtype, shape):
    """The transposed cast with its tiles moved through tensor descriptors (TMA; the interpreter runs them too):
    bit-exact against the reference, with planted hard values, partial tiles (160 x 96 with 64 x 64 tiles), the
    fused bookkeeping and the column sums; shapes whose sides are not multiples of 16 keep the pointer path."""
    monkeypatch.setitem(cast.CONFIGS, "transpose", {**cast.CONFIGS["transpose"], "TMA": True})
    m, n = shape
    assert cast._tma_fits(torch.empty(shape, dtype=torch.bfloat16, device=DEVICE)) == (m % 16 == 0 and n % 16 == 0)
    for dtype in INPUT_DTYPES:
        scale = torch.tensor(2.0**-2, device=DEVICE)
        x = inputs(shape, dtype, fp8_dtype, scale.item())
        assert_cast_equal(cast.cast_to_fp8(x, scale, fp8_dtype, True), cast_to_fp8_ref(x, scale, fp8_dtype, True))
    args = (fp8_dtype, 0, True, True, True, True, None, True)
    x = inputs(shape, torch.bfloat16, fp8_dtype, 1.0)
    got_state, ref_state = _state(4, 1.0), _state(4, 1.0)
    got, ref = quantize.quantize_(x, *got_state, *args), reference.quantize_ref(x, *ref_state, *args)
    no_stats = (torch.zeros(()), torch.zeros((), dtype=torch.int64))
    assert_cast_equal((*got[:2], *no_stats), (*ref[:2], *no_stats))
    assert torch.equal(got[2], ref[2])
    if DEVICE == "cpu":  # planted NaNs make some column sums NaN
        torch.testing.assert_close(got[3], ref[3], rtol=0, atol=0, equal_nan=True)
    for g, r in zip(got_state, ref_state, strict=True):
        torch.testing.assert_close(g, r, rtol=0, atol=0, equal_nan=True)


# The bias gradient's tolerance against the exact (fp64) column sum: every fp32 addition of a sum of n terms rounds by
# at most 2**-24 relative, so |error| <= n * 2**-24 * sum|x| (a loose bound; the test data land far inside it).
def column_sum_bound(x):
    return x.shape[0] * 2.0**-24 * x.double().abs().sum(0)


def _column_sum_cast(x, fp8_dtype, transpose):
    """quantize_ with column_sum on a fresh state and its reference: (got, ref) output tuples."""
    args = (fp8_dtype, 0, True, True, True, transpose, None, True)
    got_state, ref_state = _state(4, 1.0), _state(4, 1.0)
    return quantize.quantize_(x, *got_state, *args), reference.quantize_ref(x, *ref_state, *args)


@pytest.mark.parametrize(("shape", "transpose"), [((300, 52), True), ((132, 48), True), ((67, 45), True),
                                                  ((300, 52), False), ((1, 16), True), ((1100, 20), True)])  # fmt: skip
def test_fused_column_sum_matches_reference(shape, transpose):
    """The bias gradient the grad cast sums as it reads: bit for bit the reference's order (several row blocks, a
    partial last one, several row groups, no transposed copy at all), close to the exact column sum."""
    x = (torch.randn(shape) * torch.exp2(torch.randint(-6, 6, shape).float())).to(torch.bfloat16).to(DEVICE)
    got, ref = _column_sum_cast(x, torch.float8_e5m2, transpose)
    assert len(got) == 4 and got[3].dtype == torch.float32 and got[3].shape == (shape[1],)
    no_stats = (torch.zeros(()), torch.zeros((), dtype=torch.int64))
    assert_cast_equal((*got[:2], *no_stats), (*ref[:2], *no_stats))
    exact = x.double().sum(0)
    assert ((ref[3].double() - exact).abs() <= column_sum_bound(x)).all()
    if DEVICE == "cpu":  # the interpreter sums a tile's rows in order, as the reference does
        assert torch.equal(got[3], ref[3])
    else:  # a GPU reduction tree: fp32 rounding of the same sum, and deterministic
        assert ((got[3].double() - exact).abs() <= column_sum_bound(x)).all()
        assert torch.equal(got[3], _column_sum_cast(x, torch.float8_e5m2, transpose)[0][3])


def test_column_sum_order_matches_the_kernel_config():
    # The reference's order is the kernel's only with its tile rows and row grouping.
    cfg = cast.CONFIGS["transpose"]
    assert cfg["BLOCK_M"] == reference.COLUMN_SUM_BLOCK_ROWS and cfg["GROUP_M"] == reference.COLUMN_SUM_GROUP
    x = torch.randn(300, 20, dtype=torch.float64).float()
    torch.testing.assert_close(column_sum_ref(x), x.sum(0), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="2-D"):
        column_sum_ref(x.reshape(2, 150, 20))


@pytest.mark.gpu
@pytest.mark.parametrize("exact_round", [False, True])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("transpose_via", ["bytes", "fp32"])
@pytest.mark.parametrize("stats", ["element", "row", "tile"])
def test_gpu_large_cast_every_variant(monkeypatch, exact_round, fp8_dtype, transpose_via, stats):
    # Every compiled variant the benchmark sweep may pick: with/without pre-rounding, each transpose path.
    monkeypatch.setattr(cast, "EXACT_ROUND_ON_GPU", exact_round)
    flat_stats = "tile" if stats == "row" else stats  # 1-D blocks have no rows
    monkeypatch.setitem(cast.CONFIGS, "flat", {**cast.CONFIGS["flat"], "STATS": flat_stats})
    variant = {"TRANSPOSE_VIA": transpose_via, "STATS": stats}
    monkeypatch.setitem(cast.CONFIGS, "transpose", {**cast.CONFIGS["transpose"], **variant})
    for dtype in INPUT_DTYPES:
        scale = torch.tensor(2.0**-2, device=DEVICE)
        x = inputs((1032, 2053), dtype, fp8_dtype, scale.item())
        for transpose in (False, True):
            assert_cast_equal(
                cast.cast_to_fp8(x, scale, fp8_dtype, transpose), cast_to_fp8_ref(x, scale, fp8_dtype, transpose)
            )
        assert torch.equal(cast.amax(x), amax_ref(x))


@pytest.mark.gpu
def test_gpu_custom_ops_and_torch_compile():
    x = inputs((272, 336), torch.bfloat16, torch.float8_e4m3fn, 1.0)
    scale = torch.tensor(4.0, device=DEVICE)
    # The fake (meta) implementations and schemas; opcheck's output comparison cannot take FP8 NaNs, so the
    # compiled run below checks the outputs bit for bit instead.
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(
        torch.ops.lightning_fp8.cast_to_fp8.default, (x, scale, torch.float8_e4m3fn, True), test_utils=checks
    )
    torch.library.opcheck(torch.ops.lightning_fp8.amax.default, (x,), test_utils=checks)

    def f(x, scale):
        return cast.cast_to_fp8(x * 2, scale, torch.float8_e4m3fn, True), cast.amax(x)

    got, got_amax = torch.compile(f, fullgraph=True)(x, scale)
    assert_cast_equal(got, cast_to_fp8_ref(x * 2, scale, torch.float8_e4m3fn, True))
    assert torch.equal(got_amax, amax_ref(x))


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_scaled_mm_bias_and_fast_accum(out_dtype):
    a = torch.randn(272, 160, device=DEVICE).to(torch.float8_e4m3fn)
    b = torch.randn(96, 160, device=DEVICE).to(torch.float8_e4m3fn).t()
    bias = torch.randn(96, device=DEVICE)
    s_a, s_b = torch.tensor(0.5, device=DEVICE), torch.tensor(4.0, device=DEVICE)
    exact = (a.double() * 0.5) @ (b.double() * 4.0) + bias.to(out_dtype).double()
    for fast in (False, True):
        got = ops.scaled_mm(a, b, s_a, s_b, out_dtype, bias=bias, use_fast_accum=fast)
        assert got.dtype == out_dtype
        # One rounding to out_dtype (bf16: 2**-8 relative) of an fp32 or, with fast accumulation, a ~14-bit
        # accumulation of 160 products (outputs have std ~25: an absolute error of 0.1 is 0.4% of that).
        torch.testing.assert_close(got.double(), exact, rtol=2**-7, atol=0.1)


def test_scaled_mm_emulation_bias():
    a = torch.randn(33, 48).to(torch.float8_e4m3fn)
    b = torch.randn(16, 48).to(torch.float8_e5m2).t()
    bias = torch.randn(16)
    one = torch.tensor(1.0)
    with_bias = ops.scaled_mm(a, b, one, one, torch.bfloat16, bias=bias)
    exact = (a.float() @ b.float() + bias.bfloat16().float()).bfloat16()
    assert torch.equal(with_bias, exact)


# Elements one FP8 code apart that the activation casts may show against the reference: the kernel's erf and exp (the
# interpreter's too) and torch's differ by an ulp at times, and E5M2's two mantissa bits put many values near a
# rounding boundary once the GELU backward's terms cancel. Measured 0.00-0.10% on one CPU and 0.11-0.17% on another
# (the vector math libraries differ); a wrong formula or scale moves most elements, or by more than one code.
ACTIVATION_TOLERATED = 1e-2


def assert_fp8_near(got, ref, tolerated_fraction):
    """FP8 tensors equal byte for byte but for at most ``tolerated_fraction`` of elements one code apart (the kernel's
    erf and exp against torch's: an ulp of fp32 moves a value across an FP8 rounding boundary now and then)."""
    g, r = got.view(torch.uint8).int(), ref.view(torch.uint8).int()
    differ = g != r
    assert ((g - r).abs()[differ] == 1).all(), "a byte differs by more than one code"
    assert differ.float().mean().item() <= tolerated_fraction, differ.float().mean().item()


@pytest.mark.parametrize("activation", ["gelu", "gelu_backward"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("shape", "current"), [((67, 45), True), ((130, 64), False), ((300, 52), True)])
def test_activation_cast_matches_reference(activation, dtype, shape, current):
    """A cast of a GELU's output from its input, and of its input gradient from the output gradient and the input
    (ScalingState.quantize(activation=...), FP8MLP's casts): the bytes, both layouts, the statistics and the column sums
    of what kernels/reference.py: activation_ref computes, over successive casts with a NaN among them."""
    gen = torch.Generator().manual_seed(7)
    got_state, ref_state = _state(4, 1.0), _state(4, 1.0)
    fp8_dtype = torch.float8_e4m3fn if activation == "gelu" else torch.float8_e5m2
    for step, magnitude in enumerate([1.0, 30.0, float("nan"), 1e-3]):
        x = torch.randn(shape, generator=gen) * (1.0 if magnitude != magnitude else magnitude)
        if magnitude != magnitude:
            x[5, 3] = float("nan")
        h = (torch.randn(shape, generator=gen) * 3).to(dtype).to(DEVICE)
        x = x.to(dtype).to(DEVICE)
        aux = h if activation == "gelu_backward" else None
        args = (fp8_dtype, 0, True, not current, current or step == 0, True, None, True, activation, aux)
        got = quantize.quantize_(x, *got_state, *args)
        ref = reference.quantize_ref(x, *ref_state, *args)
        assert_fp8_near(got[0], ref[0], ACTIVATION_TOLERATED)
        assert torch.equal(got[1].view(torch.uint8), got[0].t().contiguous().view(torch.uint8))
        assert torch.equal(got[2], ref[2]), (step, got[2], ref[2])  # scale_inv
        torch.testing.assert_close(got[3], ref[3], rtol=1e-5, atol=1e-5, equal_nan=True)  # column sums
        torch.testing.assert_close(got_state, ref_state, rtol=1e-6, atol=0)  # history, scale, statistics
    assert int(got_state[4]) == 1 and int(got_state[5]) == 4
    # The fused values are the activation's: a plain cast of the reference activation gives the same bytes.
    plain = cast_to_fp8_ref(reference.activation_ref(x, activation, aux), 1.0 / ref[2], fp8_dtype)
    assert_fp8_near(got[0], plain[0], ACTIVATION_TOLERATED)


def test_activation_references_are_torch_gelu():
    h = torch.randn(1000, dtype=torch.float64) * 4
    g = torch.randn(1000, dtype=torch.float64)
    torch.testing.assert_close(reference.gelu_ref(h), F.gelu(h).float(), rtol=1e-5, atol=1e-6)
    hr = h.clone().requires_grad_()
    (F.gelu(hr) * g).sum().backward()
    torch.testing.assert_close(reference.gelu_backward_ref(g, h), hr.grad.float(), rtol=1e-5, atol=1e-6)


def test_traced_quantize_op_with_activation():
    """The triton_op torch.compile records (kernels/quantize.py: quantize_op) takes the activation and its input through
    its schema: the GELU backward's cast, current scaling with the column sums, against the reference."""
    gen = torch.Generator().manual_seed(9)
    got_state, ref_state = _state(4, 1.0), _state(4, 1.0)
    x = torch.randn(67, 48, generator=gen).to(torch.bfloat16).to(DEVICE)
    h = (torch.randn(67, 48, generator=gen) * 3).to(torch.bfloat16).to(DEVICE)
    args = (torch.float8_e5m2, 0, True, False, True, True, None, True, "gelu_backward", h)
    got = quantize.quantize_op(x, *got_state, *args)
    ref = reference.quantize_ref(x, *ref_state, *args)
    assert_fp8_near(got[0], ref[0], ACTIVATION_TOLERATED)
    assert torch.equal(got[2], ref[2])
    torch.testing.assert_close(got[3], ref[3], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_state, ref_state, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    ("current", "transpose", "column_sum", "activation", "fp8_hidden"),
    [(False, True, False, None, False), (True, True, False, None, False), (False, True, True, None, False),
     (True, False, False, "gelu", False), (False, True, True, "gelu_backward", False),
     (False, False, False, "gelu", True), (False, True, True, "gelu_backward", True)],
)  # fmt: skip
def test_no_state_buffer_is_passed_to_a_cast_kernel_twice(
    monkeypatch, current, transpose, column_sum, activation, fp8_hidden
):
    """Traced (torch.compile), every buffer of the scaling state that a cast updates goes to its kernels once, and so
    does ``x``: torch.compile functionalizes a kernel's writes per argument (a mutated graph input passed again as an
    unused pointer is one more alias of it), and inductor realizes every tensor argument of a user kernel as a buffer
    of its own, so an ``x`` computed by a fused kernel (a LayerNorm's output) passed again as the unread activation
    input was written twice in high precision in every compiled step (session 18, H100 output code)."""
    launches = []
    monkeypatch.setattr(cast, "_launch", lambda kernel, x, work, cfg, *args, **kw: launches.append(args))
    monkeypatch.setattr(quantize, "_launch", lambda kernel, x, work, cfg, *args, **kw: launches.append(args))
    state = _state(4, 1.0)
    x = torch.randn(64, 48).to(DEVICE)
    aux = torch.randn(64, 48).to(DEVICE) if activation == "gelu_backward" else None
    aux_scale_inv = None
    if aux is not None and fp8_hidden:  # FP8MLP(fp8_hidden=True)'s backward: the GELU input kept in FP8
        aux, aux_scale_inv = aux.to(torch.float8_e4m3fn), torch.tensor(0.5, device=DEVICE)
    args = (torch.float8_e4m3fn, 0, True, True, current, transpose, None, column_sum, activation, aux)
    keep = fp8_hidden and activation == "gelu"
    quantize._quantize_impl(x, *state, *args, aux_scale_inv, keep, eager=False)
    assert launches
    for launch_args in launches:
        tensors = [a for a in launch_args if isinstance(a, torch.Tensor)]
        for buf in (*state, x):
            assert sum(t is buf for t in tensors) <= 1


def _bytes_equal(got, ref):
    """FP8 tensors equal byte for byte, NaN positions compared as NaN (any NaN encoding is a NaN)."""
    g_nan, r_nan = torch.isnan(got.float()), torch.isnan(ref.float())
    return torch.equal(g_nan, r_nan) and torch.equal(got.view(torch.uint8)[~r_nan], ref.view(torch.uint8)[~r_nan])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("shape", "current"), [((67, 45), True), ((130, 64), False)])
def test_gelu_cast_keeps_its_input_in_fp8(dtype, shape, current):
    """keep_input (FP8MLP(fp8_hidden=True)'s forward cast): the GELU input's FP8 copy, written by the same pass, is the
    plain cast of the input with the GELU cast's scale divided by 2**PRE_ACTIVATION_HEADROOM and at most 2**5 (the
    1e-3 step: a tiny GELU amax, a large scale), byte for byte (no erf in it), NaN included; the GELU's own cast and
    the state's bookkeeping are those of a cast without it."""
    gen = torch.Generator().manual_seed(11)
    got_state, ref_state, plain_state = _state(4, 1.0), _state(4, 1.0), _state(4, 1.0)
    headroom = 2.0**-reference.PRE_ACTIVATION_HEADROOM
    for step, magnitude in enumerate([1.0, 30.0, float("nan"), 1e-3]):
        x = torch.randn(shape, generator=gen) * (1.0 if magnitude != magnitude else magnitude)
        if magnitude != magnitude:
            x[5, 3] = float("nan")
        x = (x - 2 * x.abs().mean()).to(dtype).to(DEVICE)  # negative values larger than the positive ones
        args = (torch.float8_e4m3fn, 0, True, not current, current or step == 0, False, None, False, "gelu", None)
        got = quantize.quantize_(x, *got_state, *args, None, True)
        ref = reference.quantize_ref(x, *ref_state, *args, None, True)
        plain = quantize.quantize_(x, *plain_state, *args)
        assert len(got) == 4 and got[3].shape == x.shape and got[3].dtype == torch.float8_e4m3fn
        assert torch.equal(got[0].view(torch.uint8), plain[0].view(torch.uint8)) and torch.equal(got[2], plain[2])
        kept = cast_to_fp8_ref(x, torch.clamp(headroom / got[2], max=2.0**5), torch.float8_e4m3fn)[0]
        assert _bytes_equal(got[3], kept), step
        assert _bytes_equal(ref[3], kept), step
        assert torch.equal(got[2], ref[2])
        torch.testing.assert_close(got_state, plain_state, rtol=0, atol=0)
        torch.testing.assert_close(got_state, ref_state, rtol=1e-6, atol=0)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", [(67, 45), (128, 64)])
def test_gelu_backward_reads_an_fp8_input(fp8_dtype, shape):
    """activation_input in FP8 with its scale_inv (FP8MLP(fp8_hidden=True)'s backward): the same cast, bytes, statistics
    and column sums as with the fp32 values it stands for; a NaN byte counts as NaN."""
    gen = torch.Generator().manual_seed(12)
    h = torch.randn(shape, generator=gen) * 3
    h[1, 2] = float("nan")
    h_scale_inv = torch.tensor(2.0**-3, device=DEVICE)
    h_fp8 = cast_to_fp8_ref(h, 1.0 / h_scale_inv.cpu(), fp8_dtype)[0].to(DEVICE)
    g = torch.randn(shape, generator=gen).to(torch.bfloat16).to(DEVICE)
    states = [_state(4, 1.0) for _ in range(3)]
    args = (torch.float8_e5m2, 0, True, True, True, True, None, True, "gelu_backward")
    got = quantize.quantize_(g, *states[0], *args, h_fp8, h_scale_inv)
    wide = quantize.quantize_(g, *states[1], *args, reference.dequantize_ref(h_fp8, h_scale_inv))
    ref = reference.quantize_ref(g, *states[2], *args, h_fp8, h_scale_inv)
    assert _bytes_equal(got[0], wide[0]) and _bytes_equal(got[1], wide[1])
    assert torch.equal(got[2], wide[2])
    torch.testing.assert_close(got[3], wide[3], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(states[0], states[1], rtol=0, atol=0)
    assert_fp8_near(got[0], ref[0], ACTIVATION_TOLERATED)
    assert torch.equal(got[2], ref[2]) and int(states[0][4]) == 1  # the NaN counted as a non-finite cast


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", [(67, 45), (128, 64)])
def test_gelu_recast_from_fp8_matches_reference(fp8_dtype, shape):
    """FP8MLP(fp8_hidden=True)'s backward recomputes the GELU output's transposed copy from the FP8 input it kept:
    eagerly (ops.recast_activation_transposed) and as the triton_op torch.compile records, against
    reference.recast_activation_ref, which is the transposed cast of gelu(dequantized input)."""
    gen = torch.Generator().manual_seed(13)
    h = torch.randn(shape, generator=gen) * 3
    h[3, 4] = float("nan")
    h_scale_inv = torch.tensor(2.0**-2, device=DEVICE)
    h_fp8 = cast_to_fp8_ref(h, 1.0 / h_scale_inv.cpu(), fp8_dtype)[0].to(DEVICE)
    scale = torch.tensor(2.0**4, device=DEVICE)
    ref = reference.recast_activation_ref(h_fp8, h_scale_inv, scale, torch.float8_e4m3fn, "gelu")
    plain = cast_to_fp8_ref(reference.gelu_ref(reference.dequantize_ref(h_fp8, h_scale_inv)), scale,
                            torch.float8_e4m3fn, transpose=True)[1]  # fmt: skip
    assert _bytes_equal(ref, plain) and ref.shape == (shape[1], shape[0])
    got = ops.recast_activation_transposed(h_fp8, h_scale_inv, scale, torch.float8_e4m3fn, "gelu")
    traced = cast._cast_transposed_op(h_fp8, scale, torch.float8_e4m3fn, "gelu", h_scale_inv)
    if ops.use_triton(h_fp8):
        assert_fp8_near(got, ref, ACTIVATION_TOLERATED)
    else:
        assert _bytes_equal(got, ref)
    assert_fp8_near(traced, ref, ACTIVATION_TOLERATED)
    assert torch.isnan(got.float()).sum() == 1


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy under the interpreter: inf * 0
def test_an_e5m2_input_holding_infinities_is_read_as_infinite():
    """An FP8 input of the fused activations holding E5M2's inf bytes (0x7C, 0xFC): the GELU of +-inf, and the GELU
    gradient at it, are NaN (non-finite), as in the reference. Found by a sweep: under the interpreter the kernel
    read them as +-65536, so the GELU output saturated at 57344 (or gave -0)."""
    every = torch.arange(256, dtype=torch.uint8).view(16, 16).view(torch.float8_e5m2).to(DEVICE)
    scale_inv, scale = torch.tensor(0.5, device=DEVICE), torch.tensor(4.0, device=DEVICE)
    ref = reference.recast_activation_ref(every, scale_inv, scale, torch.float8_e5m2, "gelu")
    got = quantize.recast_transposed(every, scale, torch.float8_e5m2, "gelu", scale_inv)
    assert_fp8_near(got, ref, ACTIVATION_TOLERATED)
    assert _bytes_equal(got.t()[every.float().isinf()], ref.t()[every.float().isinf()])
    grad = torch.ones(16, 16, device=DEVICE)
    outs = [fn(grad, *_state(1, 1.0), torch.float8_e5m2, 0, True, False, True, True, None, False, "gelu_backward",
               every, scale_inv) for fn in (quantize.quantize_, reference.quantize_ref)]  # fmt: skip
    assert_fp8_near(outs[0][0], outs[1][0], ACTIVATION_TOLERATED)
    assert torch.isnan(outs[0][0].float()[every.float().isinf()]).all()


def test_traced_quantize_op_keeps_the_input():
    """The triton_op's fixed schema returns the kept input as its fourth output."""
    x = (torch.randn(67, 48, generator=torch.Generator().manual_seed(14)) * 3).to(torch.bfloat16).to(DEVICE)
    got_state, ref_state = _state(4, 1.0), _state(4, 1.0)
    args = (torch.float8_e4m3fn, 0, True, True, True, False, None, False, "gelu", None, None, True)
    got = quantize.quantize_op(x, *got_state, *args)
    ref = reference.quantize_ref(x, *ref_state, *args)
    assert _bytes_equal(got[3], ref[3]) and torch.equal(got[2], ref[2])


def test_reference_cast_saturates_finite_float64_beyond_fp32_range():
    """The CPU path's cast of a finite float64 above fp32's maximum gave NaN (x.float() is inf, which the finiteness
    test saw) where every other finite value saturates; a non-finite x is NaN still."""
    for fp8_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        fmax = torch.finfo(fp8_dtype).max
        x = torch.tensor([1e300, -1e300, 1e39, 448.0, float("inf"), float("nan")], dtype=torch.float64)
        x_fp8, _, _, n_saturated = cast_to_fp8_ref(x, torch.tensor(2.0**-126), fp8_dtype)
        got = x_fp8.float()
        assert got[:3].tolist() == [fmax, -fmax, fmax]
        assert got[4:].isnan().all() and int(n_saturated) == 3


def test_triton_path_casts_float64_as_the_reference_does(monkeypatch):
    """Float64 casts take the reference's ops on every path: Triton's kernels read fp32, where a finite float64 past
    fp32's range became inf (a NaN byte, no saturation) and ops.amax / ops.cast_to_fp8 refused float64 outright."""
    from lightning_fp8 import ScalingState

    x = torch.tensor([1e300, -3.0, 1.0, 5e-40], dtype=torch.float64, device=DEVICE)
    results = {}
    for mode in ("triton", "reference"):
        monkeypatch.setenv("LIGHTNING_FP8_KERNELS", mode)
        state = ScalingState(torch.float8_e4m3fn, 1, 0, "max", delayed=False, device=DEVICE)
        x_fp8, _, scale_inv = state.quantize(x)
        results[mode] = (x_fp8.view(torch.uint8), scale_inv, state.saturation, state.nonfinite_count,
                         ops.amax(x), ops.cast_to_fp8(x, torch.tensor(1.0, device=DEVICE), torch.float8_e5m2)[0])
    assert results["reference"][0].view(torch.float8_e4m3fn).float()[0] == 448.0  # saturated, not NaN
    for got, want in zip(results["triton"], results["reference"], strict=True):
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e5m2 else got,
                           want.view(torch.uint8) if want.dtype == torch.float8_e5m2 else want)


@triton.jit
def _scales(amax_ptr, out_ptr, n, MAX_EXP: tl.constexpr, MAX_MANT: tl.constexpr, MARGIN: tl.constexpr,
            BLOCK: tl.constexpr):  # fmt: skip
    # _pow2_scale of each amax (prev 3.0), for the test below.
    offs = tl.arange(0, BLOCK)
    a = tl.load(amax_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, _pow2_scale(a, 3.0, MAX_EXP, MAX_MANT, MARGIN), mask=offs < n)


def test_pow2_scale_kernel_matches_reference_for_subnormal_amaxes():
    """kernels/scaling.py's _pow2_scale (every fused cast, FP8AdamW's and the communication kernels' scales) against
    reference.pow2_scale_ref, bit for bit, over normal and fp32-subnormal amaxes, 0 and inf, at margins that bring
    the subnormals' scales under the 2**127 clamp (where reading them as 2**-127 showed)."""
    amax = torch.tensor([1e-40, 1.4e-45, 5e-39, 2.0**-140, 1.1754942e-38, 1e-30, 0.7, 448.0, 0.0, float("inf")])
    for fp8_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        fmax = torch.finfo(fp8_dtype).max
        max_exp, max_mant = reference.float32_exponent_mantissa(fmax)
        for margin in (0, 9, 16):
            got = torch.empty(16, device=DEVICE)
            _scales[(1,)](amax.to(DEVICE), got, amax.numel(), max_exp, max_mant, margin, BLOCK=16)
            want = reference.pow2_scale_ref(amax, fmax, margin, torch.tensor(3.0))
            assert torch.equal(got[: amax.numel()].cpu(), want), (fp8_dtype, margin, got, want)
