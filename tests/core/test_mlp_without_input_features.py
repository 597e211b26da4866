"""FP8MLP with ``in_features=0``: its output is ``proj(gelu(fc.bias))`` on every token, so proj's input is not empty
where ``x`` is. Its first casts follow FP8Linear's rule as for any other input (the reference: the same two layers
run one after the other, ``proj(F.gelu(fc(x)))``): proj's input state is initialized by its first informative cast
and casts with its delayed scale afterwards. It stayed uninitialized (every cast took its own amax, never
saturating where the delayed scale did), since the forward took fc's empty input as proj's."""

import copy

import pytest
import torch
import torch.nn.functional as F

from lightning_fp8 import FP8MLP
from lightning_fp8.scaling import ROLES

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny tensor ops on one thread


def _states(layer) -> dict:
    return {
        (role, name): getattr(layer.fp8_scaling[role], name).clone()
        for role in ROLES
        for name in ("scale", "amax_history", "saturation")
    } | {(role, "initialized"): layer.fp8_scaling[role].initialized for role in ROLES}


def test_proj_input_state_follows_the_unfused_layers():
    torch.manual_seed(0)
    mlp = FP8MLP(0, 64, 32)
    with torch.no_grad():
        mlp.fc.bias.normal_()
    ref = copy.deepcopy(mlp)
    w = torch.linspace(-1, 1, 32)
    # The bias grows 8x, then shrinks: with its delayed scale, proj's input saturates at the second step.
    for magnitude in (1.0, 8.0, 0.125):
        with torch.no_grad():
            mlp.fc.bias.mul_(magnitude)
            ref.fc.bias.mul_(magnitude)
        x = torch.randn(2, 3, 0, requires_grad=True)
        y = mlp(x)
        (y * w).sum().backward()
        y_ref = ref.proj(F.gelu(ref.fc(x)))
        (y_ref * w).sum().backward()
        assert torch.equal(y, y_ref)
        for layer, layer_ref in ((mlp.fc, ref.fc), (mlp.proj, ref.proj)):
            got, expected = _states(layer), _states(layer_ref)
            for key, value in expected.items():
                if isinstance(value, bool):
                    assert got[key] == value, key
                elif key[0] == "grad_output":  # the fused GELU derivative rounds apart from torch's in fp32's last bits
                    torch.testing.assert_close(got[key], value, rtol=1e-5, atol=0.0, msg=str(key))
                else:
                    assert torch.equal(got[key], value), key
            for name in ("weight", "bias"):
                grad, grad_ref = getattr(layer, name).grad, getattr(layer_ref, name).grad
                torch.testing.assert_close(grad, grad_ref, rtol=1e-4, atol=1e-7, msg=name)  # the GELU derivative
    assert mlp.proj.fp8_scaling["input"].initialized
    assert mlp.proj.fp8_scaling["input"].saturation.item() == ref.proj.fp8_scaling["input"].saturation.item()
