"""fp8_state_dict records what each scaling state's values mean (format, margin, delayed or current, amax algo), and
load_fp8_state_dict refuses a checkpoint written under other settings, or values its buffers cannot hold exactly,
before it loads anything. Checkpoints without the settings (written before they were saved) still load."""

import io

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8Recipe, convert_to_fp8, fp8_state_dict, load_fp8_state_dict

SETTINGS = ("fp8_max", "margin", "delayed", "amax_compute_algo")


def _model(recipe=None, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return convert_to_fp8(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 16)), recipe)


def _trained(recipe=None, seed: int = 0) -> nn.Module:
    model = _model(recipe, seed)
    for _ in range(3):
        model(torch.randn(16, 32)).sum().backward()
    return model


def _round_trip(state: dict) -> dict:
    """``state`` through torch.save and torch.load(weights_only=True), as a checkpoint."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _buffers(model: nn.Module) -> dict:
    return {k: v for k, v in fp8_state_dict(model).items() if k.rpartition(".")[2] not in (*SETTINGS, "initialized")}


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        assert value.dtype == b[key].dtype and torch.equal(value, b[key]), key


def test_settings_are_saved_as_plain_tensors_with_the_recipe_values():
    saved = _round_trip(fp8_state_dict(_trained(FP8Recipe(margin=2, amax_compute_algo="most_recent"))))
    # By hand from the recipe: hybrid is E4M3 (448) forward and E5M2 (57344) for gradients; weights are always current.
    expected = {
        "input": (448.0, 2, 1, 1),
        "weight": (448.0, 2, 0, 1),
        "grad_output": (57344.0, 2, 1, 1),
    }
    for layer in ("0", "1"):
        for role, values in expected.items():
            for name, value in zip(SETTINGS, values, strict=True):
                t = saved[f"{layer}.fp8_scaling.{role}.{name}"]
                assert t.shape == () and t.item() == value, (layer, role, name)
    e4m3 = fp8_state_dict(_model("fp8-lm-e4m3"))
    assert e4m3["1.fp8_scaling.grad_output.fp8_max"].item() == 448.0
    assert fp8_state_dict(_model("fp8-lm-current"))["0.fp8_scaling.input.delayed"].item() == 0


def test_same_recipe_round_trips():
    src = _trained(FP8Recipe(margin=1))
    saved = _round_trip(fp8_state_dict(src))
    dst = _model(FP8Recipe(margin=1), seed=1)
    dst.load_state_dict(src.state_dict())
    load_fp8_state_dict(dst, saved)
    _assert_same(_buffers(dst), _buffers(src))
    x = torch.randn(8, 32)
    assert torch.equal(dst[0](x), src[0](x))


OTHER_RECIPES = {
    # field: (saved recipe, model recipe, words the error names for the first mismatching state)
    "fp8_format": ("fp8-lm", "fp8-lm-e4m3", ("grad_output", "E5M2", "E4M3")),
    "margin": (FP8Recipe(), FP8Recipe(margin=4), ("margin 0", "margin 4")),
    "scaling": ("fp8-lm", "fp8-lm-current", ("delayed scaling", "current scaling")),
    "amax_compute_algo": (FP8Recipe(), FP8Recipe(amax_compute_algo="most_recent"), ("'max'", "'most_recent'")),
}


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("field", list(OTHER_RECIPES))
def test_checkpoint_of_another_recipe_is_refused_and_nothing_loads(field, strict):
    saved_recipe, model_recipe, words = OTHER_RECIPES[field]
    saved = _round_trip(fp8_state_dict(_trained(saved_recipe)))
    model = _trained(model_recipe, seed=1)
    before = fp8_state_dict(model)
    with pytest.raises(ValueError, match="another FP8 recipe") as info:
        load_fp8_state_dict(model, saved, strict=strict)
    message = str(info.value)
    assert "fp8_scaling." in message and all(w in message for w in words), message
    _assert_same(fp8_state_dict(model), before)


def test_a_format_mismatch_would_saturate_every_gradient_cast():
    """Why the check exists: the hybrid run's E5M2 grad_output scale, applied to E4M3 casts, saturates them."""
    src = _trained("fp8-lm")
    g = src[1].fp8_scaling["grad_output"]
    amax = g.amax_history.max()
    assert amax * g.scale > 448  # the E5M2 scale is far too large for E4M3's max
    with pytest.raises(ValueError, match="E5M2"):
        load_fp8_state_dict(_model("fp8-lm-e4m3"), fp8_state_dict(src))


@pytest.mark.parametrize("strict", [True, False])
def test_checkpoint_without_settings_still_loads(strict):
    """Written before the settings were saved: same keys minus the settings (and the initialized flags, saved since
    then too); loads as before, unchecked."""
    src = _trained()
    old = {k: v for k, v in fp8_state_dict(src).items() if k.rpartition(".")[2] not in (*SETTINGS, "initialized")}
    assert len(old) == 6 * 6  # 2 layers x 3 roles x 6 buffers
    dst = _model(seed=1)
    load_fp8_state_dict(dst, _round_trip(old), strict=strict)
    _assert_same(_buffers(dst), _buffers(src))
    assert dst[0].fp8_scaling["input"].initialized


def test_unexpected_settings_key_is_refused_when_strict():
    saved = fp8_state_dict(_trained())
    saved["2.fp8_scaling.input.margin"] = torch.tensor(0)
    with pytest.raises(KeyError, match="unexpected"):
        load_fp8_state_dict(_model(), saved)
    load_fp8_state_dict(_model(), saved, strict=False)  # ignored


@pytest.mark.parametrize("value", ["0", torch.zeros(2, dtype=torch.int64)])
def test_a_setting_that_is_not_one_number_is_refused(value):
    saved = {**fp8_state_dict(_trained()), "0.fp8_scaling.input.margin": value}
    model = _model(seed=1)
    before = fp8_state_dict(model)
    with pytest.raises(TypeError, match="0.fp8_scaling.input.margin"):
        load_fp8_state_dict(model, saved)
    _assert_same(fp8_state_dict(model), before)


def test_a_setting_saved_as_a_python_number_is_refused_saying_a_tensor_is_expected():
    # Found by a sweep: a margin of 0 (a Python int) was refused as "int of shape (), expected one number".
    saved = {**fp8_state_dict(_trained()), "0.fp8_scaling.input.margin": 0}
    with pytest.raises(TypeError, match=r"'0.fp8_scaling.input.margin' is int, expected a one-element tensor"):
        load_fp8_state_dict(_model(seed=1), saved)


def test_per_rank_gather_round_trips_settings(tmp_path):
    """The Lightning plugin gathers every rank's fp8_state_dict (comm.all_gather_state): one rank of gloo here."""
    import torch.distributed as dist

    from lightning_fp8.integrations.lightning.comm import all_gather_state

    src = _trained()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        gathered = all_gather_state(fp8_state_dict(src))
    finally:
        dist.destroy_process_group()
    assert len(gathered) == 1
    _assert_same(gathered[0], fp8_state_dict(src))
    dst = _model(seed=1)
    load_fp8_state_dict(dst, gathered[0])
    _assert_same(_buffers(dst), _buffers(src))


# -- values the fp32 / int64 buffers cannot hold exactly ------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("0.fp8_scaling.input.scale", 2.0**200),  # a float64 power of two: inf in fp32
        ("0.fp8_scaling.input.scale", 2.0**-160),  # 0 in fp32
        ("0.fp8_scaling.input.amax", 1e-50),  # 0 in fp32
        ("0.fp8_scaling.input.amax", 1e300),  # inf in fp32
        ("0.fp8_scaling.input.saturation", 0.1),  # not an fp32 number: it would change
    ],
)
def test_float64_value_that_fp32_cannot_hold_is_refused(key, value):
    saved = fp8_state_dict(_trained())
    model = _trained(seed=1)
    before = fp8_state_dict(model)
    with pytest.raises(ValueError, match="cannot hold exactly"):
        load_fp8_state_dict(model, {**saved, key: torch.tensor(value, dtype=torch.float64)})
    _assert_same(fp8_state_dict(model), before)


def test_float64_values_fp32_holds_load():
    src = _trained()
    saved = {k: (v.double() if v.is_floating_point() else v) for k, v in fp8_state_dict(src).items()}
    saved["0.fp8_scaling.input.scale"] = torch.tensor(2.0**100, dtype=torch.float64)  # in fp32's range
    dst = _model(seed=1)
    load_fp8_state_dict(dst, saved)
    assert dst[0].fp8_scaling["input"].scale.dtype == torch.float32
    assert dst[0].fp8_scaling["input"].scale.item() == 2.0**100
    expected = _buffers(src)
    expected["0.fp8_scaling.input.scale"] = torch.tensor(2.0**100)
    _assert_same(_buffers(dst), expected)
