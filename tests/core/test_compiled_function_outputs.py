"""Compiled FP8 layers' autograd Functions return a tensor that no other op of their traced forward returned.

torch 2.11's dynamo returns every intermediate of an autograd Function's traced forward as an extra output of the
Function (torch 2.13 does not). When the real output is also one of them (an op that returns its input unchanged,
``y.to(y.dtype)``, ends the forward), autograd gives that tensor the extra output's place, and the layer's backward
receives a zero output gradient: zero input and weight gradients, silently (compiled fp32 training on the CPU at every
step; on the GPU whenever the token count was a multiple of 16). This checks the cause on any torch version: it runs
the compiled layers with dynamo's eager backend, whose autograd Functions run their traced forward in an
``torch.fx.Interpreter``, and counts the forward's nodes whose value is the output tensor itself.
"""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_fp8 import FP8MLP, FP8Linear
from tests.fx_outputs import forward_outputs


@pytest.fixture
def forward_bodies():
    with forward_outputs() as runs:
        yield runs


def _fp32_linear(bias):
    return FP8Linear(32, 48, bias=bias)


def _fp32_mlp(bias):
    return FP8MLP(32, 64, bias=bias)


@pytest.mark.parametrize("make", [_fp32_linear, _fp32_mlp], ids=["linear", "mlp"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_compiled_layer_output_is_no_other_traced_value(forward_bodies, make, bias, autocast, device):
    """16 tokens: on the GPU no padding to the FP8 GEMM's multiple of 16, whose slice made a new tensor."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = make(bias).to(device)
    eager = copy.deepcopy(layer)
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    x = torch.randn(16, 32, device=device)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        ya, yb = compiled(xa), eager(xb)
    assert forward_bodies, "the compiled layer ran no autograd Function forward through the FX interpreter"
    for y, count in forward_bodies:
        assert count == 1, f"the traced forward's output {tuple(y.shape)} is the value of {count} of its nodes"
    # what goes wrong on torch 2.11 when it is not: the gradients (equal to eager's: the same casts and GEMMs)
    ya.float().square().mean().backward()
    yb.float().square().mean().backward()
    assert xa.grad.abs().max() > 0
    assert torch.equal(xa.grad, xb.grad)
    for (name, p), q in zip(layer.named_parameters(), eager.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
