"""The activation arguments of ``ScalingState.quantize`` (lightning_fp8/cast_checks.py: check_activation) where a
mutation audit found their checks unpinned, against the rules the checks' messages state: ``keep_input`` keeps a GELU's
input and takes no ``column_sum``; without an activation no ``activation_input`` / ``activation_scale_inv`` is taken;
only an FP8 ``activation_input`` takes an ``activation_scale_inv``, a one-element float32 tensor. Each refusal names
the argument and comes before the cast records anything (the state's cast count stays 0). And the plain cast
(``ops.cast_to_fp8``, check_cast_arguments) names a scale on another device than ``x``."""

import pytest
import torch

from lightning_fp8.scaling import ScalingState


def _state():
    return ScalingState(torch.float8_e5m2, 4, 0, "max", delayed=True)


def test_keep_input_with_column_sum_is_refused():
    s = ScalingState(torch.float8_e4m3fn, 4, 0, "max", delayed=True)
    with pytest.raises(ValueError, match=r"keep_input=True\) keeps a GELU's input.*column_sum=True"):
        s.quantize(torch.randn(8, 16), activation="gelu", keep_input=True, column_sum=True)
    assert int(s.casts) == 0


@pytest.mark.parametrize("given", ["activation_input", "activation_scale_inv"])
def test_activation_arguments_without_an_activation_are_refused(given):
    s = _state()
    g = torch.randn(8, 16)
    kwargs = {given: g if given == "activation_input" else torch.ones(())}
    with pytest.raises(ValueError, match=r"activation=None\) takes no activation_input or activation_scale_inv"):
        s.quantize(g, **kwargs)
    assert int(s.casts) == 0


def test_a_high_precision_activation_input_takes_no_scale_inv():
    s = _state()
    g = torch.randn(8, 16)
    with pytest.raises(ValueError, match=r"an FP8 activation_input needs its activation_scale_inv \(and only an FP8"):
        s.quantize(
            g, activation="gelu_backward", activation_input=torch.randn(8, 16), activation_scale_inv=torch.ones(())
        )
    assert int(s.casts) == 0


@pytest.mark.parametrize(
    "scale_inv",
    [torch.ones(2), torch.ones((), dtype=torch.float64), None],
    ids=["two_elements", "float64", "missing"],
)
def test_an_fp8_activation_inputs_scale_inv_is_checked(scale_inv):
    s = _state()
    g = torch.randn(8, 16)
    h_fp8 = torch.randn(8, 16).to(torch.float8_e4m3fn)
    match = "activation_scale_inv must be a one-element float32" if scale_inv is not None else "needs its activation_"
    with pytest.raises(ValueError, match=match):
        s.quantize(g, activation="gelu_backward", activation_input=h_fp8, activation_scale_inv=scale_inv)
    assert int(s.casts) == 0


def test_a_scale_on_another_device_than_x_is_refused_by_the_plain_cast():
    # ops.cast_to_fp8 (the reference path on a CPU): a scale left on another device (here the meta device) is named.
    from lightning_fp8 import ops

    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match=r"cast_to_fp8: scale is on meta but x is on cpu; move the scale to x's"):
        ops.cast_to_fp8(x, torch.ones((), device="meta"), torch.float8_e4m3fn)
