"""FP8FSDPStrategy's checks of FSDPStrategy's arguments apply to them passed by position as by keyword: they are read
by name from FSDPStrategy's own signature."""

import inspect

import pytest
import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy

from lightning_fp8.integrations.lightning import FP8FSDPStrategy


def _positional(**given):
    """FSDPStrategy's arguments up to the last one ``given``, by position: its defaults, with ``given``."""
    params = list(inspect.signature(FSDPStrategy.__init__).parameters.values())[1:]
    last = max(i for i, p in enumerate(params) if p.name in given)
    return [given.get(p.name, p.default) for p in params[: last + 1]]


def test_mixed_precision_by_position_is_refused_as_by_keyword():
    mixed = MixedPrecision(param_dtype=torch.bfloat16)
    with pytest.raises(ValueError) as by_keyword:
        FP8FSDPStrategy(mixed_precision=mixed)
    with pytest.raises(ValueError) as by_position:
        FP8FSDPStrategy(*_positional(mixed_precision=mixed))
    assert str(by_position.value) == str(by_keyword.value)


def test_sharding_strategy_and_device_mesh_by_position_are_checked_as_by_keyword():
    for given in (
        {"sharding_strategy": "HYBRID_SHARD"},
        {"sharding_strategy": None},
        {"device_mesh": (1, 2)},
        {"device_mesh": "2"},
    ):
        with pytest.raises((ValueError, TypeError)) as by_keyword:
            FP8FSDPStrategy(**given)
        with pytest.raises(type(by_keyword.value)) as by_position:
            FP8FSDPStrategy(*_positional(**given))
        assert str(by_position.value) == str(by_keyword.value), given


def test_a_device_mesh_list_by_position_reaches_fsdp_as_the_tuple_it_is_by_keyword():
    by_keyword = FP8FSDPStrategy(device_mesh=[2])
    by_position = FP8FSDPStrategy(*_positional(device_mesh=[2], sharding_strategy=ShardingStrategy.FULL_SHARD))
    assert by_position.kwargs["device_mesh"] == by_keyword.kwargs["device_mesh"] == (2,)
    assert by_position.kwargs["use_orig_params"] is True
