"""Which Lightning strategies FP8-LM trains under: the DDP family, single device, ``"fsdp_fp8"`` (and names
registered for its class) and ModelParallelStrategy; Lightning's FSDP, DeepSpeed and XLA strategies are refused with
the alternative named."""

from __future__ import annotations

import importlib
from typing import Any

from lightning_fp8.integrations.lightning.strategy_args import STRATEGY_NAME


def is_fp8_strategy(strategy: Any, namespace: str) -> bool:
    """Whether ``strategy`` (a name or an instance) is this package's FP8 FSDP strategy for ``namespace``: the
    instance, ``"fsdp_fp8"``, or another name registered in Lightning's StrategyRegistry for its class."""
    from lightning_fp8.integrations.lightning.strategy import strategy_class  # (it imports this module)

    if isinstance(strategy, str):
        registered = _registered_class(strategy.lower(), namespace)
        ours = registered is not None and issubclass(registered, strategy_class(namespace))
        return ours or strategy.lower() == STRATEGY_NAME
    return isinstance(strategy, strategy_class(namespace))


def _registered_class(name: str, namespace: str) -> type | None:
    """The class Lightning's StrategyRegistry builds for ``name`` (lowercase, as Lightning looks it up), or None."""
    strategy = (_registered_entry(name, namespace) or {}).get("strategy")
    return strategy if isinstance(strategy, type) else None


def _registered_entry(name: str, namespace: str) -> dict[str, Any] | None:
    """Lightning's StrategyRegistry entry of ``name`` (``strategy``: the class, ``init_params``), or None."""
    root = "lightning.pytorch" if namespace == "lightning" else namespace
    registry = importlib.import_module(f"{root}.strategies").StrategyRegistry
    entry = dict.get(registry, name)  # (its get() builds the strategy)
    return entry if isinstance(entry, dict) else None


def _strategy_types(namespace: str) -> dict[str, tuple[type, ...]]:
    root = "lightning.pytorch" if namespace == "lightning" else namespace
    strategies = importlib.import_module(f"{root}.strategies")
    return {
        "fsdp": (strategies.FSDPStrategy,),
        "deepspeed": (strategies.DeepSpeedStrategy,),
        "xla": (strategies.XLAStrategy, strategies.SingleDeviceXLAStrategy),
    }


_UNSUPPORTED = {
    "fsdp": (
        "Lightning's FSDPStrategy only runs its own FSDPPrecision plugin: use strategy='fsdp_fp8' "
        "(lightning_fp8.FP8FSDPStrategy, same arguments) for FSDP, or ModelParallelStrategy for FSDP2"
    ),
    "deepspeed": (
        "DeepSpeed owns precision and optimizer itself: use strategy='ddp', 'fsdp_fp8' or ModelParallelStrategy"
    ),
    "xla": "FP8 GEMMs need CUDA (sm89+) or the CPU emulation, not XLA: use strategy='ddp', 'fsdp_fp8' or 'auto'",
}


def check_supported_strategy(
    strategy: Any, namespace: str = "lightning", precision: str = "the FP8-LM precision"
) -> None:
    """Raise a ``ValueError`` naming the alternative if FP8-LM cannot run under ``strategy`` (a name or instance).

    Supported: ``"auto"``, single device, the DDP family, ``"fsdp_fp8"`` and ``ModelParallelStrategy``.
    ``precision`` names what the user passed in the message (``"precision='fp8-lm-o1'"``).
    """
    if is_fp8_strategy(strategy, namespace):
        return
    if isinstance(strategy, str):
        name = strategy.lower()
        registered = _registered_class(name, namespace)
        if registered is not None:  # judged by the class its name builds
            for family, types in _strategy_types(namespace).items():
                if issubclass(registered, types):
                    raise ValueError(f"{precision} does not support strategy={strategy!r}: {_UNSUPPORTED[family]}")
            return
        for family, message in _UNSUPPORTED.items():
            if family in name and name != STRATEGY_NAME:
                raise ValueError(f"{precision} does not support strategy={strategy!r}: {message}")
        return
    for family, types in _strategy_types(namespace).items():
        if isinstance(strategy, types):
            raise ValueError(
                f"{precision} does not support strategy={type(strategy).__name__}(...): {_UNSUPPORTED[family]}"
            )


def check_ddp_comm_hook(strategy: Any, fp8_communication: bool, precision: str, namespace: str = "lightning") -> None:
    """Raise ValueError for ``DDPStrategy(ddp_comm_hook=...)`` (or a name registered for one) when the FP8 plugin
    installs its own communication hook.

    DDP takes one communication hook: Lightning registers the user's when it wraps the model (on GPUs; on the CPU it
    ignores it), and the plugin's ``register_comm_hook`` of the FP8 all-reduce then failed in the first fit with
    torch's "register_comm_hook or register_builtin_comm_hook can only be called once", which says neither which hook
    nor what to do. ``precision`` names what the user passed (``"precision='fp8-lm'"``)."""
    if isinstance(strategy, str):  # a registered name: the class and the arguments it builds with
        entry = _registered_entry(strategy.lower(), namespace) or {}
        cls, hook = entry.get("strategy"), (entry.get("init_params") or {}).get("ddp_comm_hook")
        given = f"strategy={strategy!r}, registered as DDPStrategy(ddp_comm_hook={_name(hook)}),"
    else:
        cls, hook = type(strategy), getattr(strategy, "_ddp_comm_hook", None)
        given = f"DDPStrategy(ddp_comm_hook={_name(hook)})"
    is_ddp = isinstance(cls, type) and any(c.__name__ == "DDPStrategy" for c in cls.__mro__)
    if hook is None or not fp8_communication or not is_ddp:
        return
    raise ValueError(
        f"{precision} installs its FP8 gradient all-reduce as DDP's communication hook, and DDP takes one: "
        f"{given} would be a second. Drop ddp_comm_hook (and ddp_comm_state, ddp_comm_wrapper) to communicate "
        "gradients in FP8, or keep your hook with plugins=[FP8LMPrecision(fp8_communication=False)]"
    )


def _name(hook: Any) -> str:
    return getattr(hook, "__qualname__", None) or repr(hook)
