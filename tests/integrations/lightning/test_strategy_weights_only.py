"""FP8FSDPStrategy.load_checkpoint loads with torch.load(weights_only=True) unless the caller passes False: Lightning
passes weights_only=None by default, which must not mean an unrestricted unpickling."""

import pickle

import pytest
import torch

from lightning_fp8 import FP8FSDPStrategy
from lightning_fp8.integrations.lightning import strategy as strategy_module


class NotAllowlisted:
    """A class torch.load(weights_only=True) refuses to build."""


class _Stop(Exception):
    pass


def _strategy(monkeypatch) -> FP8FSDPStrategy:
    strategy = FP8FSDPStrategy()
    monkeypatch.setattr(strategy, "broadcast", lambda obj, src=0: obj)  # one process, no process group
    return strategy


@pytest.mark.parametrize(("given", "expected"), [(None, True), (True, True), (False, False)])
def test_load_checkpoint_passes_weights_only_true_unless_false_is_given(tmp_path, monkeypatch, given, expected):
    path = tmp_path / "model.ckpt"
    torch.save({"state_dict": {}}, path)
    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs.get("weights_only"))
        raise _Stop

    strategy = _strategy(monkeypatch)
    monkeypatch.setattr(strategy_module.torch, "load", spy)
    with pytest.raises(_Stop):
        strategy.load_checkpoint(path, weights_only=given)
    assert seen == [expected]


def test_a_checkpoint_with_an_arbitrary_object_is_refused_by_default(tmp_path, monkeypatch):
    path = tmp_path / "model.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"thing": NotAllowlisted()}}, path)
    with pytest.raises(pickle.UnpicklingError, match="[Ww]eights only load failed"):
        _strategy(monkeypatch).load_checkpoint(path)


@pytest.mark.parametrize("keep", [0, 10, 0.5, "text"])
def test_a_truncated_checkpoint_is_refused_with_its_path(tmp_path, monkeypatch, keep):
    path = tmp_path / "model.ckpt"
    torch.save({"state_dict": {"w": torch.randn(256)}}, path)
    data = path.read_bytes()
    if keep == "text":
        data = b"hello world\n"
    else:
        data = data[: int(keep * len(data)) if isinstance(keep, float) else keep]
    path.write_bytes(data)
    with pytest.raises(ValueError, match=r"model\.ckpt' cannot be read .*truncated or corrupt.*Nothing was loaded"):
        _strategy(monkeypatch).load_checkpoint(path)
