"""Dtype routes: parameters, inputs and autocast in float32 / bfloat16 / float16 reach the same FP8 training; float64
is refused with an error that names the call."""

import pytest
import torch

from lightning_fp8 import FP8MLP, FP8Linear

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Relative (Frobenius) error of an FP8 layer against float64 on its own parameters and input: E4M3 on both forward
# operands measured 0.034-0.036 here for every dtype route, E5M2 on the output gradient 0.047-0.062 (dgrad, wgrad).
FORWARD_RTOL, BACKWARD_RTOL = 0.05, 0.08


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("autocast", (None, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("param_dtype", DTYPES)
def test_linear_dtype_route_output_grads_and_values(param_dtype, x_dtype, autocast):
    torch.manual_seed(0)
    layer = FP8Linear(64, 48, dtype=param_dtype)
    x = torch.randn(40, 64).to(x_dtype).requires_grad_()
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        y = layer(x)
    grad_y = torch.randn(y.shape).to(y.dtype)
    y.backward(grad_y)
    assert y.dtype == (autocast or x_dtype) and x.grad.dtype == x_dtype
    assert layer.weight.grad.dtype == layer.weight.dtype == param_dtype
    assert layer.bias.grad.dtype == param_dtype
    w, b, xd, gd = layer.weight.double(), layer.bias.double(), x.detach().double(), grad_y.double()
    assert _rel(y, xd @ w.T + b) < FORWARD_RTOL
    assert _rel(x.grad, gd @ w) < BACKWARD_RTOL
    assert _rel(layer.weight.grad, gd.T @ xd) < BACKWARD_RTOL


def test_fp8_mlp_refuses_float64_naming_itself():
    with pytest.raises(TypeError, match=r"FP8MLP\(dtype=torch.float64\).*float32, bfloat16 or float16"):
        FP8MLP(32, 64, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"FP8MLP\(dtype='float32'\)"):
        FP8MLP(32, 64, dtype="float32")


def test_float64_layer_parameters_and_inputs_are_refused_naming_the_fix():
    with pytest.raises(TypeError, match=r"FP8Linear\(dtype=torch.float64\)"):
        FP8Linear(32, 32, dtype=torch.float64)
    layer = FP8Linear(32, 32)
    with pytest.raises(TypeError, match=r"input of dtype torch.float64.*x.float\(\)"):
        layer(torch.randn(4, 32, dtype=torch.float64))
    layer.double()
    with pytest.raises(TypeError, match=r"weight has dtype torch.float64.*model.float\(\)"):
        layer(torch.randn(4, 32))
