"""FP8LMPrecision's checkpoint state: found under either flavour's name, and checked whole before any part loads."""

import copy

import pytest
import torch
from torch import nn

from lightning_fp8.integrations.lightning.precision import FP8LMPrecision, precision_class
from lightning_fp8.recovery import fallen_back_layers, put_back_to_high_precision
from lightning_fp8.state import fp8_state_dict


def _plugin(cls: type = FP8LMPrecision, seed: int = 0) -> tuple:
    """A plugin whose model (converted, one backward run: non-trivial scaling state) is ``nn.Sequential``."""
    torch.manual_seed(seed)
    module = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 48))
    plugin = cls()
    plugin.convert_module(module)
    module(torch.randn(8, 32)).square().mean().backward()
    return plugin, module


def _saved_state() -> dict:
    saver, module = _plugin(seed=1)
    saver.grad_scaler.load_state_dict({**saver.grad_scaler.state_dict(), "scale": 2.0**10, "skipped_steps": 7})
    put_back_to_high_precision(module, ["2"])
    return copy.deepcopy(saver.state_dict())


def _snapshot(plugin: FP8LMPrecision, module: nn.Module) -> tuple:
    return plugin.grad_scaler.state_dict(), fallen_back_layers(module), fp8_state_dict(module)


@pytest.mark.parametrize(("saved_by", "loaded_by"), [("lightning", "pytorch_lightning"),
                                                     ("pytorch_lightning", "lightning")])  # fmt: skip
def test_a_checkpoint_of_the_other_flavour_is_loaded(saved_by, loaded_by):
    # Lightning files the plugin's state under the class's __qualname__ and loads only its own: on_load_checkpoint
    # (called just before, as Lightning's checkpoint connector does) must find and load the other flavour's.
    state = _saved_state()
    checkpoint = {precision_class(saved_by).__qualname__: state, "state_dict": {}}
    plugin, module = _plugin(precision_class(loaded_by))
    assert precision_class(loaded_by).__qualname__ not in checkpoint
    plugin.on_load_checkpoint(checkpoint)
    assert plugin.grad_scaler.get_scale() == 2.0**10 and plugin.grad_scaler.skipped_steps == 7
    assert fallen_back_layers(module) == ["2"]
    loaded = fp8_state_dict(module)
    assert loaded.keys() == state["fp8"].keys()
    assert all(torch.equal(value, state["fp8"][key]) for key, value in loaded.items())


def _bad_scale(state: dict) -> None:
    state["fp8"]["0.fp8_scaling.input.scale"] = torch.tensor(3.0)  # not a power of two


def _bad_scaler(state: dict) -> None:
    state["grad_scaler"]["steps"] = -1


@pytest.mark.parametrize("corrupt", [_bad_scale, _bad_scaler])
@pytest.mark.parametrize("hook", ["load_state_dict", "on_load_checkpoint"])
def test_a_bad_part_of_the_state_changes_nothing(corrupt, hook):
    # mu was loaded, and the fallen-back layers put back, before the FP8 scaling state was checked.
    state = _saved_state()
    corrupt(state)
    plugin, module = _plugin()
    before = _snapshot(plugin, module)
    with pytest.raises(ValueError, match="must be a power of two|expected an int >= 0"):
        if hook == "load_state_dict":
            plugin.load_state_dict(state)
        else:
            plugin.on_load_checkpoint({"FP8LMPrecision": state, "state_dict": {}})
    after = _snapshot(plugin, module)
    assert before[:2] == after[:2]
    assert all(torch.equal(value, after[2][key]) for key, value in before[2].items())


@pytest.mark.parametrize("missing", ["recipe", "grad_scaler"])
def test_a_state_without_a_required_entry_says_so(missing):
    state = {key: value for key, value in _saved_state().items() if key != missing}
    plugin, _ = _plugin()
    with pytest.raises(KeyError, match=rf"precision-plugin state lacks \['{missing}'\].*precision='fp8-lm' run"):
        plugin.load_state_dict(state)
