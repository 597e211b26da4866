"""The batched FP8 gradient cast (kernels/grad_cast.py) against its reference and the per-tensor cast, bit for bit
(TRITON_INTERPRET=1 on CPU)."""

import pytest
import torch
from lightning_fp8.kernels import grad_cast, quantize, reference, reference_grad_cast

from lightning_fp8.formats import E4M3, E5M2, FP8_MAX

F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16
# Not powers of two; under the interpreter a chunk is 128 elements: several chunks with a ragged last one, one chunk
# exactly, one and a half, an empty tensor.
SHAPES = [(37, 19), (130,), (0, 4), (5,), (3, 5, 7), (256,), (11, 16)]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _bits(t: torch.Tensor) -> torch.Tensor:
    # Bit patterns: NaN equals NaN of the same payload; -0 differs from +0.
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _assert_same(a, b):
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    elif a is None:
        assert b is None
    else:
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(_bits(a), _bits(b))


def _grads(dtype, fp8_dtype):
    """Fresh random gradients over many binades, with the cases that matter: all zeros (amax 0), inf and NaN, values
    at and above the format maximum (saturation), tiny values (FP8 subnormals)."""
    grads = [torch.randn(shape) * 2.0 ** torch.randint(-12, 12, shape) for shape in SHAPES]
    grads[3].zero_()
    fmax = FP8_MAX[fp8_dtype]
    grads[1][:4] = torch.tensor([float("inf"), -fmax * 1.5, fmax, 3e-6])
    grads[4].view(-1)[7] = float("nan")
    grads[6].view(-1)[:3] = torch.tensor([-float("inf"), fmax * 4, fmax])  # saturates: the scale (8) is kept
    return [g.to(dtype) for g in grads]


def _states(n):
    states = [reference_grad_cast.new_grad_cast_state("cpu") for _ in range(n)]
    for i, s in enumerate(states):  # a few casts into training: a scale to keep (amax 0), history, counters
        buffers = reference_grad_cast.grad_cast_state_buffers(s)
        buffers[1].fill_(2.0 ** (i - 3))
        buffers[0].fill_(0.25 * i)
        buffers[4].fill_(i % 2)
        buffers[5].fill_(10 + i)
    return states


def _both(grads, fp8_dtype, **kwargs):
    """(kernel results, kernel states), (reference results, reference states), from the same initial states."""
    states = _states(len(grads))
    ref_states = [s.clone() for s in states]
    out = grad_cast.grad_cast(grads, states, fp8_dtype, **kwargs)
    ref = reference_grad_cast.grad_cast_ref(grads, ref_states, fp8_dtype, **kwargs)
    return (out, states), (ref, ref_states)


@pytest.mark.parametrize("fp8_dtype", [E5M2, E4M3])
@pytest.mark.parametrize("dtype", [F16, BF16, F32])
def test_kernel_matches_reference(dtype, fp8_dtype):
    grads = _grads(dtype, fp8_dtype)
    (out, states), (ref, ref_states) = _both(grads, fp8_dtype, count_big=True)
    _assert_same(out, ref)
    _assert_same(states, ref_states)
    assert [g.shape for g in out[0]] == [g.shape for g in grads]
    # The cases are there: amax 0 kept the scale, inf and NaN counted, values saturated.
    buffers = [reference_grad_cast.grad_cast_state_buffers(s) for s in states]
    assert buffers[3][1].item() == 2.0**0 and buffers[3][2].item() == 0.0
    assert [b[4].item() for b in buffers] == [i % 2 + (i in (1, 4, 6)) for i in range(len(SHAPES))]
    assert out[3][1].item() >= 3 and buffers[6][3].item() > 0


@pytest.mark.parametrize("fp8_dtype", [E5M2, E4M3])
@pytest.mark.parametrize("dtype", [F16, F32])
def test_accumulation_matches_reference(dtype, fp8_dtype):
    # Onto pending FP8 gradients (those of a first cast): dequantize, add, cast again.
    first = reference_grad_cast.grad_cast_ref(_grads(dtype, fp8_dtype), _states(len(SHAPES)), fp8_dtype)
    pending = {"pending_data": first[0], "pending_scale_inv": list(first[1].unbind())}
    grads = _grads(dtype, fp8_dtype)
    (out, states), (ref, ref_states) = _both(grads, fp8_dtype, count_big=False, **pending)
    _assert_same(out, ref)
    _assert_same(states, ref_states)
    assert out[3] is None


@pytest.mark.parametrize("fp8_dtype", [E5M2, E4M3])
def test_kernel_matches_the_per_tensor_cast(fp8_dtype):
    # The batched cast is the per-tensor Triton cast (what a gradient hook ran on a GPU), state and all.
    grads = _grads(F16, fp8_dtype)
    states = _states(len(grads))
    singles = [s.clone() for s in states]
    data, scale_inv, amax, _ = grad_cast.grad_cast(grads, states, fp8_dtype)
    for i, (g, s) in enumerate(zip(grads, singles, strict=True)):
        buffers = reference_grad_cast.grad_cast_state_buffers(s)
        g_fp8, _, s_inv = quantize.quantize_(g, *buffers, fp8_dtype, 0, True, False, True, False)
        _assert_same([data[i], scale_inv[i], amax[i]], [g_fp8, s_inv.reshape(()), buffers[2]])
    _assert_same(states, singles)


def test_unaligned_gradients():
    # Gradients at addresses that are not multiples of 16 bytes (views into one buffer) take the unhinted path.
    flat = torch.randn(1000, dtype=F16)
    grads = [flat[3:40], flat[41:141].view(10, 10), flat[150:407]]
    (out, states), (ref, ref_states) = _both(grads, E5M2, count_big=True)
    _assert_same(out, ref)
    _assert_same(states, ref_states)
    odd_fp8 = ref[0][0].view(torch.uint8)[1:].view(E5M2)  # 36 values at an odd address
    pending = {"pending_data": [odd_fp8], "pending_scale_inv": [ref[1][0]]}
    (out, states), (ref, ref_states) = _both([flat[1:37]], E5M2, **pending)
    _assert_same(out, ref)
    _assert_same(states, ref_states)


def test_state_layout_is_the_cast_state():
    # The packed state starts as FP8AdamW's separate buffers did: history [0], scale 1, amax 0, saturation 0, counters.
    buffers = reference_grad_cast.grad_cast_state_buffers(reference_grad_cast.new_grad_cast_state("cpu"))
    expected = [torch.zeros(1), torch.ones(()), torch.zeros(()), torch.zeros(()), torch.zeros((), dtype=torch.int64),
                torch.zeros((), dtype=torch.int64)]  # fmt: skip
    _assert_same(buffers, expected)
    x = torch.randn(40, dtype=F16)
    state = reference_grad_cast.new_grad_cast_state("cpu")
    separate = [t.clone() for t in expected]
    reference.quantize_ref(x, *reference_grad_cast.grad_cast_state_buffers(state), E5M2, 0, True, False, True, False)
    reference.quantize_ref(x, *separate, E5M2, 0, True, False, True, False)
    _assert_same(reference_grad_cast.grad_cast_state_buffers(state), separate)


def test_bad_input():
    grads = [torch.randn(8, dtype=F16), torch.randn(8, dtype=F32)]
    states = _states(2)
    assert grad_cast.grad_cast([], [], E5M2, count_big=True)[0] == []
    with pytest.raises(TypeError, match="share one dtype"):
        grad_cast.grad_cast(grads, states, E5M2)
    with pytest.raises(TypeError, match="contiguous"):
        grad_cast.grad_cast([torch.randn(4, 4, dtype=F16).t()], states[:1], E5M2)
    with pytest.raises(TypeError, match="fp8_dtype"):
        grad_cast.grad_cast(grads[:1], states[:1], torch.float16)
    with pytest.raises(ValueError, match="both or neither"):
        grad_cast.grad_cast(grads[:1], states[:1], E5M2, pending_data=[torch.zeros(8, dtype=E5M2)])
    with pytest.raises(ValueError, match="one state per gradient"):
        grad_cast.grad_cast(grads[:1], states, E5M2)


@pytest.mark.parametrize(
    "state", [torch.zeros(3, dtype=torch.int64), torch.zeros(4), torch.zeros(8, dtype=torch.int64)], ids=str
)
def test_a_state_of_another_size_or_dtype_is_refused(state):
    """The kernel reads and writes the packed state by its address: a 3-element one had its count written past its
    end (heap corruption), an fp32 one was read as the packed fields."""
    buffer = torch.full((8,), -1, dtype=torch.int64)
    state = buffer[:3] if state.numel() == 3 else state
    with pytest.raises(TypeError, match="4 elements"):
        grad_cast.grad_cast([torch.randn(4)], [state], E5M2)
    assert buffer[3:].eq(-1).all()


def test_pending_gradients_of_another_size_or_count_are_refused():
    grads, states = [torch.randn(4)], _states(1)
    scale_inv = [torch.tensor(1.0)]
    with pytest.raises(ValueError, match="number of elements"):  # was read past its end
        grad_cast.grad_cast(grads, states, E5M2, pending_data=[torch.zeros(2, dtype=E5M2)], pending_scale_inv=scale_inv)
    with pytest.raises(ValueError, match="one of each per gradient"):
        grad_cast.grad_cast(grads, states, E5M2, pending_data=[torch.zeros(4, dtype=E5M2)], pending_scale_inv=[])


_BAD_GRAD_CASTS = {
    # name: (grads, states, fp8_dtype, keywords) -> error, match
    "mixed_dtypes": ((lambda: ([torch.randn(8, dtype=F16), torch.randn(8)], _states(2), E5M2, {})), TypeError,
                     "share one dtype"),
    "float64": ((lambda: ([torch.randn(8, dtype=torch.float64)], _states(1), E5M2, {})), TypeError, "share one dtype"),
    "not_fp8": ((lambda: ([torch.randn(8)], _states(1), torch.float16, {})), TypeError, "fp8_dtype"),
    "state_count": ((lambda: ([torch.randn(8)], _states(2), E5M2, {})), ValueError, "one state per gradient"),
    "state_size": ((lambda: ([torch.randn(8)], [torch.zeros(3, dtype=torch.int64)], E5M2, {})), TypeError,
                   "4 elements"),
    "pending_alone": ((lambda: ([torch.randn(8)], _states(1), E5M2, {"pending_data": [torch.zeros(8, dtype=E5M2)]})),
                      ValueError, "both or neither"),
    "pending_size": ((lambda: ([torch.randn(8)], _states(1), E5M2, {"pending_data": [torch.zeros(2, dtype=E5M2)],
                                                                   "pending_scale_inv": [torch.tensor(1.0)]})),
                     ValueError, "number of elements"),
    # The kernel read these by address as fp32: wrong gradients, silently.
    "pending_scale_inv_float64": ((lambda: ([torch.randn(8)], _states(1), E5M2, {
        "pending_data": [torch.zeros(8, dtype=E5M2)], "pending_scale_inv": [torch.tensor(0.5, dtype=torch.float64)]})),
        TypeError, "pending_scale_inv must be a one-element float32"),
    "pending_scale_inv_float16": ((lambda: ([torch.randn(8)], _states(1), E5M2, {
        "pending_data": [torch.zeros(8, dtype=E5M2)], "pending_scale_inv": [torch.tensor(0.5, dtype=F16)]})),
        TypeError, "pending_scale_inv must be a one-element float32"),
    "state_on_meta": ((lambda: ([torch.randn(8)], [_states(1)[0].to("meta")], E5M2, {})), ValueError,
                      "must all be on cpu"),
    # Two programs updating one state's counters race on a GPU; the reference counted both.
    "state_twice": ((lambda: ([torch.randn(8), torch.randn(8)], _states(1) * 2, E5M2, {})), ValueError,
                    "states overlap"),
    "states_overlapping": ((lambda: ([torch.randn(8), torch.randn(8)], _overlapping_states(), E5M2, {})), ValueError,
                           "states overlap"),
}  # fmt: skip


def _overlapping_states() -> list[torch.Tensor]:
    buffer = torch.zeros(6, dtype=torch.int64)
    return [buffer[0:4], buffer[2:6]]


def test_states_that_are_adjacent_views_of_one_buffer_are_taken():
    """The overlap check refuses shared counters only: states packed back to back in one buffer cast as separate
    states do."""
    grads = [torch.randn(8) * 3, torch.randn(5)]
    buffer = torch.cat(_states(2))
    got = grad_cast.grad_cast(grads, list(buffer.split(4)), E5M2)
    separate = _states(2)
    want = reference_grad_cast.grad_cast_ref(grads, separate, E5M2)
    _assert_same(got, want)
    _assert_same(list(buffer.split(4)), separate)


@pytest.mark.parametrize("kernels", ["reference", "triton"])
@pytest.mark.parametrize("case", list(_BAD_GRAD_CASTS))
def test_the_dispatch_refuses_on_both_paths_what_the_kernel_refuses(case, kernels, monkeypatch):
    """ops.grad_cast: found by a sweep, the reference path (every CPU run) checked nothing: mixed or float64 gradients
    were cast, and the rest failed with a KeyError, an IndexError, a TypeError about None or a zip() error. The Triton
    path read a float64 or float16 pending_scale_inv as fp32 bits."""
    from lightning_fp8 import ops

    monkeypatch.setenv("LIGHTNING_FP8_KERNELS", kernels)
    make, error, match = _BAD_GRAD_CASTS[case]
    grads, states, fp8_dtype, keywords = make()
    with pytest.raises(error, match=match):
        ops.grad_cast(grads, states, fp8_dtype, **keywords)


def test_a_pending_gradient_of_another_shape_is_read_by_its_elements_on_both_paths():
    """The kernel reads a pending gradient by its elements (it checks their number); the reference broadcast its shape
    against the gradient's (found by a sweep: a (2, 4) one for an (8,) gradient raised, a (1, 8) one gave (1, 8))."""
    grads = [torch.randn(8)]
    for shape in [(2, 4), (1, 8)]:
        pending = [(torch.randn(8) * 100).to(E5M2).reshape(shape)]
        scale_inv = [torch.tensor(0.25)]
        want = grad_cast.grad_cast(grads, _states(1), E5M2, pending_data=pending, pending_scale_inv=scale_inv)
        got = reference_grad_cast.grad_cast_ref(
            grads, _states(1), E5M2, pending_data=pending, pending_scale_inv=scale_inv
        )
        _assert_same(got, want)
        assert got[0][0].shape == want[0][0].shape == (8,)
