"""The FP8 byte transpose (kernels/transpose.py) against torch's, under TRITON_INTERPRET=1 on CPU."""

import pytest
import torch
from lightning_fp8.kernels.transpose import transpose_2d


@pytest.mark.parametrize(("m", "n"), [(48, 80), (130, 70), (64, 64), (1, 17), (0, 5)])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_transpose_equals_torch_byte_for_byte(m, n, dtype):
    x = (torch.randn(m, n, generator=torch.Generator().manual_seed(m * 1000 + n)) * 30).to(dtype)
    y = transpose_2d(x)
    assert y.shape == (n, m) and y.dtype == dtype and y.is_contiguous()
    assert torch.equal(y.view(torch.uint8), x.view(torch.uint8).t().contiguous())


def test_transpose_rejects_what_it_cannot_do():
    with pytest.raises(ValueError, match=r"1-byte dtype, got shape \(4, 4\), dtype torch.bfloat16"):
        transpose_2d(torch.zeros(4, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"contiguous=False"):
        transpose_2d(torch.zeros(4, 6, dtype=torch.uint8).t())


@pytest.mark.gpu
def test_transpose_of_a_weight_wider_than_cudas_second_grid_axis():
    """More than 65535 column tiles (4.19M input features): a launch over a second grid axis would fail there."""
    x = torch.randint(0, 256, (3, 65536 * 64 + 77), dtype=torch.uint8, device="cuda")
    assert torch.equal(transpose_2d(x.view(torch.float8_e4m3fn)).view(torch.uint8), x.t().contiguous())
