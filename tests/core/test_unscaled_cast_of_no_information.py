"""A cast of t * unscale (FP8AdamW's scaled fp16 master in a weight's storage) whose amax carries no information (an
inf or NaN among finite values, all zeros) keeps t's scale, as a cast of t does: the same FP8 bytes, scale_inv and
statistics. Before, the kept scale (t's) was applied to t * unscale itself: with unscale 2**10 a weight holding one
NaN saturated every finite value (saturation 0.5 for [NaN, 0.25]) and dequantized 0.25 as 0.0017."""

import pytest
import torch
from lightning_fp8.kernels import reference

from lightning_fp8 import E4M3, E5M2, ScalingState

BUFFERS = ("scale", "amax_history", "amax", "saturation", "nonfinite_count", "casts")


def _pair(fp8_dtype, margin, delayed):
    return ScalingState(fp8_dtype, 1, margin, "max", delayed), ScalingState(fp8_dtype, 1, margin, "max", delayed)


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("delayed", [False, True])
@pytest.mark.parametrize("unscale", [2.0**10, 2.0**-7])
def test_a_cast_of_t_times_unscale_is_the_cast_of_t(fp8_dtype, delayed, unscale):
    gen = torch.Generator().manual_seed(5)
    plain, scaled = _pair(fp8_dtype, 1, delayed)
    u = torch.tensor(unscale)
    for step, kind in enumerate(["normal", "nan", "normal", "zeros", "inf", "empty", "normal"]):
        t = torch.randn(4, 16, generator=gen) * 2.0 ** (step - 3)
        if kind == "nan":
            t[1, 3] = float("nan")
        elif kind == "inf":
            t[0, 0] = -float("inf")
        elif kind == "zeros":
            t = torch.zeros(4, 16)
        elif kind == "empty":
            t = torch.zeros(0, 16)
        want = plain.quantize(t, transpose=True, current=True)
        got = scaled.quantize(t * u, transpose=True, current=True, unscale=u)
        for name, g, w in zip(("x_fp8", "x_fp8_t"), got[:2], want[:2], strict=True):
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)) or torch.equal(  # NaN: any encoding
                g.float().nan_to_num(7.0), w.float().nan_to_num(7.0)
            ), (step, kind, name, g, w)
        assert torch.equal(got[2], want[2]), (step, kind, got[2], want[2])  # scale_inv
        for name in BUFFERS:
            assert torch.equal(getattr(scaled, name), getattr(plain, name)), (step, kind, name)


def test_a_weight_with_a_nan_keeps_its_finite_values():
    # The minimal case: after a cast with data (scale 256 for t = [1, 0.5]), [NaN, 0.25] stored as t * 2**10.
    state = ScalingState(E4M3, 1, 0, "max", False)
    u = torch.tensor(2.0**10)
    state.quantize(torch.tensor([[1.0, 0.5]]) * u, current=True, unscale=u)
    x_fp8, _, scale_inv = state.quantize(torch.tensor([[float("nan"), 0.25]]) * u, current=True, unscale=u)
    values = reference.dequantize_ref(x_fp8, scale_inv)
    assert torch.isnan(values[0, 0]) and values[0, 1].item() == 0.25
    assert state.saturation.item() == 0.0 and state.scale.item() == 256.0 and state.nonfinite_count.item() == 1


@pytest.mark.parametrize("speculative", [True, False, "eager"])
def test_the_triton_cast_matches_the_reference(monkeypatch, speculative):
    """The fused Triton cast (the interpreter on the CPU), one-pass speculative or not, bit for bit the reference."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pytest.importorskip("triton")
    from lightning_fp8.kernels import quantize

    monkeypatch.setattr(quantize, "SPECULATIVE_CURRENT_SCALING", speculative)
    f32, i64 = {"dtype": torch.float32, "device": device}, {"dtype": torch.int64, "device": device}
    fresh = lambda: [torch.zeros(1, **f32), torch.tensor(4.0, **f32), torch.zeros((), **f32),  # noqa: E731
                     torch.zeros((), **f32), torch.zeros((), **i64), torch.zeros((), **i64)]  # fmt: skip
    got_state, ref_state = fresh(), fresh()
    gen = torch.Generator().manual_seed(2)
    u = torch.tensor(2.0**9, device=device)
    for kind in ["normal", "nan", "zeros", "normal", "inf"]:
        t = torch.randn(5, 33, generator=gen).to(device)
        if kind == "nan":
            t[2, 7] = float("nan")
        elif kind == "inf":
            t[4, 32] = float("inf")
        elif kind == "zeros":
            t.zero_()
        args = (t * u, E4M3, 0, True, False, True, True, u)
        got = quantize.quantize_(args[0], *got_state, *args[1:])
        ref = reference.quantize_ref(args[0], *ref_state, *args[1:])
        assert torch.equal(got[0].float().nan_to_num(7.0), ref[0].float().nan_to_num(7.0)), kind
        assert torch.equal(got[1].float().nan_to_num(7.0), ref[1].float().nan_to_num(7.0)), kind
        assert torch.equal(got[2], ref[2]), kind
        assert all(torch.equal(g, r) for g, r in zip(got_state, ref_state, strict=True)), kind
