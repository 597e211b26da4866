"""How a launch turns FP8-LM on: the ``lightning_fp8`` config section, launcher flags and environment variables.

Accelerate validates its own config file (unknown top-level keys are an error) and its own ``mixed_precision``
and FP8 backend values, so FP8-LM never travels through them. Instead:

- ``lightning-fp8 launch`` reads a top-level ``lightning_fp8:`` section from the Accelerate config file (and its
  ``--fp8-recipe`` / ``--fp8-exclude`` flags), removes the section before Accelerate sees the file, and passes
  the result to every training process in two environment variables;
- :class:`~lightning_fp8.accelerate.Accelerator` reads those variables. Setting them by hand works with plain
  ``accelerate launch`` (or ``torchrun``, or ``python``) too.

=========================  =================================================================================
``LIGHTNING_FP8_RECIPE``   a recipe name (``fp8-lm``, ``fp8-lm-o1``, ...), ``none`` (FP8-LM off), or a JSON
                           object of :class:`~lightning_fp8.FP8Recipe` fields, optionally with ``"name"`` as
                           the base recipe: ``{"name": "fp8-lm", "margin": 1}``
``LIGHTNING_FP8_EXCLUDE``  comma-separated module name patterns (``fnmatch``) kept in high precision, matched
                           against each linear layer's qualified name and its last component: ``lm_head``; or a
                           JSON array of patterns, for patterns with a comma: ``["blocks.[0,1].fc"]``
``LIGHTNING_FP8_TP_PLAN``  with Accelerate's tensor parallelism (``ParallelismConfig(tp_size=N)``): the plan the
                           Accelerator applies (``gpt``, the default; ``llama``; ``gpt-no-sp`` / ``llama-no-sp``
                           without sequence parallelism), or ``none`` when the script parallelizes the model itself
=========================  =================================================================================
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from fnmatch import fnmatchcase
from typing import Any

from torch import nn

from lightning_fp8.recipe import FP8Recipe, resolve_recipe
from lightning_fp8.warnings import warn_once

CONFIG_KEY = "lightning_fp8"
ENV_RECIPE = "LIGHTNING_FP8_RECIPE"
ENV_EXCLUDE = "LIGHTNING_FP8_EXCLUDE"
ENV_TP_PLAN = "LIGHTNING_FP8_TP_PLAN"
OFF = "none"
TP_PLANS = ("gpt", "llama", "gpt-no-sp", "llama-no-sp", OFF)

_RECIPE_FIELDS = tuple(f.name for f in fields(FP8Recipe))
_SECTION_KEYS = ("recipe", "exclude_modules", "tp_plan", *_RECIPE_FIELDS)
# YAML 1.1 reads off/no/false (and on/yes/true) as booleans, which are never recipe names.
_YAML_BOOL_HINT = f" (YAML reads off/no/false as False: write {OFF!r} to turn FP8-LM off, or quote a name)"


def check_recipe_name(name: object, source: str) -> None:
    """Raise a ``ValueError`` naming ``source`` and the valid names unless ``name`` is a recipe name or ``none``."""
    if name != OFF and (not isinstance(name, str) or name not in FP8Recipe.names()):
        raise ValueError(
            f"{source}={name!r} is not a known FP8 recipe: choose one of {FP8Recipe.names()} "
            f"(or {OFF!r} to turn FP8-LM off)"
        )


def check_tp_plan(plan: object, source: str) -> None:
    """Raise a ``ValueError`` naming ``source`` unless ``plan`` is one of :data:`TP_PLANS`."""
    if plan not in TP_PLANS:
        raise ValueError(f"{source}={plan!r} is not a tensor-parallel plan: choose one of {list(TP_PLANS)}")


def tp_plan_from_env(environ: Mapping[str, str]) -> str:
    """:data:`ENV_TP_PLAN` from ``environ`` (default ``gpt``), validated."""
    plan = environ.get(ENV_TP_PLAN, "").strip() or "gpt"
    check_tp_plan(plan, ENV_TP_PLAN)
    return plan


def _named_recipe(name: object, source: str) -> FP8Recipe:
    try:
        check_recipe_name(name, source)
    except ValueError as err:
        raise ValueError(f"{err}{_YAML_BOOL_HINT if isinstance(name, bool) else ''}") from None
    return FP8Recipe.from_name(name)


def exclude_patterns(value: object, source: str) -> tuple[str, ...]:
    """The module name patterns of ``value`` (a list, a comma-separated string or a JSON array of strings); a
    ``ValueError`` naming ``source`` (the flag, variable or config key it came from) for anything else."""
    if isinstance(value, str):
        patterns = _exclude_from_json(value, source)
        value = value.split(",") if patterns is None else patterns  # "[]": none
    if not isinstance(value, (list, tuple)) or not all(isinstance(p, str) for p in value):
        raise ValueError(
            f"{source}={value!r} must be a list of module name patterns (or a comma-separated string), e.g. ['lm_head']"
        )
    return tuple(p.strip() for p in value if p.strip())


def _exclude_from_json(value: str, source: str) -> list[str] | None:
    """The patterns of a JSON array of strings (how :meth:`FP8LaunchConfig.to_env` carries patterns with a comma,
    such as ``blocks.[0,1].fc``); ``None`` for anything else, read as a comma-separated list. ValueError for a JSON
    array of other values (``[1, 2]`` would otherwise be the patterns ``[1`` and ``2]``, matching nothing)."""
    if not value.strip().startswith("["):
        return None
    try:
        patterns = json.loads(value)
    except json.JSONDecodeError:
        return None  # a plain pattern such as ``[ab]c``
    if not isinstance(patterns, list):
        return None
    if not all(isinstance(p, str) for p in patterns):
        raise ValueError(
            f"{source}={value!r} is a JSON array of {sorted({type(p).__name__ for p in patterns})}: give module name "
            'patterns as strings, e.g. ["lm_head", "blocks.0.*"], or a comma-separated string'
        )
    return patterns


def _matches(fqn: str, pattern: str) -> bool:
    return fnmatchcase(fqn, pattern) or fnmatchcase(fqn.rpartition(".")[2], pattern)


@dataclass(frozen=True, kw_only=True)
class FP8LaunchConfig:
    """What the launch asked for: the recipe, the linear layers kept in high precision, the tensor-parallel plan.

    Args:
        recipe: the :class:`~lightning_fp8.FP8Recipe` every process converts its model with.
        exclude_modules: ``fnmatch`` patterns; a linear layer whose qualified name (``blocks.0.mlp.fc``) or last
            name component (``fc``) matches one stays ``nn.Linear``.
        tp_plan: used only with Accelerate's tensor parallelism (``tp_size > 1``): one of :data:`TP_PLANS`, the
            Megatron-style plan that :func:`~lightning_fp8.distributed.tensor_parallel.apply_fp8_tensor_parallel`
            applies (``gpt``, ``llama``; ``-no-sp``: without sequence parallelism), or ``none`` (the script shards
            the model itself).
    """

    recipe: FP8Recipe
    exclude_modules: tuple[str, ...] = ()
    tp_plan: str = "gpt"

    def __post_init__(self) -> None:
        if not isinstance(self.recipe, FP8Recipe):
            raise TypeError(f"FP8LaunchConfig(recipe=...) must be an FP8Recipe, got {type(self.recipe).__name__}")
        object.__setattr__(self, "exclude_modules", exclude_patterns(self.exclude_modules, "exclude_modules"))
        check_tp_plan(self.tp_plan, "tp_plan")

    @property
    def tensor_parallel(self) -> tuple[str, bool] | None:
        """``(plan, sequence_parallel)`` for ``apply_fp8_tensor_parallel``; ``None``: the script shards the model."""
        if self.tp_plan == OFF:
            return None
        plan, _, no_sp = self.tp_plan.partition("-")
        return plan, not no_sp

    def module_filter(self, module: nn.Module, fqn: str) -> bool:
        """``convert_to_fp8``'s ``module_filter_fn``: False for layers matched by :attr:`exclude_modules`."""
        return not any(_matches(fqn, p) for p in self.exclude_modules)

    def unmatched_patterns(self, model: nn.Module) -> list[str]:
        """The :attr:`exclude_modules` patterns that match no linear layer of ``model`` (a misspelt name keeps
        nothing in high precision)."""
        linears = [fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear)]
        return [p for p in self.exclude_modules if not any(_matches(fqn, p) for fqn in linears)]

    # --- the config-file section -------------------------------------------------------------------------

    @classmethod
    def from_section(cls, section: object, source: str = CONFIG_KEY) -> FP8LaunchConfig | None:
        """Parse the ``lightning_fp8`` section of an Accelerate config file; ``None`` when it turns FP8-LM off.

        The section is either a recipe name (``lightning_fp8: fp8-lm``) or a mapping with ``recipe`` (a name,
        default ``fp8-lm``; ``none`` turns FP8-LM off), ``exclude_modules`` (a list of patterns) and any
        :class:`~lightning_fp8.FP8Recipe` field overriding the named recipe (``margin: 1``). Only ``none`` turns
        FP8-LM off: a ``recipe:`` key left empty (YAML null) is an error, not a way to switch it off.

        Raises:
            ValueError: on an unknown key, an empty recipe, a bad recipe name or field value; the message names
                ``source``.
        """
        if isinstance(section, str):
            section = {"recipe": section}
        if not isinstance(section, Mapping):
            raise ValueError(
                f"{source} must be a recipe name or a mapping with keys {list(_SECTION_KEYS)}, got {section!r}"
                f"{_YAML_BOOL_HINT if isinstance(section, bool) else ''}"
            )
        # YAML reads keys such as `on:` as booleans: sort by repr so mixed types reach the error below.
        unknown = sorted(set(section) - set(_SECTION_KEYS), key=repr)
        if unknown:
            raise ValueError(f"{source} has unknown key(s) {unknown}: allowed keys are {list(_SECTION_KEYS)}")
        name = section.get("recipe", "fp8-lm")
        if name is None:
            raise ValueError(
                f"{source}.recipe is empty: write a recipe name (one of {FP8Recipe.names()}), {OFF!r} to turn FP8-LM "
                "off, or leave the key out for the default fp8-lm"
            )
        # With `recipe: none` the other values are still checked (against fp8-lm): a broken section is reported
        # when it is written, not when FP8-LM is switched back on.
        recipe = _named_recipe("fp8-lm" if name == OFF else name, f"{source}.recipe")
        overrides = {k: v for k, v in section.items() if k in _RECIPE_FIELDS}
        try:
            recipe = recipe.replace(**overrides)
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None
        exclude = exclude_patterns(section.get("exclude_modules", ()), f"{source}.exclude_modules")
        tp_plan = section.get("tp_plan", "gpt")
        check_tp_plan(tp_plan, f"{source}.tp_plan")
        if name == OFF:
            return None
        return cls(recipe=recipe, exclude_modules=exclude, tp_plan=tp_plan)

    # --- environment variables ---------------------------------------------------------------------------

    def to_env(self) -> dict[str, str]:
        """The environment variables that carry this config to the training processes."""
        named = {n: FP8Recipe.from_name(n) for n in FP8Recipe.names()}
        name = next((n for n, r in named.items() if r == self.recipe), None)
        recipe = name if name is not None else json.dumps(self.recipe.to_dict(), sort_keys=True)
        exclude = ",".join(self.exclude_modules)
        if any("," in p for p in self.exclude_modules) or exclude.startswith("["):
            # A comma inside a pattern (`blocks.[0,1].fc`) would split it: send a JSON array instead.
            exclude = json.dumps(list(self.exclude_modules))
        return {ENV_RECIPE: recipe, ENV_EXCLUDE: exclude, ENV_TP_PLAN: self.tp_plan}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FP8LaunchConfig | None:
        """Read :data:`ENV_RECIPE`, :data:`ENV_EXCLUDE` and :data:`ENV_TP_PLAN`; ``None`` when the recipe is unset
        or ``none``.

        Raises:
            ValueError: on an unknown recipe name, malformed JSON or a bad recipe field.
        """
        environ = os.environ if environ is None else environ
        value = environ.get(ENV_RECIPE, "").strip()
        if not value or value == OFF:
            return None
        if value.startswith(("{", "[")):
            recipe = _recipe_from_json(value)
        else:
            recipe = _named_recipe(value, ENV_RECIPE)
        exclude = exclude_patterns(environ.get(ENV_EXCLUDE, ""), ENV_EXCLUDE)
        return cls(recipe=recipe, exclude_modules=exclude, tp_plan=tp_plan_from_env(environ))


_JSON_EXAMPLE = '{"name": "fp8-lm", "margin": 1}'


def _recipe_from_json(value: str) -> FP8Recipe:
    try:
        data: Any = json.loads(value)
    except json.JSONDecodeError as err:
        raise ValueError(f"{ENV_RECIPE}={value!r} is not valid JSON ({err}): give a recipe name or an object") from None
    if not isinstance(data, dict):
        raise ValueError(
            f"{ENV_RECIPE}={value!r} must be a JSON object of FP8Recipe fields (e.g. {_JSON_EXAMPLE}) or a recipe "
            f"name, one of {FP8Recipe.names()} (or {OFF!r} to turn FP8-LM off)"
        )
    name = data.pop("name", "fp8-lm")
    if not isinstance(name, str) or name not in FP8Recipe.names():
        raise ValueError(
            f'{ENV_RECIPE}={value!r} has "name": {json.dumps(name)}, which is not a base recipe: choose one of '
            f"{FP8Recipe.names()}; to turn FP8-LM off set {ENV_RECIPE}={OFF} (a name, not a JSON object)"
        )
    base = FP8Recipe.from_name(name)
    unknown = sorted(set(data) - set(_RECIPE_FIELDS))
    if unknown:
        # The config file's section names its base recipe `recipe:` and holds the layers to exclude and the TP plan;
        # here those are "name" and variables of their own.
        elsewhere = {"recipe": '"name" (the base recipe)', "exclude_modules": ENV_EXCLUDE, "tp_plan": ENV_TP_PLAN}
        hints = [f"{key!r} goes in {elsewhere[key]}" for key in unknown if key in elsewhere]
        raise ValueError(
            f'{ENV_RECIPE} has unknown FP8Recipe field(s) {unknown}: allowed are {list(_RECIPE_FIELDS)} and "name" '
            f"(the base recipe, one of {FP8Recipe.names()})" + (f"; {', '.join(hints)}" if hints else "")
        )
    try:
        return base.replace(**data)
    except ValueError as err:
        raise ValueError(f"{ENV_RECIPE}: {err}") from None


def resolve_launch_config(recipe: FP8Recipe | str | None) -> FP8LaunchConfig | None:
    """This process's FP8 settings: ``recipe`` (from code) if given, else the launch's environment variables.

    ``"none"`` turns FP8-LM off. A recipe from code keeps the ``LIGHTNING_FP8_EXCLUDE`` patterns and
    ``LIGHTNING_FP8_TP_PLAN`` of the environment, whether or not it also sets ``LIGHTNING_FP8_RECIPE``.

    Raises:
        ValueError: for an unknown recipe name in ``recipe``, or in the environment when ``recipe`` is ``None``.
    """
    if recipe is None:
        return FP8LaunchConfig.from_env()
    if recipe == OFF:
        launched = os.environ.get(ENV_RECIPE, "").strip()
        if launched and launched != OFF:  # as for any other recipe from code: said, not silent
            warn_once(f"Accelerator(fp8_lm_recipe={OFF!r}) turns off the FP8-LM training the launch's {ENV_RECIPE}="
                      f"{launched!r} asked for")  # fmt: skip
        return None
    if not isinstance(recipe, (str, FP8Recipe)):
        raise TypeError(
            f"Accelerator(fp8_lm_recipe=...) must be an FP8Recipe, a recipe name ({FP8Recipe.names()} or "
            f"{OFF!r}) or None, got {type(recipe).__name__}"
            + (": e.g. FP8Recipe(**fields)" if isinstance(recipe, dict) else "")
        )
    try:
        recipe = resolve_recipe(recipe)
    except ValueError as error:  # the recipe's own error names neither the argument nor the way to turn FP8 off
        raise ValueError(f"Accelerator(fp8_lm_recipe={recipe!r}): {error}, or {OFF!r} to train without FP8") from None
    # The launch's recipe is overridden, not used: one that does not parse is no error here.
    launched = os.environ.get(ENV_RECIPE, "").strip()
    try:
        launched_recipe = FP8LaunchConfig.from_env({ENV_RECIPE: launched})
    except ValueError:
        launched_recipe = None
    if launched and launched != OFF and (launched_recipe is None or launched_recipe.recipe != recipe):
        warn_once(f"Accelerator(fp8_lm_recipe=...) overrides the launch's {ENV_RECIPE}={launched!r}")
    exclude = exclude_patterns(os.environ.get(ENV_EXCLUDE, ""), ENV_EXCLUDE)
    return FP8LaunchConfig(recipe=recipe, exclude_modules=exclude, tp_plan=tp_plan_from_env(os.environ))
