"""What a scaled FP8 cast does with non-finite values, pinned against the rule as kernels/reference.py and
ScalingState's docstring state it, computed here element by element in float64: a non-finite value becomes NaN
(overflow is never hidden by the saturating clamp) and does not count as saturated; a finite one whose scaled
magnitude reaches the format's maximum is clamped to it and counted. A mutation audit found both unpinned (a cast that
clamped inf to the maximum, or counted inf and NaN as saturated, passed the suite)."""

import math

import pytest
import torch

from lightning_fp8 import ops
from lightning_fp8.formats import E4M3, E5M2, fp8_max
from lightning_fp8.scaling import ScalingState


def _values(fmax: float) -> torch.Tensor:
    """Fresh random values under the maximum, some at and past it (finite), and +-inf and NaN, in a 4 x 8 tensor."""
    torch.manual_seed(0)
    x = (torch.rand(32) * 2 - 1) * fmax / 2
    x[[1, 5, 9]] = torch.tensor([fmax, -fmax * 3, fmax * 1.5])
    x[[2, 12, 20]] = torch.tensor([math.inf, -math.inf, math.nan])
    return x.reshape(4, 8)


def _expected(x: torch.Tensor, scale: float, fmax: float) -> tuple[list[float], int]:
    """Per element, in float64: NaN for a non-finite value, else the scaled value clamped to +-fmax; and how many finite
    values reached fmax."""
    values, saturated = [], 0
    for v in x.reshape(-1).double().tolist():
        if not math.isfinite(v):
            values.append(math.nan)
            continue
        y = v * scale
        saturated += abs(y) >= fmax
        values.append(max(-fmax, min(fmax, y)))
    return values, saturated


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_cast_makes_non_finite_values_nan_and_counts_only_finite_saturation(dtype):
    fmax = fp8_max(dtype)
    x = _values(fmax)
    scale = torch.tensor(1.0)
    x_fp8, x_fp8_t, _, n_saturated = ops.cast_to_fp8(x, scale, dtype, transpose=True)
    values, saturated = _expected(x, 1.0, fmax)
    got = x_fp8.double().reshape(-1).tolist()
    for i, (g, e) in enumerate(zip(got, values, strict=True)):
        if math.isnan(e):
            assert math.isnan(g), (i, x.reshape(-1)[i].item(), g)
        elif abs(e) == fmax:
            assert g == e, (i, g, e)
        else:  # rounded to the nearest FP8 value: within half a step (E5M2: 2 mantissa bits)
            assert abs(g - e) <= abs(e) * 2.0**-2 + 2.0**-16, (i, g, e)
    assert int(n_saturated) == saturated == 3
    assert torch.equal(x_fp8_t.view(torch.uint8), x_fp8.t().contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_scaling_state_saturation_is_the_finite_saturated_fraction(dtype):
    # A current-scaling cast of a tensor holding inf keeps the previous scale (1): the finite values at and past the
    # maximum saturate; inf and NaN become NaN and are left out of the count, but not out of the denominator (numel).
    fmax = fp8_max(dtype)
    x = _values(fmax)
    state = ScalingState(dtype, history_len=1, margin=0, algo="max", delayed=False)
    x_fp8, _, scale_inv = state.quantize(x)
    assert scale_inv.item() == 1.0
    _, saturated = _expected(x, 1.0, fmax)
    assert state.saturation.item() == pytest.approx(saturated / x.numel(), rel=1e-6)
    assert state.nonfinite_count.item() == 1 and state.amax.item() == math.inf
    nan_at = torch.isnan(x_fp8.float()).reshape(-1).nonzero().reshape(-1).tolist()
    assert nan_at == [2, 12, 20]
