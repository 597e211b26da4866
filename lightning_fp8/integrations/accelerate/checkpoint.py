"""FP8 training state in ``accelerator.save_state`` / ``load_state``: scaling states, mu, health history.

Accelerate saves the model weights, the optimizer (FP8AdamW's low-precision states and their scales are
ordinary optimizer state), schedulers, RNG and data samplers. What it does not know about is saved here, once
Accelerate's files are written, one file per rank in ``<checkpoint>/lightning_fp8/rank<R>.pt``:

- the FP8 scaling state of every prepared model (scales, amax histories, counters: non-persistent buffers, so
  they are not in the model's ``state_dict``); per rank, because delayed-scaling histories of activations and
  activation gradients are per rank;
- the gradient scaler mu and its counters, the health monitor's history and the scale-jump alerts;
- the state of each model's FP8 gradient communication (the DDP hook's or FSDP2 collectives' ``FP8CommState``: the
  native path's extra headroom and the collective count), where the run communicates in FP8;
- the names of the layers that ``FP8GradScaler(nonfinite_fallback="bf16")`` put back to ``nn.Linear``. A model
  prepared afresh has them in FP8 again: :func:`put_back` puts them back before any state is loaded into it (FP8
  scaling state, weights, optimizer states), as Lightning's plugin does in ``on_load_checkpoint``.

Loading is in three calls, so that a bad file changes nothing: :func:`load` reads and checks the file's layout,
:func:`check` checks every part against the prepared models before any layer is put back, and after the weights and
optimizer states are in, :func:`restore` loads the parts.

A save marks the folder incomplete (:func:`begin_save`) before Accelerate writes its first file, and removes the mark
(:func:`end_save`) once every rank's FP8 state is written: a save that fails part-way leaves a folder :func:`load`
refuses, instead of one mixing new and old files.

Every file holds plain tensors, numbers, lists and dicts: it loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_fp8 import recovery
from lightning_fp8.integrations.accelerate import state_entries
from lightning_fp8.recipe import FP8Recipe
from lightning_fp8.state import check_fp8_state_dict, fp8_state_dict, load_fp8_state_dict
from lightning_fp8.warnings import warn_once

FORMAT_VERSION = 1
SUBDIR = "lightning_fp8"
# Present in a checkpoint folder from the start of a save_state until every rank wrote its FP8 state (begin_save).
SAVE_IN_PROGRESS = "save_in_progress"


def rank_file(directory: str | os.PathLike, rank: int) -> Path:
    """Where rank ``rank`` keeps its FP8 state inside the checkpoint folder ``directory``."""
    return Path(directory) / SUBDIR / f"rank{rank}.pt"


def build_state(
    recipe: FP8Recipe,
    models: list[nn.Module],
    world_size: int,
    grad_scaler: Any | None,
    health: Any | None,
    steps: int,
    scale_jumps: Any | None = None,
    comm_states: list[Any | None] | None = None,
) -> dict[str, Any]:
    """This rank's FP8 state; ``models`` are unwrapped (no DDP ``module.`` prefix); ``comm_states``: each model's
    ``FP8CommState`` (``None`` for a model without FP8 communication)."""
    comm_states = comm_states if comm_states is not None else [None] * len(models)
    return {
        "format_version": FORMAT_VERSION,
        "recipe": recipe.to_dict(),
        "world_size": world_size,
        "models": [fp8_state_dict(m) for m in models],
        "fallen_back_layers": [recovery.fallen_back_layers(m) for m in models],
        "grad_scaler": grad_scaler.state_dict() if grad_scaler is not None else None,
        "health": health.state_dict() if health is not None else None,
        "scale_jumps": scale_jumps.state_dict() if scale_jumps is not None else None,
        "comm": [comm.state_dict() if comm is not None else None for comm in comm_states],
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


def begin_save(directory: str | os.PathLike, rank: int) -> None:
    """Mark ``directory`` as being saved into, before Accelerate writes any of its files there, and delete the rank's
    FP8 state file a former save left (rank 0 deletes every rank's): the folder no longer holds a whole checkpoint, and
    :func:`load` refuses it until :func:`end_save` (once every rank's new file is written) removes the mark.

    Every rank calls it (the ranks write Accelerate's files unsynchronized): the mark is written whole or not at all.
    """
    marker = Path(directory) / SUBDIR / SAVE_IN_PROGRESS
    marker.parent.mkdir(parents=True, exist_ok=True)
    if not marker.is_file():
        partial = marker.with_name(f"{marker.name}.{rank}.partial")
        partial.write_text(
            "lightning_fp8: accelerator.save_state is writing this checkpoint, or stopped before it was complete "
            "(load_state refuses the folder). Load an earlier checkpoint, or save into this folder again.\n"
        )
        os.replace(partial, marker)
    rank_file(directory, rank).unlink(missing_ok=True)
    if rank == 0:
        for path in marker.parent.glob("rank*.pt"):
            path.unlink(missing_ok=True)


def end_save(directory: str | os.PathLike) -> None:
    """Remove :func:`begin_save`'s mark: call it on one process, once every rank has written its file."""
    (Path(directory) / SUBDIR / SAVE_IN_PROGRESS).unlink(missing_ok=True)


def check_complete(directory: str | os.PathLike) -> None:
    """Raise ValueError when ``directory`` holds :func:`begin_save`'s mark: a save into it did not complete."""
    marker = Path(directory) / SUBDIR / SAVE_IN_PROGRESS
    if marker.exists():
        raise ValueError(
            f"accelerator.load_state: {marker} exists: a save_state into {str(directory)!r} started and did not "
            "complete, so the folder mixes files of two checkpoints or misses some. Nothing was loaded; load an "
            "earlier checkpoint"
        )


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

    Raises:
        ValueError: for a folder a save did not complete (:func:`check_complete`), or whose FP8 state misses the
            file of a rank that saved it; for a corrupt file (a process count that is not a whole number >= 1, say)
            or one of another format.
    """
    check_complete(directory)
    path = state_file(directory, rank)
    if path is None and any((Path(directory) / SUBDIR).glob("rank*.pt")):
        _incomplete(directory, rank_file(directory, 0))
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
    state_entries.check_entries(state, str(path))
    state_entries.check_count(state, "world_size", 1, str(path))
    if path != rank_file(directory, rank) and rank < state["world_size"]:  # a rank that saved, without its file
        _incomplete(directory, rank_file(directory, rank))
    if state["world_size"] != world_size:
        warn_once(
            f"accelerator.load_state: the FP8 state was saved by {state['world_size']} process(es) and is loaded "
            f"by {world_size}; ranks without their own file use rank 0's activation scaling statistics"
        )
    return state


def _incomplete(directory: str | os.PathLike, missing: Path) -> None:
    raise ValueError(
        f"accelerator.load_state: {missing} is missing while other ranks' FP8 state files of {str(directory)!r} are "
        "there: the checkpoint is incomplete (a save that did not complete, or a deleted file). Nothing was loaded; "
        "load an earlier checkpoint"
    )


def state_file(directory: str | os.PathLike, rank: int) -> Path | None:
    """This rank's file, else rank 0's (a checkpoint written by fewer processes), else ``None``.

    A rank at or past the number of processes that rank 0's file records takes rank 0's file even when it has its
    own: that one is stale, left by an earlier save into the same folder with more processes (before
    :func:`begin_save` deleted such files), and would give this rank another mu and step count than rank 0's.
    """
    own, first = rank_file(directory, rank), rank_file(directory, 0)
    if rank != 0 and own.is_file() and first.is_file():
        saved_world_size = _read(first).get("world_size")
        if isinstance(saved_world_size, int) and rank >= saved_world_size:
            return first
    for path in (own, first):
        if path.is_file():
            return path
    return None


def check(
    state: dict[str, Any],
    recipe: FP8Recipe,
    models: list[nn.Module],
    grad_scaler: Any | None,
    health: Any | None,
    *,
    strict: bool = True,
    source: str = "the FP8 state",
    scale_jumps: Any | None = None,
    comm_states: list[Any | None] | None = None,
) -> None:
    """Raise what :func:`restore` would raise for ``state`` (from :func:`load`) once :func:`put_back` has run, changing
    nothing.

    Call it before :func:`put_back` (which checks on its own, before changing anything, that the layers can be put
    back): the layers that fell back in the saved run are still FP8 layers of the unwrapped ``models`` then, and the
    checkpoint has no scaling state for them.

    Args:
        strict: ``load_state``'s: with ``False`` the scaling states of layers only the checkpoint or only the models
            have are left out, as Accelerate leaves out their weights.
        source: where ``state`` was read from (the rank file), named in the errors.

    Raises:
        KeyError: when the state lacks an entry that :func:`build_state` writes.
        ValueError, TypeError: for an optimizer step count that is not a whole number >= 0, a different number of
            models, fallen-back layers the models do not have, and what :func:`~lightning_fp8.load_fp8_state_dict`,
            ``FP8GradScaler.load_state_dict``, ``HealthMonitor.load_state_dict``, ``ScaleJumps.load_state_dict`` and
            ``FP8CommState.load_state_dict`` raise for their parts.
    """
    # load_state sets its step count from the state last, after Accelerate loaded the weights: checked here first.
    state_entries.check_entries(state, source, (*state_entries.ENTRIES, "optimizer_steps"))
    state_entries.check_count(state, "optimizer_steps", 0, source)
    try:  # the saved recipe, the model count and the fallen-back layers are checked by _parts itself
        for check_part, _ in _parts(state, recipe, models, grad_scaler, health, strict, scale_jumps, comm_states):
            check_part()
    except (KeyError, ValueError, TypeError) as error:
        message = error.args[0] if len(error.args) == 1 else str(error)  # KeyError's str() is a repr
        raise type(error)(f"{source}: {message}") from error


def put_back(state: dict[str, Any], models: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
    """Put the layers that had fallen back to ``nn.Linear`` in the saved run back in the unwrapped ``models``.

    Call it after :func:`check` and before anything is loaded into them: ``convert_to_fp8`` made those layers FP8
    again and FP8AdamW (O2) took their weights' storage, so neither the FP8 scaling state nor the optimizer state of
    the checkpoint fits them. Putting them back releases their weights from ``optimizers`` (fp32 states, as saved);
    the weights' values are the checkpoint's once Accelerate loads the model. Nothing happens for a checkpoint written
    before the names were saved.

    Raises:
        ValueError: when a layer cannot be put back (see :func:`lightning_fp8.recovery.put_back_to_high_precision`:
            e.g. the model is wrapped by DistributedDataParallel), before anything is changed.
    """
    for model, names in zip(models, state_entries.fallen_back(state, models), strict=True):
        if names:
            recovery.put_back_to_high_precision(model, names, optimizers)


def restore(
    state: dict[str, Any],
    recipe: FP8Recipe,
    models: list[nn.Module],
    grad_scaler: Any | None,
    health: Any | None,
    *,
    strict: bool = True,
    scale_jumps: Any | None = None,
    comm_states: list[Any | None] | None = None,
) -> None:
    """Load ``state`` (from :func:`load`) into the unwrapped ``models`` (their fallen-back layers put back), the scaler
    and the health monitor. Every part is checked before any is loaded: a bad entry anywhere in the file changes
    nothing.

    Raises:
        KeyError, ValueError, TypeError: as :func:`check`.
    """
    parts = _parts(state, recipe, models, grad_scaler, health, strict, scale_jumps, comm_states)
    for check_part, _ in parts:
        check_part()
    saved = FP8Recipe.from_dict(state["recipe"])
    if saved != recipe:
        what = "loaded" if saved.same_scaling(recipe) else (
            "not loaded (written under other scaling settings): each FP8 layer's first casts compute their scales "
            "from the tensors themselves")  # fmt: skip
        warn_once(
            f"accelerator.load_state: the checkpoint was trained with FP8 recipe {state['recipe']}, this run uses "
            f"{recipe.to_dict()}; the saved scaling state is {what}"
        )
    for _, load_part in parts:
        load_part()


def _parts(
    state: dict[str, Any],
    recipe: FP8Recipe,
    models: list[nn.Module],
    grad_scaler: Any | None,
    health: Any | None,
    strict: bool,
    scale_jumps: Any | None = None,
    comm_states: list[Any | None] | None = None,
) -> list[tuple[Callable[[], None], Callable[[], None]]]:
    """``(check, load)`` of each part of ``state``: each model's scaling state, mu, the health history, the scale-jump
    alerts (absent from checkpoints written before they were saved: the first log after the load compares nothing),
    each model's FP8 communication state (``comm_states``, one per model, ``None`` for a model without one)."""
    state_entries.check_entries(state, "the FP8 state")
    saved = FP8Recipe.from_dict(state["recipe"])
    if len(state["models"]) != len(models):
        raise ValueError(
            f"accelerator.load_state: the checkpoint has FP8 state for {len(state['models'])} model(s) but "
            f"{len(models)} FP8 model(s) were prepared: prepare the same models as the run that saved it"
        )
    parts = []
    if saved.same_scaling(recipe):
        fallen_back = state_entries.fallen_back(state, models)
        for model, model_state, names in zip(models, state["models"], fallen_back, strict=True):
            # Layers still to be put back have no scaling state in the checkpoint (once put back, they have none).
            modules = dict(model.named_modules())
            leaving_out = [modules[n] for n in names]
            check_part = partial(check_fp8_state_dict, model, model_state, strict, leaving_out=leaving_out)
            parts.append((check_part, partial(load_fp8_state_dict, model, model_state, strict)))
    for owner, key in ((grad_scaler, "grad_scaler"), (health, "health"), (scale_jumps, "scale_jumps")):
        if owner is not None and state.get(key) is not None:
            parts.append((partial(owner.check_state_dict, state[key]), partial(owner.load_state_dict, state[key])))
    saved_comms = state_entries.saved_comm(state, models)
    for comm, saved_comm in zip(comm_states or [None] * len(models), saved_comms, strict=True):
        # Either side without FP8 communication (a checkpoint of one process resumed on several, or the reverse):
        # nothing to carry over, the hooks start fresh.
        if comm is not None and saved_comm is not None:
            parts.append((partial(comm.check_state_dict, saved_comm), partial(comm.load_state_dict, saved_comm)))
    return parts
