"""load_fp8_state_dict across a DDP/DataParallel wrapper, where the model has a child of its own named ``module`` (an
EMA wrapper's, such as AveragedModel): only a wrapper's leading ``module.`` is a wrapper's. With strict=False, a dict
none of whose keys names a state of the model warns instead of loading nothing silently."""

import pytest
import torch
from torch import nn

from lightning_fp8 import convert_to_fp8, fp8_state_dict, load_fp8_state_dict


def _with_module_child() -> nn.Module:
    torch.manual_seed(0)
    return convert_to_fp8(nn.ModuleDict({"module": nn.Sequential(nn.Linear(32, 32))}))


def _plain() -> nn.Module:
    torch.manual_seed(0)
    return convert_to_fp8(nn.Sequential(nn.Linear(32, 32)))


def _layer(model: nn.Module) -> nn.Module:
    model = model.module if isinstance(model, nn.DataParallel) else model
    return model["module"][0] if isinstance(model, nn.ModuleDict) else model[0]


def _trained(make) -> nn.Module:
    model = make()
    _layer(model)(torch.randn(4, 32))  # input scale no longer 1 (128)
    return model


def _assert_loaded(model: nn.Module, source: nn.Module) -> None:
    got, want = fp8_state_dict(_layer(model)), fp8_state_dict(_layer(source))
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    assert _layer(model).fp8_scaling["input"].scale != 1


@pytest.mark.parametrize("make", [_with_module_child, _plain], ids=["module_child", "plain"])
def test_saved_from_data_parallel_loads_into_the_model(make):
    source = _trained(make)
    saved = fp8_state_dict(nn.DataParallel(source))
    model = make()
    load_fp8_state_dict(model, saved)
    _assert_loaded(model, source)


@pytest.mark.parametrize("make", [_with_module_child, _plain], ids=["module_child", "plain"])
def test_saved_from_the_model_loads_into_data_parallel(make):
    source = _trained(make)
    model = nn.DataParallel(make())
    load_fp8_state_dict(model, fp8_state_dict(source))
    _assert_loaded(model, source)


@pytest.mark.parametrize("make", [_with_module_child, _plain], ids=["module_child", "plain"])
def test_same_wrapping_loads_as_it_is(make):
    source = _trained(make)
    model = make()
    load_fp8_state_dict(model, fp8_state_dict(source))
    _assert_loaded(model, source)
    wrapped = nn.DataParallel(make())
    load_fp8_state_dict(wrapped, fp8_state_dict(nn.DataParallel(source)))
    _assert_loaded(wrapped, source)


def test_non_strict_load_across_data_parallel_loads_everything():
    source = _trained(_with_module_child)
    model = _with_module_child()
    load_fp8_state_dict(model, fp8_state_dict(nn.DataParallel(source)), strict=False)
    _assert_loaded(model, source)


def test_non_strict_load_that_matches_nothing_warns():
    source = _trained(_with_module_child)
    saved = {f"other.{key}": value for key, value in fp8_state_dict(source).items()}
    model = _with_module_child()
    with pytest.warns(UserWarning, match="nothing was loaded"):
        load_fp8_state_dict(model, saved, strict=False)
    assert _layer(model).fp8_scaling["input"].scale == 1
    with pytest.raises(KeyError):
        load_fp8_state_dict(model, saved)


def test_non_strict_load_into_a_model_not_yet_converted_warns_and_says_to_convert():
    # The likely mistake: loading the FP8 state before convert_to_fp8. The model has no scaling state at all, so
    # nothing can load; that was silent (the warning above needed at least one state of the model's to compare).
    saved = fp8_state_dict(_trained(_plain))
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(32, 32))
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    with pytest.warns(UserWarning, match="this model has no FP8 scaling state") as record:
        load_fp8_state_dict(plain, saved, strict=False)
    assert "Convert the model first" in str(record[0].message)
    assert all(torch.equal(v, before[k]) for k, v in plain.state_dict().items())
    with pytest.raises(KeyError):  # strict: the unexpected keys, as before
        load_fp8_state_dict(plain, saved)
