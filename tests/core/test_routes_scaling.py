"""Route sweep of the per-tensor scaling state: ``ScalingState`` casts over many steps, the casts ``FP8Linear`` feeds
its three GEMMs, and the checkpoint routes (``fp8_state_dict`` / ``check_fp8_state_dict`` / ``load_fp8_state_dict``,
deep copy, pickle), each against an independent reference written here from DESIGN.md and docs/concepts/formats.md:

- ``scale = 2 ** (floor(log2(fp8_max / amax)) - margin)``, the exponent clamped to fp32's normal range [-126, 127]; an
  amax of 0 or a non-finite one keeps the previous scale (1 before any);
- ``x_fp8 = saturate(x * scale)``: round to nearest even onto the format's grid (built here from its bit layout), finite
  values clamped to +-fp8_max, non-finite ones NaN; saturation counts finite ``|x * scale| >= fp8_max``;
- delayed scaling: a cast uses the scale of the earlier casts' amax history (its max, or its newest entry), the first
  cast whose amax is finite and > 0 uses its own; every cast rolls the window with its amax in front (0 for a zero or
  non-finite one) and only a cast with information moves the scale. Current scaling: every cast its own amax.

Every comparison is exact (FP8 values bit for bit, scales and statistics as fp32 numbers): power-of-two scales add no
rounding, so there is no tolerance to name.
"""

import copy
import io
import math
import pickle

import numpy as np
import pytest
import torch
from torch import nn

from lightning_fp8 import (
    E4M3,
    E5M2,
    FP8AdamW,
    FP8Linear,
    FP8Recipe,
    ScalingState,
    compute_scale,
    convert_to_fp8,
    fp8_state_dict,
    load_fp8_state_dict,
    ops,
)
from lightning_fp8.state import check_fp8_state_dict
from tests.copying import COPY_ROUTES, copy_by

ROLES = ("input", "weight", "grad_output")
# format: (largest finite value, exponent bits, mantissa bits), docs/concepts/formats.md's table
_FORMATS = {E4M3: (448.0, 4, 3), E5M2: (57344.0, 5, 2)}


# ----------------------------------------------------------------------------------------------------- the reference
def _grid(dtype: torch.dtype) -> np.ndarray:
    """The format's finite non-negative values, ascending; a value's index is its bit pattern (so an even index is an
    even mantissa, the tie-breaking rule's choice)."""
    fmax, ebits, mbits = _FORMATS[dtype]
    bias = 2 ** (ebits - 1) - 1
    values = [
        math.ldexp(m, 1 - bias - mbits) if e == 0 else math.ldexp(2**mbits + m, e - bias - mbits)
        for e in range(2**ebits)
        for m in range(2**mbits)
    ]
    return np.array([v for v in values if v <= fmax])


_GRIDS = {dtype: _grid(dtype) for dtype in _FORMATS}


def _saturate_ref(v: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """``saturate(v)`` as float64: finite values clamped to +-fp8_max and rounded to the nearest grid value (ties to
    the even bit pattern), non-finite ones NaN."""
    grid = _GRIDS[dtype]
    v = np.asarray(v, dtype=np.float64)
    out = np.full(v.shape, np.nan)
    finite = np.isfinite(v)
    a = np.minimum(np.abs(v[finite]), grid[-1])
    hi = np.searchsorted(grid, a)  # the first grid value >= a (a <= fp8_max: always one)
    lo = np.maximum(hi - 1, 0)
    below, above = a - grid[lo], grid[hi] - a
    pick = np.where(below < above, lo, np.where(above < below, hi, np.where(lo % 2 == 0, lo, hi)))
    out[finite] = np.copysign(grid[pick], v[finite])
    return out


def _scale_ref(amax: float, dtype: torch.dtype, margin: int, prev: float) -> float:
    """DESIGN.md's scale, exactly (float64 ``ldexp``, no rounded log2); ``prev`` where amax carries no information."""
    if not (math.isfinite(amax) and amax > 0):
        return prev
    fmax = _FORMATS[dtype][0]
    e = math.frexp(fmax)[1] - math.frexp(amax)[1] + 1
    while math.ldexp(amax, e) > fmax:  # the largest e with amax * 2**e <= fmax
        e -= 1
    while math.ldexp(amax, e + 1) <= fmax:
        e += 1
    return math.ldexp(1.0, min(max(e - margin, -126), 127))


def _f32(v: float) -> float:
    return float(np.float32(v))


class _RefState:
    """One role's scaling state, as the docs describe it."""

    def __init__(self, dtype: torch.dtype, history_len: int, margin: int, algo: str, delayed: bool) -> None:
        self.dtype, self.margin, self.algo, self.delayed = dtype, margin, algo, delayed
        self.scale, self.history, self.initialized = 1.0, [0.0] * history_len, False
        self.amax, self.saturation, self.nonfinite, self.casts = 0.0, 0.0, 0, 0

    def cast(self, x: np.ndarray) -> tuple[float, np.ndarray]:
        """The scale the cast of ``x`` (float64 values of the tensor) uses and its FP8 values; records the cast."""
        amax = (math.inf if not np.isfinite(x).all() else float(np.abs(x).max())) if x.size else 0.0
        informative = math.isfinite(amax) and amax > 0
        own = not self.delayed or not self.initialized
        used = _scale_ref(amax, self.dtype, self.margin, self.scale) if own else self.scale
        scaled = x * used  # float64: exact (a power of two), and what fp32 overflows to inf saturates as finite
        finite = np.isfinite(x)
        self.saturation = _f32(float((np.abs(scaled[finite]) >= _FORMATS[self.dtype][0]).sum()) / max(x.size, 1))
        self.amax, self.casts, self.nonfinite = amax, self.casts + 1, self.nonfinite + (not math.isfinite(amax))
        self.history = [amax if informative else 0.0, *self.history[:-1]]
        if informative:
            self.initialized = True
        if not self.delayed:
            self.scale = used
        elif informative:
            window = max(self.history) if self.algo == "max" else self.history[0]
            self.scale = _scale_ref(window, self.dtype, self.margin, self.scale)
        return used, _saturate_ref(scaled, self.dtype)

    def assert_matches(self, state: ScalingState, where: str) -> None:
        assert state.scale.item() == self.scale, where
        assert state.amax_history.tolist() == [_f32(h) for h in self.history], where
        assert state.amax.item() == _f32(self.amax), where
        assert state.saturation.item() == self.saturation, where
        assert (state.nonfinite_count.item(), state.casts.item()) == (self.nonfinite, self.casts), where
        assert state.initialized == self.initialized, where


def _assert_fp8(got: torch.Tensor, want: np.ndarray, where: str) -> None:
    """FP8 tensor ``got`` holds the values ``want`` (signs of zeros included, NaN where NaN)."""
    values = got.float().double().numpy().reshape(want.shape)
    assert np.array_equal(values, want, equal_nan=True), where
    assert np.array_equal(np.signbit(values), np.signbit(want)), where


def _ref_of(recipe: FP8Recipe, role: str) -> _RefState:
    delayed = recipe.scaling == "delayed" and role != "weight"  # weights: always current, history 1
    dtype = recipe.backward_dtype if role == "grad_output" else recipe.forward_dtype
    history = 1 if role == "weight" else recipe.amax_history_len
    return _RefState(dtype, history, recipe.margin, recipe.amax_compute_algo, delayed)


def _weights_only_round_trip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_the_reference_grid_is_the_formats_and_its_rounding_is_torchs_saturating_cast(dtype):
    # The reference checks itself, not the library: every finite bit pattern decodes to the grid, and on random
    # values (subnormal range, ties, beyond the maximum) the grid's rounding is torch's own cast after a clamp.
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float().double().numpy()
    finite = codes[np.isfinite(codes)]
    assert sorted(set(finite[finite >= 0].tolist())) == _GRIDS[dtype].tolist()
    fmax = _FORMATS[dtype][0]
    gen = torch.Generator().manual_seed(0)
    v = torch.cat([torch.randn(4000, generator=gen) * 10.0 ** torch.randint(-6, 6, (4000,), generator=gen),
                   torch.from_numpy(_GRIDS[dtype][:-1] + np.diff(_GRIDS[dtype]) / 2).float()])  # fmt: skip
    torch_cast = v.clamp(-fmax, fmax).to(dtype).float().double().numpy()
    _assert_fp8(torch.from_numpy(torch_cast).to(dtype), _saturate_ref(v.double().numpy(), dtype), "grid")


# ------------------------------------------------------------------------------------- ScalingState over many steps
def _step_input(step: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Step ``step``'s tensor, of a shape that is no power of two: random magnitudes over 11 decades, with zero,
    NaN, +-inf, fp32-subnormal, huge and power-of-two-boundary steps among them."""
    shape = ((5, 13), (3, 7, 3), (29,), (1, 1), (11, 6))[step % 5]
    x = torch.randn(shape, generator=gen) * 10.0 ** ((step * 7) % 11 - 5)
    kind = step % 9
    if kind == 2:
        return torch.zeros(shape)  # amax 0: no information
    if kind == 4:
        x.view(-1)[-1] = (float("nan"), float("inf"), float("-inf"))[step % 3]  # non-finite amax
    if kind == 6:
        x = torch.randn(shape, generator=gen) * (1e-41 if step % 2 else 1e37)  # fp32 subnormal amax, or huge
    if kind == 7:
        fmax = _FORMATS[dtype][0]
        x.view(-1)[0] = -fmax * 2.0 ** (step % 13 - 9)  # amax exactly on a power-of-two boundary
    return x


SEQUENCES = [
    # (fp8 dtype, history_len, amax_compute_algo, margin, delayed)
    (E4M3, 1, "max", 0, True),
    (E5M2, 1, "most_recent", 3, True),
    (E4M3, 2, "max", 1, True),
    (E5M2, 2, "most_recent", 0, True),
    (E4M3, 3, "max", 3, True),
    (E5M2, 3, "max", 1, True),
    (E4M3, 7, "most_recent", 1, True),
    (E5M2, 7, "max", 3, True),
    (E4M3, 40, "max", 0, True),
    (E5M2, 40, "most_recent", 1, True),
    (E4M3, 3, "max", 1, False),
    (E5M2, 7, "most_recent", 3, False),
]


def _run_sequence(dtype, history_len, algo, margin, delayed, steps: int) -> None:
    state = ScalingState(dtype, history_len, margin, algo, delayed)
    ref = _RefState(dtype, history_len, margin, algo, delayed)
    gen = torch.Generator().manual_seed(history_len * 10 + margin)
    first = (2, 4, 0)[history_len % 3]  # some sequences start with an all-zero or a non-finite cast: no first cast yet
    for step in range(steps):
        x = _step_input(step + first, gen, dtype)
        used, want = ref.cast(x.double().numpy())
        transpose = x.dim() == 2
        x_fp8, x_fp8_t, scale_inv = state.quantize(x, transpose=transpose)
        where = f"step {step}"
        assert scale_inv.item() == 1.0 / used, where  # the scale this cast used
        _assert_fp8(x_fp8, want, where)
        if transpose:
            _assert_fp8(x_fp8_t, want.T, where)
        ref.assert_matches(state, where)


@pytest.mark.parametrize(("dtype", "history_len", "algo", "margin", "delayed"), SEQUENCES,
                         ids=lambda v: str(v).replace("torch.float8_", ""))  # fmt: skip
def test_scaling_state_over_many_steps_matches_the_reference(dtype, history_len, algo, margin, delayed):
    # 50 steps: the 40-long window fills and rolls; every history sees zero, non-finite, subnormal, huge and boundary
    # amaxes, first casts after them, and recovery.
    _run_sequence(dtype, history_len, algo, margin, delayed, steps=50)


@pytest.mark.parametrize(("dtype", "history_len", "algo", "margin", "delayed"), [SEQUENCES[7], SEQUENCES[11]],
                         ids=["delayed", "current"])  # fmt: skip
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's numpy: x * scale -> inf
def test_the_triton_cast_route_matches_the_reference_too(monkeypatch, dtype, history_len, algo, margin, delayed):
    # The fused Triton cast (on a GPU; here under the interpreter, tests/conftest.py) does the same bookkeeping.
    monkeypatch.setenv("LIGHTNING_FP8_KERNELS", "triton")
    _run_sequence(dtype, history_len, algo, margin, delayed, steps=12)


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_a_non_finite_step_keeps_the_scale_shows_nan_and_the_next_finite_steps_recover(bad, algo):
    """docs/concepts/formats.md: the cast keeps the previous scale, its FP8 copy holds NaN where the tensor did (the
    finite values cast as usual), its amax reads inf, it is counted, and the history gets 0; the next cast uses the
    kept scale and the one after that the window's."""
    state = ScalingState(E4M3, 3, 1, algo, delayed=True)
    first = torch.full((4, 5), 3.0)
    state.quantize(first)  # own amax 3: scale 2**floor(log2(448 / 3)) / 2 = 64
    assert state.scale.item() == 64.0
    x = torch.randn(4, 5) * 2
    x[1, 2] = float(bad)
    x_fp8, _, scale_inv = state.quantize(x)
    assert scale_inv.item() == 1 / 64.0 and state.scale.item() == 64.0
    values = x_fp8.float()
    assert torch.isnan(values[1, 2]) and torch.isnan(values).sum() == 1
    want = _saturate_ref(x.double().numpy() * 64.0, E4M3)
    _assert_fp8(x_fp8, want, "finite values of the non-finite step")
    assert state.amax.item() == math.inf and state.nonfinite_count.item() == 1
    assert state.amax_history.tolist() == [0.0, 3.0, 0.0] and state.initialized
    _, _, scale_inv = state.quantize(torch.full((4, 5), 0.5))  # recovers: the kept scale, then the window's
    assert scale_inv.item() == 1 / 64.0
    assert state.scale.item() == (64.0 if algo == "max" else 256.0)  # max(0.5, 0, 3) = 3, or the newest 0.5
    _, _, scale_inv = state.quantize(torch.full((4, 5), 0.5))
    assert scale_inv.item() == (1 / 64.0 if algo == "max" else 1 / 256.0)  # the scale the last step left
    assert state.amax_history.tolist() == [0.5, 0.5, 0.0]  # 3 rolled out
    assert state.scale.item() == 256.0 and state.nonfinite_count.item() == 1


# ------------------------------------------------------------------------------------------------- powers of two
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("margin", [0, 1, 3])
def test_scales_round_down_to_a_power_of_two_at_the_documented_boundaries(dtype, margin):
    """The exponent is the floor: an amax exactly ``fp8_max * 2**k`` gets ``2**-k`` (its scaled value is fp8_max, and
    counts as saturated: ``>=``); one fp32 ulp above it gets half that; one ulp below it the same ``2**-k``. Every
    scale is a power of two with ``amax * scale <= fp8_max / 2**margin`` and twice it above (within the clamp)."""
    fmax = _FORMATS[dtype][0]
    for k in (-30, -7, 0, 5, 20):
        boundary = np.float32(fmax * 2.0**k)
        for amax, want_exp in ((boundary, -k), (np.nextafter(boundary, np.float32(np.inf)), -k - 1),
                               (np.nextafter(boundary, np.float32(0)), -k)):  # fmt: skip
            want = math.ldexp(1.0, want_exp - margin)
            assert want == _scale_ref(float(amax), dtype, margin, 1.0)
            assert compute_scale(torch.tensor(amax), dtype, margin).item() == want, (k, amax)
            state = ScalingState(dtype, 1, margin, "max", delayed=False)  # the cast route: its own amax
            x = torch.full((3, 17), float(amax) / 4)
            x[2, 16] = float(amax)
            _, _, scale_inv = state.quantize(x)
            assert scale_inv.item() == 1.0 / want, (k, amax)
            at_max = margin == 0 and amax == boundary
            assert state.saturation.item() == _f32((1 if at_max else 0) / x.numel()), (k, amax)
    gen = torch.Generator().manual_seed(3)
    amaxes = torch.cat([torch.rand(200, generator=gen) * 10.0 ** torch.randint(-40, 38, (200,), generator=gen),
                        torch.tensor([1e-45, 3.4e38, 1.1754944e-38])])  # fmt: skip
    scales = compute_scale(amaxes, dtype, margin).double()
    assert (torch.frexp(scales).mantissa == 0.5).all()
    headroom = fmax * 2.0**-margin
    products = amaxes.double() * scales
    clamped = (scales == 2.0**127) | (scales == 2.0**-126)
    assert (products <= headroom).all()
    assert ((products * 2 > headroom) | clamped).all()
    for amax, scale in zip(amaxes.tolist(), scales.tolist(), strict=True):
        assert scale == _scale_ref(amax, dtype, margin, 1.0), amax


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("scale_exp", [-126, -40, 0, 17, 127])
def test_power_of_two_scales_make_the_cast_exact_multiples_of_the_formats_step(dtype, scale_exp):
    """With a power-of-two scale the dequantized values ``x_fp8 * scale_inv`` are exact integer multiples of the
    smallest subnormal times ``scale_inv``, and scaling back (``* scale``) gives the FP8 values again exactly: the scale
    added no rounding of its own, the only one is the FP8 rounding of ``x * scale``."""
    state = ScalingState(dtype, 1, 0, "max", delayed=True)
    state.set_initialized(True)  # delayed, with this scale: the cast uses it as it is
    with torch.no_grad():
        state.scale.fill_(2.0**scale_exp)
    gen = torch.Generator().manual_seed(scale_exp + 200)
    # |x * scale| from about 2**-16 to 2**-1 times fp8_max: subnormal and normal FP8 values; |x| below 2**126 (a
    # scale of 2**-126 comes from fp32's largest amaxes, with a margin).
    exponents = torch.randint(-16, -1, (7, 19), generator=gen).double() + math.log2(_FORMATS[dtype][0]) - scale_exp
    exponents = exponents.clamp(max=124)
    x = (torch.randn(7, 19, generator=gen, dtype=torch.float64) * 2.0**exponents).float()
    x_fp8, _, scale_inv = state.quantize(x)
    assert scale_inv.item() == 2.0**-scale_exp and torch.isfinite(x_fp8.float()).all()
    deq = x_fp8.float().double() * scale_inv.double()
    assert torch.equal((x_fp8.float() * scale_inv).double(), deq)  # exact in fp32 too (2**-127 included)
    step = _GRIDS[dtype][1] * 2.0**-scale_exp
    assert torch.equal(deq / step, torch.round(deq / step))
    assert torch.equal(deq * 2.0**scale_exp, x_fp8.float().double())
    _assert_fp8(x_fp8, _saturate_ref(x.double().numpy() * 2.0**scale_exp, dtype), "cast")


# ------------------------------------------------------------------------------ what FP8Linear's GEMMs consume
class _GemmSpy:
    """Records the FP8 operands and scale_invs of every GEMM an FP8Linear runs, in order: forward ``(x_fp8, w_fp8^T)``,
    dgrad ``(dy_fp8, w_fp8)``, wgrad ``(dy_fp8^T, x_fp8)`` (the second operands column-major views)."""

    def __init__(self, monkeypatch) -> None:
        self.calls = []
        mm = ops.scaled_mm

        def spy_mm(a_fp8, b_fp8, a_scale_inv, b_scale_inv, *args, **kwargs):
            self.calls.append((a_fp8.clone(), b_fp8.clone(), a_scale_inv.item(), b_scale_inv.item()))
            return mm(a_fp8, b_fp8, a_scale_inv, b_scale_inv, *args, **kwargs)

        monkeypatch.setattr(ops, "scaled_mm", spy_mm)  # linear_forward_mm calls it too


LAYER_RECIPES = [
    FP8Recipe(),
    FP8Recipe(amax_history_len=3, amax_compute_algo="most_recent", margin=3),
    FP8Recipe(scaling="current", margin=1),
    FP8Recipe(fp8_format="e4m3", amax_history_len=1),
]


@pytest.mark.parametrize("recipe", LAYER_RECIPES, ids=["default", "h3-recent-m3", "current-m1", "e4m3-h1"])
@pytest.mark.parametrize("act_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_linear_gemms_consume_the_reference_casts_of_input_weight_and_grad_output(monkeypatch, recipe, act_dtype):
    """Forward ``x_fp8 @ w_fp8^T``, dgrad ``dy_fp8 @ w_fp8``, wgrad ``dy_fp8^T @ x_fp8``: each operand is the reference
    quantization of its tensor with the scale its role's state gives (the delayed roles' scale as the state held it
    before the step, their own amax at the first cast; the weight's own amax, which its state holds after the step),
    the transposed copies included. Shapes: 3 x 7 tokens, 48 -> 80 features, a non-contiguous input."""
    spy = _GemmSpy(monkeypatch)
    torch.manual_seed(0)
    layer = FP8Linear(48, 80, recipe=recipe, dtype=act_dtype)
    refs = {role: _ref_of(recipe, role) for role in ROLES}
    gen = torch.Generator().manual_seed(1)
    for step in range(5):
        x = (torch.randn(7, 3, 48, generator=gen) * 10.0 ** (step % 3 - 1)).to(act_dtype).transpose(0, 1)
        dy = (torch.randn(3, 7, 80, generator=gen) * 10.0 ** (-2 * (step % 3))).to(act_dtype)
        if step == 2:
            x[1, 4, 5] = float("nan")  # a non-finite input: NaN in its FP8 copy, the scale kept, recovered after
        if step == 3:
            dy = torch.zeros_like(dy)  # the output gradient carries no information this step
        before = {role: layer.fp8_scaling[role].scale.item() for role in ROLES}
        initialized = {role: layer.fp8_scaling[role].initialized for role in ROLES}
        spy.calls.clear()
        x_in = x.detach().clone().requires_grad_(True)
        layer(x_in).backward(dy)
        where = f"step {step}"
        (x_fp8, w_fp8_t, x_si, w_si), (dy_fp8, w_fp8, dy_si, w_si_2), (dy_fp8_t, x_fp8_2, dy_si_2, x_si_2) = spy.calls
        assert (w_si_2, dy_si_2, x_si_2) == (w_si, dy_si, x_si), where
        x_used, x_want = refs["input"].cast(x.double().numpy().reshape(-1, 48))
        w_used, w_want = refs["weight"].cast(layer.weight.detach().double().numpy())
        dy_used, dy_want = refs["grad_output"].cast(dy.double().numpy().reshape(-1, 80))
        for role, used, scale_inv in (
            ("input", x_used, x_si),
            ("weight", w_used, w_si),
            ("grad_output", dy_used, dy_si),
        ):
            assert scale_inv == 1.0 / used, (where, role)
            if refs[role].delayed and initialized[role]:
                assert used == before[role], (where, role)  # the delayed scale the state held before the step
        assert layer.fp8_scaling["weight"].scale.item() == w_used, where  # current: the state keeps what it used
        _assert_fp8(x_fp8, x_want, f"{where} input (forward)")
        _assert_fp8(x_fp8_2, x_want, f"{where} input (wgrad, from the transposed copy)")
        _assert_fp8(w_fp8_t, w_want.T, f"{where} weight (forward)")
        _assert_fp8(w_fp8, w_want, f"{where} weight (dgrad, from the transposed copy)")
        _assert_fp8(dy_fp8, dy_want, f"{where} grad_output (dgrad)")
        _assert_fp8(dy_fp8_t, dy_want.T, f"{where} grad_output (wgrad, transposed copy)")
        for role in ROLES:
            refs[role].assert_matches(layer.fp8_scaling[role], f"{where} {role}")


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("emit", ["cast", "two_pass", "one_pass"])
def test_the_weight_the_forward_consumes_after_fp8adamw_steps(monkeypatch, opt_level, emit):
    """At O2 the weight's storage holds FP8AdamW's scaled fp16 master: the forward's FP8 weight is still the
    quantization of the true weight (``state_dict()``'s) with the scale of its amax. With ``emit_fp8_weights`` the
    optimizer's copy replaces the cast: bit for bit the cast with ``scale_update="two_pass"``; with one pass its scale
    comes from an upper bound (a binade or so lower at times: never higher, so never saturating)."""
    spy = _GemmSpy(monkeypatch)
    torch.manual_seed(0)
    recipe = FP8Recipe(opt_level=opt_level, margin=1)
    layer = FP8Linear(48, 80, recipe=recipe)
    options = {} if emit == "cast" else {"emit_fp8_weights": True, "scale_update": emit}
    optimizer = FP8AdamW(layer.parameters(), lr=1e-2, recipe=recipe, **options)
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        w = layer.state_dict()["weight"].double().numpy()
        want_scale = _scale_ref(float(np.abs(w).max()), E4M3, 1, 1.0)
        spy.calls.clear()
        layer(torch.randn(21, 48, generator=gen).requires_grad_(True)).sum().backward()
        _, w_fp8_t, _, w_scale_inv = spy.calls[0]  # the forward GEMM's
        used = 1.0 / w_scale_inv
        if emit == "one_pass" and step > 0:
            assert used <= want_scale and math.frexp(used)[0] == 0.5, step
        else:
            assert used == want_scale, step
        _assert_fp8(w_fp8_t, _saturate_ref(w * used, E4M3).T, f"step {step}")
        assert layer.fp8_scaling["weight"].amax.item() == _f32(np.abs(w).max()), step
        optimizer.step()
        optimizer.zero_grad()


# ------------------------------------------------------------------------------------------------ checkpoint routes
def _model(recipe: FP8Recipe, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return convert_to_fp8(nn.Sequential(nn.Linear(48, 32), nn.GELU(), nn.Linear(32, 80)), recipe)


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, dy: torch.Tensor) -> list:
    optimizer.zero_grad()
    x = x.clone().requires_grad_(True)
    y = model(x)
    y.backward(dy)
    optimizer.step()
    return [y.detach(), x.grad, *(p.grad.clone() for p in model.parameters())]


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for i in range(n):
        x = torch.randn(13, 48, generator=gen) * 10.0 ** (i % 4 - 2)
        dy = torch.randn(13, 80, generator=gen) * 10.0 ** (-(i % 5) - 2)
        out.append((torch.zeros_like(x) if i == 2 else x, dy))  # one all-zero input mid-history
    return out


def _assert_states_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), (key, got[key], value)


RESUME_RECIPES = [
    FP8Recipe(amax_history_len=3),
    FP8Recipe(amax_history_len=7, amax_compute_algo="most_recent", margin=1),
    FP8Recipe(amax_history_len=1, margin=3, fp8_format="e4m3"),
    FP8Recipe(scaling="current", amax_history_len=7),
]


@pytest.mark.parametrize("recipe", RESUME_RECIPES, ids=["h3", "h7-recent-m1", "h1-m3-e4m3", "current-h7"])
def test_resume_mid_history_through_a_weights_only_checkpoint_continues_bit_for_bit(recipe):
    batches = _batches(10)
    live = _model(recipe, 0)
    live_opt = torch.optim.SGD(live.parameters(), lr=1e-3)
    for x, dy in batches[:5]:  # 5 steps: a window of 7 is not full yet, one of 3 has rolled
        _train_step(live, live_opt, x, dy)
    saved = _weights_only_round_trip(
        {"model": live.state_dict(), "fp8": fp8_state_dict(live), "optimizer": live_opt.state_dict()}
    )
    resumed = _model(recipe, 1)
    resumed_opt = torch.optim.SGD(resumed.parameters(), lr=1e-3)
    check_fp8_state_dict(resumed, saved["fp8"])
    resumed.load_state_dict(saved["model"])
    load_fp8_state_dict(resumed, saved["fp8"])
    resumed_opt.load_state_dict(saved["optimizer"])
    _assert_states_equal(fp8_state_dict(resumed), fp8_state_dict(live))
    for step, (x, dy) in enumerate(batches[5:]):
        for a, b in zip(_train_step(live, live_opt, x, dy), _train_step(resumed, resumed_opt, x, dy), strict=True):
            assert torch.equal(a, b), step
        _assert_states_equal(fp8_state_dict(resumed), fp8_state_dict(live))


@pytest.mark.parametrize("route", COPY_ROUTES)
def test_a_layer_copied_mid_history_continues_as_the_original(route):
    recipe = FP8Recipe(amax_history_len=5, margin=1)
    batches = _batches(8)
    model = _model(recipe, 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for x, dy in batches[:3]:
        _train_step(model, optimizer, x, dy)
    twin = copy_by(model, route)
    _assert_states_equal(fp8_state_dict(twin), fp8_state_dict(model))
    twin_opt = torch.optim.SGD(twin.parameters(), lr=1e-3)
    for step, (x, dy) in enumerate(batches[3:]):
        for a, b in zip(_train_step(model, optimizer, x, dy), _train_step(twin, twin_opt, x, dy), strict=True):
            assert torch.equal(a, b), step
    _assert_states_equal(fp8_state_dict(twin), fp8_state_dict(model))
    twin_states = [m for m in twin.modules() if isinstance(m, ScalingState)]
    assert all(
        s.scale.data_ptr() != t.scale.data_ptr()  # its own buffers, not the original's
        for s, t in zip((m for m in model.modules() if isinstance(m, ScalingState)), twin_states, strict=True)
    )


@pytest.mark.parametrize("route", ["deepcopy", "pickle", "state_dict"])
def test_a_scaling_state_used_directly_round_trips_mid_history(route):
    state = ScalingState(E5M2, 3, 2, "most_recent", delayed=True)
    ref = _RefState(E5M2, 3, 2, "most_recent", True)
    gen = torch.Generator().manual_seed(5)
    for step in range(4):
        x = _step_input(step, gen, E5M2)
        state.quantize(x)
        ref.cast(x.double().numpy())
    if route == "deepcopy":
        twin = copy.deepcopy(state)
    elif route == "pickle":
        twin = pickle.loads(pickle.dumps(state))
    else:
        twin = ScalingState(E5M2, 3, 2, "most_recent", delayed=True)
        load_fp8_state_dict(twin, _weights_only_round_trip(fp8_state_dict(state)))
    for step in range(4, 12):
        x = _step_input(step, gen, E5M2)
        used, want = ref.cast(x.double().numpy())
        for s in (state, twin):
            x_fp8, _, scale_inv = s.quantize(x)
            assert scale_inv.item() == 1.0 / used, step
            _assert_fp8(x_fp8, want, f"step {step}")
            ref.assert_matches(s, f"step {step}")


def _fp8_snapshot(model: nn.Module) -> tuple[dict, list]:
    return fp8_state_dict(model), [m.initialized for m in model.modules() if isinstance(m, ScalingState)]


def _assert_unchanged(model: nn.Module, snapshot: tuple[dict, list]) -> None:
    state, flags = _fp8_snapshot(model)
    _assert_states_equal(state, snapshot[0])
    assert flags == snapshot[1]


OTHER_RECIPES = {
    # field: (the model's recipe, words of the refusal)
    "margin": (FP8Recipe(amax_history_len=3, margin=3), ("margin 1", "margin 3")),
    "amax_compute_algo": (FP8Recipe(amax_history_len=3, margin=1, amax_compute_algo="most_recent"), ("'max'",)),
    "fp8_format": (FP8Recipe(amax_history_len=3, margin=1, fp8_format="e4m3"), ("E5M2", "E4M3")),
    "scaling": (FP8Recipe(amax_history_len=3, margin=1, scaling="current"), ("delayed scaling", "current scaling")),
    "amax_history_len": (FP8Recipe(amax_history_len=5, margin=1), ("amax_history_len", "(3,)", "(5,)")),
}


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("field", list(OTHER_RECIPES))
def test_a_checkpoint_of_another_recipe_is_refused_naming_the_setting_and_changes_nothing(field, strict):
    saved_recipe = FP8Recipe(amax_history_len=3, margin=1)
    source = _model(saved_recipe, 0)
    _train_step(source, torch.optim.SGD(source.parameters(), lr=1e-3), *_batches(1)[0])
    saved = _weights_only_round_trip(fp8_state_dict(source))
    model_recipe, words = OTHER_RECIPES[field]
    model = _model(model_recipe, 1)
    _train_step(model, torch.optim.SGD(model.parameters(), lr=1e-3), *_batches(2)[1])
    snapshot = _fp8_snapshot(model)
    for call in (check_fp8_state_dict, load_fp8_state_dict):
        with pytest.raises(ValueError) as info:
            call(model, saved, strict=strict)
        assert all(word in str(info.value) for word in words), str(info.value)
    _assert_unchanged(model, snapshot)


def test_a_recipe_that_differs_only_in_opt_level_loads_the_scaling_state():
    # opt_level changes the optimizer's states, not what a scale or an amax history means.
    source = _model(FP8Recipe(opt_level="O2", amax_history_len=3), 0)
    _train_step(source, torch.optim.SGD(source.parameters(), lr=1e-3), *_batches(1)[0])
    model = _model(FP8Recipe(opt_level="O1", amax_history_len=3), 1)
    load_fp8_state_dict(model, _weights_only_round_trip(fp8_state_dict(source)))
    _assert_states_equal(fp8_state_dict(model), fp8_state_dict(source))


_IN = "0.fp8_scaling.input."
BAD_VALUES = {
    # name: (key, value, error, words of the message)
    "nan_scale": (_IN + "scale", torch.tensor(float("nan")), ValueError, "a power of two"),
    "negative_scale": (_IN + "scale", torch.tensor(-4.0), ValueError, "a power of two"),
    "zero_scale": (_IN + "scale", torch.tensor(0.0), ValueError, "a power of two"),
    "inf_scale": (_IN + "scale", torch.tensor(float("inf")), ValueError, "a power of two"),
    "scale_3": (_IN + "scale", torch.tensor(3.0), ValueError, "a power of two"),
    "subnormal_scale": (_IN + "scale", torch.tensor(2.0**-127), ValueError, "a power of two"),
    "scale_of_shape_1": (_IN + "scale", torch.tensor([4.0]), ValueError, "the checkpoint is corrupt"),
    "int_scale": (_IN + "scale", torch.tensor(4), TypeError, "expected a torch.float32 tensor"),
    "number_scale": (_IN + "scale", 4.0, TypeError, "expected a torch.float32 tensor"),
    "nan_history": (_IN + "amax_history", torch.tensor([1.0, float("nan"), 0.0]), ValueError, "finite and non-neg"),
    "negative_history": (_IN + "amax_history", torch.tensor([1.0, -2.0, 0.0]), ValueError, "finite and non-neg"),
    "inf_history": (_IN + "amax_history", torch.tensor([float("inf"), 0.0, 0.0]), ValueError, "finite and non-neg"),
    "short_history": (_IN + "amax_history", torch.ones(2), ValueError, "amax_history_len differs"),
    "nan_amax": (_IN + "amax", torch.tensor(float("nan")), ValueError, "non-negative"),
    "negative_amax": (_IN + "amax", torch.tensor(-1.0), ValueError, "non-negative"),
    "saturation_2": (_IN + "saturation", torch.tensor(2.0), ValueError, r"in \[0, 1\]"),
    "negative_casts": (_IN + "casts", torch.tensor(-1), ValueError, "non-negative"),
    "float_casts": (_IN + "casts", torch.tensor(2.0), TypeError, "expected a torch.int64 tensor"),
    "inexact_history": (_IN + "amax_history", torch.tensor([0.1, 0.0, 0.0], dtype=torch.float64), ValueError,
                        "cannot hold exactly"),
    "flag_2": (_IN + "initialized", torch.tensor(2), ValueError, "must be 1 or 0"),
    "bool_flag": (_IN + "initialized", torch.tensor(True), TypeError, "expected one integer"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_a_bad_value_in_a_state_dict_is_refused_naming_it_and_changes_nothing(case):
    key, value, error, words = BAD_VALUES[case]
    recipe = FP8Recipe(amax_history_len=3)
    source = _model(recipe, 0)
    _train_step(source, torch.optim.SGD(source.parameters(), lr=1e-3), *_batches(1)[0])
    saved = fp8_state_dict(source)
    saved[key] = value
    model = _model(recipe, 1)
    snapshot = _fp8_snapshot(model)  # a fresh model: also its uninitialized flags must stay
    for strict in (True, False):
        for call in (check_fp8_state_dict, load_fp8_state_dict):
            with pytest.raises(error, match=words) as info:
                call(model, saved, strict=strict)
            assert repr(key) in str(info.value), str(info.value)
    _assert_unchanged(model, snapshot)


def test_a_history_of_the_right_length_but_another_shape_is_called_corrupt_not_another_history_length():
    # A history of shape (3, 1) (or (1, 3)) has the model's amax_history_len: the hint "amax_history_len differs?"
    # sends the user to the recipe, where nothing differs. tests/core/test_state_load_checks.py pins the same rule for a
    # scale of shape (1,).
    recipe = FP8Recipe(amax_history_len=3)
    saved = fp8_state_dict(_model(recipe, 0))
    model = _model(recipe, 1)
    snapshot = _fp8_snapshot(model)
    for shape in ((3, 1), (1, 3)):
        bad = dict(saved)
        bad[_IN + "amax_history"] = saved[_IN + "amax_history"].reshape(shape)
        with pytest.raises(ValueError, match=r"in the model \(the checkpoint is corrupt"):
            load_fp8_state_dict(model, bad)
    _assert_unchanged(model, snapshot)


def test_the_refusal_of_a_long_history_names_the_bad_entry_and_stays_readable():
    # A 1024-long history with one negative entry: the message printed all 1024 values (over 5000 characters) and
    # did not say which entry is wrong. It should name the value (and where it is), as a person reads it.
    recipe = FP8Recipe(amax_history_len=1024)
    model = _model(recipe, 1)
    saved = fp8_state_dict(model)
    history = torch.zeros(1024)
    history[700] = -1.0
    saved[_IN + "amax_history"] = history
    snapshot = _fp8_snapshot(model)
    with pytest.raises(ValueError, match="finite and non-negative") as info:
        load_fp8_state_dict(model, saved)
    message = str(info.value)
    assert "-1.0" in message and "700" in message and len(message) < 800, (len(message), message[:300])
    _assert_unchanged(model, snapshot)


def test_a_long_history_a_buffer_cannot_hold_exactly_is_refused_naming_the_entry():
    recipe = FP8Recipe(amax_history_len=1024)
    model = _model(recipe, 1)
    saved = fp8_state_dict(model)
    history = torch.zeros(1024, dtype=torch.float64)
    history[513] = 1.0 + 2.0**-40  # not an fp32 number
    saved[_IN + "amax_history"] = history
    snapshot = _fp8_snapshot(model)
    with pytest.raises(
        ValueError,
        match=r"holds 1\.0000000000009095 at index 513 \(of \(1024,\)\), which a "
        r"torch\.float32 buffer cannot hold exactly \(it would be 1\.0 at index 513",
    ):
        load_fp8_state_dict(model, saved)
    _assert_unchanged(model, snapshot)


def test_a_numpy_string_algo_is_kept_as_a_plain_string():
    """As FP8Recipe keeps its string fields (``as_choice``): a NumPy string (or a StrEnum member) given as
    ``ScalingState(algo=...)`` is stored as ``str``."""
    state = ScalingState(torch.float8_e4m3fn, 4, 0, np.str_("most_recent"), True)
    assert type(state.algo) is str and state.algo == "most_recent"


def test_values_of_other_exact_dtypes_load_as_the_buffers_dtypes():
    recipe = FP8Recipe(amax_history_len=3)
    source = _model(recipe, 0)
    _train_step(source, torch.optim.SGD(source.parameters(), lr=1e-3), *_batches(1)[0])
    saved = fp8_state_dict(source)
    converted = {
        key: value.double() if value.is_floating_point() else value.to(torch.int32) for key, value in saved.items()
    }
    model = _model(recipe, 1)
    load_fp8_state_dict(model, converted)
    _assert_states_equal(fp8_state_dict(model), saved)  # stored as fp32 and int64, whatever they came as


def test_missing_and_extra_keys_strict_and_not():
    recipe = FP8Recipe(amax_history_len=3)
    source = _model(recipe, 0)
    _train_step(source, torch.optim.SGD(source.parameters(), lr=1e-3), *_batches(1)[0])
    saved = fp8_state_dict(source)
    first_layer = {k: v for k, v in saved.items() if k.startswith("0.")}
    extra = dict(
        saved, **{"0.fp8_scaling.input.unknown": torch.tensor(1.0), "5.fp8_scaling.input.scale": torch.ones(())}
    )
    model = _model(recipe, 1)
    _train_step(model, torch.optim.SGD(model.parameters(), lr=1e-3), *_batches(2)[1])
    snapshot = _fp8_snapshot(model)
    with pytest.raises(KeyError, match=r"missing \['2\.fp8_scaling\.grad_output\.amax'"):
        load_fp8_state_dict(model, first_layer)
    with pytest.raises(KeyError, match=r"unexpected \['0\.fp8_scaling\.input\.unknown', '5\.fp8_scaling"):
        load_fp8_state_dict(model, extra)
    with pytest.raises(KeyError):
        check_fp8_state_dict(model, first_layer)
    _assert_unchanged(model, snapshot)
    load_fp8_state_dict(model, first_layer, strict=False)  # the first layer's states load, the second's stay
    got = fp8_state_dict(model)
    _assert_states_equal({k: v for k, v in got.items() if k.startswith("0.")}, first_layer)
    _assert_states_equal({k: v for k, v in got.items() if k.startswith("2.")},
                         {k: v for k, v in snapshot[0].items() if k.startswith("2.")})  # fmt: skip
    load_fp8_state_dict(model, extra, strict=False)  # the unknown keys are ignored
    _assert_states_equal(fp8_state_dict(model), saved)


def test_the_saved_and_the_loaded_dicts_share_no_memory_with_the_model():
    recipe = FP8Recipe(amax_history_len=3)
    model = _model(recipe, 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    _train_step(model, optimizer, *_batches(1)[0])
    saved = fp8_state_dict(model)
    snapshot = _fp8_snapshot(model)
    for value in saved.values():
        value.add_(1)  # a checkpoint edited after saving: the model's state is its own
    _assert_unchanged(model, snapshot)
    loaded = fp8_state_dict(_model(recipe, 1))
    load_fp8_state_dict(model, loaded)
    after = _fp8_snapshot(model)
    for value in loaded.values():
        value.mul_(2)
    _assert_unchanged(model, after)
