"""compute_scale(prev_scale=...) of a kind that is no scale is refused, not converted into one.

``torch.as_tensor`` took a bool (tensor or NumPy bool) as the scale 1.0 and a complex tensor as its real part, and a
string failed inside torch ("new(): invalid data type 'str'"); a Python bool was already refused.
"""

import numpy as np
import pytest
import torch

from lightning_fp8 import E4M3, compute_scale

NO_INFORMATION = torch.tensor(0.0)  # an amax of 0: the result is prev_scale


@pytest.mark.parametrize("prev_scale", [np.True_, np.False_, True])
def test_a_bool_prev_scale_is_refused_as_a_python_bool_is(prev_scale):
    with pytest.raises(ValueError, match=r"compute_scale\(prev_scale=.*\): must be a positive power of two"):
        compute_scale(NO_INFORMATION, E4M3, prev_scale=prev_scale)


@pytest.mark.parametrize(
    ("prev_scale", "kind"),
    [
        (torch.tensor(True), "torch.bool tensor"),
        (torch.tensor([True, False]), "torch.bool tensor"),
        (torch.tensor(4.0 + 1.0j), "torch.complex64 tensor"),
        ("4.0", "str"),
        (np.array([True, False]), "torch.bool tensor"),
        (object(), "object"),
    ],
)
def test_a_prev_scale_that_is_no_real_tensor_or_number_is_refused(prev_scale, kind):
    with pytest.raises(TypeError, match=rf"compute_scale\(prev_scale=\.\.\.\) takes a real .* got .*{kind}"):
        compute_scale(NO_INFORMATION, E4M3, prev_scale=prev_scale)


def test_real_prev_scales_are_kept_where_amax_carries_no_information():
    # The ones that were taken before still are: numbers that are powers of two, NumPy floats, tensors of any real
    # dtype (an integer one included), 0-dim or of amax's shape.
    amax = torch.tensor([0.0, float("inf"), 448.0 / 2**3])
    for prev, want in (
        (2.0**-3, [2.0**-3, 2.0**-3, 8.0]),
        (np.float32(4.0), [4.0, 4.0, 8.0]),
        (torch.tensor(16, dtype=torch.int64), [16.0, 16.0, 8.0]),
        (torch.tensor([2.0, 4.0, 1.0], dtype=torch.float64), [2.0, 4.0, 8.0]),
        (torch.tensor(2.0, dtype=torch.bfloat16), [2.0, 2.0, 8.0]),
        (np.array(4.0), [4.0, 4.0, 8.0]),
        (np.array([2.0, 4.0, 1.0]), [2.0, 4.0, 8.0]),
        ([2.0, 4.0, 1.0], [2.0, 4.0, 8.0]),
    ):
        got = compute_scale(amax, E4M3, prev_scale=prev)
        assert got.dtype == torch.float32 and got.tolist() == want, (prev, got)
