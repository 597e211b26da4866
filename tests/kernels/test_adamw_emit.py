"""The AdamW kernel's FP8 weight copy against its reference (bit for bit, TRITON_INTERPRET=1 on CPU), and the copy
against the FP8Linear forward's own weight cast (two passes: bit for bit; one pass: a valid, more cautious copy)."""

import pytest
import torch
from lightning_fp8.kernels import adamw, reference, reference_adamw

from lightning_fp8.formats import E4M3, E5M2
from lightning_fp8.scaling import ScalingState
from tests.kernels.test_adamw import BF16, CASES, F16, F32, HYPER, SHAPES, _assert_same, _bits, _make, _one_thread
from tests.kernels.test_adamw import _run as run_step

__all__ = ["_one_thread"]  # the module-scoped fixture, re-used

EMIT_CASES = ["o2_fp8_grad", "o2_fp16_grad", "o2_master_apart", "fp32", "fp32_master_bf16_param"]


def _run(fn, tensors, case, *, two_pass, fp8_dtype=E4M3, margin=0):
    _, scaled, fp8_grads, copies = CASES[case]

    def fp8_outputs(t):
        for d in t:
            device = d["p"].device  # every byte must be written
            d["fp8"] = torch.full(d["p"].shape, float("nan"), dtype=fp8_dtype, device=device)
            d["record"] = torch.full((5,), -1, dtype=torch.int64, device=device)
        return {"fp8_weights": [d["fp8"] for d in t], "fp8_weight_stats": [d["record"] for d in t]}

    return run_step(fn, tensors, scaled=scaled, fp8_grads=fp8_grads, copies=copies, two_pass=two_pass,
                    prepare=fp8_outputs, fp8_margin=margin)  # fmt: skip


def _forward_cast(d, case, margin=0, fp8_dtype=E4M3):
    """What FP8Linear's forward does with the weight after the step: ScalingState("weight").quantize."""
    _, scaled, _, copies = CASES[case]
    state = ScalingState(fp8_dtype, 1, margin=margin, algo="max", delayed=False)
    src = d["copy"] if copies else d["p"]
    unscale = d["scales"][0] if scaled and not copies else None
    x_fp8, _, scale_inv = reference.quantize_ref(
        src, state.amax_history, state.scale, state.amax, state.saturation, state.nonfinite_count, state.casts,
        fp8_dtype, margin, True, False, True, False, unscale,
    )  # fmt: skip
    return x_fp8, scale_inv, state


@pytest.mark.parametrize("two_pass", [True, False], ids=["two_pass", "one_pass"])
@pytest.mark.parametrize("case", EMIT_CASES)
def test_emitting_kernel_matches_reference_bit_for_bit(case, two_pass):
    dtypes, scaled, fp8_grads, copies = CASES[case]
    if not scaled and not two_pass:
        pytest.skip("one pass bounds need the stored amaxes (the optimizer runs two passes without them)")
    tensors = _make("cpu", SHAPES, dtypes, scaled=scaled, fp8_grads=fp8_grads, copies=copies)
    expected = _run(reference_adamw.adamw_step_ref, tensors, case, two_pass=two_pass)
    _assert_same(expected, _run(adamw.adamw_step, tensors, case, two_pass=two_pass))
    # The states are those of a step without emission.
    plain = [{k: v for k, v in d.items() if k not in ("fp8", "record")} for d in expected]
    from tests.kernels.test_adamw import _run as run_plain

    _assert_same(plain, run_plain(reference_adamw.adamw_step_ref, tensors, scaled=scaled, fp8_grads=fp8_grads,
                                  copies=copies, two_pass=two_pass))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("two_pass", [True, False], ids=["two_pass", "one_pass"])
@pytest.mark.parametrize("case", EMIT_CASES)
def test_emitting_kernel_matches_reference_on_gpu(case, two_pass):
    dtypes, scaled, fp8_grads, copies = CASES[case]
    if not scaled and not two_pass:
        pytest.skip("one pass bounds need the stored amaxes (the optimizer runs two passes without them)")
    tensors = _make("cuda", [*SHAPES, (1000, 333)], dtypes, scaled=scaled, fp8_grads=fp8_grads, copies=copies)
    expected = _run(reference_adamw.adamw_step_ref, tensors, case, two_pass=two_pass)
    _assert_same(expected, _run(adamw.adamw_step, tensors, case, two_pass=two_pass))


@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize("case", EMIT_CASES)
def test_two_pass_copy_is_the_forward_cast_bit_for_bit(case, margin):
    dtypes, scaled, fp8_grads, copies = CASES[case]
    tensors = _make("cpu", SHAPES, dtypes, scaled=scaled, fp8_grads=fp8_grads, copies=copies)
    for d in _run(adamw.adamw_step, tensors, case, two_pass=True, margin=margin):
        x_fp8, scale_inv, state = _forward_cast(d, case, margin)
        assert torch.equal(_bits(d["fp8"]).view(x_fp8.shape), _bits(x_fp8))
        floats, counts = reference_adamw.fp8_weight_record_views(d["record"])
        rec_scale_inv, amax, scale, saturation, history = floats
        # The statistics the forward records are those of the emitted record.
        assert torch.equal(rec_scale_inv, scale_inv) and torch.equal(scale, state.scale)
        assert torch.equal(amax, state.amax) and torch.equal(saturation, state.saturation)
        assert torch.equal(history.reshape(1), state.amax_history)
        assert counts.tolist() == [int(state.nonfinite_count), int(state.casts)] == [0, 1]
        true_w = d["copy"].float() if copies else d["p"].float() * (1 / d["scales"][0] if scaled else 1)
        assert amax == true_w.abs().max()  # the amax of the unscaled weight


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_one_pass_copy_is_valid_and_no_bolder_than_the_forward_cast(fp8_dtype):
    case = "o2_fp8_grad"
    dtypes, scaled, fp8_grads, copies = CASES[case]
    tensors = _make("cpu", SHAPES, dtypes, scaled=scaled, fp8_grads=fp8_grads, copies=copies)
    for d in _run(adamw.adamw_step, tensors, case, two_pass=False, fp8_dtype=fp8_dtype):
        floats, _ = reference_adamw.fp8_weight_record_views(d["record"])
        scale_inv, amax, scale = floats[:3]
        _, _, state = _forward_cast(d, case, fp8_dtype=fp8_dtype)
        # The bound is an upper bound: a scale at most the forward's, the amax exact, nothing saturates.
        assert scale <= state.scale and amax == state.amax
        assert floats[3] == 0 and scale * scale_inv == 1 and torch.frexp(scale).mantissa == 0.5
        w = d["p"].float() / d["scales"][0]
        # A valid copy: dequantized, within FP8 rounding of the weight (half an ulp of the format, relative).
        deq = d["fp8"].float() * scale_inv
        rel = 2.0 ** -(4 if fp8_dtype == E4M3 else 3)
        small = w.abs() < 2.0**-6 / scale  # subnormal range of the copy: absolute error instead
        assert torch.all(((deq - w).abs() <= rel * w.abs()) | small)


def test_non_finite_weight_is_recorded_and_nan_in_the_copy():
    case = "o2_fp16_grad"
    dtypes, scaled, fp8_grads, copies = CASES[case]
    tensors = _make("cpu", SHAPES[:1], dtypes, scaled=scaled, fp8_grads=fp8_grads, copies=copies)
    tensors[0]["g"].view(-1)[5] = float("nan")
    expected = _run(reference_adamw.adamw_step_ref, tensors, case, two_pass=True)
    _assert_same(expected, _run(adamw.adamw_step, tensors, case, two_pass=True))
    floats, counts = reference_adamw.fp8_weight_record_views(expected[0]["record"])
    assert floats[1].isinf() and floats[4] == 0 and counts.tolist() == [1, 1]
    assert expected[0]["fp8"].float().view(-1)[5].isnan()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("two_pass", [True, False], ids=["two_pass", "one_pass"])
@pytest.mark.parametrize("case", ["o2_fp8_grad", "o2_fp16_grad", "o2_master_apart"])
def test_a_copy_without_amax_information_keeps_the_finite_values(case, two_pass, device):
    """A weight holding a NaN (or all zeros) has no amax to scale by: its copy takes scale 1 for the weight, so the
    finite values dequantize to the weight within FP8 rounding. Before, scale 1 applied to the scaled master
    (``weight * 2**k``) saturated them (the copy read +-448 * 2**-k)."""
    dtypes, scaled, fp8_grads, copies = CASES[case]
    tensors = _make(device, SHAPES[:2], dtypes, scaled=scaled, fp8_grads=fp8_grads, copies=copies)
    tensors[0]["g"].view(-1)[5] = float("nan")
    tensors[1]["p"].zero_()
    tensors[1]["g"].zero_()
    expected = _run(reference_adamw.adamw_step_ref, tensors, case, two_pass=two_pass)
    _assert_same(expected, _run(adamw.adamw_step, tensors, case, two_pass=two_pass))
    for d in expected:
        w = d["copy"].double() if copies else d["p"].double() / d["scales"][0].double()
        floats, _ = reference_adamw.fp8_weight_record_views(d["record"])
        deq = d["fp8"].double().view(w.shape) * floats[0].double()
        finite = torch.isfinite(w)
        small = w.abs() < 2.0**-6  # the copy's subnormals (scale 1): an absolute error instead
        close = ((deq - w).abs() <= 2.0**-4 * w.abs()) | (small & ((deq - w).abs() <= 2.0**-10))
        assert torch.all(close[finite]), (deq[finite & ~close], w[finite & ~close])
        assert torch.equal(torch.isnan(deq), ~finite) and floats[3] == 0  # nothing saturated


def test_bad_fp8_weight_lists_raise():
    tensors = _make("cpu", SHAPES[:1], (F16, E4M3, F16, F16), scaled=True, fp8_grads=False, copies=False)
    d = tensors[0]
    base = ([d["p"]], [d["g"]], [d["m"]], [d["v"]], [tuple(d["scales"])], [tuple(d["amaxes"])], None)
    record = torch.zeros(5, dtype=torch.int64)
    bad = {
        "together": {"fp8_weights": [torch.empty(d["p"].shape, dtype=E4M3)]},
        "must be contiguous": {"fp8_weights": [torch.empty(d["p"].shape, dtype=BF16)], "fp8_weight_stats": [record]},
        "int64 tensor of 5": {"fp8_weights": [torch.empty(d["p"].shape, dtype=E4M3)],
                              "fp8_weight_stats": [torch.zeros(5, dtype=F32)]},
        # On another device (a sweep: the kernel wrote them by their addresses, a segmentation fault for these)
        "param, on its device": {"fp8_weights": [torch.empty(d["p"].shape, dtype=E4M3, device="meta")],
                             "fp8_weight_stats": [record]},
        "5 elements on its param's device": {"fp8_weights": [torch.empty(d["p"].shape, dtype=E4M3)],
                                             "fp8_weight_stats": [record.to("meta")]},
        # A negative margin: the kernel refused it, the reference scaled the copy past the FP8 maximum (a sweep)
        "margin must be an int >= 0": {"fp8_weights": [torch.empty(d["p"].shape, dtype=E4M3)],
                                       "fp8_weight_stats": [record], "fp8_margin": -1},
    }  # fmt: skip
    for fn in (reference_adamw.adamw_step_ref, adamw.adamw_step):
        for match, kwargs in bad.items():
            with pytest.raises(ValueError, match=match):
                fn(*base, **HYPER, **kwargs)
