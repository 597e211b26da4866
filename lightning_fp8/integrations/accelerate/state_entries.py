"""The form of the entries of an Accelerate FP8 state file (``lightning_fp8/rank<R>.pt``, written by
:func:`~lightning_fp8.integrations.accelerate.checkpoint.build_state`), checked before any part of it loads: a corrupt
file names itself and what to do, and changes nothing."""

from __future__ import annotations

from typing import Any

from torch import nn

# The entries of build_state's that load() requires; check() requires "optimizer_steps" too (load_state restores it).
ENTRIES = ("recipe", "world_size", "models", "grad_scaler", "health")


def saved_comm(state: dict[str, Any], models: list[nn.Module]) -> list[Any]:
    """The saved FP8 communication state of each model (``None`` each in checkpoints written before it was saved),
    checked to be one entry per model; each entry's own checks are ``FP8CommState.check_state_dict``'s."""
    saved = state.get("comm")
    if saved is None:
        return [None] * len(models)
    if not isinstance(saved, list) or len(saved) != len(models):
        raise ValueError(
            f"the FP8 state's 'comm' is {repr(saved)[:200]}, not one FP8 communication state (or None) per prepared "
            f"model ({len(models)}): the file is corrupt. Load an earlier checkpoint, or delete this folder's "
            "lightning_fp8/ files to start the FP8 scales and mu fresh"
        )
    return saved


def fallen_back(state: dict[str, Any], models: list[nn.Module]) -> list[list[str]]:
    """The names of each model's layers that fell back in the saved run (none in checkpoints written before the names
    were saved), checked to name layers of ``models``."""
    saved = state.get("fallen_back_layers") or [[] for _ in models]
    well_formed = isinstance(saved, list) and len(saved) == len(models) and all(
        isinstance(names, list) and all(isinstance(name, str) for name in names) for names in saved
    )  # fmt: skip
    if not well_formed:
        raise ValueError(
            f"the FP8 state's 'fallen_back_layers' is {repr(saved)[:200]}, not one list of layer names per prepared "
            f"model ({len(models)}): the file is corrupt. Load an earlier checkpoint, or delete this folder's "
            "lightning_fp8/ files to start the FP8 scales and mu fresh"
        )
    for model, names in zip(models, saved, strict=True):
        unknown = [name for name in names if name not in dict(model.named_modules())]
        if unknown:
            raise ValueError(
                f"the FP8 state names layers {unknown[:5]} that fell back to nn.Linear in the saved run, which the "
                f"prepared {type(model).__name__} does not have: the checkpoint was written for another model. "
                "Prepare the model that saved it"
            )
    return saved


def check_entries(state: dict[str, Any], source: str, required: tuple[str, ...] = ENTRIES) -> None:
    """Raise a KeyError naming ``source`` (the file) when ``state`` lacks one of the ``required`` entries that
    :func:`build_state` writes."""
    missing = [key for key in required if key not in state]
    if missing:
        raise KeyError(
            f"{source} lacks the entries {missing} (it holds {sorted(state)}): it was not written by lightning_fp8's "
            "Accelerator or is corrupt. Load an earlier checkpoint, or delete this folder's lightning_fp8/ files to "
            "start the FP8 scales and mu fresh"
        )


def check_count(state: dict[str, Any], key: str, least: int, source: str) -> None:
    """Raise a ValueError naming ``source`` when ``state[key]`` is not a whole number >= ``least`` (what
    :func:`build_state` writes for the process and step counts; a bool, float or tensor there is a corrupt file)."""
    value = state[key]
    if type(value) is not int or value < least:
        raise ValueError(
            f"{source}: {key!r} is {value!r}, not a whole number >= {least}: the file is corrupt or was not written by "
            "lightning_fp8's Accelerator. Nothing was loaded; load an earlier checkpoint, or delete this folder's "
            "lightning_fp8/ files to start the FP8 scales and mu fresh"
        )
