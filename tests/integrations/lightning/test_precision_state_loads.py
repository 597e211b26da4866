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
    assert_refused_unchanged(state, hook, ValueError, "must be a power of two|expected an int >= 0")


def assert_refused_unchanged(state: dict, hook: str, error: type[Exception], match: str) -> None:
    """Loading ``state`` through ``hook`` raises ``error`` matching ``match``, and the plugin and module keep mu, the
    fallen-back layers and the FP8 state they had."""
    plugin, module = _plugin()
    before = _snapshot(plugin, module)
    with pytest.raises(error, match=match):
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


class _Net(nn.Module):
    """Children whose names end in, and differ only by, a wrapper's name fragment (torch.compile's ``_orig_mod``)."""

    def __init__(self) -> None:
        super().__init__()
        self.net_orig_mod = nn.Sequential(nn.Linear(32, 64))
        self.net0 = nn.Linear(64, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net0(self.net_orig_mod(x))


def test_a_layer_name_holding_a_wrapper_fragment_is_kept_whole():
    # '_orig_mod.' was stripped from anywhere in a name: 'net_orig_mod.0' became 'net0', the other layer's name, so
    # one layer's scaling state overwrote the other's in the checkpoint and the resume failed.
    def plugin(seed: int) -> tuple:
        torch.manual_seed(seed)
        module = _Net()
        plugin = FP8LMPrecision()
        plugin.convert_module(module)
        module(torch.randn(8, 32) * (seed + 1)).square().mean().backward()
        return plugin, module

    saver, saved_module = plugin(0)
    put_back_to_high_precision(saved_module, ["net_orig_mod.0"])
    state = copy.deepcopy(saver.state_dict())
    assert state["fp8"].keys() == fp8_state_dict(saved_module).keys()
    assert state["fallen_back_layers"] == ["net_orig_mod.0"]
    weights = copy.deepcopy(saved_module.state_dict())

    loader, module = plugin(1)
    loader.on_load_checkpoint({"FP8LMPrecision": state, "state_dict": weights})
    loader.load_state_dict(state)
    assert fallen_back_layers(module) == ["net_orig_mod.0"]
    assert torch.equal(module.net_orig_mod[0].weight, weights["net_orig_mod.0.weight"])
    loaded = fp8_state_dict(module)
    assert loaded.keys() == state["fp8"].keys()
    assert all(torch.equal(value, state["fp8"][key]) for key, value in loaded.items())


def test_a_state_saved_under_wrapper_names_loads_by_whole_components():
    # Older checkpoints hold the names under the wrapping that saved them: '_orig_mod' components are dropped.
    state = _saved_state()
    state["fp8"] = {f"_orig_mod.{key}": value for key, value in state["fp8"].items()}
    state["fallen_back_layers"] = ["_orig_mod.2"]
    plugin, module = _plugin()
    plugin.load_state_dict(state)
    assert fallen_back_layers(module) == ["2"]


def _connected_plugin() -> tuple:
    """A plugin with its model and its FP8AdamW (O2: the FP8 weights' storage holds the optimizer's masters)."""
    plugin, module = _plugin()
    _, [optimizer], _ = plugin.connect(module, [torch.optim.AdamW(module.parameters())], [])
    return plugin, module, optimizer


def _model_snapshot(plugin: FP8LMPrecision, module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple:
    layers = [type(m).__name__ for m in module.modules()]
    params = {name: (p, p.detach().clone()) for name, p in module.named_parameters()}
    groups = [[id(p) for p in group["params"]] for group in optimizer.param_groups]
    return layers, params, groups, _snapshot(plugin, module)


def _assert_unchanged(before: tuple, after: tuple) -> None:
    assert before[0] == after[0]  # layer types: none put back
    assert before[1].keys() == after[1].keys()
    for name, (param, value) in before[1].items():
        assert after[1][name][0] is param and after[1][name][1].dtype == value.dtype
        assert torch.equal(after[1][name][1], value), name
    assert before[2] == after[2]  # the optimizer still holds the same parameters (none released)
    assert before[3][:2] == after[3][:2]
    assert all(torch.equal(value, after[3][2][key]) for key, value in before[3][2].items())


def _set(key: str, value: object):
    def corrupt(state: dict) -> None:
        state[key] = value

    return corrupt


@pytest.mark.parametrize(
    ("corrupt", "error", "match"),
    [
        (_set("fallen_back_layers", None), TypeError, "'fallen_back_layers' is None, not a list of layer names"),
        (_set("fallen_back_layers", 5), TypeError, "'fallen_back_layers' is 5, not a list"),
        (_set("fallen_back_layers", "2"), TypeError, "'fallen_back_layers' is '2', not a list"),  # not '2' as chars
        (_set("fallen_back_layers", [2]), TypeError, r"'fallen_back_layers' is \[2\], not a list of layer names"),
        (_set("fallen_back_layers", ["7"]), ValueError, r"names layers \['7'\] .* has no FP8 layer of that name"),
        (_set("fallen_back_layers", ["1"]), ValueError, r"names layers \['1'\]"),  # the GELU
        (_set("fallen_back_layers", [""]), ValueError, r"names layers \[''\]"),  # the model itself
        (_set("fp8_per_rank", "x"), TypeError, "'fp8_per_rank' is 'x', not a list of one FP8 scaling state"),
        (_set("fp8_per_rank", [None]), TypeError, r"'fp8_per_rank' is \[None\]"),
        (_set("fp8_per_rank", []), TypeError, r"'fp8_per_rank' is \[\]"),
    ],
)
@pytest.mark.parametrize("hook", ["load_state_dict", "on_load_checkpoint"])
def test_a_corrupt_layer_list_or_per_rank_state_is_refused_before_anything_changes(corrupt, error, match, hook):
    state = _saved_state()
    corrupt(state)
    plugin, module, optimizer = _connected_plugin()
    before = _model_snapshot(plugin, module, optimizer)
    with pytest.raises(error, match=match):
        if hook == "load_state_dict":
            plugin.load_state_dict(state)
        else:
            plugin.on_load_checkpoint({"FP8LMPrecision": state, "state_dict": {}})
    _assert_unchanged(before, _model_snapshot(plugin, module, optimizer))


@pytest.mark.parametrize("value", [torch.zeros(3, 3), [1.0]], ids=["wrong-shape", "not-a-tensor"])
def test_a_bad_weight_of_a_fallen_back_layer_is_refused_before_the_layer_is_put_back(value):
    # The layer was put back to nn.Linear (and its weight released from FP8AdamW) before the copy of its weight failed.
    state = _saved_state()
    plugin, module, optimizer = _connected_plugin()
    weights = {**copy.deepcopy(module.state_dict()), "2.weight": value}
    before = _model_snapshot(plugin, module, optimizer)
    with pytest.raises(ValueError, match=r"checkpoint's '2.weight' is .* has a \(48, 64\) weight"):
        plugin.on_load_checkpoint({"FP8LMPrecision": state, "state_dict": weights})
    _assert_unchanged(before, _model_snapshot(plugin, module, optimizer))


def test_a_fallen_back_layer_gets_the_checkpoints_weight_with_an_optimizer():
    saver, saved_module = _plugin(seed=1)
    put_back_to_high_precision(saved_module, ["2"])
    state, weights = copy.deepcopy(saver.state_dict()), copy.deepcopy(saved_module.state_dict())
    plugin, module, optimizer = _connected_plugin()
    plugin.on_load_checkpoint({"FP8LMPrecision": state, "state_dict": weights})
    assert fallen_back_layers(module) == ["2"] and type(module[2]) is nn.Linear
    assert torch.equal(module[2].weight, weights["2.weight"]) and torch.equal(module[2].bias, weights["2.bias"])
    assert module[2].weight in {p for group in optimizer.param_groups for p in group["params"]}


def _with_comm_state(plugin: FP8LMPrecision, overflows: int) -> FP8LMPrecision:
    """Give ``plugin`` the FP8CommState that connect() installs under DDP, after ``overflows`` native FP8 sums that
    overflowed (each adds a binade of pre-scale headroom)."""
    from lightning_fp8.distributed import FP8CommState
    from lightning_fp8.distributed.comm import cast_stats

    plugin.comm_state = FP8CommState()
    plugin.comm_state.extra_headroom(torch.device("cpu"))
    for _ in range(overflows):
        stats = cast_stats(torch.ones(1), torch.zeros((), dtype=torch.int64), 8, found=torch.tensor(True))
        plugin.comm_state.record(stats, native_overflow=True)
    return plugin


def test_the_comm_hooks_state_travels_in_the_checkpoint(tmp_path):
    # The native FP8 all-reduce's extra headroom, grown after overflowing sums, restarted at 0 on resume: the resumed
    # run overflowed (and skipped steps) again until it had grown back.
    saver = _with_comm_state(_plugin()[0], overflows=3)
    torch.save({"FP8LMPrecision": saver.state_dict()}, tmp_path / "ckpt.pt")
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)["FP8LMPrecision"]
    assert state["comm"] == {"extra_headroom": 3, "reductions": 3}
    loader = _with_comm_state(_plugin()[0], overflows=0)
    loader.load_state_dict(state)
    assert loader.comm_state.state_dict() == saver.comm_state.state_dict()
    # Without hooks in the resumed run (one device) the entry has no use and is left; without it, the state is fresh.
    _plugin()[0].load_state_dict(state)
    fresh = _with_comm_state(_plugin()[0], overflows=1)
    fresh.load_state_dict({key: value for key, value in state.items() if key != "comm"})
    assert fresh.comm_state.state_dict()["extra_headroom"] == 1


@pytest.mark.parametrize("hook", ["load_state_dict", "on_load_checkpoint"])
def test_a_corrupt_comm_state_is_refused_before_anything_changes(hook):
    state = {**_saved_state(), "comm": {"extra_headroom": 99, "reductions": 0}}
    plugin, module, optimizer = _connected_plugin()
    _with_comm_state(plugin, overflows=1)
    before = _model_snapshot(plugin, module, optimizer)
    with pytest.raises(ValueError, match="FP8CommState.load_state_dict: entry 'extra_headroom' is 99"):
        if hook == "load_state_dict":
            plugin.load_state_dict(state)
        else:
            plugin.on_load_checkpoint({"FP8LMPrecision": state, "state_dict": {}})
    _assert_unchanged(before, _model_snapshot(plugin, module, optimizer))
    assert plugin.comm_state.state_dict() == {"extra_headroom": 1, "reductions": 1}
