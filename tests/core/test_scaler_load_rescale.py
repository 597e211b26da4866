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


def _load_in_order(model: nn.Module, scaler: FP8GradScaler, checkpoint: dict, scaler_first: bool) -> None:
    if scaler_first:  # Lightning's plugin
        scaler.load_state_dict(checkpoint["scaler"])
        load_fp8_state_dict(model, checkpoint["fp8"])
    else:  # Accelerate's load_state
        load_fp8_state_dict(model, checkpoint["fp8"])
        scaler.load_state_dict(checkpoint["scaler"])


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
    _load_in_order(model, scaler, checkpoint, scaler_first)
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
    _load_in_order(model, scaler, checkpoint, scaler_first)
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


def _rescaled(states: dict[str, torch.Tensor], ratio: float) -> dict[str, torch.Tensor]:
    """``states`` after mu changed by ``ratio``, computed here: amax history and last amax times ``ratio``, the scale
    divided by it and kept within the scales casts produce (2**-126 to 2**127)."""
    return {
        key: (value / ratio).clamp(2.0**-126, 2.0**127) if key.endswith(".scale") else value * ratio
        for key, value in states.items()
    }


def _load_checkpoint(model: nn.Module, scaler: FP8GradScaler, checkpoint: dict, scaler_first: bool) -> None:
    with pytest.warns(UserWarning, match="outside this scaler's"):
        _load_in_order(model, scaler, checkpoint, scaler_first)


@pytest.mark.parametrize("scaler_first", [True, False], ids=["scaler_then_fp8", "fp8_then_scaler"])
@pytest.mark.parametrize(("bounds", "resumed"), [({"max_scale": 256.0}, 256.0), ({"min_scale": 2.0**16}, 2.0**16)],
                         ids=["above_max_scale", "below_min_scale"])  # fmt: skip
def test_a_saved_mu_outside_the_bounds_rescales_the_checkpoint_states_to_the_resumed_mu(scaler_first, bounds, resumed):
    # The checkpoint was saved at mu 4096; this scaler's bounds resume it at another mu: the grad_output states saved
    # beside 4096 are rescaled to it, as a change of mu from 4096 to the resumed mu rescales them, in either order.
    checkpoint, saved, model, _ = _checkpoint()
    scaler = FP8GradScaler(init_scale=16.0 if "max_scale" in bounds else 2.0**17, growth_interval=10**6, model=model,
                           **bounds)  # fmt: skip
    _load_checkpoint(model, scaler, checkpoint, scaler_first)
    assert scaler.scale == resumed
    _assert_states(model, _rescaled(saved, resumed / 4096.0))
    # The next backward casts the gradients of mu = resumed with scales that fit them (unrescaled, the scales of mu
    # 4096 would saturate the 16x larger gradients below min_scale).
    assert _backward(model, scaler) < 0.01


@pytest.mark.parametrize("scaler_first", [True, False], ids=["scaler_then_fp8", "fp8_then_scaler"])
def test_the_resume_rescale_clamps_the_scale_as_a_change_of_mu_does(scaler_first):
    # A saved grad_output scale of 2**-120 at mu 4096, resumed at mu 2**20: divided by 256 it would be 2**-128, whose
    # reciprocal is inf; the runtime rescale keeps it at 2**-126.
    checkpoint, saved, model, _ = _checkpoint()
    key = "2.fp8_scaling.grad_output.scale"
    checkpoint["fp8"] = {**checkpoint["fp8"], key: torch.tensor(2.0**-120)}
    saved[key] = torch.tensor(2.0**-120)
    scaler = FP8GradScaler(init_scale=2.0**21, min_scale=2.0**20, growth_interval=10**6, model=model)
    _load_checkpoint(model, scaler, checkpoint, scaler_first)
    assert scaler.scale == 2.0**20
    expected = _rescaled(saved, 256.0)
    assert expected[key].item() == 2.0**-126
    _assert_states(model, expected)


@pytest.mark.parametrize("scaler_first", [True, False], ids=["scaler_then_fp8", "fp8_then_scaler"])
def test_after_a_clamped_resume_a_later_mu_load_rescales_from_the_resumed_mu(scaler_first):
    # The pair is complete once: a scaler state loaded next rescales from the resumed mu (256), not again from 4096.
    checkpoint, saved, model, _ = _checkpoint()
    scaler = FP8GradScaler(init_scale=16.0, max_scale=256.0, growth_interval=10**6, model=model)
    _load_checkpoint(model, scaler, checkpoint, scaler_first)
    scaler.load_state_dict(FP8GradScaler(init_scale=64.0).state_dict())  # 256 -> 64
    _assert_states(model, _rescaled(saved, 64.0 / 4096.0))


@pytest.mark.parametrize("keys", [("casts", "saturation"), ("casts", "saturation", "nonfinite_count"),
                                  ("scale", "casts"), ("amax_history", "saturation")],
                         ids=["counters", "all_counters", "scale_only", "history_only"])  # fmt: skip
def test_a_partial_fp8_load_of_a_grad_output_state_does_not_pair_with_the_scaler_load(keys):
    # strict=False, with only some of each grad_output state's buffers: the others keep their live values (of the live
    # mu 16), so the state does not hold the saved mu's values, and the scaler load that follows rescales it.
    checkpoint, _, model, scaler = _checkpoint()
    partial = {k: v for k, v in checkpoint["fp8"].items() if ".grad_output." in k and k.rpartition(".")[2] in keys}
    expected = _grad_outputs(model)
    expected.update({k: v for k, v in partial.items() if k in expected})  # what the partial load replaces
    load_fp8_state_dict(model, partial, strict=False)
    scaler.load_state_dict(checkpoint["scaler"])  # 16 -> 4096
    _assert_states(model, _rescaled(expected, 256.0))


def test_a_partial_fp8_load_with_scale_and_history_pairs_and_keeps_them():
    # Found by review: strict=False with scale and amax history but not the last amax (a statistic) gives the state
    # what its next casts use as saved beside the checkpoint's mu: paired, not rescaled again by the scaler load
    # (rescaling them made the next backward saturate); the last amax keeps its live value.
    checkpoint, saved, model, scaler = _checkpoint()
    partial = {k: v for k, v in checkpoint["fp8"].items()
               if ".grad_output." in k and k.rpartition(".")[2] in ("scale", "amax_history", "casts")}  # fmt: skip
    expected = _grad_outputs(model)
    expected.update({k: v for k, v in saved.items() if k.rpartition(".")[2] in ("scale", "amax_history")})
    load_fp8_state_dict(model, partial, strict=False)
    scaler.load_state_dict(checkpoint["scaler"])  # 16 -> 4096: the checkpoint's mu
    _assert_states(model, expected)
    assert _backward(model, scaler) < 0.01


@pytest.mark.parametrize("order", ["scaler_fp8_fp8", "fp8_scaler_fp8"])
@pytest.mark.parametrize(("bounds", "resumed"), [({"max_scale": 256.0}, 256.0), ({"min_scale": 2.0**16}, 2.0**16)],
                         ids=["above_max_scale", "below_min_scale"])  # fmt: skip
def test_loading_the_fp8_state_again_after_a_clamped_resume_takes_the_correction_again(order, bounds, resumed):
    # Found by review: once the pair was complete, a second FP8 state load of the same checkpoint (before any cast)
    # kept the saved mu's values under the resumed mu.
    checkpoint, saved, model, _ = _checkpoint()
    scaler = FP8GradScaler(init_scale=16.0 if "max_scale" in bounds else 2.0**17, growth_interval=10**6, model=model,
                           **bounds)  # fmt: skip
    _load_checkpoint(model, scaler, checkpoint, order.startswith("scaler"))
    load_fp8_state_dict(model, checkpoint["fp8"])
    assert scaler.scale == resumed
    _assert_states(model, _rescaled(saved, resumed / 4096.0))
    assert _backward(model, scaler) < 0.01
