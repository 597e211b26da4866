"""``FP8WeightAllGather(fused=...)`` has ``FP8CommState``'s meaning (one setting; it took ``fused`` and ``state``
before): ``None`` picks per gather, ``True`` without Triton is refused when it is built, not inside FSDP's
all-gather, and the kernels' device checks name the all-gather and its weights."""

from __future__ import annotations

import pytest
import torch

from lightning_fp8 import ops
from lightning_fp8.distributed import FP8WeightAllGather
from lightning_fp8.distributed.comm_state_checks import resolve_fused


@pytest.mark.parametrize("fused", ["yes", 1, 0.0])
def test_a_setting_that_is_not_none_or_a_bool_is_refused(fused):
    with pytest.raises(TypeError, match=r"FP8WeightAllGather\(fused=.*pass None, True or False"):
        FP8WeightAllGather(None, {}, fused=fused)


def test_fused_without_triton_is_refused_when_built(monkeypatch):
    monkeypatch.setattr(ops, "triton_available", lambda: False)
    with pytest.raises(ValueError, match=r"FP8WeightAllGather\(fused=True\): the Triton kernels need Triton"):
        FP8WeightAllGather(None, {}, fused=True)
    for fused in (None, False):  # the references: nothing to refuse
        assert FP8WeightAllGather(None, {}, fused=fused).fused is fused
    assert resolve_fused(None, torch.device("cuda")) is False  # no Triton: the references, on a GPU too


def test_fused_on_a_device_the_kernels_do_not_run_on_names_the_weights(monkeypatch):
    from lightning_fp8.distributed import comm_state_checks

    monkeypatch.setattr(ops, "triton_available", lambda: True)
    monkeypatch.setattr(comm_state_checks, "_triton_interpreted", lambda: False)
    with pytest.raises(ValueError, match=r"FP8WeightAllGather\(fused=True\): the weights are on cpu"):
        resolve_fused(True, torch.device("cpu"), "FP8WeightAllGather", "the weights")
    assert resolve_fused(False, torch.device("cpu"), "FP8WeightAllGather", "the weights") is False
