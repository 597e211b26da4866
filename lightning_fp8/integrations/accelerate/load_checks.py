"""The checks of Accelerate's own checkpoint files that ``accelerator.load_state`` runs before it changes anything.

Accelerate 1.15's ``load_state`` loads the model files, then the optimizer files, then the schedulers' and the custom
objects' files, each straight into the live objects: a file that fails to load leaves those before it loaded (the
checkpoint's weights beside the run's own optimizer states), and torch's ``load_state_dict`` copies every tensor that
fits before it reports those that do not. The FP8 Accelerator reads and checks them first (:func:`check_files`):

- every model file can be read, and holds the model's keys (unless ``strict=False``) with the model's shapes;
- every optimizer file can be read and passes the prepared optimizer's checks
  (:meth:`~lightning_fp8.integrations.accelerate.optimizer.FP8AcceleratedOptimizer.check_state_dict`: its parameter
  groups, FP8AdamW's states);
- every scheduler file and custom object file can be read, and there are as many custom object files as registered
  objects;
- this process's random states file (``random_states_<R>.pkl``) can be read and holds the Python, NumPy and torch
  states (:func:`check_random_states`): Accelerate only logs a file it cannot load, and the run goes on with its own
  random states.

Not checked: FSDP's model and optimizer folders (torch.distributed.checkpoint), the data samplers' files, and the
values a scheduler's or custom object's own ``load_state_dict`` refuses.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import load as accelerate_load
from accelerate.utils.constants import MODEL_NAME, OPTIMIZER_NAME, RNG_STATE_NAME, SAFE_MODEL_NAME, SCHEDULER_NAME
from safetensors import safe_open
from torch import nn

from lightning_fp8.integrations.accelerate.checkpoint import SUBDIR
from lightning_fp8.optim import FP8AdamW
from lightning_fp8.optim.state_layout import _KEYS

_EXTRA_STATE = "_extra_state"  # the key suffix of a module's get_extra_state in its state dict
_CORRUPT = "the checkpoint is corrupt or was not completely written. Nothing was loaded; load an earlier checkpoint"


def check_files(
    directory: str | os.PathLike,
    models: list[nn.Module] | None,
    optimizers: list[Any] | None,
    schedulers: list[Any],
    custom_objects: int,
    strict: bool = True,
    load_kwargs: dict[str, Any] | None = None,
) -> None:
    """Raise, naming the file, for a file of ``directory`` that Accelerate's ``load_state`` would fail to load.

    Args:
        directory: the checkpoint folder.
        models, optimizers, schedulers: the prepared objects, as the accelerator lists them (``None``: their files
            are not Accelerate's plain ones, e.g. FSDP's folders, and are not checked).
        custom_objects: how many objects were registered with ``register_for_checkpointing``.
        strict, load_kwargs: as passed to ``load_state`` (``strict`` is ``load_state_dict``'s).

    Raises:
        FileNotFoundError: for a missing file.
        ValueError: for a file that cannot be read, or whose content does not fit its object.
        RuntimeError: for another number of custom object files than registered objects (Accelerate's error).
    """
    directory, load_kwargs = Path(directory), load_kwargs or {}
    for i, model in enumerate(models or []):
        ending = f"_{i}" if i > 0 else ""
        safetensors_file = directory / f"{SAFE_MODEL_NAME}{ending}.safetensors"  # Accelerate's choice of file
        if safetensors_file.exists():
            _check_model_file(safetensors_file, _safetensors_shapes(safetensors_file), model, strict, safetensors=True)
        else:
            path = directory / f"{MODEL_NAME}{ending}.bin"
            saved = _read(path, accelerate_load, map_location="cpu", mmap=True)
            shapes = saved if not isinstance(saved, dict) else {
                key: tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                for key, value in saved.items()
            }  # fmt: skip
            _check_model_file(path, shapes, model, strict, safetensors=False)
    for i, optimizer in enumerate(optimizers or []):
        path = directory / (f"{OPTIMIZER_NAME}.bin" if i == 0 else f"{OPTIMIZER_NAME}_{i}.bin")
        # A second read of the file (Accelerate reads it again to load it), memory-mapped: the check reads each
        # state once and keeps no copy of the file.
        state_dict = _read(path, accelerate_load, map_location="cpu", **{"mmap": True, **load_kwargs})
        if hasattr(optimizer, "check_state_dict"):
            try:
                optimizer.check_state_dict(state_dict)
            except ValueError as error:
                raise ValueError(f"accelerator.load_state: {path}: {error}") from None
    for i, _ in enumerate(schedulers):
        path = directory / (f"{SCHEDULER_NAME}.bin" if i == 0 else f"{SCHEDULER_NAME}_{i}.bin")
        _read(path, accelerate_load, **load_kwargs)
    _check_custom_files(directory, custom_objects)


def check_plain_run_files(
    directory: str | os.PathLike, optimizers: list[Any], load_kwargs: dict[str, Any] | None
) -> None:
    """With FP8-LM off: raise, naming the file, when an optimizer file of an FP8 checkpoint holds FP8AdamW's scaled
    moments (``exp_avg`` stored as ``value * exp_avg_scale``) for a prepared optimizer that is not an FP8AdamW.

    ``torch.optim.AdamW.load_state_dict`` takes such a file without a word and reads the stored values as the moments
    (a first moment of 0.0098 as 160). Only the folders of FP8 saves (their ``lightning_fp8/`` subfolder) are read;
    a file converted with :func:`~lightning_fp8.optim.adamw_state_dict` passes.
    """
    directory = Path(directory)
    if not (directory / SUBDIR).is_dir():
        return
    for i, optimizer in enumerate(optimizers):
        path = directory / (f"{OPTIMIZER_NAME}.bin" if i == 0 else f"{OPTIMIZER_NAME}_{i}.bin")
        if isinstance(getattr(optimizer, "optimizer", optimizer), FP8AdamW) or not path.is_file():
            continue  # an FP8AdamW of the script's own reads them; a missing file is Accelerate's error
        state_dict = _read(path, accelerate_load, map_location="cpu", **{"mmap": True, **(load_kwargs or {})})
        states = state_dict.get("state", {}) if isinstance(state_dict, dict) else {}
        if any(isinstance(state, dict) and f"{key}_scale" in state for state in states.values() for key in _KEYS):
            raise ValueError(
                f"accelerator.load_state: {path} holds FP8AdamW's optimizer states (moments stored as value * scale), "
                f"but FP8-LM is off in this run and its {type(getattr(optimizer, 'optimizer', optimizer)).__name__} "
                "would read the stored values as the moments. Launch with the recipe the checkpoint was saved with "
                "(lightning-fp8 launch --fp8-recipe ...), or convert the file first (lightning_fp8.optim."
                "adamw_state_dict: torch.save(adamw_state_dict(torch.load(path, weights_only=True)), path); see "
                "docs/guides/checkpoints.md). Nothing was loaded"
            )


# What Accelerate 1.16's save_accelerator_state always writes, and load_accelerator_state sets the random states from.
_RANDOM_STATES = ("random_state", "numpy_random_seed", "torch_manual_seed")


def check_random_states(directory: str | os.PathLike, process_index: int, saved_processes: int | None) -> None:
    """Raise, naming the file, when this process's random states file is missing or cannot be loaded.

    Every process that saves writes its own (``random_states_<R>.pkl``); a process that did not save (a run resumed on
    more processes) has none, and keeps its own random states, as in Accelerate.

    Args:
        directory: the checkpoint folder.
        process_index: this process's index.
        saved_processes: how many processes saved the checkpoint (its FP8 state says); ``None``: unknown, then
            taken as one more than the highest process index among the folder's random states files.

    Raises:
        FileNotFoundError: for a missing file of a process that saved.
        ValueError: for a file that cannot be read, or misses a random state.
    """
    directory = Path(directory)
    if saved_processes is None:
        found = [re.fullmatch(rf"{RNG_STATE_NAME}_(\d+)\.pkl", name) for name in os.listdir(directory)]
        saved_processes = 1 + max((int(match[1]) for match in found if match is not None), default=0)
    if process_index >= saved_processes:
        return
    path = directory / f"{RNG_STATE_NAME}_{process_index}.pkl"
    states = _read(path, accelerate_load)  # as Accelerate reads it
    missing = [key for key in _RANDOM_STATES if key not in states] if isinstance(states, dict) else list(_RANDOM_STATES)
    if missing:
        raise ValueError(f"accelerator.load_state: {path} does not hold the random states {missing}: {_CORRUPT}")


def _read(path: Path, read: Callable[..., Any], **kwargs: Any) -> Any:
    """``read(path, **kwargs)``, or an error naming the file and saying what to do."""
    if not path.is_file():
        raise FileNotFoundError(
            f"accelerator.load_state: {path} is missing: the checkpoint is incomplete, or was saved with other "
            "prepared objects. Nothing was loaded; load a checkpoint saved by this script"
        )
    try:
        return read(path, **kwargs)
    except Exception as error:  # a truncated or corrupt file: torch and safetensors raise zip, pickle, EOF errors
        raise ValueError(
            f"accelerator.load_state: {path} cannot be read ({type(error).__name__}: {str(error)[:300]}): {_CORRUPT}"
        ) from error


def _safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The tensors' shapes from the file's header (no tensor is read; a file shorter than the header says fails)."""
    return _read(path, _header_shapes)


def _header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(path, framework="pt") as f:
        return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}


def _check_model_file(path: Path, saved: Any, model: nn.Module, strict: bool, safetensors: bool) -> None:
    """Raise ValueError where Accelerate's load of the file into ``model`` would fail on the file's ``saved`` shapes by
    key: ``model.load_state_dict`` for a ``.bin`` file, safetensors' ``load_model`` for a ``.safetensors`` one.

    The keys are compared as torch's ``load_state_dict`` reports them (safetensors' ``load_model`` too): the model's
    tensors, and the extra state of the modules that take one (``set_extra_state``; a module that only writes one,
    ``get_extra_state``, has it unexpected); the shapes only for the tensors other than extra state, which torch hands
    to ``set_extra_state`` as saved.
    ``safetensors``: a key missing from the file is fine when its tensor is another key's that the file has
    (safetensors files hold tied weights once; ``load_model`` ties them back), and a model whose state dict holds a
    value other than a tensor is refused whatever ``strict`` is (``load_model`` fails on it).
    """
    if not isinstance(saved, dict):
        raise ValueError(f"accelerator.load_state: {path} holds a {type(saved).__name__}, not a state dict: {_CORRUPT}")
    # The state dict Accelerate's loaders compare against too (safetensors' load_model computes it as well).
    expected = model.state_dict(keep_vars=True)
    not_tensors = [key for key, value in expected.items() if not isinstance(value, torch.Tensor)]
    if safetensors and not_tensors:
        raise ValueError(
            f"accelerator.load_state: {path} is a safetensors file, and the prepared {type(model).__name__}'s state "
            f"dict holds {not_tensors[0]!r} ({type(expected[not_tensors[0]]).__name__}), not a tensor (extra state "
            "from get_extra_state?): safetensors' load_model, which Accelerate loads the file with, takes tensors "
            "only. Save the checkpoint with save_state(..., safe_serialization=False). Nothing was loaded"
        )
    written, taken = _extra_state_keys(model)
    tensors = {key: value for key, value in expected.items()
               if isinstance(value, torch.Tensor) and key not in written}  # fmt: skip
    # As torch's load_state_dict reports keys (safetensors' load_model takes its lists): a module's extra state is
    # expected where the module takes one, unexpected where it only writes one.
    expected = {key: value for key, value in expected.items() if key not in written}
    expected.update(dict.fromkeys(taken))
    wrong = [(key, saved[key], tuple(value.shape)) for key, value in tensors.items()
             if key in saved and not _loads_into(saved[key], value)]  # fmt: skip
    if wrong:
        key, got, own = wrong[0]
        raise ValueError(
            f"accelerator.load_state: {path} holds {key!r} of shape {got}, the prepared {type(model).__name__} has "
            f"{own} ({len(wrong)} such tensor(s)): the checkpoint was saved for another model; prepare the model that "
            "saved it. Nothing was loaded"
        )
    if not strict:
        return
    missing = [key for key in expected
               if key not in saved and not (safetensors and _tied_to_saved(key, tensors, saved))]  # fmt: skip
    unexpected = [key for key in saved if key not in expected]
    if missing or unexpected:
        raise ValueError(
            f"accelerator.load_state: {path} does not hold the prepared {type(model).__name__}'s weights: missing "
            f"{missing[:5]}, unexpected {unexpected[:5]}: the checkpoint was saved for another model; prepare the "
            f"model that saved it (or pass strict=False to load_state).{_compiled_hint(missing, unexpected)} Nothing "
            "was loaded"
        )


def _compiled_hint(missing: list[str], unexpected: list[str]) -> str:
    """What to do when the keys differ only by torch.compile's ``_orig_mod.`` prefix (a model compiled in the script,
    torch.compile(model), saved; loaded into one not compiled there, or the other way round)."""
    prefix = "_orig_mod."
    strip = {key.replace(prefix, "") for key in missing} == {key.replace(prefix, "") for key in unexpected}
    if not strip or not any(prefix in key for key in missing + unexpected):
        return ""
    saved_compiled = any(prefix in key for key in unexpected)
    return (
        f" The keys differ only by torch.compile's {prefix!r} prefix: the checkpoint was saved from a model "
        f"{'compiled' if saved_compiled else 'not compiled'} with torch.compile(model) in the script; "
        f"{'compile' if saved_compiled else 'do not compile'} the model the same way before prepare() to load it "
        "(or compile it with model.compile(), which keeps the keys)."
    )


def _extra_state_keys(model: nn.Module) -> tuple[set[str], set[str]]:
    """The state dict keys (as ``Module.state_dict`` names them) of the extra state ``model``'s modules write
    (``get_extra_state`` overridden) and of the extra state they take (``set_extra_state`` overridden: torch's
    ``_load_from_state_dict`` loads the key then, and reports it unexpected otherwise)."""
    written, taken = set(), set()
    for name, module in model.named_modules(remove_duplicate=False):
        key = f"{name}.{_EXTRA_STATE}" if name else _EXTRA_STATE
        if type(module).get_extra_state is not nn.Module.get_extra_state:
            written.add(key)
        if type(module).set_extra_state is not nn.Module.set_extra_state:
            taken.add(key)
    return written, taken


def _loads_into(shape: tuple[int, ...], value: torch.Tensor) -> bool:
    # torch's _load_from_state_dict: shapes must match, except a one-element 1-d tensor loads into a 0-dim one, and a
    # lazy (uninitialized) parameter takes any shape.
    own = tuple(value.shape) if not isinstance(value, nn.parameter.UninitializedTensorMixin) else None
    return own is None or shape == own or (own == () and shape == (1,))


def _tied_to_saved(key: str, tensors: dict[str, torch.Tensor], saved: dict[str, Any]) -> bool:
    tensor = tensors.get(key)
    return tensor is not None and any(
        other in saved and other_tensor is tensor for other, other_tensor in tensors.items() if other != key
    )


def _check_custom_files(directory: Path, count: int) -> None:
    # Accelerate compares the number of custom_checkpoint_<i>.pkl files with the registered objects only after it
    # loaded everything else; it then loads them with weights_only=False, as read here.
    found = [f for f in os.listdir(directory) if re.search(r"^custom_checkpoint_\d+\.pkl$", f) is not None]
    if len(found) != count:
        raise RuntimeError(
            f"accelerator.load_state: {directory} holds {len(found)} custom checkpoint(s) (custom_checkpoint_<i>.pkl) "
            f"and {count} object(s) are registered with register_for_checkpointing: register the objects the run "
            "that saved it registered. Nothing was loaded"
        )
    for index in range(count):
        path = directory / f"custom_checkpoint_{index}.pkl"
        _read(path, accelerate_load, map_location="cpu", weights_only=False)
