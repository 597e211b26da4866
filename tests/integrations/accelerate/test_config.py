"""The launch settings: the `lightning_fp8` config section, the environment variables, and their errors."""

import json

import pytest
from torch import nn

from lightning_fp8 import FP8Recipe
from lightning_fp8.integrations.accelerate.config import ENV_EXCLUDE, ENV_RECIPE, ENV_TP_PLAN, FP8LaunchConfig


def test_section_with_name_overrides_and_excludes_round_trips_through_env():
    cfg = FP8LaunchConfig.from_section({"recipe": "fp8-lm-o1", "margin": 1, "exclude_modules": ["lm_head", "*.proj"]})
    assert cfg.recipe == FP8Recipe(opt_level="O1", margin=1)
    env = cfg.to_env()
    # Not a named recipe any more: the environment carries every field as JSON.
    assert json.loads(env[ENV_RECIPE]) == cfg.recipe.to_dict()
    assert env[ENV_EXCLUDE] == "lm_head,*.proj"
    assert FP8LaunchConfig.from_env(env) == cfg


def test_named_recipe_travels_by_name_and_string_shorthand():
    cfg = FP8LaunchConfig.from_section("fp8-lm-current")
    assert cfg.recipe == FP8Recipe.from_name("fp8-lm-current")
    assert cfg.to_env() == {ENV_RECIPE: "fp8-lm-current", ENV_EXCLUDE: "", ENV_TP_PLAN: "gpt"}
    assert FP8LaunchConfig.from_section({}).recipe == FP8Recipe()  # the default recipe is fp8-lm


@pytest.mark.parametrize("off", [{"recipe": "none"}, "none"])
def test_none_turns_fp8_off(off):
    assert FP8LaunchConfig.from_section(off) is None
    assert FP8LaunchConfig.from_env({ENV_RECIPE: "none"}) is None
    assert FP8LaunchConfig.from_env({}) is None


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ({"recipe": "fp8-lmm"}, r"lightning_fp8\.recipe='fp8-lmm' is not a known FP8 recipe: choose one of \['fp8-lm'"),
        ({"recipe": "fp8-lm", "histroy": 3}, r"unknown key\(s\) \['histroy'\]: allowed keys are \['recipe'"),
        ({"recipe": "fp8-lm", "scaling": "dynamic"}, r"FP8Recipe\(scaling='dynamic'\) is not supported.*delayed"),
        ({"exclude_modules": 3}, r"exclude_modules=3 must be a list of module name patterns"),
        ([1, 2], r"must be a recipe name or a mapping"),
        ({"tp_plan": "megatron"}, r"lightning_fp8\.tp_plan='megatron' is not a tensor-parallel plan: choose one"),
        # `recipe:` left empty in YAML is None: an error saying what to write, never FP8-LM silently off.
        ({"recipe": None}, r"lightning_fp8\.recipe is empty: write a recipe name .* 'none' to turn FP8-LM off"),
        ({"recipe": False}, r"recipe=False is not a known FP8 recipe.*\(YAML reads off/no/false as False"),
        (False, r"got False \(YAML reads off/no/false as False: write 'none'"),
    ],
)
def test_bad_sections_say_what_is_allowed(section, match):
    with pytest.raises(ValueError, match=match):
        FP8LaunchConfig.from_section(section)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("fp8_lm", r"LIGHTNING_FP8_RECIPE='fp8_lm' is not a known FP8 recipe: choose one of \['fp8-lm', "),
        ("{bad json", r"is not valid JSON"),
        ('{"name": "fp8-lm", "marign": 1}', r"unknown FP8Recipe field\(s\) \['marign'\]"),
        ('{"margin": -1}', r"margin=-1"),
        # The config section's keys, which the variable spells otherwise or holds in variables of their own:
        ('{"recipe": "fp8-lm-o1"}', r"\['recipe'\]: allowed are .* and \"name\" .*'recipe' goes in \"name\""),
        ('{"exclude_modules": ["lm_head"]}', r"'exclude_modules' goes in LIGHTNING_FP8_EXCLUDE$"),
        ('{"tp_plan": "llama"}', r"'tp_plan' goes in LIGHTNING_FP8_TP_PLAN$"),
    ],
)
def test_bad_environment_values(value, match):
    with pytest.raises(ValueError, match=match):
        FP8LaunchConfig.from_env({ENV_RECIPE: value})


@pytest.mark.parametrize(
    ("plan", "expected"),
    [("", ("gpt", True)), ("llama", ("llama", True)), ("gpt-no-sp", ("gpt", False)), ("none", None)],
)
def test_tensor_parallel_plan_from_the_launch(plan, expected):
    cfg = FP8LaunchConfig.from_env({ENV_RECIPE: "fp8-lm", ENV_TP_PLAN: plan})
    assert cfg.tensor_parallel == expected
    assert FP8LaunchConfig.from_env(cfg.to_env()) == cfg
    with pytest.raises(ValueError, match=r"LIGHTNING_FP8_TP_PLAN='rows' is not a tensor-parallel plan"):
        FP8LaunchConfig.from_env({ENV_RECIPE: "fp8-lm", ENV_TP_PLAN: "rows"})


def test_json_environment_recipe_starts_from_its_named_base():
    cfg = FP8LaunchConfig.from_env({ENV_RECIPE: '{"name": "fp8-lm-e4m3", "amax_history_len": 4}'})
    assert cfg.recipe == FP8Recipe(fp8_format="e4m3", amax_history_len=4)


def test_module_filter_matches_qualified_name_or_last_component():
    cfg = FP8LaunchConfig(recipe=FP8Recipe(), exclude_modules=("lm_head", "blocks.1.*"))
    layer = nn.Linear(16, 16)
    assert not cfg.module_filter(layer, "lm_head")
    assert not cfg.module_filter(layer, "model.lm_head")
    assert not cfg.module_filter(layer, "blocks.1.mlp.fc")
    assert cfg.module_filter(layer, "blocks.0.mlp.fc")
    assert cfg.module_filter(layer, "lm_head_extra")


def test_a_recipe_from_code_keeps_the_shell_exclude_even_without_a_launch_recipe(monkeypatch):
    from lightning_fp8.integrations.accelerate.config import resolve_launch_config

    monkeypatch.delenv(ENV_RECIPE, raising=False)
    monkeypatch.setenv(ENV_EXCLUDE, "lm_head, *.proj")
    assert resolve_launch_config("fp8-lm-o1").exclude_modules == ("lm_head", "*.proj")
    monkeypatch.setenv(ENV_RECIPE, "fp8-lm")
    with pytest.warns(UserWarning, match=r"overrides the launch's LIGHTNING_FP8_RECIPE='fp8-lm'"):
        assert resolve_launch_config("fp8-lm-o1").exclude_modules == ("lm_head", "*.proj")


def test_none_from_code_turning_off_a_launch_recipe_says_so(monkeypatch):
    # Every other recipe from code that differs from the launch's warns; "none" turned FP8 off without a word.
    from lightning_fp8.integrations.accelerate.config import resolve_launch_config

    monkeypatch.setenv(ENV_RECIPE, "fp8-lm-e4m3")
    with pytest.warns(UserWarning, match=r"fp8_lm_recipe='none'\) turns off .* LIGHTNING_FP8_RECIPE='fp8-lm-e4m3'"):
        assert resolve_launch_config("none") is None


@pytest.mark.parametrize("code", ["none", "fp8-lm-o1"])
def test_a_recipe_from_code_overrides_a_launch_recipe_that_does_not_parse(monkeypatch, code):
    # The environment was parsed first: a bad LIGHTNING_FP8_RECIPE in the shell failed Accelerator(fp8_lm_recipe=...).
    from lightning_fp8.integrations.accelerate.config import resolve_launch_config

    monkeypatch.setenv(ENV_RECIPE, f"fp8-lmm-{code}")
    monkeypatch.delenv(ENV_EXCLUDE, raising=False)
    if code == "none":
        assert resolve_launch_config(code) is None
    else:
        with pytest.warns(UserWarning, match=rf"overrides the launch's LIGHTNING_FP8_RECIPE='fp8-lmm-{code}'"):
            assert resolve_launch_config(code).recipe == FP8Recipe.from_name(code)
    with pytest.raises(ValueError, match="is not a known FP8 recipe"):
        resolve_launch_config(None)


@pytest.mark.parametrize("patterns", [("blocks.[0,1].fc",), ("lm_head", "h[a,b]"), ("[ab]c",), ("lm_head", "fc")])
def test_exclude_patterns_with_a_comma_reach_the_training_processes_whole(patterns):
    # An fnmatch class may hold a comma: the launch sends such patterns as a JSON array, not split on commas.
    cfg = FP8LaunchConfig(recipe=FP8Recipe(), exclude_modules=patterns)
    env = cfg.to_env()
    assert FP8LaunchConfig.from_env(env).exclude_modules == patterns
    if not any("," in p or p.startswith("[") for p in patterns):
        assert env[ENV_EXCLUDE] == ",".join(patterns)  # plain lists stay comma-separated, as documented


def test_exclude_environment_takes_a_json_array_or_a_comma_list():
    read = FP8LaunchConfig.from_env
    assert read({ENV_RECIPE: "fp8-lm", ENV_EXCLUDE: '["blocks.[0,1].fc", "lm_head"]'}).exclude_modules == (
        "blocks.[0,1].fc",
        "lm_head",
    )
    assert read({ENV_RECIPE: "fp8-lm", ENV_EXCLUDE: "[ab]c, lm_head"}).exclude_modules == ("[ab]c", "lm_head")


def test_unknown_keys_of_mixed_types_are_reported():
    # YAML reads `on:` as the key True: sorting it with string keys must not raise a bare TypeError.
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['marg1n', True\]: allowed keys are"):
        FP8LaunchConfig.from_section({"recipe": "fp8-lm", True: True, "marg1n": 1})


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ('{"name": "none", "margin": 1}', r"LIGHTNING_FP8_RECIPE=.* has \"name\": \"none\", which is not a base recipe"
         r": choose one of \['fp8-lm'.*to turn FP8-LM off set LIGHTNING_FP8_RECIPE=none"),
        ('[{"margin": 1}]', r"LIGHTNING_FP8_RECIPE='\[\{\"margin\": 1\}\]' must be a JSON object of FP8Recipe fields"),
        (" [1]", r"LIGHTNING_FP8_RECIPE='\[1\]' must be a JSON object of FP8Recipe fields"),
    ],
)
def test_json_environment_errors_name_the_variable_and_what_is_allowed(value, match):
    with pytest.raises(ValueError, match=match):
        FP8LaunchConfig.from_env({ENV_RECIPE: value})


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ({"recipe": "none", "margin": -5}, r"margin=-5"),
        ({"recipe": "none", "opt_level": "O9"}, r"opt_level='O9'"),
        ({"recipe": "none", "tp_plan": "nope"}, r"tp_plan='nope' is not a tensor-parallel plan"),
        ({"recipe": "none", "exclude_modules": 3}, r"exclude_modules=3 must be a list"),
    ],
)
def test_a_section_turned_off_is_still_checked(section, match):
    # A broken section is reported when it is written, not when FP8-LM is switched back on.
    with pytest.raises(ValueError, match=match):
        FP8LaunchConfig.from_section(section)
