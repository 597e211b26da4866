"""FP8GradScaler's settings assigned after construction (``scaler.fallback_after = 0``) are checked as its arguments:
the value ``FP8GradScaler(name=value)`` refuses is refused at the assignment, with the old value kept, instead of
failing later (a fallback spelled wrong raised "'str' object is not callable" after a skipped step; ``fallback_after=0``
ran the fallback at every skip). Accepted values are stored as ``__init__`` stores them."""

import copy
import math
import pickle

import numpy as np
import pytest
import torch
from torch import nn

import lightning_fp8.warnings
from lightning_fp8 import FP8GradScaler, convert_to_fp8

# (setting, a value FP8GradScaler(...) refuses): each refused by the assignment with the constructor's exception type.
BAD = [
    ("growth_interval", 0),
    ("growth_interval", 1.5),
    ("growth_interval", True),
    ("growth_interval", "10"),
    ("fallback_after", 0),
    ("fallback_after", -3),
    ("fallback_after", 2.0),
    ("saturation_threshold", 1.0),
    ("saturation_threshold", -1e-9),
    ("saturation_threshold", math.nan),
    ("headroom", 0.5),
    ("headroom", math.inf),
    ("headroom", None),
    ("lr_factor", 0.0),
    ("lr_factor", 1.0),
    ("lr_factor", math.nan),
    ("min_scale", 3.0),
    ("min_scale", 2.0**-127),
    ("max_scale", 2.0**128),
    ("max_scale", "big"),
    ("nonfinite_fallback", "lower-lr"),
    ("nonfinite_fallback", "fallback_to_high_precision"),
    ("nonfinite_fallback", 3),
    ("process_group", "world"),
]


@pytest.mark.parametrize(("name", "value"), BAD, ids=[f"{name}={value!r}" for name, value in BAD])
def test_a_value_the_constructor_refuses_is_refused_when_set_and_the_old_one_kept(name, value):
    with pytest.raises((TypeError, ValueError)) as constructed:
        FP8GradScaler(**{name: value})
    scaler = FP8GradScaler(growth_interval=7, fallback_after=2, lr_factor=0.25, nonfinite_fallback="lower_lr")
    before = {key: getattr(scaler, key) for key in ("growth_interval", "saturation_threshold", "headroom",
                                                    "min_scale", "max_scale", "nonfinite_fallback", "fallback_after",
                                                    "lr_factor", "process_group")}  # fmt: skip
    with pytest.raises(constructed.type, match=rf"^FP8GradScaler\.{name} = "):
        setattr(scaler, name, value)
    assert {key: getattr(scaler, key) for key in before} == before


@pytest.mark.parametrize(
    ("name", "value", "stored"),
    [
        ("growth_interval", np.int64(5), 5),
        ("fallback_after", 1, 1),
        ("saturation_threshold", 0, 0.0),
        ("headroom", 1, 1.0),
        ("lr_factor", np.float32(0.125), 0.125),
        ("min_scale", 2**-10, 2.0**-10),
        ("max_scale", 2**10, 2.0**10),
        ("nonfinite_fallback", None, None),
        ("nonfinite_fallback", "lower_lr", "lower_lr"),
    ],
)
def test_an_accepted_value_is_stored_as_the_constructor_stores_it(name, value, stored):
    scaler, constructed = FP8GradScaler(), FP8GradScaler(**{name: value})
    setattr(scaler, name, value)
    assert getattr(scaler, name) == getattr(constructed, name) == stored
    assert type(getattr(scaler, name)) is type(getattr(constructed, name)) is type(stored)


def test_bounds_that_would_leave_mu_outside_them_are_refused_until_mu_is_moved():
    scaler = FP8GradScaler(init_scale=2.0**10)
    with pytest.raises(ValueError, match=r"max_scale = 256.*mu is 1024.0.*update\(new_scale=\.\.\.\)"):
        scaler.max_scale = 256
    with pytest.raises(ValueError, match=r"min_scale = 2048.*mu is 1024.0"):
        scaler.min_scale = 2048
    assert (scaler.min_scale, scaler.max_scale) == (2.0**-24, 2.0**24)
    scaler.update(new_scale=128.0)
    scaler.max_scale = 256
    assert scaler.max_scale == 256.0 and scaler.get_scale() == 128.0
    with pytest.raises(ValueError, match=r"need min_scale <= max_scale, got \[512, 256.0\]"):
        scaler.min_scale = 512
    assert scaler.min_scale == 2.0**-24


def _model_and_batch():
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 16)))
    return model, torch.randn(8, 32)


def _nonfinite_step(scaler, model, optimizer, x):
    scaler.scale_loss(model(x).sum() * math.nan).backward()
    stepped = scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return stepped


def test_fallback_after_set_later_is_what_triggers_the_fallback():
    """``fallback_after`` and ``lr_factor`` set after construction act: one non-finite step lowers the learning rate
    by the new factor (the defaults would wait for three)."""
    model, x = _model_and_batch()
    scaler = FP8GradScaler(model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.nonfinite_fallback, scaler.fallback_after, scaler.lr_factor = "lower_lr", 1, 0.25
    assert not _nonfinite_step(scaler, model, optimizer, x)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.25, rel=0, abs=0)
    assert [entry["action"] for entry in scaler.history] == ["skip", "fallback"]


def test_a_module_set_as_the_fallback_is_the_bf16_fallback_on_that_model():
    model, _ = _model_and_batch()
    scaler = FP8GradScaler()
    scaler.nonfinite_fallback = model
    assert scaler.nonfinite_fallback == "bf16" and scaler.model is model
    scaler._take_model(nn.Linear(4, 4))  # an integration's model does not replace the one the user gave
    assert scaler.model is model


def test_a_module_set_as_the_fallback_beside_another_given_model_is_refused():
    model, _ = _model_and_batch()
    scaler = FP8GradScaler(model=model)
    with pytest.raises(ValueError, match=r"nonfinite_fallback = .*two different models"):
        scaler.nonfinite_fallback = nn.Linear(4, 4)
    assert scaler.nonfinite_fallback is None and scaler.model is model


def test_a_module_set_as_the_fallback_replaces_a_model_an_integration_gave():
    model, _ = _model_and_batch()
    scaler = FP8GradScaler()
    scaler._take_model(nn.Linear(4, 4))
    scaler.nonfinite_fallback = model
    assert scaler.model is model and scaler.nonfinite_fallback == "bf16"


def test_bf16_set_without_a_model_is_refused_at_the_step_before_anything_changes(monkeypatch):
    """``__init__`` refuses ``nonfinite_fallback='bf16'`` without a model; set later (the Lightning plugin does so
    before its fit gives the model), the step refuses it while no model was given: before, the fallback failed only
    when it ran, after a skipped step."""
    monkeypatch.setattr(lightning_fp8.warnings, "_seen", set())
    model, x = _model_and_batch()
    scaler = FP8GradScaler()
    scaler.nonfinite_fallback = "bf16"
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    weights = [p.detach().clone() for p in model.parameters()]
    scaler.scale_loss(model(x).sum()).backward()
    with pytest.raises(ValueError, match=r"no model to put layers back in: give it, scaler\.model = model"):
        scaler.step(optimizer)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
    assert scaler.get_scale() == 1.0 and scaler.skipped_steps == 0 and not scaler.history
    scaler.model = model  # the same step, now made
    assert scaler.step(optimizer)
    scaler.update()
    assert not all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))


def test_a_copied_or_unpickled_scaler_keeps_its_settings_and_still_checks_them():
    scaler = FP8GradScaler(growth_interval=3, nonfinite_fallback="lower_lr", fallback_after=5)
    for other in (copy.deepcopy(scaler), pickle.loads(pickle.dumps(scaler))):
        assert (other.growth_interval, other.nonfinite_fallback, other.fallback_after) == (3, "lower_lr", 5)
        with pytest.raises(ValueError, match=r"FP8GradScaler\.fallback_after = 0"):
            other.fallback_after = 0
        other.fallback_after = 2
        assert other.fallback_after == 2 and scaler.fallback_after == 5
