"""An infinite ``divisor`` of ``reduce_scatter_fp8`` is refused before any collective, as its check_call docstring says
("a divisor that is no finite number > 0"): the sum divided by inf is zero, so every gradient of the step would be
silently zeroed. A mutation audit of the distributed layer found the upper bound unpinned (a check of ``divisor > 0``
alone passed the suite: 0, negative and NaN divisors are tested, inf was not). Single process: the check runs before
the process group is touched."""

import math

import pytest
import torch

from lightning_fp8.distributed import SegmentLayout, reduce_scatter_fp8


def test_reduce_scatter_refuses_an_infinite_divisor_before_any_collective():
    x = torch.randn(8)
    with pytest.raises(ValueError, match=r"reduce_scatter_fp8\(divisor=inf\): must be finite and > 0"):
        reduce_scatter_fp8(x, SegmentLayout.per_tensor([8]), None, torch.float8_e5m2, divisor=math.inf)
