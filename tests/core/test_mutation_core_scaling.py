"""ScalingState behaviour that a mutation audit of the core layer found unpinned, against the rules of
lightning_fp8/scaling.py's docstrings and DESIGN.md's scale convention, with the expected values computed here
(float64, the definition of the power-of-two scale): an empty tensor's cast has amax 0, which carries no information
(it enters the history as 0, the scale is kept and the next cast still uses its own amax); ``scale_inv`` is
``1 / scale``, so ``x_fp8 * scale_inv`` gives back ``x``."""

import pytest
import torch

from lightning_fp8.formats import E4M3, E5M2, fp8_max
from lightning_fp8.scaling import ScalingState
from tests.numerics import pow2_scale


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_an_empty_cast_records_amax_zero_and_leaves_the_first_cast_to_the_next_tensor(dtype):
    state = ScalingState(dtype, history_len=4, margin=0, algo="max", delayed=True)
    x_fp8, _, scale_inv = state.quantize(torch.empty(0, 16))
    assert x_fp8.shape == (0, 16) and scale_inv.item() == 1.0
    assert state.amax.item() == 0.0 and state.amax_history.tolist() == [0.0] * 4
    assert state.scale.item() == 1.0 and not state.initialized
    assert state.nonfinite_count.item() == 0 and state.casts.item() == 1
    # The next cast of a real tensor uses its own amax: there is still no history.
    torch.manual_seed(0)
    x = torch.randn(8, 16) * 3.0
    _, _, scale_inv = state.quantize(x)
    assert 1.0 / scale_inv.item() == pow2_scale(x.abs().max().item(), fp8_max(dtype))
    assert state.initialized


def test_scale_inv_is_the_inverse_of_the_scale_and_dequantizes_the_cast():
    torch.manual_seed(1)
    x = torch.randn(16, 32) * 1e-3  # amax ~3e-3: scale 2**17 for E4M3, far from 1
    state = ScalingState(E4M3, history_len=1, margin=0, algo="max", delayed=False)
    x_fp8, _, scale_inv = state.quantize(x)
    expected = pow2_scale(x.abs().max().item(), 448.0)
    assert expected > 2.0**10 and state.scale.item() == expected
    assert state.scale_inv.item() == 1.0 / expected == scale_inv.item()
    back = x_fp8.double() * state.scale_inv.item()
    assert torch.allclose(back, x.double(), rtol=2.0**-3, atol=2.0**-9 / expected)
