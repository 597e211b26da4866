"""`lightning-fp8`: recipe listing, the resolution of the FP8 settings, and errors before anything is launched."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_fp8 import FP8Recipe
from lightning_fp8.integrations.accelerate import cli
from lightning_fp8.integrations.accelerate.config import ENV_EXCLUDE, ENV_RECIPE, ENV_TP_PLAN, FP8LaunchConfig
from lightning_fp8.integrations.accelerate.launch_config import read_config, write_config
from lightning_fp8.integrations.accelerate.launch_config import resolve_environment as resolve


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    # launch() exports what it resolved into os.environ: each test gets its own copy, so that nothing leaks into
    # later tests (PARALLELISM_CONFIG_TP_SIZE=2 left behind made every later Accelerator try to init a process group).
    monkeypatch.setattr(os, "environ", dict(os.environ))
    for name in (ENV_RECIPE, ENV_EXCLUDE, ENV_TP_PLAN):
        os.environ.pop(name, None)


def test_recipes_lists_every_name_with_its_fields(capsys):
    assert cli.main(["recipes"]) == 0
    lines = dict(line.split(": ", 1) for line in capsys.readouterr().out.strip().splitlines())
    assert sorted(lines) == FP8Recipe.names()
    assert FP8Recipe.from_dict(json.loads(lines["fp8-lm-o1"])) == FP8Recipe.from_name("fp8-lm-o1")


def test_recipes_refuses_arguments_it_would_ignore(capsys):
    # `lightning-fp8 recipes fp8-lm` printed every recipe, the argument silently ignored.
    assert cli.main(["recipes", "fp8-lm"]) == 2
    assert "lightning-fp8 recipes: takes no arguments, got ['fp8-lm']" in capsys.readouterr().err
    assert cli.main(["recipes", "--help"]) == 0
    assert "usage: lightning-fp8 launch" in capsys.readouterr().out


def test_unknown_command_and_usage(capsys):
    assert cli.main(["lanch"]) == 2
    assert "unknown command 'lanch'" in capsys.readouterr().err
    assert cli.main([]) == 2


def test_precedence_flags_then_section_then_environment_then_default(monkeypatch):
    section = {"recipe": "fp8-lm-o1", "exclude_modules": ["lm_head"], "tp_plan": "llama"}
    assert resolve(None, None, None, None) == {
        ENV_RECIPE: "fp8-lm",
        ENV_EXCLUDE: "",
        ENV_TP_PLAN: "gpt",
    }
    monkeypatch.setenv(ENV_RECIPE, "fp8-lm-current")
    monkeypatch.setenv(ENV_TP_PLAN, "gpt-no-sp")
    assert resolve(None, None, None, None) == {
        ENV_RECIPE: "fp8-lm-current",
        ENV_EXCLUDE: "",
        ENV_TP_PLAN: "gpt-no-sp",
    }
    assert resolve(None, None, None, None, "none")[ENV_TP_PLAN] == "none"
    expected = {ENV_RECIPE: "fp8-lm-o1", ENV_EXCLUDE: "lm_head", ENV_TP_PLAN: "llama"}
    assert resolve(section, None, None, "c.yaml") == expected
    expected = {ENV_RECIPE: "fp8-lm-e4m3", ENV_EXCLUDE: "a,b", ENV_TP_PLAN: "gpt"}
    assert resolve(section, "fp8-lm-e4m3", "a,b", "c.yaml", "gpt") == expected
    assert resolve(section, "none", None, "c.yaml")[ENV_RECIPE] == "none"
    custom = resolve({"recipe": "fp8-lm", "margin": 2}, None, None, "c.yaml")[ENV_RECIPE]
    assert FP8Recipe.from_dict(json.loads(custom)) == FP8Recipe(margin=2)


def _write(path, data):
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize(
    ("section", "flags", "expected"),
    [
        (
            {"recipe": "fp8-lmm"},
            [],
            r"lightning-fp8 launch: error: lightning_fp8 \(in .*bad\.yaml\)\.recipe='fp8-lmm' is not a known FP8 "
            r"recipe: choose one of \['fp8-lm', 'fp8-lm-current', 'fp8-lm-e4m3', 'fp8-lm-o1'\]",
        ),
        ({"recipe": "fp8-lm", "recipie": "x"}, [], r"unknown key\(s\) \['recipie'\]: allowed keys are"),
        (None, ["--fp8-recipe", "e4m3"], r"--fp8-recipe='e4m3' is not a known FP8 recipe: choose one of"),
        ({"tp_plan": "megatron"}, [], r"tp_plan='megatron' is not a tensor-parallel plan: choose one of \['gpt'"),
        (None, ["--fp8-tp-plan", "row"], r"--fp8-tp-plan='row' is not a tensor-parallel plan: choose one of"),
        # Accelerate's own FP8 options: its parser takes them, lightning_fp8's Accelerator would ignore them
        # (options every Accelerate since 1.0 has: 1.16 dropped MS-AMP's --fp8_opt_level)
        (
            None,
            ["--fp8_margin", "2", "--fp8-amax-history-len=8"],
            r"error: --fp8_amax_history_len, --fp8_margin: "
            r"options of Accelerate's own FP8 backends .* Set FP8-LM's with --fp8-recipe",
        ),
    ],
)
def test_bad_settings_fail_before_launching(tmp_path, capsys, section, flags, expected):
    config = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "NO", "num_processes": 1}
    if section is not None:
        config["lightning_fp8"] = section
    path = _write(tmp_path / "bad.yaml", config)
    # The training script does not exist: the error must come first, and nothing may be launched.
    assert cli.main(["launch", "--config_file", path, *flags, str(tmp_path / "missing.py")]) == 2
    err = capsys.readouterr().err
    assert re.search(expected, err), err


def test_accelerate_rejects_our_section_so_launch_hands_it_a_copy_without_it(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    config = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_CPU", "num_processes": 3}
    path = _write(tmp_path / "c.yaml", {**config, "lightning_fp8": {"recipe": "fp8-lm-o1"}})
    # Why the section has to go (if Accelerate starts accepting unknown keys, this documents a change).
    with pytest.raises(ValueError, match=r"unknown keys \(\['lightning_fp8'\]\)"):
        load_config_from_file(path)
    data = read_config(path)
    assert data.pop("lightning_fp8") == {"recipe": "fp8-lm-o1"}
    loaded = load_config_from_file(write_config(data, tmp_path / "clean.yaml"))
    assert (loaded.distributed_type.value, loaded.num_processes) == ("MULTI_CPU", 3)


def test_parallelism_sizes_turn_the_parallelism_config_on(capsys, monkeypatch):
    # accelerate launch ignores --parallelism_config_tp_size without --use_parallelism_config (it would train
    # data-parallel) and refuses that switch without FSDP2; lightning-fp8 launch exports what the switch would.
    for name in ("ACCELERATE_USE_PARALLELISM_CONFIG", "PARALLELISM_CONFIG_TP_SIZE", "PARALLELISM_CONFIG_DP_SHARD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    plain = cli._parser().parse_args(["--multi_gpu", "train.py"])
    cli._use_parallelism_config_if_sized(plain)
    assert "ACCELERATE_USE_PARALLELISM_CONFIG" not in os.environ and capsys.readouterr().err == ""
    args = cli._parser().parse_args(["--multi_gpu", "--parallelism_config_tp_size", "2", "train.py"])
    cli._use_parallelism_config_if_sized(args)
    assert os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
    assert (os.environ["PARALLELISM_CONFIG_TP_SIZE"], os.environ["PARALLELISM_CONFIG_DP_SHARD_SIZE"]) == ("2", "1")
    assert "parallelism sizes given: exporting" in capsys.readouterr().err


def test_shell_exclude_and_plan_are_kept_whatever_chooses_the_recipe(monkeypatch):
    # Each setting: its flag, else the section's key, else the variable exported in the shell, else the default.
    monkeypatch.setenv(ENV_EXCLUDE, "lm_head")
    monkeypatch.setenv(ENV_TP_PLAN, "llama")
    kept = {ENV_EXCLUDE: "lm_head", ENV_TP_PLAN: "llama"}
    assert resolve(None, "fp8-lm-o1", None, None) == {
        ENV_RECIPE: "fp8-lm-o1",
        **kept,
    }  # recipe by flag
    assert resolve(None, None, None, None) == {
        ENV_RECIPE: "fp8-lm",
        **kept,
    }  # the default recipe
    assert resolve({"recipe": "fp8-lm-e4m3"}, None, None, "c.yaml") == {
        ENV_RECIPE: "fp8-lm-e4m3",
        **kept,
    }
    section = {"exclude_modules": ["head"], "tp_plan": "gpt"}  # the section's keys win over the shell's ...
    from_section = {ENV_RECIPE: "fp8-lm", ENV_EXCLUDE: "head", ENV_TP_PLAN: "gpt"}
    assert resolve(section, None, None, "c.yaml") == from_section
    assert resolve(section, None, "fc", "c.yaml", "none")[ENV_EXCLUDE] == "fc"  # ... and the flags over both
    monkeypatch.setenv(ENV_TP_PLAN, "rows")
    with pytest.raises(ValueError, match=r"LIGHTNING_FP8_TP_PLAN='rows' is not a tensor-parallel plan"):
        resolve(None, "fp8-lm", None, None)


def test_launch_passes_the_shell_exclude_on_with_a_recipe_flag(tmp_path):
    root = Path(__file__).resolve().parents[3]
    script = tmp_path / "print_env.py"
    script.write_text(f"import os\nopen({str(tmp_path / 'env.json')!r}, 'w').write(__import__('json').dumps("
                      f"{{k: os.environ.get(k) for k in ({ENV_RECIPE!r}, {ENV_EXCLUDE!r})}}))\n")  # fmt: skip
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("LIGHTNING_FP8_", "ACCELERATE_"))}
    environ.update({"HF_HOME": str(tmp_path / "hf"), "PYTHONPATH": str(root), ENV_EXCLUDE: "lm_head"})
    cmd = [sys.executable, "-m", "lightning_fp8.integrations.accelerate.cli", "launch", "--cpu", "--fp8-recipe",
           "fp8-lm-o1", str(script)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=root, env=environ, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "env.json").read_text()) == {ENV_RECIPE: "fp8-lm-o1", ENV_EXCLUDE: "lm_head"}


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"lightning_fp8": {"recipe": "fp8-lm"}}, r"has no `distributed_type`.*add `distributed_type: 'NO'`"),
        ({"lightning_fp8": "fp8-lm-o1", "use_cpu": True}, r"has no `distributed_type`"),
        ({"distributed_type": "NO", "lightning_fp8": {"recipe": None}}, r"\.recipe is empty: write a recipe name"),
        ({"distributed_type": "NO", "lightning_fp8": False}, r"got False \(YAML reads off/no/false as False"),
        # Accelerate refuses the unknown key with a traceback that suggests upgrading it
        (
            {"distributed_type": "NO", "lightning-fp8": {"recipe": "fp8-lm-o1"}},
            r"error: config file .* has a section `lightning-fp8`: the FP8-LM section is named `lightning_fp8`",
        ),
    ],
)
def test_config_file_edge_values_fail_before_launching_with_what_to_write(tmp_path, capsys, config, expected):
    path = _write(tmp_path / "edge.yaml", config)
    assert cli.main(["launch", "--config_file", path, str(tmp_path / "missing.py")]) == 2
    err = capsys.readouterr().err
    assert re.search(expected, err), err


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("bad.yaml", "distributed_type: NO\nlightning_fp8: {recipe: fp8\n", r"config file .*bad.yaml does not parse"),
        ("bad.json", '{"distributed_type": "NO",', r"config file .*bad.json does not parse"),
        ("list.yaml", "- distributed_type\n", r"config file .*list.yaml does not hold a mapping \(it holds a list\)"),
        # an empty file said only "does not hold a mapping", not what to write
        ("empty.yaml", "", r"empty.yaml does not hold a mapping \(it is empty\): write .*accelerate config --config_f"),
        # Accelerate's own FP8 settings, which FP8-LM does not read (its --fp8_* options are refused alike)
        ("fp8.yaml", "distributed_type: 'NO'\nfp8_config:\n  backend: TE\n", r"has an `fp8_config` section"),
    ],
)
def test_a_config_file_that_does_not_parse_or_holds_accelerates_fp8_section_is_a_usage_error(
    tmp_path, capsys, name, text, expected
):
    """A malformed file raised the YAML/JSON parser's traceback (a list exited with status 1); Accelerate's
    fp8_config section was launched with and silently unused (found by a sweep)."""
    path = tmp_path / name
    path.write_text(text)
    assert cli.main(["launch", "--config_file", str(path), str(tmp_path / "missing.py")]) == 2
    err = capsys.readouterr().err
    assert re.search(expected, err), err


def test_an_empty_section_means_the_defaults_and_is_removed_from_accelerates_copy(tmp_path, monkeypatch):
    path = tmp_path / "empty.yaml"
    path.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nlightning_fp8:\n")
    seen = {}

    def launch_command(args):  # what accelerate launch would be given
        seen["config"] = read_config(args.config_file)
        seen["recipe"] = os.environ[ENV_RECIPE]

    monkeypatch.setattr("accelerate.commands.launch.launch_command", launch_command)
    assert cli.main(["launch", "--config_file", str(path), "train.py"]) == 0
    assert seen == {"config": {"compute_environment": "LOCAL_MACHINE", "distributed_type": "NO"}, "recipe": "fp8-lm"}


@pytest.mark.parametrize("argv", [["--help"], ["--cpu", "--help"], ["--config_file", "c.yaml", "-h"]])
def test_launch_help_lists_the_fp8_options_wherever_help_is_asked(capsys, argv):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["launch", *argv])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.index("--fp8-recipe NAME") < out.index("All other options are those of `accelerate launch`")
    assert "--fp8-exclude PATTERNS" in out and "--fp8-tp-plan PLAN" in out and "--num_processes" in out


def test_launch_help_under_its_own_program_name_lists_accelerates_options(capsys, monkeypatch):
    # Accelerate's help formatter filters its groups by sys.argv: run as `lightning-fp8 launch --help`, it hid most of
    # `accelerate launch --help`'s options, which the help says are all there. The reference: Accelerate's own help.
    from accelerate.commands.launch import launch_command_parser

    monkeypatch.setattr(sys, "argv", ["accelerate", "launch", "--help"])
    reference = launch_command_parser().format_help()
    monkeypatch.setattr(sys, "argv", ["/usr/bin/lightning-fp8", "launch", "--help"])
    with pytest.raises(SystemExit):
        cli.main(["launch", "--help"])
    out = capsys.readouterr().out
    options = set(re.findall(r"--[a-z_]+", reference))
    assert {"--config_file", "--cpu", "--main_process_port", "--num_processes"} <= options
    assert options <= set(re.findall(r"--[a-z_]+", out)), sorted(options - set(re.findall(r"--[a-z_]+", out)))
    assert sys.argv == ["/usr/bin/lightning-fp8", "launch", "--help"]  # put back


def test_a_script_argument_named_like_an_accelerate_fp8_option_is_the_scripts(tmp_path, monkeypatch):
    """Only options before the training script are the launcher's: the script's own --fp8_margin passes through."""
    seen = {}
    monkeypatch.setattr("accelerate.commands.launch.launch_command", lambda args: seen.update(vars(args)))
    script = str(tmp_path / "train.py")
    assert cli.main(["launch", "--cpu", script, "--fp8_margin", "2"]) == 0
    assert seen["training_script"] == script and seen["training_script_args"] == ["--fp8_margin", "2"]


@pytest.mark.parametrize("section", ["lightning_fp8:\n  recipe: fp8-lm-o1\n", ""], ids=["with section", "without"])
def test_a_cpu_launch_through_torchrun_keeps_accelerates_default_config_file_out(tmp_path, monkeypatch, section):
    # --cpu keeps Accelerate's default config file out; the switch to torchrun turned --cpu off, and Accelerate then
    # read that file, unfiltered: our section failed it, or its mixed_precision leaked into the CPU launch.
    import accelerate.commands.launch as accelerate_launch

    default = tmp_path / "default_config.yaml"
    accelerate_keys = "compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nmixed_precision: fp16\n"
    default.write_text(accelerate_keys + section)
    monkeypatch.setattr("accelerate.commands.config.config_args.default_config_file", str(default))
    monkeypatch.setattr(accelerate_launch, "default_config_file", str(default))
    seen = {}

    def launch_command(args):  # accelerate launch's checks and defaults, without the launch
        args, _, _ = accelerate_launch._validate_launch_command(args)
        seen.update(vars(args), recipe=os.environ[ENV_RECIPE])

    monkeypatch.setattr(accelerate_launch, "launch_command", launch_command)
    assert cli.main(["launch", "--cpu", "--num_processes", "2", str(tmp_path / "train.py")]) == 0
    assert (seen["mixed_precision"], seen["num_processes"], seen["multi_gpu"]) == ("no", 2, True)
    assert seen["recipe"] == "fp8-lm" and os.environ["ACCELERATE_USE_CPU"] == "true"


@pytest.mark.parametrize("blank", ["", " ", "\t"])
def test_a_blank_shell_recipe_counts_as_unset_not_as_off(monkeypatch, blank):
    # Under the launcher an unset LIGHTNING_FP8_RECIPE means fp8-lm: a blank one must not turn FP8-LM off.
    monkeypatch.setenv(ENV_RECIPE, blank)
    assert resolve(None, None, None, None) == {
        ENV_RECIPE: "fp8-lm",
        ENV_EXCLUDE: "",
        ENV_TP_PLAN: "gpt",
    }


def test_a_section_pattern_with_a_comma_reaches_the_training_processes_whole(monkeypatch):
    monkeypatch.delenv(ENV_RECIPE, raising=False)
    monkeypatch.delenv(ENV_EXCLUDE, raising=False)
    env = resolve({"exclude_modules": ["blocks.[0,1].fc", "lm_head"]}, None, None, "c.yaml")
    assert FP8LaunchConfig.from_env(env).exclude_modules == ("blocks.[0,1].fc", "lm_head")


def test_a_yaml_boolean_key_in_the_section_is_reported_as_unknown(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("distributed_type: 'NO'\nlightning_fp8:\n  recipe: fp8-lm\n  on: true\n  marg1n: 1\n")
    assert cli.main(["launch", "--config_file", str(path), str(tmp_path / "missing.py")]) == 2
    assert re.search(r"unknown key\(s\) \['marg1n', True\]: allowed keys are", capsys.readouterr().err)


@pytest.mark.parametrize("where", ["flag", "config"])
@pytest.mark.parametrize("value", ["fp8", "fp16"])
def test_accelerates_fp8_or_fp16_mixed_precision_fails_before_launching(tmp_path, capsys, monkeypatch, where, value):
    # mixed_precision fp8 selects Accelerate's own FP8 backends (its launcher failed with a traceback when none was
    # installed), fp16 a second loss scaler: refused as the Accelerator refuses them, nothing launched. With FP8-LM
    # off (recipe none) they are Accelerate's business and pass on.
    launched = []
    monkeypatch.setattr("accelerate.commands.launch.launch_command", lambda args: launched.append(args))
    config = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "NO", "num_processes": 1}
    flags = ["--mixed_precision", value] if where == "flag" else []
    if where == "config":
        config["mixed_precision"] = value
    path = _write(tmp_path / "c.yaml", config)
    script = str(tmp_path / "train.py")
    assert cli.main(["launch", "--config_file", path, *flags, script]) == 2
    err = capsys.readouterr().err
    expected = rf"lightning-fp8 launch: error: mixed_precision='{value}' cannot be combined with FP8-LM"
    assert re.search(expected, err), err
    assert not launched
    assert cli.main(["launch", "--config_file", path, *flags, "--fp8-recipe", "none", script]) == 0
    assert len(launched) == 1


def test_exclude_variable_as_a_json_array_takes_strings_only_and_may_be_empty():
    """A JSON array carries patterns with commas (to_env writes one); '[1, 2]' became the patterns '[1' and '2]' and
    '[]' the pattern '[]' (each matching nothing: conversion only warned)."""
    env = {ENV_RECIPE: "fp8-lm"}
    assert FP8LaunchConfig.from_env({**env, ENV_EXCLUDE: '["blocks.[0,1].fc", "lm_head"]'}).exclude_modules == (
        "blocks.[0,1].fc",
        "lm_head",
    )
    assert FP8LaunchConfig.from_env({**env, ENV_EXCLUDE: "[]"}).exclude_modules == ()
    assert FP8LaunchConfig.from_env({**env, ENV_EXCLUDE: "[ab]c"}).exclude_modules == ("[ab]c",)  # not JSON
    for value in ("[1, 2]", '["lm_head", 3]'):
        with pytest.raises(ValueError, match=r"LIGHTNING_FP8_EXCLUDE=.* is a JSON array of .*int.*as strings"):
            FP8LaunchConfig.from_env({**env, ENV_EXCLUDE: value})
