"""The launcher's config file and the FP8-LM settings it resolves: an Accelerate config file read and checked (its
``lightning_fp8:`` section besides Accelerate's own keys), the copy without that section written for Accelerate, and
the environment the training processes get (:data:`~lightning_fp8.integrations.accelerate.config.ENV_RECIPE` and the
others) from the flags, the section, the shell's variables and the defaults, in that order."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from lightning_fp8.integrations.accelerate.config import (
    CONFIG_KEY,
    ENV_EXCLUDE,
    ENV_RECIPE,
    ENV_TP_PLAN,
    OFF,
    FP8LaunchConfig,
    check_recipe_name,
    check_tp_plan,
    exclude_patterns,
    tp_plan_from_env,
)
from lightning_fp8.recipe import FP8Recipe


def normalized_key(key: str) -> str:
    # lightning-fp8, Lightning_FP8, lightning fp8, lightningfp8 -> lightning_fp8
    flat = "".join(c for c in key.lower() if c.isalnum())
    return "lightning_fp8" if flat == "lightningfp8" else key


def read_config(path: str) -> dict[str, Any]:
    """The config file's mapping; ValueError for a file that does not parse or holds no mapping."""
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f) if path.endswith(".json") else yaml.safe_load(f)
        except (json.JSONDecodeError, yaml.YAMLError) as err:
            raise ValueError(f"config file {path} does not parse: {err}") from None
    if not isinstance(data, dict):
        what = "is empty" if data is None else f"holds a {type(data).__name__}"
        raise ValueError(
            f"config file {path} does not hold a mapping (it {what}): write Accelerate's settings into it with "
            f"`accelerate config --config_file {path}` (at least `distributed_type`), then add the `{CONFIG_KEY}:` "
            "section; or leave --config_file out and pass --fp8-recipe / --fp8-exclude"
        )
    return data


def check_accelerate_keys(config: dict[str, Any], path: str) -> None:
    """Accelerate requires ``distributed_type`` in every config file (and fails with a traceback without it), and
    refuses unknown keys (a mis-spelled ``lightning_fp8`` section, or an Accelerator argument, with a traceback that
    names the copy without our section and suggests upgrading Accelerate): say what to change before anything is
    launched."""
    near = [key for key in config if isinstance(key, str) and key != CONFIG_KEY and normalized_key(key) == CONFIG_KEY]
    if near:
        raise ValueError(f"config file {path} has a section `{near[0]}`: the FP8-LM section is named `{CONFIG_KEY}`")
    if "distributed_type" not in config:
        raise ValueError(
            f"config file {path} has no `distributed_type`, which Accelerate requires besides the `{CONFIG_KEY}` "
            "section: add `distributed_type: 'NO'` for one process (MULTI_GPU or MULTI_CPU, with num_processes, for "
            "several), or "
            f"write the Accelerate settings with `accelerate config --config_file {path}` and add the section back. "
            "FP8 settings alone need no config file: pass --fp8-recipe / --fp8-exclude instead"
        )
    # Accelerate refuses them too, but in the copy without our section: its traceback would name a temporary file
    # that is gone by then (and suggest upgrading Accelerate).
    from accelerate.commands.config.config_args import ClusterConfig, SageMakerConfig
    from accelerate.utils import ComputeEnvironment

    local = config.get("compute_environment", ComputeEnvironment.LOCAL_MACHINE) == ComputeEnvironment.LOCAL_MACHINE
    kind = ClusterConfig if local else SageMakerConfig
    known = kind.__dataclass_fields__
    # As Accelerate reads the file: its process_config first turns old keys (fp16, dynamo_backend) into new ones.
    processed = kind.process_config(dict(config)) if hasattr(kind, "process_config") else config
    unknown = sorted((key for key in processed if key not in known), key=repr)
    if unknown:
        raise ValueError(
            f"config file {path} has key(s) {unknown} that Accelerate's config file does not take (it takes "
            f"{sorted(known)}, plus the `{CONFIG_KEY}` section): remove them, and set what the script's Accelerator "
            "takes (gradient_accumulation_steps, ...) in the script"
        )


def write_config(config: dict[str, Any], path: Path) -> str:
    with open(path, "w", encoding="utf-8") as f:
        if path.suffix == ".json":
            json.dump(config, f)
        else:
            yaml.safe_dump(config, f)
    return str(path)


def resolve_environment(
    section: object,
    recipe_flag: str | None,
    exclude_flag: str | None,
    path: str | None,
    tp_plan_flag: str | None = None,
) -> dict[str, str]:
    """The environment for the training processes. Each setting comes from the first of: its flag, the config
    section, the environment variable already set, the default.

    The recipe: ``--fp8-recipe``, else the section's (a section without ``recipe`` means ``fp8-lm``), else
    ``LIGHTNING_FP8_RECIPE``, else ``fp8-lm``. The excluded modules and the tensor-parallel plan: ``--fp8-exclude`` /
    ``--fp8-tp-plan``, else the section's ``exclude_modules`` / ``tp_plan``, else ``LIGHTNING_FP8_EXCLUDE`` /
    ``LIGHTNING_FP8_TP_PLAN``, else none / ``gpt``: patterns exported in the shell are kept whichever way the
    recipe was chosen, the recipe ``none`` included (an ``Accelerator(fp8_lm_recipe=...)`` in the script that turns
    FP8-LM on keeps them).

    Raises:
        ValueError: on a bad recipe name, plan, pattern list or section, naming where it came from and what is
            allowed.
    """
    if recipe_flag is not None:
        check_recipe_name(recipe_flag, "--fp8-recipe")
    if tp_plan_flag is not None:
        check_tp_plan(tp_plan_flag, "--fp8-tp-plan")
    # Checked where they came from: an error names the flag or the variable, not the config section.
    exclude = None if exclude_flag is None else exclude_patterns(exclude_flag, "--fp8-exclude")
    if section is None and recipe_flag is None and os.environ.get(ENV_RECIPE, "").strip():
        # Set in the shell: validate it as the training processes will, then pass it on. A blank value counts as
        # unset, as it does for the training processes: the launcher's default fp8-lm, not FP8-LM off.
        launched = FP8LaunchConfig.from_env({ENV_RECIPE: os.environ[ENV_RECIPE]})
        recipe = None if launched is None else launched.recipe
        exclude = exclude if exclude is not None else exclude_patterns(os.environ.get(ENV_EXCLUDE, ""), ENV_EXCLUDE)
        tp_plan = tp_plan_flag if tp_plan_flag is not None else tp_plan_from_env(os.environ)
    else:
        source = f"{CONFIG_KEY} (in {path})" if section is not None else CONFIG_KEY
        if section is None:
            section = {}
        elif isinstance(section, str):
            section = {"recipe": section}
        if isinstance(section, dict):
            section = dict(section)
            if recipe_flag is not None:
                section["recipe"] = recipe_flag
            _set_from_flag_or_environment(section, "exclude_modules", exclude, ENV_EXCLUDE)
            _set_from_flag_or_environment(section, "tp_plan", tp_plan_flag, ENV_TP_PLAN)
        settings = FP8LaunchConfig.from_section(section, source)
        if settings is not None:
            return settings.to_env()
        # The recipe none: from_section checked the section's patterns and plan.
        recipe = None
        exclude = exclude_patterns(section.get("exclude_modules", ()), f"{source}.exclude_modules")
        tp_plan = section.get("tp_plan", "gpt")
    # With FP8-LM off the patterns and the plan travel all the same: an Accelerator(fp8_lm_recipe=...) in the script
    # that turns it on keeps them, as it keeps those of a plain launch's environment.
    settings = FP8LaunchConfig(recipe=recipe or FP8Recipe(), exclude_modules=exclude, tp_plan=tp_plan)
    return settings.to_env() if recipe is not None else {**settings.to_env(), ENV_RECIPE: OFF}


def _set_from_flag_or_environment(section: dict[str, Any], key: str, flag: object, variable: str) -> None:
    """``section[key]``: the flag when given (already checked), else the section's own value, else the shell's
    ``variable``."""
    if flag is not None:
        section[key] = flag
        return
    value = os.environ.get(variable, "").strip()
    if key in section or not value:
        return
    # Checked here, so that an error names the variable, not the section.
    if key == "exclude_modules":
        value = list(exclude_patterns(value, variable))
    else:
        check_tp_plan(value, variable)
    section[key] = value
