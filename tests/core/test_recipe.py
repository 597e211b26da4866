import types

import pytest
import torch

from lightning_fp8 import FP8Recipe, ScalingState
from lightning_fp8.recipe import resolve_recipe


def test_defaults_are_fp8_lm():
    r = FP8Recipe()
    assert (r.fp8_format, r.scaling, r.amax_history_len, r.amax_compute_algo, r.margin, r.opt_level) == (
        "hybrid",
        "delayed",
        16,
        "max",
        0,
        "O2",
    )
    assert r.forward_dtype == torch.float8_e4m3fn and r.backward_dtype == torch.float8_e5m2
    assert FP8Recipe(fp8_format="e4m3").backward_dtype == torch.float8_e4m3fn


def test_named_recipes():
    assert FP8Recipe.from_name("fp8-lm") == FP8Recipe()
    assert FP8Recipe.from_name("fp8-lm-o1").opt_level == "O1"
    assert FP8Recipe.from_name("fp8-lm-current").scaling == "current"
    assert set(FP8Recipe.names()) >= {"fp8-lm", "fp8-lm-o1", "fp8-lm-current", "fp8-lm-e4m3"}
    with pytest.raises(ValueError, match="unknown FP8 recipe name 'fp8-xx'.*fp8-lm"):
        FP8Recipe.from_name("fp8-xx")


def test_frozen_and_keyword_only():
    r = FP8Recipe()
    with pytest.raises(AttributeError):
        r.margin = 2
    with pytest.raises(TypeError):
        FP8Recipe("hybrid")


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("fp8_format", "e5m2", "fp8_format='e5m2'.*hybrid"),
        ("scaling", "dynamic", "scaling='dynamic'.*delayed"),
        ("amax_compute_algo", "mean", "amax_compute_algo='mean'"),
        ("opt_level", "O3", "opt_level='O3'.*O1"),
        ("opt_level", 2, "opt_level=2"),
        ("amax_history_len", 0, "amax_history_len=0.*>= 1"),
        ("amax_history_len", 4.0, "amax_history_len=4.0.*must be an int"),
        ("amax_history_len", 2**40, "amax_history_len=1099511627776.*<= 4096"),
        ("margin", -1, "margin=-1"),
        ("margin", True, "margin=True.*must be an int"),
    ],
)
def test_bad_values_name_field_value_and_allowed(field, value, match):
    with pytest.raises(ValueError, match=match):
        FP8Recipe(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [("fp8_format", 3), ("scaling", None), ("opt_level", 2), ("amax_compute_algo", ["max"]),
     ("amax_history_len", "16"), ("margin", 1.5)],
)  # fmt: skip
def test_wrong_field_types_are_type_and_value_errors(field, value):
    # A field of the wrong type is a TypeError and, like every bad recipe value, a ValueError.
    with pytest.raises(TypeError, match=f"{field}=.*must be"):
        FP8Recipe(**{field: value})
    with pytest.raises(ValueError, match=f"{field}="):
        FP8Recipe(**{field: value})


def test_dict_round_trip_and_unknown_keys():
    r = FP8Recipe(scaling="current", margin=1)
    assert FP8Recipe.from_dict(r.to_dict()) == r
    with pytest.raises(ValueError, match="unknown FP8Recipe field.*'histroy'"):
        FP8Recipe.from_dict({"histroy": 3})


def test_resolve_recipe():
    assert resolve_recipe(None) == FP8Recipe()
    assert resolve_recipe("fp8-lm-o1").opt_level == "O1"
    with pytest.raises(TypeError, match="recipe must be"):
        resolve_recipe(3)


@pytest.mark.parametrize("values", ["fp8-lm", None, [("margin", 1)], 3])
def test_from_dict_refuses_what_is_not_a_mapping(values):
    """A recipe name was taken for its characters ("unknown FP8Recipe field(s) ['-', '8', ...]"), None raised "not
    iterable", a list of pairs was taken for its pairs. A TypeError saying a mapping is expected; a name is pointed to
    from_name. A mapping that is not a dict loads."""
    with pytest.raises(
        TypeError, match=f"FP8Recipe.from_dict takes a mapping of recipe fields.*got {type(values).__name__}"
    ):
        FP8Recipe.from_dict(values)
    if isinstance(values, str):
        with pytest.raises(TypeError, match=r"use FP8Recipe.from_name\('fp8-lm'\)"):
            FP8Recipe.from_dict(values)
    assert FP8Recipe.from_dict(types.MappingProxyType({"margin": 1})) == FP8Recipe(margin=1)
    with pytest.raises(ValueError, match=r"unknown FP8Recipe field\(s\) \['a', 1\]"):  # keys of two types
        FP8Recipe.from_dict({1: 0, "a": 0})


def test_numpy_integers_are_taken_as_ints():
    """A count read from a NumPy array or config was refused as "must be an int"; it is taken as the int it is (a
    NumPy float still is not)."""
    np = pytest.importorskip("numpy")
    recipe = FP8Recipe(amax_history_len=np.int64(4), margin=np.int32(1))
    assert recipe == FP8Recipe(amax_history_len=4, margin=1) and type(recipe.margin) is int
    with pytest.raises(ValueError, match="must be an int"):
        FP8Recipe(margin=np.float64(1.0))
    state = ScalingState(torch.float8_e4m3fn, np.int64(8), np.int32(1), "max", True)
    assert state.amax_history.shape == (8,) and type(state.margin) is int


def test_history_len_bounds_are_the_same_for_recipe_and_scaling_state():
    # The longest window is accepted (and builds its state); one more is refused by both, before any allocation.
    from lightning_fp8.formats import E4M3
    from lightning_fp8.recipe import MAX_AMAX_HISTORY_LEN
    from lightning_fp8.scaling import ScalingState

    FP8Recipe(amax_history_len=MAX_AMAX_HISTORY_LEN)
    state = ScalingState(E4M3, history_len=MAX_AMAX_HISTORY_LEN, margin=0, algo="max", delayed=True)
    assert state.amax_history.numel() == MAX_AMAX_HISTORY_LEN
    with pytest.raises(ValueError, match="amax_history_len=4097"):
        FP8Recipe(amax_history_len=MAX_AMAX_HISTORY_LEN + 1)
    with pytest.raises(ValueError, match="history_len=4097"):
        ScalingState(E4M3, history_len=MAX_AMAX_HISTORY_LEN + 1, margin=0, algo="max", delayed=True)


def test_same_scaling_compares_the_scaling_fields_of_recipes_and_names():
    assert FP8Recipe().same_scaling("fp8-lm") and FP8Recipe().same_scaling(FP8Recipe(opt_level="O1"))
    assert FP8Recipe().same_scaling("fp8-lm-o1")  # the optimizer level is not a scaling setting
    assert not FP8Recipe().same_scaling("fp8-lm-current") and not FP8Recipe().same_scaling(FP8Recipe(margin=1))
    with pytest.raises(ValueError, match="fp8-lmm"):
        FP8Recipe().same_scaling("fp8-lmm")
    with pytest.raises(TypeError, match="same_scaling takes a recipe or a recipe name, got None"):
        FP8Recipe().same_scaling(None)


@pytest.mark.parametrize("other", [3, None, {"margin": 1}])
def test_same_scaling_of_something_else_names_what_it_got(other):
    with pytest.raises(TypeError, match=r"same_scaling takes a recipe or a recipe name, got"):
        FP8Recipe().same_scaling(other)


def test_a_numpy_bool_flag_is_refused_naming_numpy():
    # NumPy 2 names its bool type "bool": the refusal said "got bool" for np.True_, a riddle (found by a sweep).
    np = pytest.importorskip("numpy")
    from lightning_fp8 import FP8Linear

    with pytest.raises(TypeError, match=r"bias=.*must be True or False \(a Python bool\), got numpy\.bool"):
        FP8Linear(16, 16, bias=np.bool_(True))


def test_replace_names_the_allowed_fields_for_an_unknown_one():
    # dataclasses.replace only said "unexpected keyword argument 'marign'".
    with pytest.raises(TypeError, match=r"unknown field\(s\) \['marign'\]: allowed fields are \['amax_compute_algo'"):
        FP8Recipe().replace(marign=1)
    assert FP8Recipe().replace(margin=2) == FP8Recipe(margin=2)
    with pytest.raises(ValueError, match="margin=-1"):
        FP8Recipe().replace(margin=-1)
