"""ops.scaled_mm's emulation (a CPU, an older GPU) refuses the operands torch._scaled_mm refuses on the real path:
else a script that runs on a laptop fails first on a GPU with FP8 tensor cores."""

import pytest
import torch

from lightning_fp8 import E4M3, E5M2, ops

ONE = torch.tensor(1.0)


def _fp8(*shape, dtype=E4M3):
    return torch.randn(*shape).to(dtype)


def test_the_documented_layout_multiplies_exactly():
    a, w = _fp8(24, 40), _fp8(32, 40)
    out = ops.scaled_mm(a, w.t(), torch.tensor(0.5), torch.tensor(2.0), torch.float32)
    assert torch.equal(out, ((a.double() * 0.5) @ (w.double() * 2.0).t()).float())
    # Size-1 dimensions have no meaningful stride: one token, one output feature.
    ops.scaled_mm(_fp8(1, 40), w.t(), ONE, ONE, torch.float32)
    ops.scaled_mm(a, _fp8(1, 40).t(), ONE, ONE, torch.float32)


@pytest.mark.parametrize(
    ("a", "b", "match"),
    [
        (_fp8(24, 40), _fp8(40, 32), "column-major b_fp8"),  # b row-major: w_fp8 not transposed
        (_fp8(40, 24).t(), _fp8(32, 40).t(), "row-major a_fp8"),
        (_fp8(2, 24, 40), _fp8(32, 40).t(), "2-D a_fp8"),
        (_fp8(24, 40), _fp8(32, 32).t(), r"\(K, N\), got shapes \(24, 40\) and \(32, 32\)"),
        (_fp8(24, 40, dtype=E5M2), _fp8(32, 40, dtype=E5M2).t(), "two torch.float8_e5m2"),
    ],
)
def test_emulation_refuses_what_the_real_gemm_refuses(a, b, match):
    with pytest.raises(ValueError, match=match):
        ops.scaled_mm(a, b, ONE, ONE, torch.float32)
