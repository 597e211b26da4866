"""FP8 training state in ``accelerator.save_state`` / ``load_state``: scaling states, mu, health history.

Accelerate saves the model weights, the optimizer (FP8AdamW's low-precision states and their scales are
ordinary optimizer state), schedulers, RNG and data samplers. What it does not know about is saved here, by
save/load hooks, one file per rank in ``<checkpoint>/lightning_fp8/rank<R>.pt``:

- the FP8 scaling state of every prepared model (scales, amax histories, counters: non-persistent buffers, so
  they are not in the model's ``state_dict``); per rank, because delayed-scaling histories of activations and
  activation gradients are per rank;
- the gradient scaler mu and its counters, and the health monitor's history;
- the names of the layers that ``FP8GradScaler(nonfinite_fallback="bf16")`` put back to ``nn.Linear``. A model
  prepared afresh has them in FP8 again: :func:`put_back_fallen_back_layers` puts them back before any state is
  loaded into it (FP8 scaling state, weights, optimizer states), as Lightning's plugin does in
  ``on_load_checkpoint``.

Every file holds plain tensors, numbers, lists and dicts: it loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_fp8 import recovery
from lightning_fp8.recipe import FP8Recipe
from lightning_fp8.state import check_fp8_state_dict, fp8_state_dict, load_fp8_state_dict
from lightning_fp8.warnings import warn_once

FORMAT_VERSION = 1
SUBDIR = "lightning_fp8"


def rank_file(directory: str | os.PathLike, rank: int) -> Path:
    """Where rank ``rank`` keeps its FP8 state inside the checkpoint folder ``directory``."""
    return Path(directory) / SUBDIR / f"rank{rank}.pt"


def build_state(
    recipe: FP8Recipe, models: list[nn.Module], world_size: int, grad_scaler: Any | None, health: Any | None, steps: int
) -> dict[str, Any]:
    """This rank's FP8 state; ``models`` are unwrapped (no DDP ``module.`` prefix)."""
    return {
        "format_version": FORMAT_VERSION,
        "recipe": recipe.to_dict(),
        "world_size": world_size,
        "models": [fp8_state_dict(m) for m in models],
        "fallen_back_layers": [recovery.fallen_back_layers(m) for m in models],
        "grad_scaler": grad_scaler.state_dict() if grad_scaler is not None else None,
        "health": health.state_dict() if health is not None else None,
        "optimizer_steps": steps,
    }


def save(directory: str | os.PathLike, rank: int, state: dict[str, Any]) -> Path:
    """Write this rank's file whole or not at all: to a temporary file first, renamed over the old one when complete
    (a crash while writing leaves the previous checkpoint's file as it was)."""
    path = rank_file(directory, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    try:
        torch.save(state, partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def _read(path: Path) -> dict[str, Any]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a truncated or corrupt file: torch raises zip, pickle or EOF errors
        raise ValueError(
            f"{path} cannot be read ({type(error).__name__}: {error}): the checkpoint's FP8 state is corrupt or was "
            "not completely written; load an earlier checkpoint, or delete this folder's lightning_fp8/ files to "
            "start the FP8 scales and mu fresh"
        ) from error
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, not lightning_fp8's FP8 state: the file is not ours")
    return state


def load(directory: str | os.PathLike, rank: int, world_size: int) -> dict[str, Any] | None:
    """This rank's saved FP8 state, or ``None`` (with a warning) when the checkpoint has none.

    A checkpoint written with another number of processes has no file for some ranks: those ranks take rank 0's
    (weights and mu are the same on every rank; only activation statistics differ, and they re-adapt in
    ``amax_history_len`` steps).
    """
    path = _state_file(directory, rank)
    if path is None:
        warn_once(
            f"accelerator.load_state({str(directory)!r}): the checkpoint has no FP8 state ({SUBDIR}/ is missing; "
            "was it saved without FP8-LM?). FP8 scales and mu start fresh."
        )
        return None
    state = _read(path)
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path} has FP8 state format {state.get('format_version')!r}; this lightning_fp8 reads format "
            f"{FORMAT_VERSION}: load it with the lightning_fp8 version that wrote it"
        )
    _check_entries(state, str(path))
    if state["world_size"] != world_size:
        warn_once(
            f"accelerator.load_state: the FP8 state was saved by {state['world_size']} process(es) and is loaded "
            f"by {world_size}; ranks without their own file use rank 0's activation scaling statistics"
        )
    return state


def _state_file(directory: str | os.PathLike, rank: int) -> Path | None:
    """This rank's file, else rank 0's (a checkpoint written by fewer processes), else ``None``."""
    for path in (rank_file(directory, rank), rank_file(directory, 0)):
        if path.is_file():
            return path
    return None


def put_back_fallen_back_layers(
    directory: str | os.PathLike, rank: int, models: list[nn.Module], optimizers: list[torch.optim.Optimizer]
) -> None:
    """Put the layers that had fallen back to ``nn.Linear`` in the saved run back in the unwrapped ``models``.

    Call it before anything is loaded into them: ``convert_to_fp8`` made those layers FP8 again and FP8AdamW (O2)
    took their weights' storage, so neither the FP8 scaling state nor the optimizer state of the checkpoint fits
    them. Putting them back releases their weights from ``optimizers`` (fp32 states, as saved); the weights' values
    are the checkpoint's once Accelerate loads the model. Nothing happens for a checkpoint written before the names
    were saved, or without FP8 state.

    Raises:
        ValueError: when a layer cannot be put back (see :func:`lightning_fp8.recovery.put_back_to_high_precision`:
            e.g. the model is wrapped by DistributedDataParallel), before anything is changed.
    """
    path = _state_file(directory, rank)
    if path is None:
        return
    saved = _read(path).get("fallen_back_layers") or []
    for model, names in zip(models, saved, strict=False):  # a count mismatch is reported by restore()
        if names:
            recovery.put_back_to_high_precision(model, names, optimizers)


def restore(
    state: dict[str, Any], recipe: FP8Recipe, models: list[nn.Module], grad_scaler: Any | None, health: Any | None
) -> None:
    """Load ``state`` (from :func:`load`) into the unwrapped ``models``, the scaler and the health monitor. Every part
    is checked before any is loaded: a bad entry anywhere in the file changes nothing.

    Raises:
        KeyError: when the state lacks an entry that :func:`build_state` writes.
        ValueError: when the checkpoint holds FP8 state for a different number of models; and what
            :func:`~lightning_fp8.load_fp8_state_dict`, ``FP8GradScaler.load_state_dict`` and
            ``HealthMonitor.load_state_dict`` raise for their parts.
    """
    _check_entries(state, "the FP8 state")
    saved = FP8Recipe.from_dict(state["recipe"])
    if len(state["models"]) != len(models):
        raise ValueError(
            f"accelerator.load_state: the checkpoint has FP8 state for {len(state['models'])} model(s) but "
            f"{len(models)} FP8 model(s) were prepared: prepare the same models as the run that saved it"
        )
    loads_fp8 = saved.same_scaling(recipe)
    # (check, load) of each part: every check runs before the first load.
    parts = [(partial(check_fp8_state_dict, model, model_state), partial(load_fp8_state_dict, model, model_state))
             for model, model_state in zip(models, state["models"], strict=True) if loads_fp8]  # fmt: skip
    for owner, key in ((grad_scaler, "grad_scaler"), (health, "health")):
        if owner is not None and state[key] is not None:
            parts.append((partial(owner.check_state_dict, state[key]), partial(owner.load_state_dict, state[key])))
    for check, _ in parts:
        check()
    if saved != recipe:
        what = "loaded" if loads_fp8 else (
            "not loaded (written under other scaling settings): each FP8 layer's first casts compute their scales "
            "from the tensors themselves")  # fmt: skip
        warn_once(
            f"accelerator.load_state: the checkpoint was trained with FP8 recipe {state['recipe']}, this run uses "
            f"{recipe.to_dict()}; the saved scaling state is {what}"
        )
    for _, load in parts:
        load()


def _check_entries(state: dict[str, Any], source: str) -> None:
    """Raise a KeyError naming ``source`` (the file) when ``state`` lacks an entry that :func:`build_state` writes."""
    missing = [key for key in ("recipe", "world_size", "models", "grad_scaler", "health") if key not in state]
    if missing:
        raise KeyError(
            f"{source} lacks the entries {missing} (it holds {sorted(state)}): it was not written by lightning_fp8's "
            "Accelerator or is corrupt. Load an earlier checkpoint, or delete this folder's lightning_fp8/ files to "
            "start the FP8 scales and mu fresh"
        )
