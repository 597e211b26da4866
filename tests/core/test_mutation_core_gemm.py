"""The emulated scaled GEMM (lightning_fp8/ops.py: scaled_mm) against its docstring, computed here in float64: the
bias is "rounded to out_dtype as autocast does, ... added to the fp32 result before its one rounding to out_dtype".
A mutation audit found the bias's rounding unpinned (an fp32 bias added unrounded to a bf16 GEMM passed the suite:
FP8Linear hands it a bias of the output's dtype already)."""

import pytest
import torch

from lightning_fp8 import ops
from lightning_fp8.formats import E4M3, E5M2


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_an_fp32_bias_is_rounded_to_the_output_dtype_before_it_is_added(out_dtype, monkeypatch):
    monkeypatch.setenv("LIGHTNING_FP8_EMULATE_GEMM", "1")
    torch.manual_seed(0)
    a = torch.randn(8, 16).to(E4M3)
    w = (torch.randn(16, 16) * 4).to(E5M2)  # row-major (N, K): its .t() is the column-major (K, N) operand
    a_scale_inv, b_scale_inv = torch.tensor(2.0**-3), torch.tensor(2.0**2)
    # Biases whose bf16/fp16 rounding moves them by much more than the products' own rounding at the output.
    bias = (torch.randn(16) * 64 + torch.rand(16)).float()
    got = ops.scaled_mm(a, w.t(), a_scale_inv, b_scale_inv, out_dtype, bias=bias)
    # float64: the FP8 values and power-of-two scales are exact, and so is a sum of 16 of their products.
    product = (a.double() * a_scale_inv.double()) @ (w.double().t() * b_scale_inv.double())
    expected = (product + bias.to(out_dtype).double()).float().to(out_dtype)
    unrounded_bias = (product + bias.double()).float().to(out_dtype)
    assert got.dtype == out_dtype
    assert torch.equal(got, expected)
    assert not torch.equal(expected, unrounded_bias)  # the case tells the two apart


def _quantized(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values the first (own-amax) cast of ``t`` stands for, in float64: scale 2**floor(log2(fmax / amax))
    (margin 0), saturating round to nearest by torch's own conversion, times the inverse scale."""
    fmax = torch.finfo(dtype).max
    t64 = t.detach().double()
    k = torch.floor(torch.log2(fmax / t64.abs().max()))
    scale = 2.0**k
    while (t64.abs().max() * scale * 2) <= fmax:  # log2 rounding: the largest power of two that fits
        scale = scale * 2
    while (t64.abs().max() * scale) > fmax:
        scale = scale / 2
    return (t64 * scale).float().to(dtype).double() / scale


def test_weight_gradient_of_a_bf16_input_keeps_the_weights_fp32_precision():
    # An fp32 layer fed bf16 activations (the previous layer's output under autocast): the weight gradient is computed
    # into the weight's dtype, fp32 (the wgrad GEMM's output dtype is the weight's, ``dtypes[1]``), not the input's.
    # Reference: float64 dy_q^T @ x_q of the operands as the first casts quantize them.
    from lightning_fp8 import FP8Linear

    torch.manual_seed(0)
    layer = FP8Linear.from_linear(torch.nn.Linear(16, 32))
    x = torch.randn(48, 16).to(torch.bfloat16)
    g = torch.randn(48, 32)
    y = layer(x)
    (y.float() * g).sum().backward()
    dy = g.to(torch.bfloat16)  # the gradient of bf16 y
    expected = _quantized(dy, E5M2).t() @ _quantized(x, E4M3)
    got = layer.weight.grad
    assert got.dtype == torch.float32
    rel = ((got.double() - expected).abs().max() / expected.abs().max()).item()
    assert rel < 2.0**-16, rel  # fp32 accumulation; a bf16 result is off by up to 2**-9
