"""FP8FSDPStrategy's refusal of FSDP's ``mixed_precision``, pinned where a mutation audit of the integrations found it
unpinned (the refusal removed, the argument was silently ignored: ``mixed_precision_config`` is None, FP8 layers
choose their own precision). The refusal's rule is the class's own: an error naming the argument and saying to drop
it; left out or None, the strategy builds."""

import pytest
import torch
from torch.distributed.fsdp import MixedPrecision

from lightning_fp8.integrations.lightning import FP8FSDPStrategy


def test_fsdp_mixed_precision_is_refused_saying_to_drop_it():
    with pytest.raises(ValueError, match=r"FP8FSDPStrategy\(mixed_precision=\.\.\.\) is not supported.*drop"):
        FP8FSDPStrategy(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    for strategy in (FP8FSDPStrategy(), FP8FSDPStrategy(mixed_precision=None)):
        assert strategy.mixed_precision_config is None
