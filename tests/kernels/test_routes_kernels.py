"""A route sweep of the Triton kernels' launchers: the inputs a caller can hand them (shapes, layouts, dtypes, values,
scale arguments, multi-tensor lists), each compared bit for bit with the kernel's reference in kernels/reference*.py,
and through lightning_fp8/ops.py's dispatch (``LIGHTNING_FP8_KERNELS=triton`` against ``=reference``): CPU emulation
must give GPU numerics. The regular inputs are covered by test_cast.py, test_adamw.py, test_grad_cast_kernels.py and
tests/distributed/test_comm_kernels.py; this file covers the edges around them. On CPU the kernels run under
TRITON_INTERPRET=1 (tests/conftest.py): every shape is small.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from lightning_fp8.kernels import (  # noqa: E402
    adamw,
    cast,
    grad_cast,
    record,
    reference,
    reference_adamw,
    reference_grad_cast,
)
from lightning_fp8.kernels import transpose as byte_transpose  # noqa: E402
from lightning_fp8.kernels.comm_table import block_table  # noqa: E402

from lightning_fp8 import ops  # noqa: E402
from lightning_fp8.distributed.quantize import segment_kernels  # noqa: E402

# The interpreter runs the kernels' arithmetic in numpy, which warns of inf * 0, overflows to inf and NaN compares;
# the results are what is checked.
pytestmark = [
    pytest.mark.usefixtures("one_thread"),  # tests/conftest.py: thousands of tiny ops
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_DTYPES = (E4M3, E5M2)
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
INPUT_DTYPES = (F32, F16, BF16)
FMAX = {E4M3: 448.0, E5M2: 57344.0}

# The one tolerance of this file: a fused GELU (recast_activation_transposed) computes erf/exp in the kernel, which
# differ from torch's by an fp32 ulp at times; such a value lands one FP8 code away now and then (quantize_'s
# docstring: "about 0.1%"). At most this fraction of the elements may differ, each by one code.
ACTIVATION_TOLERATED = 1e-2

# Shapes off every block size (the flat cast's 2048, the transposed cast's 64 x 64 tiles, the interpreter's chunks of
# 128 for the multi-tensor kernels): none, one element, 0-dim, odd 1-D lengths, a last dimension of 1, one row, 3-D.
FLAT_SHAPES = [(), (0,), (1,), (7,), (127,), (129,), (1003,), (3, 4, 5), (2, 1, 3, 1)]
MATRIX_SHAPES = [(1, 1), (7, 1), (1, 129), (129, 1), (65, 7), (0, 5), (300, 2)]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _random(shape, seed: int, spread: float = 8.0) -> torch.Tensor:
    """Fresh values over ``2 * spread`` binades around 1 (fp32, on the CPU)."""
    g = _gen(seed)
    return torch.randn(shape, generator=g) * torch.exp2(torch.empty(shape).uniform_(-spread, spread, generator=g))


def _same(a, b) -> bool:
    """Equal dtype, shape and bit patterns (FP8 by their bytes, -0.0 apart from +0.0); any NaN equals any NaN."""
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().reshape(-1).contiguous(), b.detach().reshape(-1).contiguous()
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan = torch.isnan(a.float())
    if not torch.equal(nan, torch.isnan(b.float())):
        return False
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(view)[~nan], b.view(view)[~nan])


def _both_paths(monkeypatch, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` (an ops function) on the Triton path, then on the reference path: (triton, reference).
    Tensor arguments are cloned for each path (the states are written in place); the clones come back as well."""
    results = []
    for mode in ("triton", "reference"):
        monkeypatch.setenv("LIGHTNING_FP8_KERNELS", mode)
        a = [x.clone() if isinstance(x, torch.Tensor) else x for x in args]
        out = fn(*a, **kwargs)
        results.append((list(out) if isinstance(out, (tuple, list)) else [out], [x for x in a if torch.is_tensor(x)]))
    return results


def _raised(fn, *args, **kwargs) -> BaseException | None:
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 (which exception is the subject of the test)
        return e
    return None


# ------------------------------------------------------------------------------------------------------------- casts


@pytest.mark.parametrize("dtype", INPUT_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_cast_and_amax_of_every_shape_match_the_reference(fp8_dtype, dtype):
    """cast.cast_to_fp8 (and its transposed copy for 2-D inputs) and cast.amax over shapes off every block size: the
    bytes, the shapes of both outputs (the transposed one empty unless asked), the amax and the saturated count."""
    scale = torch.tensor(2.0**-3, device=DEVICE)
    for i, shape in enumerate(FLAT_SHAPES + MATRIX_SHAPES):
        x = (_random(shape, i) * FMAX[fp8_dtype] / 4).to(dtype).to(DEVICE)
        assert _same(cast.amax(x), reference.amax_ref(x)), shape
        for transpose in (False, True) if x.dim() == 2 else (False,):
            got = cast.cast_to_fp8(x, scale, fp8_dtype, transpose)
            ref = reference.cast_to_fp8_ref(x, scale, fp8_dtype, transpose)
            assert _same(got, ref), (shape, transpose)
            assert got[0].shape == x.shape and got[1].shape == ((x.shape[1], x.shape[0]) if transpose else (0,))


LAYOUTS = {
    # name: a function of a fresh contiguous fp32 tensor -> the strided input
    "transposed": lambda t: t.reshape(24, 40).t(),
    "stepped": lambda t: t.reshape(40, 24)[::3, ::2],
    "broadcast_rows": lambda t: t.reshape(-1)[:24].reshape(1, 24).expand(40, 24),  # stride 0
    "broadcast_scalar": lambda t: t.reshape(-1)[0].expand(5, 3),
    "storage_offset": lambda t: t.reshape(-1)[5 : 5 + 37 * 13].view(37, 13),
    "channels_last": lambda t: t.reshape(-1)[:120].reshape(2, 5, 3, 4).contiguous(memory_format=torch.channels_last),
    "negative_zeros": lambda t: -torch.zeros(3, 17),
    "one_column": lambda t: t.reshape(-1)[:300].reshape(300, 1),
    "zero_dim": lambda t: t.reshape(-1)[7],
}


@pytest.mark.parametrize("dtype", INPUT_DTYPES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_casts_as_its_values_through_the_dispatch(monkeypatch, layout, dtype):
    """ops.amax, ops.cast_to_fp8 (with and without the transposed copy), ops.recast_transposed and
    ops.recast_activation_transposed on strided inputs: the Triton path (which makes them contiguous) gives the
    reference path's bits, and both give the cast of the values, whatever the strides."""
    x = LAYOUTS[layout](_random(960, 3) * 60).to(dtype).to(DEVICE)
    dense = x.contiguous()
    scale = torch.tensor(2.0**-2, device=DEVICE)
    checks = [(ops.amax, (x,)), (ops.cast_to_fp8, (x, scale, E4M3))]
    if x.dim() == 2:
        checks += [(ops.cast_to_fp8, (x, scale, E5M2, True)), (ops.recast_transposed, (x, scale, E4M3))]
    for fn, args in checks:
        (got, _), (ref, _) = _both_paths(monkeypatch, fn, *args)
        assert _same(got, ref), fn.__name__
        (dense_ref, _), _ = _both_paths(monkeypatch, fn, dense, *args[1:])
        assert _same(ref, dense_ref), fn.__name__
    if x.dim() == 2:
        # The GELU recast reads an FP8 input: the same strides on an FP8 tensor.
        x_fp8 = LAYOUTS[layout](_random(960, 4) * 4).to(E4M3).to(DEVICE) if layout != "negative_zeros" else x.to(E4M3)
        args = (x_fp8, torch.tensor(0.25, device=DEVICE), scale, E4M3, "gelu")
        (got, _), (ref, _) = _both_paths(monkeypatch, ops.recast_activation_transposed, *args)
        _assert_fp8_near(got[0], ref[0])


def _assert_fp8_near(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    g, r = got.view(torch.uint8).int(), ref.view(torch.uint8).int()
    differ = g != r
    assert ((g - r).abs()[differ] == 1).all(), "a byte differs by more than one code"
    assert differ.float().mean().item() <= ACTIVATION_TOLERATED


def _special_values(fp8_dtype: torch.dtype, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x values whose products with ``scale`` are the hard cases of the cast, representable in ``dtype``: +-0, the
    dtype's subnormals, values at, just below and just past the FP8 maximum, +-inf, NaN, the dtype's maximum."""
    fmax, info = FMAX[fp8_dtype], torch.finfo(dtype)
    sub = info.tiny * torch.tensor([0.5, 0.25, -0.125, 2.0**-6])  # subnormals of the input dtype (bf16: 2**-126...)
    at = torch.tensor([fmax, -fmax]) / scale
    past = torch.nextafter(at.to(dtype), at.to(dtype) * 2).float()  # the next value of the input dtype past it
    below = torch.nextafter(at.to(dtype), at.to(dtype) * 0).float()
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), info.max, -info.max])
    return torch.cat([sub, at, past, below, special, at * 1.0625]).to(dtype)


@pytest.mark.parametrize("scale", [1.0, 2.0**-126, 2.0**127, 2.0**-3])
@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_special_values_and_extreme_scales_cast_as_the_reference(fp8_dtype, dtype, scale):
    """Zeros (the sign kept: -0.0 is the byte 0x80), subnormal inputs, values at and just past the FP8 maximum
    (saturated and counted), +-inf and NaN (NaN, not counted), under the smallest and largest fp32 power-of-two
    scales (x * 2**127 overflows fp32 to inf for a finite x: it saturates, as the reference's clamp does)."""
    x = _special_values(fp8_dtype, dtype, scale)
    x = torch.cat([x, (_random(61, 5) / scale).to(dtype)]).to(DEVICE)
    s = torch.tensor(scale, device=DEVICE)
    for shape in ((x.numel(),), (1, x.numel()), (x.numel(), 1)):
        xs = x.reshape(shape)
        transpose = xs.dim() == 2
        got, ref = cast.cast_to_fp8(xs, s, fp8_dtype, transpose), reference.cast_to_fp8_ref(xs, s, fp8_dtype, transpose)
        assert _same(got, ref), shape
    x_fp8 = got[0].reshape(-1).view(torch.uint8)
    assert x_fp8[10].item() == 0x00 and x_fp8[11].item() == 0x80  # +0.0 and -0.0 (their places in _special_values)
    finite = torch.isfinite(x.float())
    assert got[3].item() == int(((x.float() * scale).abs() >= FMAX[fp8_dtype])[finite].sum())


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_bf16_subnormals_cast_as_their_fp32_values(fp8_dtype):
    """bf16 subnormal inputs: the reference's cast of them equals the Triton cast of the same values held in fp32 (bf16
    widens exactly). The Triton launch on the bf16 tensor itself is not compared on CPU: the interpreter flushes bf16
    subnormals when it loads them (fp32 tensors of the same values cast right; a GPU runs this with ``gpu`` tests)."""
    tiny = torch.finfo(BF16).tiny
    x = (torch.randn(300, generator=_gen(6)) * tiny).to(BF16).to(DEVICE)
    assert (x.float().abs() < tiny).sum() > 100 and (x != 0).sum() > 100  # subnormals, mostly
    scale = torch.tensor(2.0**127, device=DEVICE)  # the subnormals times 2**127: normal FP8 values
    for s in (scale, torch.tensor(1.0, device=DEVICE)):
        assert _same(cast.cast_to_fp8(x.float(), s, fp8_dtype), reference.cast_to_fp8_ref(x, s, fp8_dtype))
    assert _same(cast.amax(x.float()), reference.amax_ref(x))
    if DEVICE == "cpu":
        pytest.skip("the Triton interpreter flushes bf16 subnormals on load (an interpreter bug, not the kernel's)")
    assert _same(cast.cast_to_fp8(x, scale, fp8_dtype), reference.cast_to_fp8_ref(x, scale, fp8_dtype))


ONE_ELEMENT_SCALES = {
    "0-dim": lambda: torch.tensor(4.0),
    "(1,)": lambda: torch.tensor([4.0]),
    "(1, 1)": lambda: torch.tensor([[4.0]]),
    "strided_view": lambda: torch.tensor([1.0, 2.0, 4.0])[::2][1:],  # a storage offset
    "broadcast": lambda: torch.tensor(4.0).expand(1, 1),
}


@pytest.mark.parametrize("scale", list(ONE_ELEMENT_SCALES))
def test_any_one_element_scale_scales_like_a_0_dim_one(monkeypatch, scale):
    """A scale is any one-element fp32 tensor (cast_checks.check_cast_arguments): each layout of it casts as the 0-dim
    scale, on both paths, and leaves x_fp8 with x's shape (not broadcast to the scale's rank)."""
    x = _random((13, 9), 7).to(DEVICE)
    s = ONE_ELEMENT_SCALES[scale]().to(DEVICE)
    (got, _), (ref, _) = _both_paths(monkeypatch, ops.cast_to_fp8, x, s, E4M3, True)
    want = reference.cast_to_fp8_ref(x, torch.tensor(4.0, device=DEVICE), E4M3, True)
    assert _same(got, want) and _same(ref, want)


BAD_SCALES = {
    # name: (scale, error, what the message names)
    "float64": (lambda: torch.tensor(4.0, dtype=torch.float64), TypeError, "float32"),
    "float16": (lambda: torch.tensor(4.0, dtype=F16), TypeError, "float32"),
    "int": (lambda: torch.tensor(4, dtype=torch.int32), TypeError, "float32"),
    "two_elements": (lambda: torch.tensor([4.0, 4.0]), TypeError, "one-element"),
    "empty": (lambda: torch.tensor([]), TypeError, "one-element"),
    "python_float": (lambda: 4.0, TypeError, "one-element"),
    "other_device": (lambda: torch.tensor(4.0, device="meta"), ValueError, "scale is on meta"),
}


@pytest.mark.parametrize("kernels", ["triton", "reference"])
@pytest.mark.parametrize("bad", list(BAD_SCALES))
def test_a_bad_scale_is_refused_clearly_on_both_paths(monkeypatch, bad, kernels):
    """A scale of another dtype, size, type or device: a TypeError/ValueError naming the cast and the scale, the same on
    both paths (not a Triton compile error, a read of the wrong bits or a broadcast)."""
    monkeypatch.setenv("LIGHTNING_FP8_KERNELS", kernels)
    make, error, match = BAD_SCALES[bad]
    x = _random((5, 16), 8).to(DEVICE)
    for fn, args in ((ops.cast_to_fp8, (x, make(), E4M3)), (ops.recast_transposed, (x, make(), E5M2))):
        with pytest.raises(error, match=match) as info:
            fn(*args)
        assert "scale" in str(info.value) and fn.__name__ in str(info.value)


BAD_INPUTS = {
    "int8": lambda: torch.ones(4, 16, dtype=torch.int8),
    "int64": lambda: torch.ones(4, 16, dtype=torch.int64),
    "bool": lambda: torch.ones(4, 16, dtype=torch.bool),
    "complex": lambda: torch.ones(4, 16, dtype=torch.complex64),
    "fp8": lambda: torch.ones(4, 16).to(E4M3),
    "sparse": lambda: torch.ones(4, 16).to_sparse(),
}


@pytest.mark.parametrize("kernels", ["triton", "reference"])
@pytest.mark.parametrize("bad", list(BAD_INPUTS))
def test_an_input_the_kernels_cannot_read_is_refused_clearly_on_both_paths(monkeypatch, bad, kernels):
    """Integer, bool, complex, FP8 and sparse inputs: a TypeError naming the cast, on both paths, for every cast entry
    point of the dispatch."""
    monkeypatch.setenv("LIGHTNING_FP8_KERNELS", kernels)
    x, one = BAD_INPUTS[bad]().to(DEVICE), torch.tensor(1.0, device=DEVICE)
    for fn, args in ((ops.amax, (x,)), (ops.cast_to_fp8, (x, one, E4M3)), (ops.recast_transposed, (x, one, E4M3))):
        with pytest.raises(TypeError, match=fn.__name__):
            fn(*args)


def test_the_triton_launchers_refuse_float64_by_name_and_the_dispatch_routes_it_to_the_reference(monkeypatch):
    """cast.amax and cast.cast_to_fp8 read 16- and 32-bit floats: a float64 input is a clear TypeError there, and
    ops (forced to Triton) casts it on the reference path instead (a finite value past fp32's range saturates)."""
    x = _random((9, 16), 9).double().to(DEVICE)
    x[0, 0] = 1e300
    one = torch.tensor(1.0, device=DEVICE)
    with pytest.raises(TypeError, match="amax casts float16, bfloat16 or float32 values, got torch.float64"):
        cast.amax(x)
    with pytest.raises(TypeError, match="cast_to_fp8 casts float16, bfloat16 or float32 values, got torch.float64"):
        cast.cast_to_fp8(x, one, E4M3)
    (got, _), (ref, _) = _both_paths(monkeypatch, ops.cast_to_fp8, x, one, E4M3, True)
    assert _same(got, ref) and got[0].view(torch.uint8)[0, 0].item() == 0x7E  # 448, saturated


def test_a_scale_that_requires_grad_gives_outputs_without_grad_on_both_paths(monkeypatch):
    """A scale that requires grad (an nn.Parameter used as a scale): the Triton cast returns plain tensors (its outputs
    are no function autograd can differentiate); the reference path must too. It detaches x but not the scale, so its
    x_fp8 and x_fp8_t required grad and carried a grad_fn on CPU only (kernels/reference.py: cast_to_fp8_ref)."""
    x = _random((8, 16), 10).to(DEVICE)
    scale = torch.tensor(2.0, device=DEVICE, requires_grad=True)
    (got, _), (ref, _) = _both_paths(monkeypatch, ops.cast_to_fp8, x, scale, E4M3, True)
    assert _same(got, ref)
    assert [t.requires_grad for t in got] == [False] * 4
    assert [t.requires_grad for t in ref] == [False] * 4, "the reference path's outputs require grad"


# ------------------------------------------------------------------------------------------- a scaling state's cast


def _state(history: int, scale: float, seed: int) -> list[torch.Tensor]:
    """A scaling state a few casts into training: (amax_history, scale, last_amax, saturation, nonfinite, casts)."""
    hist = torch.rand(history, generator=_gen(seed)) * 10
    values = [hist, torch.tensor(scale), torch.tensor(0.5), torch.tensor(0.0), torch.tensor(3), torch.tensor(7)]
    return [v.to(DEVICE) for v in values]


MODES = [
    (True, True, 16, False),
    (True, False, 17, True),
    (False, True, 1, True),
]  # delayed, algo_max, history, current


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("state_scale", [1.0, 2.0**127, 2.0**-126])
def test_quantize_of_every_shape_matches_through_the_dispatch(monkeypatch, fp8_dtype, state_scale):
    """ops.quantize (the fused cast with its bookkeeping) on shapes off the block sizes, with histories of 16 and 17
    (a power of two and one past it), under the extreme stored scales: outputs and every state buffer, bit for bit."""
    flat = [((), False, False), ((1,), False, False), ((127,), False, False), ((1003,), False, False)]
    cases = flat + [((3, 4, 5), False, False), ((1, 1), True, True), ((129, 1), True, True), ((1, 129), True, True)]
    for i, (shape, transpose, column_sum) in enumerate(cases):
        delayed, algo_max, history, current = MODES[i % len(MODES)]
        x = (_random(shape, 20 + i) * 30).to(BF16).to(DEVICE)
        state = _state(history, state_scale, i)
        (got, got_state), (ref, ref_state) = _both_paths(
            monkeypatch, ops.quantize, x, *state, fp8_dtype, 0, algo_max, delayed, current, transpose,
            column_sum=column_sum,
        )  # fmt: skip
        assert _same(got, ref), (shape, delayed, current)
        assert _same(got_state, ref_state), (shape, delayed, current)


QUANTIZE_VALUES = {
    # name: the values of a (67, 45) fp32 input from a random one
    "zeros": lambda x: torch.zeros_like(x),
    "negative_zeros": lambda x: -torch.zeros_like(x),
    "one_inf": lambda x: x.index_put_((torch.tensor([3]), torch.tensor([4])), torch.tensor(float("inf"))),
    "one_nan": lambda x: x.index_put_((torch.tensor([5]), torch.tensor([6])), torch.tensor(float("nan"))),
    "fp32_subnormals": lambda x: x * 1e-40,
    "near_fp32_max": lambda x: x * 3e37,
}


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("values", list(QUANTIZE_VALUES))
def test_quantize_of_special_values_matches_through_the_dispatch(monkeypatch, values, dtype):
    """All zeros (amax 0: the scale kept), -0.0, an inf, a NaN (non-finite amax: counted, the scale kept), fp32
    subnormals (a subnormal amax's scale), values near fp32's maximum (fp16: inf), in delayed, current and unscaled
    casts with margins of 0, 3 and 40 binades (the scale clamped at 2**-126): both paths, bit for bit."""
    x = QUANTIZE_VALUES[values](_random((67, 45), 30)).to(dtype).to(DEVICE)
    for fp8_dtype in FP8_DTYPES:
        for delayed, current, margin, unscale in ((True, True, 0, None), (True, False, 0, None),
                                                  (False, True, 3, 2.0**-7), (True, True, 40, None)):  # fmt: skip
            state = _state(1 if unscale is not None or not delayed else 4, 2.0**-3, 31)
            u = torch.tensor(unscale, device=DEVICE) if unscale is not None else None
            (got, got_state), (ref, ref_state) = _both_paths(
                monkeypatch, ops.quantize, x, *state, fp8_dtype, margin, True, delayed, current, True, unscale=u
            )
            assert _same(got, ref) and _same(got_state, ref_state), (fp8_dtype, delayed, current, margin)


def test_record_op_matches_the_reference_for_long_histories_and_subnormal_amaxes():
    """kernels/record.py's bookkeeping with histories of 16 and 17 entries (BLOCK_H 16 and 32) and amaxes that are fp32
    subnormals, 0 or past the format maximum: record_cast_ref's state, bit for bit."""
    for history in (16, 17):
        got_state, ref_state = _state(history, 4.0, 40), _state(history, 4.0, 40)
        for step, amax in enumerate([1e-40, 3e-39, 0.0, 1e5, float("inf"), 2.0**-149]):
            a = torch.tensor(amax, device=DEVICE)
            n_sat = torch.tensor(step, dtype=torch.int64, device=DEVICE)
            used = got_state[1].clone()
            got = record.record_op(a, n_sat, used, *got_state, 777, E4M3, 0, True, True)
            ref = reference.record_cast_ref(a, n_sat, 777, used.clone(), *ref_state, 448.0, 0, True, True)
            assert _same(got, ref) and _same(got_state, ref_state), (history, step)


# ----------------------------------------------------------------------------------------------------------- transpose


@pytest.mark.parametrize("dtype", [E4M3, E5M2, torch.uint8, torch.int8, torch.bool])
def test_transpose_of_thin_and_tiny_byte_matrices_is_torchs(dtype):
    """transpose_2d on one element, a column, a row, a tall thin and a wide flat matrix of every 1-byte dtype."""
    for i, shape in enumerate([(1, 1), (7, 1), (1, 129), (129, 3), (3, 200)]):
        x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=_gen(50 + i)).view(torch.int8)
        x = (x != 0) if dtype == torch.bool else x.view(dtype)
        x = x.to(DEVICE)
        assert _same(byte_transpose.transpose_2d(x), x.t().contiguous()), shape


def test_transpose_refuses_what_it_cannot_move_by_name():
    for bad in (torch.zeros(4, 6, dtype=torch.uint8).t(), torch.zeros(4, 6, dtype=F16), torch.zeros(2, 3, 4).byte()):
        with pytest.raises(ValueError, match="transpose_2d"):
            byte_transpose.transpose_2d(bad.to(DEVICE))


# -------------------------------------------------------------------------------------------------- batched grad casts


def _grad_states(n: int) -> list[torch.Tensor]:
    states = [reference_grad_cast.new_grad_cast_state(DEVICE) for _ in range(n)]
    for i, s in enumerate(states):  # a kept scale to tell apart (an amax of 0 keeps it)
        reference_grad_cast.grad_cast_state_buffers(s)[1].fill_(2.0 ** (i - 2))
    return states


def _grad_cast_both(grads, fp8_dtype, **kwargs):
    states = _grad_states(len(grads))
    ref_states = [s.clone() for s in states]
    got = grad_cast.grad_cast(grads, states, fp8_dtype, **kwargs)
    ref = reference_grad_cast.grad_cast_ref(grads, ref_states, fp8_dtype, **kwargs)
    return (got, states), (ref, ref_states)


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_grad_cast_of_a_ragged_list_matches_the_reference(fp8_dtype, dtype):
    """One launch pair over gradients of every odd size (0-dim, one element, empty, a column, 3-D), one much larger than
    the rest, one all zeros, one holding +-inf, NaN, -0.0 and values at and past the FP8 maximum (count_big counts
    |g| >= max, inf included, NaN not), and the same gradient twice (read twice: two equal casts)."""
    shapes = [(), (1,), (0,), (7, 1), (127,), (3, 4, 5), (1003,), (129,)]
    grads = [(_random(shape, 60 + i, spread=6) * 4).to(dtype) for i, shape in enumerate(shapes)]
    grads[4].zero_()
    fmax = FMAX[fp8_dtype]
    grads[7][:7] = torch.tensor([float("inf"), -float("inf"), float("nan"), -0.0, fmax, -fmax * 1.5, 2.0**-20])
    grads = [g.to(DEVICE) for g in grads] + [grads[6].to(DEVICE)]
    for margin in (0, 3):
        (got, states), (ref, ref_states) = _grad_cast_both(grads, fp8_dtype, margin=margin, count_big=True)
        assert _same(got, ref) and _same(states, ref_states), margin
        assert _same(got[0][6], got[0][-1]) and got[3][7].item() == 4  # inf, -inf, fmax, 1.5 fmax
        assert got[0][7].view(torch.uint8)[3].item() == 0x80  # -0.0 keeps its sign


def test_grad_cast_of_fp16_subnormals_and_pending_0_dim_gradients_matches_the_reference():
    """fp16 subnormal gradients (a subnormal amax's scale), and accumulation onto pending FP8 gradients of 0-dim and
    one-element shapes."""
    tiny = torch.finfo(F16).tiny
    grads = [(torch.randn(40, generator=_gen(70)) * tiny).to(F16).to(DEVICE), torch.tensor(3.0, dtype=F16).to(DEVICE),
             torch.tensor([-5.0], dtype=F16).to(DEVICE)]  # fmt: skip
    (got, states), (ref, ref_states) = _grad_cast_both(grads, E5M2)
    assert _same(got, ref) and _same(states, ref_states)
    pending = [torch.full(g.shape, 2.0).to(E5M2).to(DEVICE) for g in grads]
    scale_inv = [torch.tensor(2.0**-k, device=DEVICE) for k in (20, 1, 3)]
    (got, states), (ref, ref_states) = _grad_cast_both(grads, E5M2, pending_data=pending, pending_scale_inv=scale_inv)
    assert _same(got, ref) and _same(states, ref_states)


@pytest.mark.parametrize("kernels", ["triton", "reference"])
@pytest.mark.parametrize("scale_shape", [(1,), (1, 1)], ids=str)
def test_a_one_element_pending_scale_inv_of_any_shape_keeps_the_gradients_shapes(monkeypatch, kernels, scale_shape):
    """check_grad_cast takes any one-element fp32 pending_scale_inv, and the kernel reads its one value: the FP8
    gradients keep their gradients' shapes. The reference broadcast it against the gradient: a 0-dim gradient came
    back of shape (1,), an (8,) one of shape (1, 8) with a (1, 1) scale_inv (reference_grad_cast.grad_cast_ref), so
    ops.grad_cast on CPU returned other shapes than on a GPU."""
    monkeypatch.setenv("LIGHTNING_FP8_KERNELS", kernels)
    grads = [torch.tensor(3.0, device=DEVICE), torch.randn(8, generator=_gen(71)).to(DEVICE)]
    pending = [torch.tensor(1.0).to(E5M2).to(DEVICE), torch.randn(8, generator=_gen(72)).to(E5M2).to(DEVICE)]
    scale_inv = [torch.full(scale_shape, 0.5, device=DEVICE) for _ in grads]
    data, _, _, _ = ops.grad_cast(grads, _grad_states(2), E5M2, pending_data=pending, pending_scale_inv=scale_inv)
    assert [tuple(d.shape) for d in data] == [(), (8,)]
    want, _, _, _ = ops.grad_cast(grads, _grad_states(2), E5M2, pending_data=pending,
                                  pending_scale_inv=[s.reshape(()) for s in scale_inv])  # fmt: skip
    assert _same(data, want)


def test_an_empty_grad_cast_returns_empty_results_on_both_paths(monkeypatch):
    results = []
    for kernels in ("triton", "reference"):
        monkeypatch.setenv("LIGHTNING_FP8_KERNELS", kernels)
        results.append(ops.grad_cast([], [], E5M2, count_big=True))
    assert _same(list(results[0]), list(results[1])) and results[0][0] == []
    assert results[0][1].shape == results[0][2].shape == results[0][3].shape == (0,)


# ------------------------------------------------------------------------------------------------------------- AdamW

ADAMW_HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01, "step": 3}
ADAMW_CASES = {
    # (param, exp_avg, exp_avg_sq, grad), scaled, fp8 grads, bf16 param copies (as tests/kernels/test_adamw.py)
    "o2_fp8_grad": ((F16, E4M3, F16, E5M2), True, True, False),
    "o2_master_apart": ((F16, E4M3, F16, E5M2), True, True, True),
    "fp32": ((F32, F32, F32, F32), False, False, False),
    "moments_only_bf16_grad": ((F32, E4M3, F16, BF16), True, False, False),
}
ADAMW_SHAPES = [(0,), (1,), (), (7, 1), (1003,), (3, 4, 5)]


def _adamw_tensors(shapes, case, seed):
    """Random states a few steps into training, stored as FP8AdamW stores them (amaxes 0 for empty tensors)."""
    (p_dt, m_dt, v_dt, g_dt), scaled, fp8_grads, _ = ADAMW_CASES[case]
    gen, out = _gen(seed), []
    for shape in shapes:
        w, m = torch.randn(shape, generator=gen) * 0.05, torch.randn(shape, generator=gen) * 1e-3
        v, g = torch.rand(shape, generator=gen) * 1e-5 + 1e-9, torch.randn(shape, generator=gen) * 1e-2
        scales = [torch.tensor(2.0**k) for k in (16, 10, 20)]

        def stored(x, dt, s):
            return (x * s).to(dt) if scaled and dt in reference_adamw.SCALED_STATE_MAX else x.to(dt)

        d = {"p": stored(w, p_dt, scales[0]), "m": stored(m, m_dt, scales[1]), "v": stored(v, v_dt, scales[2]),
             "g": (g * 2**10).to(g_dt) if fp8_grads else g.to(g_dt), "scales": scales,
             "amaxes": [reference.amax_ref(t) for t in (w, m, v)], "gsi": torch.tensor(2.0**-10),
             "gamax": reference.amax_ref(g), "copy": torch.zeros(shape, dtype=BF16)}  # fmt: skip
        out.append({k: (x.to(DEVICE) if torch.is_tensor(x) else [t.to(DEVICE) for t in x]) for k, x in d.items()})
    return out


def _adamw_run(fn, tensors, case, two_pass, emit=None):
    """One step of ``fn`` on copies of ``tensors``; ``emit``: an FP8 dtype to emit weight copies in."""
    _, scaled, fp8_grads, copies = ADAMW_CASES[case]
    t = [{k: (v.clone() if torch.is_tensor(v) else [x.clone() for x in v]) for k, v in d.items()} for d in tensors]
    extra = {}
    if emit is not None:
        for d in t:
            d["fp8"] = torch.full(d["p"].shape, float("nan"), dtype=emit, device=DEVICE)
            d["record"] = torch.full((5,), -1, dtype=torch.int64, device=DEVICE)
        extra = {"fp8_weights": [d["fp8"] for d in t], "fp8_weight_stats": [d["record"] for d in t]}
    fn([d["p"] for d in t], [d["g"] for d in t], [d["m"] for d in t], [d["v"] for d in t],
       [tuple(d["scales"]) for d in t] if scaled else None, [tuple(d["amaxes"]) for d in t] if scaled else None,
       [d["gsi"] for d in t] if fp8_grads else None, **ADAMW_HYPER, grad_unscale=0.5, two_pass=two_pass,
       grad_amaxes=[d["gamax"] for d in t], param_copies=[d["copy"] for d in t] if copies else None,
       **extra)  # fmt: skip
    return t


def _records_as_values(t):
    # An FP8 weight record's views (fp32 scale_inv, amax, scale, saturation, history; int64 nonfinite, 1): NaN-aware.
    for d in t:
        if "record" in d:
            d["record"] = list(reference_adamw.fp8_weight_record_views(d.pop("record")))
    return t


def _adamw_same(a, b) -> list:
    a, b = _records_as_values(a), _records_as_values(b)
    return [(i, k) for i, (x, y) in enumerate(zip(a, b, strict=True)) for k in x if not _same(x[k], y[k])]


@pytest.mark.parametrize("two_pass", [True, False], ids=["two_pass", "one_pass"])
@pytest.mark.parametrize("case", list(ADAMW_CASES))
def test_adamw_over_ragged_tensors_matches_the_reference(case, two_pass):
    """One step over an empty tensor, one element, a 0-dim tensor, a column, one much larger tensor and a 3-D one, in
    one launch: every state, scale, amax and copy, bit for bit."""
    tensors = _adamw_tensors(ADAMW_SHAPES, case, 80)
    ref = _adamw_run(reference_adamw.adamw_step_ref, tensors, case, two_pass)
    got = _adamw_run(adamw.adamw_step, tensors, case, two_pass)
    assert _adamw_same(ref, got) == []
    assert not _same(ref[4]["p"], tensors[4]["p"])  # the step moved the weights


@pytest.mark.parametrize("two_pass", [True, False], ids=["two_pass", "one_pass"])
def test_adamw_emitting_fp8_copies_of_ragged_non_empty_tensors_matches_the_reference(two_pass):
    shapes = [s for s in ADAMW_SHAPES if s != (0,)]
    for case in ("o2_fp8_grad", "o2_master_apart"):
        tensors = _adamw_tensors(shapes, case, 81)
        for emit in FP8_DTYPES:
            ref = _adamw_run(reference_adamw.adamw_step_ref, tensors, case, two_pass, emit)
            got = _adamw_run(adamw.adamw_step, tensors, case, two_pass, emit)
            assert _adamw_same(ref, got) == [], (case, emit)


@pytest.mark.parametrize("two_pass", [True, False], ids=["two_pass", "one_pass"])
def test_adamw_emitting_the_fp8_copy_of_an_empty_weight_records_saturation_0(two_pass):
    """An empty weight (a 0-row layer, or an FSDP2 rank whose shard of a small weight is empty) among others, with
    FP8 weight copies: its record's saturation is 0, as the reference writes (n_saturated / max(numel, 1)). The
    finalize kernel divided 0 by 0 (kernels/adamw_finalize.py: _finalize_emit, ``tl.div_rn(count, n)``) and
    recorded NaN, which the forward's record_into then copied into the layer's state (a NaN saturation in the logs)."""
    tensors = _adamw_tensors([(0,), (33,)], "o2_fp8_grad", 82)
    ref = _adamw_run(reference_adamw.adamw_step_ref, tensors, "o2_fp8_grad", two_pass, E4M3)
    got = _adamw_run(adamw.adamw_step, tensors, "o2_fp8_grad", two_pass, E4M3)
    saturation = reference_adamw.fp8_weight_record_views(got[0]["record"])[0][3]
    assert saturation.item() == 0.0, f"the empty weight's recorded saturation is {saturation.item()}"
    assert _adamw_same(ref, got) == []


def test_adamw_with_one_gradient_shared_by_two_params_matches_the_reference():
    """The grads list holds one tensor twice (two params stepped with the same gradient): read-only, so both steps
    see it whole, as in the reference."""
    tensors = _adamw_tensors([(40,), (40,)], "o2_fp8_grad", 83)
    tensors[1]["g"], tensors[1]["gsi"] = tensors[0]["g"], tensors[0]["gsi"]
    for two_pass in (True, False):
        ref = _adamw_run(reference_adamw.adamw_step_ref, tensors, "o2_fp8_grad", two_pass)
        got = _adamw_run(adamw.adamw_step, tensors, "o2_fp8_grad", two_pass)
        assert _adamw_same(ref, got) == []


@pytest.mark.parametrize(("shape", "scalar_shape"), [((40,), (1, 1)), ((), (1,))], ids=["(1,1)-scales", "(1,)-scales"])
def test_adamw_reads_one_element_scales_of_any_shape_on_both_paths(shape, scalar_shape):
    """adamw_step's check takes scales, amaxes and grad_scale_invs that are "one-element fp32 tensors"
    (kernels/adamw.py: _check), and the kernel reads their one value. The reference broadcast them against the
    states instead and raised "output with shape [40] doesn't match the broadcast shape [1, 40]" (a (1, 1) scale) or
    "[] ... [1]" (a (1,) scale of a 0-dim param): the step that runs on a GPU failed on the CPU path
    (lightning_fp8/optim/step.py)."""
    tensors = _adamw_tensors([shape], "o2_fp8_grad", 84)
    for d in tensors:
        d["scales"] = [s.reshape(scalar_shape) for s in d["scales"]]
        d["gsi"] = d["gsi"].reshape(scalar_shape)
    got = _adamw_run(adamw.adamw_step, tensors, "o2_fp8_grad", True)
    error = _raised(_adamw_run, reference_adamw.adamw_step_ref, tensors, "o2_fp8_grad", True)
    assert error is None, f"the reference refused what the kernel steps: {error!r}"
    assert _adamw_same(_adamw_run(reference_adamw.adamw_step_ref, tensors, "o2_fp8_grad", True), got) == []


# ------------------------------------------------------------------------------------------- segmented communication

REF_COMM, TRITON_COMM = segment_kernels(False), segment_kernels(True)


def test_comm_kernels_with_no_segments_do_nothing():
    table = block_table([], [], [], [], device=DEVICE)
    assert len(table) == 0 and table.numel == 0
    for kernels in (REF_COMM, TRITON_COMM):
        amax, q = torch.zeros(2, device=DEVICE), torch.full((5,), 7, dtype=torch.uint8, device=DEVICE)
        n_sat = torch.tensor(3, device=DEVICE)
        kernels.segment_amax(torch.randn(5, device=DEVICE), table, amax)
        kernels.quantize(torch.randn(5, device=DEVICE), table, amax, E4M3, q, n_sat)
        out = torch.full((5,), 0.5, device=DEVICE)
        kernels.dequantize(q, table, amax, E4M3, out)
        assert amax.eq(0).all() and q.eq(7).all() and n_sat.item() == 3 and out.eq(0.5).all()


@pytest.mark.parametrize("dtype", INPUT_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_comm_quantize_and_dequantize_of_ragged_segments_and_special_amaxes_match(fp8_dtype, dtype):
    """Segments of 1, 7, 127, 129 and 1003 elements (a gap of 5 between them in the destination: unaligned tiles),
    holding -0.0, NaN, inf and an fp32 subnormal, with per-segment amaxes that are NaN, 0, -0.0, subnormal, near fp32's
    maximum or the FP8 maximum (scale 1 where not finite or 0), with and without a headroom: the reference's bytes,
    saturated counts and decoded values (into fp32, bf16 and fp16 outputs), bit for bit."""
    lengths = [1, 7, 127, 129, 1003]
    src = [sum(lengths[:i]) for i in range(len(lengths))]
    dst = [s + 5 * i for i, s in enumerate(src)]
    table = block_table(src, dst, lengths, list(range(len(lengths))), device=DEVICE, block=64)
    numel = sum(lengths) + 5 * len(lengths)
    x = _random(sum(lengths), 90) * 10
    x[[0, 3, 10, 200]] = torch.tensor([-0.0, float("nan"), float("inf"), 1e-40])
    x = x.to(dtype).to(DEVICE)
    amaxes = [torch.tensor([float("nan"), 0.0, 1e-40, 3.4e38, float("inf")]),
              torch.tensor([-0.0, 5.0, 2.0, 448.0, 57344.0])]  # fmt: skip
    for amax in amaxes:
        amax = amax.to(DEVICE)
        for headroom in (None, torch.tensor(3, device=DEVICE)):
            outs = []
            for kernels in (REF_COMM, TRITON_COMM):
                q, n_sat = torch.full((numel,), 0xAA, dtype=torch.uint8, device=DEVICE), torch.tensor(2, device=DEVICE)
                kernels.quantize(x, table, amax, fp8_dtype, q, n_sat, margin=1, headroom=headroom)
                decoded = []
                for out_dtype in INPUT_DTYPES:
                    out, counts = torch.full((numel,), 0.5, dtype=out_dtype, device=DEVICE), torch.zeros(2).long()
                    kernels.dequantize(q, table, amax, fp8_dtype, out, margin=1, headroom=headroom, inv_divisor=1 / 3,
                                       counts=counts.to(DEVICE))  # fmt: skip
                    decoded += [out, counts]
                outs.append([q, n_sat, *decoded])
            assert _same(outs[0], outs[1]), (amax.tolist(), headroom)
            assert outs[0][0][0].item() == 0x80  # -0.0 keeps its sign
    amax_ref, amax_got = torch.full((5,), -1.0, device=DEVICE), torch.full((5,), -1.0, device=DEVICE)
    REF_COMM.segment_amax(x, table, amax_ref)
    TRITON_COMM.segment_amax(x, table, amax_got)
    assert _same(amax_ref, amax_got) and amax_got[0].item() == 0.0 and amax_got[1].item() == float("inf")
