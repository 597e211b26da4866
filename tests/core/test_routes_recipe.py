"""One recipe, reached by every core route (``FP8Recipe(...)``, ``from_dict``, ``replace``, a name, ``FP8Linear``,
``convert_to_fp8``, ``FP8AdamW``), is the same recipe: field by field, and as a checkpoint stores it."""

import enum
import io
import re

import numpy as np
import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, FP8Linear, FP8Recipe, convert_to_fp8, fp8_modules


class Scaling(str, enum.Enum):
    """A configuration system's string enum (Hydra and OmegaConf hand such members to code)."""

    CURRENT = "current"


def _weights_only_round_trip(state: dict) -> dict:
    """``state`` through torch.save and torch.load(weights_only=True), as a checkpoint holding it is read."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _routes(fields: dict) -> dict[str, FP8Recipe]:
    """The recipe of ``fields`` as each core route gives it."""
    recipe = FP8Recipe(**fields)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16)), recipe)
    (converted,) = {layer.recipe for layer in fp8_modules(model).values()}
    return {
        "FP8Recipe": recipe,
        "from_dict": FP8Recipe.from_dict(fields),
        "replace": FP8Recipe().replace(**fields),
        "FP8Linear": FP8Linear(32, 16, recipe=recipe).recipe,
        "convert_to_fp8": converted,
        "FP8AdamW": FP8AdamW(model.parameters(), recipe=recipe).recipe,
    }


@pytest.mark.parametrize(
    "fields",
    [
        {"scaling": np.str_("current"), "opt_level": np.str_("O1")},
        {"fp8_format": np.str_("e4m3"), "amax_compute_algo": np.str_("most_recent")},
        {"scaling": Scaling.CURRENT},
    ],
    ids=["numpy-scaling-opt-level", "numpy-format-algo", "str-enum"],
)
def test_string_subclasses_give_the_recipe_of_plain_strings_and_a_checkpoint_torch_loads(fields):
    # NumPy integers became ints, but a NumPy string or a str enum stayed in the recipe as it was: equal to the plain
    # string, but pickled as its class by to_dict() into the checkpoints of the Lightning plugin and of Accelerate's
    # save_state, which torch.load(weights_only=True) then refused.
    plain = FP8Recipe(
        **{name: str(value.value if isinstance(value, enum.Enum) else value) for name, value in fields.items()}
    )
    for route, recipe in _routes(fields).items():
        assert recipe == plain, route
        assert repr(recipe) == repr(plain), route
        assert all(type(value) in (str, int) for value in recipe.to_dict().values()), route
        assert _weights_only_round_trip({"recipe": recipe.to_dict()})["recipe"] == plain.to_dict(), route
        assert FP8Recipe.from_dict(_weights_only_round_trip(recipe.to_dict())) == plain, route


@pytest.mark.parametrize("count", [np.int64, np.int32, np.uint8, int])
def test_numpy_counts_give_every_route_the_recipe_of_python_ints(count):
    fields = {"amax_history_len": count(4), "margin": count(2), "scaling": "current", "opt_level": "O1"}
    plain = FP8Recipe(amax_history_len=4, margin=2, scaling="current", opt_level="O1")
    for route, recipe in _routes(fields).items():
        assert recipe == plain and repr(recipe) == repr(plain), route
        assert _weights_only_round_trip(recipe.to_dict()) == plain.to_dict(), route


@pytest.mark.parametrize("name", FP8Recipe.names())
def test_a_named_recipe_is_the_same_by_name_and_by_its_fields(name):
    fields = FP8Recipe.from_name(name).to_dict()
    by_name = {
        "FP8Linear": FP8Linear(32, 16, recipe=name).recipe,
        "convert_to_fp8": next(iter(fp8_modules(convert_to_fp8(nn.Linear(32, 16), name)).values())).recipe,
        "FP8AdamW": FP8AdamW([nn.Parameter(torch.randn(4))], recipe=name).recipe,
    }
    assert all(recipe == FP8Recipe(**fields) for recipe in by_name.values()), by_name
    assert FP8AdamW([nn.Parameter(torch.randn(4))], recipe=name).opt_level == fields["opt_level"]


@pytest.mark.parametrize(
    ("where", "call"),
    [
        ("FP8Linear(recipe=...)", lambda r: FP8Linear(16, 16, recipe=r)),
        ("FP8Linear.from_linear(recipe=...)", lambda r: FP8Linear.from_linear(nn.Linear(16, 16), recipe=r)),
        ("convert_to_fp8(recipe=...)", lambda r: convert_to_fp8(nn.Sequential(nn.Linear(16, 16)), r)),
        ("FP8AdamW(recipe=...)", lambda r: FP8AdamW([nn.Parameter(torch.zeros(4))], recipe=r)),
    ],
)
def test_a_dict_given_as_a_recipe_is_refused_naming_the_call_and_the_fix(where, call):
    # It said "recipe must be an FP8Recipe, a recipe name or None, got dict": no call, no names, no way to a recipe.
    fields = {"scaling": "current", "margin": 1}
    with pytest.raises(TypeError, match=rf"^{re.escape(where)} must be an FP8Recipe, .*'fp8-lm'.*got dict.*from_dict"):
        call(fields)
    call(FP8Recipe.from_dict(fields))  # the named fix is accepted


def test_from_dict_with_a_base_recipe_name_names_from_name_and_replace():
    # LIGHTNING_FP8_RECIPE's JSON names its base recipe "name", the config section "recipe"; from_dict has no such
    # field and said only "unknown field".
    for key in ("name", "recipe"):
        with pytest.raises(ValueError, match=r"FP8Recipe\.from_name\('fp8-lm-current'\)\.replace\(\.\.\.\)"):
            FP8Recipe.from_dict({key: "fp8-lm-current", "margin": 1})
    fixed = FP8Recipe.from_name("fp8-lm-current").replace(margin=1)  # the named fix
    assert fixed == FP8Recipe(scaling="current", margin=1)
