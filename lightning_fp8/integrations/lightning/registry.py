"""The one registration with Lightning's internals: ``precision="fp8-lm"`` and ``strategy="fsdp_fp8"``.

Lightning validates ``Trainer(precision=...)`` against a closed ``Literal`` of strings and builds the precision
plugin from it in ``_AcceleratorConnector``; there is no registry for precision plugins. The least invasive way
in is to translate our strings into a plugin before Lightning looks at them: :func:`register` wraps
``_AcceleratorConnector._check_config_and_set_final_flags`` (the method that reads the ``precision``,
``plugins`` and ``strategy`` flags) so that ``precision="fp8-lm"`` becomes ``plugins=[FP8LMPrecision("fp8-lm")]``.
Everything else is passed through untouched. The same wrapper rejects strategies FP8 cannot run under, with
a message saying what to use instead, and lets ``strategy="fsdp_fp8"`` imply ``precision="fp8-lm"``.

Fabric's connector is wrapped the same way, only to refuse: the plugin needs a Trainer, so ``Fabric(precision=
"fp8-lm")`` and ``Fabric(plugins=[FP8LMPrecision()])`` fail when Fabric is built, saying what to use instead.

For ``LightningCLI`` (jsonargparse validates ``--trainer.precision`` against ``Trainer.__init__``'s annotation),
the recipe names are added to that annotation; ``--trainer.plugins lightning_fp8.FP8LMPrecision`` works too.

:func:`register` is idempotent and runs for both the ``lightning`` and ``pytorch_lightning`` namespaces that are
installed. If Lightning's internals move, it warns once (``Trainer(plugins=[FP8LMPrecision()])`` keeps working;
Fabric's hook has its own warning) and ``tests/integrations/lightning/test_registry.py`` fails loudly.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import inspect
from collections.abc import Iterable
from typing import Any, Literal, Union

from lightning_fp8.integrations.lightning.strategy_args import STRATEGY_NAME
from lightning_fp8.recipe import FP8Recipe
from lightning_fp8.warnings import warn_once

NAMESPACES = ("lightning", "pytorch_lightning")
_MARK = "_lightning_fp8_wrapped"
_CONNECTOR = "{ns}.pytorch.trainer.connectors.accelerator_connector"
_PL_CONNECTOR = "pytorch_lightning.trainer.connectors.accelerator_connector"
_CHECKED_ARGS = ("strategy", "precision", "plugins")


def precision_names() -> tuple[str, ...]:
    """The strings ``Trainer(precision=...)`` accepts once registered: the FP8 recipe names."""
    return tuple(FP8Recipe.names())


def _connector_module(namespace: str) -> Any:
    return importlib.import_module(
        _PL_CONNECTOR if namespace == "pytorch_lightning" else _CONNECTOR.format(ns=namespace)
    )


def _is_installed(namespace: str) -> bool:
    return importlib.util.find_spec(namespace) is not None


def register() -> None:
    """Register ``precision="fp8-lm"`` (and the other recipe names) and ``strategy="fsdp_fp8"`` with Lightning.

    Idempotent; a namespace that is not installed is skipped. Never raises: if Lightning's internals are not
    what this function expects, it warns once and leaves Lightning untouched.
    """
    for namespace in NAMESPACES:
        if not _is_installed(namespace):
            continue
        try:
            _register_namespace(namespace)
        except (ImportError, AttributeError, TypeError) as err:
            warn_once(
                f"lightning_fp8 could not register precision='fp8-lm' with {namespace} ({err}); "
                f"use Trainer(plugins=[lightning_fp8.FP8LMPrecision()]) instead, and please report this "
                f"{namespace} version"
            )
            continue
        try:
            _refuse_in_fabric(namespace)
        except (ImportError, AttributeError, TypeError) as err:
            warn_once(
                f"lightning_fp8 could not hook into {_FABRIC_CONNECTOR[namespace]} ({err}): the Trainer works, but "
                "Fabric(precision='fp8-lm') fails with Lightning's own error (Fabric is not supported: use "
                f"lightning_fp8.convert_to_fp8, FP8AdamW and FP8GradScaler in a Fabric loop); please report this "
                f"{namespace} version"
            )


def is_registered(namespace: str = "lightning") -> bool:
    """Whether :func:`register` has hooked into ``namespace``'s accelerator connector and strategy registry."""
    connector = _connector_module(namespace)._AcceleratorConnector
    registry = importlib.import_module(_strategies_module(namespace)).StrategyRegistry
    return getattr(connector._check_config_and_set_final_flags, _MARK, False) and STRATEGY_NAME in registry


def _strategies_module(namespace: str) -> str:
    return "pytorch_lightning.strategies" if namespace == "pytorch_lightning" else f"{namespace}.pytorch.strategies"


def _register_namespace(namespace: str) -> None:
    connector = _connector_module(namespace)._AcceleratorConnector
    original = connector._check_config_and_set_final_flags
    if not getattr(original, _MARK, False):
        params = inspect.signature(original).parameters
        missing = [name for name in _CHECKED_ARGS if name not in params]
        if missing:
            raise TypeError(f"_AcceleratorConnector._check_config_and_set_final_flags has no argument(s) {missing}")
        connector._check_config_and_set_final_flags = _wrap_check_config(original, namespace)
    _register_strategy(namespace)
    _extend_trainer_annotation(namespace)


# Fabric's connector, which reads Fabric(precision=..., plugins=...) as the Trainer's does.
_FABRIC_CONNECTOR = {"lightning": "lightning.fabric.connector", "pytorch_lightning": "lightning_fabric.connector"}


def _refuse_in_fabric(namespace: str) -> None:
    """Make ``Fabric(precision="fp8-lm")`` and ``Fabric(plugins=[FP8LMPrecision()])`` fail when Fabric is built,
    saying what to use instead (Lightning's own error listed only its precisions; the plugin failed in setup)."""
    name = _FABRIC_CONNECTOR[namespace]
    if not _is_installed(name.split(".")[0]):
        return
    connector = importlib.import_module(name)._Connector
    original = connector._check_config_and_set_final_flags
    if getattr(original, _MARK, False):
        return
    signature = inspect.signature(original)
    missing = [arg for arg in ("precision", "plugins") if arg not in signature.parameters]
    if missing:
        raise TypeError(f"Fabric's _Connector._check_config_and_set_final_flags has no argument(s) {missing}")

    @functools.wraps(original)
    def _check_config_and_set_final_flags(self: Any, *args: Any, **kwargs: Any) -> Any:
        from lightning_fp8.integrations.lightning.precision import precision_class
        from lightning_fp8.integrations.lightning.refusals import fabric_unsupported

        bound = signature.bind(self, *args, **kwargs)
        flags = bound.arguments
        precision = flags.get("precision")
        if isinstance(precision, str) and (precision in precision_names() or _near_fp8_name(precision)):
            raise ValueError(f"Fabric(precision={precision!r}): " + fabric_unsupported("Leave precision unset"))
        if flags.get("plugins") is not None:  # read once: an iterator given as plugins goes on as the list it held
            flags["plugins"] = plugin_list = _as_list(flags["plugins"])
            ours = tuple(precision_class(ns) for ns in NAMESPACES if _is_installed(ns))
            if any(isinstance(p, ours) for p in plugin_list):
                raise TypeError(fabric_unsupported("Drop FP8LMPrecision from Fabric(plugins=...)"))
        return original(*bound.args, **bound.kwargs)

    setattr(_check_config_and_set_final_flags, _MARK, True)
    connector._check_config_and_set_final_flags = _check_config_and_set_final_flags


def _wrap_check_config(original: Any, namespace: str) -> Any:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _check_config_and_set_final_flags(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        flags = bound.arguments
        flags["precision"], flags["plugins"] = _translate_flags(
            namespace, flags.get("strategy", "auto"), flags.get("precision"), flags.get("plugins")
        )
        return original(*bound.args, **bound.kwargs)

    setattr(_check_config_and_set_final_flags, _MARK, True)
    return _check_config_and_set_final_flags


def _as_list(plugins: Any) -> list[Any]:
    if plugins is None:
        return []
    return list(plugins) if isinstance(plugins, Iterable) and not isinstance(plugins, (str, bytes)) else [plugins]


def _precision_label(precision: Any, plugin: Any) -> str:
    """How an error names the FP8 precision the user asked for: ``precision='fp8-lm-o1'``, or the plugin with the
    name of its recipe when it is a named one."""
    if isinstance(precision, str) and precision in precision_names():
        return f"precision={precision!r}"
    name = next((n for n in FP8Recipe.names() if FP8Recipe.from_name(n) == plugin.recipe), None)
    return f"{type(plugin).__name__}(recipe={name!r})" if name is not None else f"{type(plugin).__name__}(...)"


def _translate_flags(namespace: str, strategy: Any, precision: Any, plugins: Any) -> tuple[Any, Any]:
    """``(precision, plugins)`` as Lightning should see them: our precision strings become a plugin instance."""
    from lightning_fp8.integrations.lightning import precision as precision_mod
    from lightning_fp8.integrations.lightning import strategy_support

    precision_cls = precision_mod.precision_class(namespace)
    plugin_list = _as_list(plugins)
    _check_flavours(namespace, plugin_list, strategy)
    base_precision = importlib.import_module(_plugins_module(namespace)).Precision
    user_precision = [p for p in plugin_list if isinstance(p, base_precision)]
    # Lightning lowercases strategy names (strategy="FSDP_FP8" is ours too), as strategy_support does.
    # A name registered for the FP8 strategy's class (StrategyRegistry.register("fsdp_fp8_offload", FP8FSDPStrategy,
    # cpu_offload=True)) is ours as much as "fsdp_fp8".
    wants_fp8_strategy = strategy_support.is_fp8_strategy(strategy, namespace)
    if getattr(strategy, "_precision_plugin", None) is not None:  # a strategy instance that brings its own plugin
        user_precision.append(strategy._precision_plugin)

    if isinstance(precision, str) and precision not in precision_names() and _near_fp8_name(precision):
        # Lightning's own error would list only its precisions: say which of ours was meant.
        raise ValueError(
            f"Trainer(precision={precision!r}) is not a known precision: did you mean {_meant(precision)!r}? The FP8 "
            f"precisions are {list(precision_names())}; a recipe of other settings (fp8_format, scaling, margin, "
            "amax_history_len, amax_compute_algo, opt_level) goes in "
            "plugins=[FP8LMPrecision(recipe=FP8Recipe(...))]"
        )
    requested = precision
    if isinstance(precision, str) and precision in precision_names():
        if user_precision:
            raise ValueError(
                f"Received both `precision={precision!r}` and a precision plugin in `plugins={user_precision}`: "
                f"choose one (e.g. `plugins=[FP8LMPrecision(recipe={precision!r})]` alone)"
            )
        plugin_list.append(precision_cls(recipe=precision))
        precision = None
    elif wants_fp8_strategy and not user_precision:
        if precision is not None:
            raise ValueError(
                f"`strategy={STRATEGY_NAME!r}` trains in FP8 but got `precision={precision!r}`: pass "
                f"`precision='fp8-lm'` (or another of {list(precision_names())}) or leave `precision` unset"
            )
        plugin_list.append(precision_cls())
    fp8 = [p for p in plugin_list + user_precision if isinstance(p, precision_cls)]
    if fp8:
        label = _precision_label(requested, fp8[0])
        strategy_support.check_supported_strategy(strategy, namespace, label)
        strategy_support.check_ddp_comm_hook(strategy, fp8[0].fp8_communication, label, namespace)
    return precision, (plugin_list or plugins)


def _check_flavours(namespace: str, plugins: list[Any], strategy: Any) -> None:
    """Raise TypeError for an FP8 plugin or strategy built on the other Lightning package's classes (``lightning``
    vs ``pytorch_lightning``): Lightning called it an invalid type, which it is not for the other Trainer."""
    from lightning_fp8.integrations.lightning import precision as precision_mod
    from lightning_fp8.integrations.lightning import strategy as strategy_mod

    precision_cls = precision_mod.precision_class(namespace)
    given = [(plugin, precision_mod._FP8LMPrecisionLogic, precision_cls, "plugins") for plugin in plugins]
    given.append((strategy, strategy_mod._FP8FSDPStrategyLogic, strategy_mod.strategy_class(namespace), "strategy"))
    for obj, logic, expected, argument in given:
        if isinstance(obj, logic) and not isinstance(obj, expected):
            package, other = (
                ("pytorch_lightning", "lightning")
                if namespace == "pytorch_lightning"
                else (namespace, "pytorch_lightning")
            )
            raise TypeError(
                f"Trainer({argument}=...): {type(obj).__name__} is built on {other}'s classes, but this Trainer is "
                f"{package}'s. Build {expected.__name__}(...) instead (the same arguments; "
                f"`from {expected.__module__} import {expected.__name__}`), or use the registered strings "
                f"(precision='fp8-lm', strategy='{STRATEGY_NAME}'), which pick the right one"
            )


# Words of FP8 recipes (FP8Recipe's values and their usual misspellings) that none of Lightning's precision strings
# holds: a precision string with one of them meant an FP8 one; by the word, the named recipe that has it.
_FP8_WORDS = {"e4m3": "fp8-lm-e4m3", "current": "fp8-lm-current", "o1": "fp8-lm-o1", "e5m2": "fp8-lm",
              "hybrid": "fp8-lm", "hybird": "fp8-lm", "delayed": "fp8-lm", "o2": "fp8-lm", "msamp": "fp8-lm",
              "ms-amp": "fp8-lm", "fp8": "fp8-lm"}  # fmt: skip


def _meant(precision: str) -> str:
    """The FP8 precision string ``precision`` most likely meant: the recipe of a word it holds (in the order above),
    else a name it misspells, else ``fp8-lm`` (any other "fp8" string), else the closest name."""
    name = precision.strip().lower().replace("_", "-")
    word = next((word for word in _FP8_WORDS if word in name and word != "fp8"), None)  # (fp8: below)
    if word is not None and _FP8_WORDS[word] in precision_names():
        return _FP8_WORDS[word]
    close = difflib.get_close_matches(name, precision_names(), n=1, cutoff=0.8)  # a misspelt name
    if close or "fp8" not in name:
        return (close or difflib.get_close_matches(name, precision_names(), n=1, cutoff=0))[0]
    return "fp8-lm"


def _near_fp8_name(precision: str) -> bool:
    # None of Lightning's precision strings starts with "fp8" (its FP8 one is "transformer-engine").
    name = precision.strip().lower()
    close = difflib.get_close_matches(name.replace("_", "-"), precision_names(), n=1, cutoff=0.75)
    return name.startswith("fp8") or any(word in name for word in _FP8_WORDS if len(word) > 2) or bool(close)


def _plugins_module(namespace: str) -> str:
    return "pytorch_lightning.plugins" if namespace == "pytorch_lightning" else f"{namespace}.pytorch.plugins"


def _register_strategy(namespace: str) -> None:
    from lightning_fp8.integrations.lightning import strategy as strategy_mod

    registry = importlib.import_module(_strategies_module(namespace)).StrategyRegistry
    if STRATEGY_NAME not in registry:
        registry.register(
            STRATEGY_NAME,
            strategy_mod.strategy_class(namespace),
            description="FSDP with FP8 scaling state, FP8 gradient reduce-scatter and FP8 checkpoints (lightning_fp8)",
        )


def _extend_trainer_annotation(namespace: str) -> None:
    # LightningCLI (jsonargparse) validates --trainer.precision against this annotation; add our names to it.
    trainer_cls = importlib.import_module(
        "pytorch_lightning" if namespace == "pytorch_lightning" else "lightning"
    ).Trainer
    init = inspect.unwrap(trainer_cls.__init__)
    annotation = init.__annotations__.get("precision")
    if annotation is None or isinstance(annotation, str) or getattr(init, _MARK, False):
        return
    names = Literal[precision_names()]  # type: ignore[valid-type]
    init.__annotations__["precision"] = Union[annotation, names]  # noqa: UP007 (a runtime typing object)
    setattr(init, _MARK, True)
