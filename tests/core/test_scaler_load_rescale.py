"""FP8GradScaler.load_state_dict changes mu: the grad_output scaling states of the scaler's model move with it, as for
every change of mu, so the next backward casts with the right scale. Loaded with the model's FP8 state from the same
checkpoint, in either order (Lightning's plugin loads the scaler first, Accelerate the FP8 state), the states are the
checkpoint's."""

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, FP8GradScaler, convert_to_fp8, fp8_state_dict, load_fp8_state_dict

BUFFERS = ("amax_history", "scale", "amax")


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(64, 32), torch.randn(64, 16)


def _run(init_scale: float, steps: int, load_at: int | None = None, saved: dict | None = None):
    """A small FP8 model trained ``steps`` steps with mu = ``init_scale`` (``saved`` loaded into the scaler before
    step ``load_at``); its scaler, and the grad_output saturation of the last layer at each step."""
    x, y = _data()
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16)))
    scaler = FP8GradScaler(init_scale=init_scale, growth_interval=10**6, model=model)
    optimizer = FP8AdamW(model.parameters(), lr=1e-4, grad_scaler=scaler)
    saturations = []
    for i in range(steps):
        if i == load_at:
            scaler.load_state_dict(saved)
        scaler.scale_loss(((model(x) - y) ** 2).mean()).backward()
        saturations.append(model[2].fp8_scaling["grad_output"].saturation.item())
        optimizer.step()
        optimizer.zero_grad()
    return model, scaler, optimizer, saturations


def _grad_outputs(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in fp8_state_dict(model).items() if ".grad_output." in k and k.endswith(BUFFERS)}


def _backward(model: nn.Module, scaler: FP8GradScaler) -> float:
    x, y = _data()
    scaler.scale_loss(((model(x) - y) ** 2).mean()).backward()
    return model[2].fp8_scaling["grad_output"].saturation.item()


def test_loading_another_mu_rescales_the_grad_output_states():
    saved = FP8GradScaler(init_scale=4096.0).state_dict()
    _, _, _, loaded = _run(16.0, 6, load_at=4, saved=saved)
    # mu 4096 from 16 by 8 exact doublings casts the same FP8 values: as if mu had stayed at 16.
    _, _, _, steady = _run(16.0, 6)
    assert loaded[4] < 0.01 and loaded[5] < 0.01, loaded
    assert loaded == pytest.approx(steady, abs=1e-3)


def test_the_rescale_is_exact():
    model, scaler, _, _ = _run(16.0, 3)
    before = _grad_outputs(model)
    scaler.load_state_dict(FP8GradScaler(init_scale=4096.0).state_dict())
    _assert_rescaled(model, before, 256)


def _checkpoint():
    """The scaler state and FP8 state of a run at mu 4096, and a live run at mu 16 to resume it in."""
    saved_model, saved_scaler, _, _ = _run(4096.0, 3)
    checkpoint = {"scaler": saved_scaler.state_dict(), "fp8": fp8_state_dict(saved_model)}
    live_model, live_scaler, _, _ = _run(16.0, 2)
    assert _grad_outputs(live_model).keys() == _grad_outputs(saved_model).keys()
    return checkpoint, _grad_outputs(saved_model), live_model, live_scaler


def _assert_states(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    for key, value in _grad_outputs(model).items():
        assert torch.equal(value, expected[key]), key


def _assert_rescaled(model: nn.Module, before: dict[str, torch.Tensor], ratio: float) -> None:
    """The grad_output states are ``before`` after mu changed by ``ratio``."""
    for key, value in _grad_outputs(model).items():
        assert torch.equal(value, before[key] / ratio if key.endswith(".scale") else before[key] * ratio), key


@pytest.mark.parametrize("scaler_first", [True, False], ids=["scaler_then_fp8", "fp8_then_scaler"])
def test_scaler_and_fp8_state_of_one_checkpoint_load_in_either_order(scaler_first):
    checkpoint, expected, model, scaler = _checkpoint()
    if scaler_first:  # Lightning's plugin
        scaler.load_state_dict(checkpoint["scaler"])
        load_fp8_state_dict(model, checkpoint["fp8"])
    else:  # Accelerate's load_state
        load_fp8_state_dict(model, checkpoint["fp8"])
        scaler.load_state_dict(checkpoint["scaler"])
    assert scaler.scale == 4096.0
    _assert_states(model, expected)  # not rescaled twice
    assert _backward(model, scaler) < 0.01
    model.zero_grad()
    # The pair is complete (and the backward cast since): a later load of another mu rescales them again.
    before = _grad_outputs(model)
    scaler.load_state_dict(FP8GradScaler(init_scale=2.0**14).state_dict())
    _assert_rescaled(model, before, 4)
    assert _backward(model, scaler) < 0.01


@pytest.mark.parametrize("scaler_first", [True, False], ids=["scaler_then_fp8", "fp8_then_scaler"])
def test_later_mu_load_after_a_paired_load_rescales(scaler_first):
    checkpoint, expected, model, scaler = _checkpoint()
    if scaler_first:
        scaler.load_state_dict(checkpoint["scaler"])
        load_fp8_state_dict(model, checkpoint["fp8"])
    else:
        load_fp8_state_dict(model, checkpoint["fp8"])
        scaler.load_state_dict(checkpoint["scaler"])
    scaler.load_state_dict(FP8GradScaler(init_scale=2.0**14).state_dict())  # 4096 -> 16384
    _assert_rescaled(model, expected, 4)


def test_fp8_state_loaded_then_cast_is_rescaled_by_a_scaler_load():
    # A backward after the FP8 state load casts with the live mu (16): the states follow it, not the checkpoint's.
    checkpoint, _, model, scaler = _checkpoint()
    load_fp8_state_dict(model, checkpoint["fp8"])
    scaler.load_state_dict(FP8GradScaler(init_scale=16.0).state_dict())  # pairs with the load: left as loaded
    _backward(model, scaler)
    model.zero_grad()
    before = _grad_outputs(model)
    scaler.load_state_dict(FP8GradScaler(init_scale=4096.0).state_dict())
    _assert_rescaled(model, before, 256)


def test_accelerate_restore_loads_fp8_state_then_scaler():
    pytest.importorskip("accelerate")
    from lightning_fp8.integrations.accelerate import checkpoint as acc
    from lightning_fp8.recipe import FP8Recipe

    saved_model, saved_scaler, _, _ = _run(4096.0, 3)
    recipe = FP8Recipe()
    state = acc.build_state(recipe, [saved_model], 1, saved_scaler, None, 3)
    expected = _grad_outputs(saved_model)
    model, scaler, _, _ = _run(16.0, 2)
    acc.restore(state, recipe, [model], scaler, None)
    assert scaler.scale == 4096.0
    _assert_states(model, expected)
    # A scaler state alone, loaded next, rescales them.
    scaler.load_state_dict(FP8GradScaler(init_scale=16.0).state_dict())
    _assert_rescaled(model, expected, 1 / 256)
    assert _backward(model, scaler) < 0.01


def test_lightning_plugin_loads_scaler_then_fp8_state():
    pytest.importorskip("lightning")
    from lightning_fp8.integrations.lightning import FP8LMPrecision

    def plugin_and_model(init_scale: float, steps: int):
        x, y = _data()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
        plugin = FP8LMPrecision(grad_scaler={"init_scale": init_scale, "growth_interval": 10**6})
        model = plugin.convert_module(model)
        plugin.grad_scaler.model = model
        for _ in range(steps):
            plugin.grad_scaler.scale_loss(((model(x) - y) ** 2).mean()).backward()
            model.zero_grad()
        return plugin, model

    saved_plugin, saved_model = plugin_and_model(4096.0, 3)
    state, expected = saved_plugin.state_dict(), _grad_outputs(saved_model)
    plugin, model = plugin_and_model(16.0, 2)
    plugin.load_state_dict(state)
    assert plugin.grad_scaler.scale == 4096.0
    _assert_states(model, expected)
    # A scaler state alone, loaded next, rescales them.
    plugin.grad_scaler.load_state_dict(FP8GradScaler(init_scale=16.0).state_dict())
    _assert_rescaled(model, expected, 1 / 256)
    assert _backward(model, plugin.grad_scaler) < 0.01
