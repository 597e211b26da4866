"""``lightning-fp8 launch``'s settings by flag, shell and config file, from a mutation audit of today's changes
(integrations/accelerate/cli.py and launch_config.py).

Each test kills mutants the existing tests let survive:

- ``launch``: ``args.mixed_precision or _config_mixed_precision(config)`` with its operands swapped (the config file's
  ``mixed_precision`` won over ``--mixed_precision``, which Accelerate lets win).
- ``resolve_environment``, a recipe exported in the shell: ``--fp8-exclude`` and ``--fp8-tp-plan`` replaced by the
  shell's variables (the flags dropped).
- ``resolve_environment``, the recipe ``none`` from a config section: its ``tp_plan`` replaced by ``gpt``.
- ``_given_once``: the comma-separated hint given to the other flags instead of ``--fp8-exclude``.
"""

import os

import pytest

from lightning_fp8.integrations.accelerate import cli
from lightning_fp8.integrations.accelerate.config import ENV_EXCLUDE, ENV_RECIPE, ENV_TP_PLAN, resolve_launch_config
from tests.integrations.accelerate.test_routes_launch import (  # the launch routes' shell and launcher stand-in
    ACCELERATE_KEYS,
    _launched,
    _no_launch_settings,  # noqa: F401 (an autouse fixture)
)


@pytest.mark.parametrize(
    ("in_file", "flag", "refused"),
    [("fp16", "no", False), ("bf16", "fp16", True)],
    ids=["file fp16, flag no", "file bf16, flag fp16"],
)
def test_the_mixed_precision_flag_wins_over_the_config_file_as_in_accelerate(
    monkeypatch, tmp_path, capsys, in_file, flag, refused
):
    """The reference: Accelerate's own reading of the launch (``_validate_launch_command``), where ``--mixed_precision``
    overrides the file. FP8-LM refuses fp16 by what Accelerate will run, and names the flag."""
    import accelerate.commands.launch as accelerate_launch

    seen = []

    def launch_command(args):  # accelerate launch's reading of the command line and file, without the launch
        seen.append(accelerate_launch._validate_launch_command(args)[0].mixed_precision)

    monkeypatch.setattr(accelerate_launch, "launch_command", launch_command)
    path = tmp_path / "c.yaml"
    path.write_text(f"{ACCELERATE_KEYS}mixed_precision: {in_file}\n")
    argv = ["launch", "--config_file", str(path), "--mixed_precision", flag]

    def main(argv: list[str]) -> int:
        with monkeypatch.context() as m:
            m.setattr(os, "environ", dict(os.environ))  # what launch() exports does not reach the next launch
            return cli.main(argv)

    assert main([*argv, "--fp8-recipe", "none", "train.py"]) == 0  # FP8-LM off: what Accelerate runs
    assert seen == [flag]
    status = main([*argv, "train.py"])
    err = capsys.readouterr().err
    if refused:
        assert status == 2 and len(seen) == 1
        assert f"mixed_precision='{flag}' cannot be combined with FP8-LM" in err and "(set by --mixed_precision)" in err
    else:
        assert status == 0 and seen == [flag, flag], err


def test_flags_win_over_the_shell_when_the_recipe_is_exported_in_the_shell(monkeypatch):
    """The docs' order: a setting's flag, else the config section, else the variable already set. With the recipe
    exported in the shell, --fp8-exclude and --fp8-tp-plan still win over the shell's patterns and plan."""
    monkeypatch.setenv(ENV_RECIPE, "fp8-lm-o1")
    monkeypatch.setenv(ENV_EXCLUDE, "lm_head")
    monkeypatch.setenv(ENV_TP_PLAN, "gpt")
    launched = _launched(monkeypatch, ["--cpu", "--fp8-exclude", "fc1,fc2", "--fp8-tp-plan", "llama", "train.py"])
    assert launched == {ENV_RECIPE: "fp8-lm-o1", ENV_EXCLUDE: "fc1,fc2", ENV_TP_PLAN: "llama"}
    monkeypatch.setattr(os, "environ", launched)  # all a training process of that launch sees
    config = resolve_launch_config(None)
    assert (config.exclude_modules, config.tp_plan) == (("fc1", "fc2"), "llama")


def test_a_section_with_the_recipe_none_keeps_its_tp_plan_for_a_recipe_the_script_turns_on(monkeypatch, tmp_path):
    """The reference: a plain launch exporting the recipe none and the plan, where Accelerator(fp8_lm_recipe=...)
    that turns FP8-LM on takes the plan (as it takes the section's patterns)."""
    path = tmp_path / "c.yaml"
    path.write_text(f"{ACCELERATE_KEYS}lightning_fp8:\n  recipe: none\n  tp_plan: llama\n  exclude_modules: [head]\n")
    launched = _launched(monkeypatch, ["--config_file", str(path), "train.py"])
    assert launched == {ENV_RECIPE: "none", ENV_EXCLUDE: "head", ENV_TP_PLAN: "llama"}
    plain = {ENV_RECIPE: "none", ENV_EXCLUDE: "head", ENV_TP_PLAN: "llama"}
    configs = []
    for env in (launched, plain):
        monkeypatch.setattr(os, "environ", dict(env))
        assert resolve_launch_config(None) is None  # FP8-LM off until the script turns it on
        configs.append(resolve_launch_config("fp8-lm"))
    assert configs[0] == configs[1] and configs[0].tp_plan == "llama"


@pytest.mark.parametrize(
    ("flag", "values", "hint"),
    [("--fp8-exclude", ("0", "2"), True), ("--fp8-recipe", ("fp8-lm", "none"), False)],
)
def test_a_repeated_flag_is_refused_with_the_one_flag_spelling_only_where_it_exists(
    monkeypatch, capsys, flag, values, hint
):
    """Several patterns go in one comma-separated --fp8-exclude (the documented spelling, which the message gives);
    a recipe is one name, so the message for --fp8-recipe offers no such spelling."""
    launched = []
    monkeypatch.setattr("accelerate.commands.launch.launch_command", launched.append)
    assert cli.main(["launch", "--cpu", flag, values[0], flag, values[1], "train.py"]) == 2
    err = capsys.readouterr().err
    assert (f"with several patterns comma-separated ({flag} {','.join(values)})" in err) is hint, err
    assert not launched
    if hint:  # the spelling given works
        assert _launched(monkeypatch, ["--cpu", flag, ",".join(values), "train.py"])[ENV_EXCLUDE] == "0,2"
