"""Pairing the two loads of one checkpoint, the FP8 state and the FP8GradScaler's mu (lightning_fp8/load_pairing.py),
where a mutation audit found its rule unpinned: "a cast since the load ends the match", and a state's reset forgets the
loads recorded for it (its cast count could climb back to the recorded one). A load that is no longer matched leaves
the other load to do what it does alone: a scaler load rescales the live grad_output states by the change of mu (the
amaxes times ``new mu / old mu``, the scale divided by it: computed here), an FP8 state load copies the saved values
as they are. Pairings that ignored the cast count, or outlived a reset, passed the suite.

The setup is tests/core/test_scaler_load_rescale.py's: a checkpoint of a run at mu 4096 and a live run at mu 16."""

import pytest
import torch

from lightning_fp8 import FP8GradScaler, load_fp8_state_dict
from lightning_fp8.scaling import ScalingState
from tests.core.test_scaler_load_rescale import _backward, _checkpoint, _grad_outputs


def _rescaled(states: dict[str, torch.Tensor], ratio: float) -> dict[str, torch.Tensor]:
    """The grad_output buffers after mu changed by ``ratio``, in float64 (powers of two: exact in float32)."""
    return {k: (v.double() / ratio if k.endswith(".scale") else v.double() * ratio).float() for k, v in states.items()}


def _assert_states(model, expected):
    got = _grad_outputs(model)
    assert got.keys() == expected.keys() and got
    for key, value in got.items():
        assert torch.equal(value, expected[key]), key


def test_an_fp8_load_followed_by_a_cast_does_not_pair_with_a_later_scaler_load():
    checkpoint, _, model, scaler = _checkpoint()
    load_fp8_state_dict(model, checkpoint["fp8"])
    _backward(model, scaler)  # casts with the live mu 16: the states hold live values now
    model.zero_grad()
    live = _grad_outputs(model)
    scaler.load_state_dict(checkpoint["scaler"])  # 16 -> 4096
    assert scaler.scale == 4096.0
    _assert_states(model, _rescaled(live, 256.0))


def test_a_scaler_load_followed_by_a_cast_does_not_pair_with_a_later_fp8_load():
    # A scaler whose max_scale resumes the checkpoint's mu 4096 at 256: its load waits for the FP8 state load to take
    # the correction 256 / 4096. A backward since ends that: the FP8 state loaded afterwards is copied as saved.
    checkpoint, saved, model, _ = _checkpoint()
    scaler = FP8GradScaler(init_scale=16.0, max_scale=256.0, growth_interval=10**6, model=model)
    with pytest.warns(UserWarning, match="outside this scaler's"):
        scaler.load_state_dict(checkpoint["scaler"])
    assert scaler.scale == 256.0
    _backward(model, scaler)
    model.zero_grad()
    load_fp8_state_dict(model, checkpoint["fp8"])
    _assert_states(model, saved)


def test_a_reset_forgets_an_fp8_load_even_when_the_cast_count_climbs_back():
    checkpoint, _, model, scaler = _checkpoint()
    load_fp8_state_dict(model, checkpoint["fp8"])
    states = [m for m in model.modules() if isinstance(m, ScalingState)]
    loaded_casts = {int(s.casts) for s in states}
    for s in states:
        s.reset()
    for _ in range(max(loaded_casts)):  # the grad_output states' cast count back to the loaded one
        _backward(model, scaler)
        model.zero_grad()
    grad_outputs = [m.fp8_scaling["grad_output"] for m in (model[0], model[2])]
    assert all(int(s.casts) in loaded_casts for s in grad_outputs)
    live = _grad_outputs(model)
    scaler.load_state_dict(checkpoint["scaler"])  # 16 -> 4096: the live states follow the change of mu
    _assert_states(model, _rescaled(live, 256.0))
