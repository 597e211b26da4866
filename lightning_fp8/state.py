"""Saving and loading the FP8 scaling state of a model (scales, amax histories, counters).

The state lives in non-persistent buffers so a converted model keeps ``nn.Linear``'s state_dict keys;
these two functions put it into (and take it out of) a checkpoint beside the model's state_dict. What each saved
value must be to load is checked in :mod:`lightning_fp8.state_values`.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection

import torch
from torch import nn

from lightning_fp8 import load_pairing
from lightning_fp8.grad_scaling.rules import rescale_grad_output_state
from lightning_fp8.recipe import check_flag
from lightning_fp8.scale_rule import _format_max
from lightning_fp8.scaling import ScalingState
from lightning_fp8.state_values import (
    _check_initialized,
    _check_mapping,
    _check_value,
    _is_number_tensor,
    _kind,
    _shape,
)
from lightning_fp8.stats import clean_name, wraps_as_module

# The buffers of a grad_output state whose load pairs it with a scaler load (lightning_fp8.load_pairing).
PAIRED_BUFFERS = ("amax_history", "scale")

# What the values of a scaling state mean, saved beside its buffers as 0-dim tensors so that a checkpoint written
# under other recipe settings is refused (a scale computed for E5M2 saturates every E4M3 cast). Checkpoints written
# before these entries existed lack them: they are optional when loading.
SETTINGS = ("fp8_max", "margin", "delayed", "amax_compute_algo")
_ALGOS = ("max", "most_recent")  # amax_compute_algo is saved as its index here

# Whether the state's next delayed cast uses its history (ScalingState.initialized), saved as a 0-dim int64 1 or 0: the
# buffers cannot always tell it. A cast with a finite amax > 0 sets it; later casts of all-zero tensors may roll the
# history back to zeros, and its scale may be 1, as a state that never cast has. Checkpoints written before this entry
# existed lack it: it is then inferred (_inferred).
INITIALIZED = "initialized"


def _setting_values(state: ScalingState) -> dict[str, float]:
    # As Python numbers, so that comparing them needs no tensor data (a model on the meta device has none).
    return {
        # The format's largest value (448 E4M3, 57344 E5M2): it identifies the format and is what the scale targets.
        "fp8_max": float(_format_max(state.fp8_dtype)),
        "margin": float(state.margin),
        "delayed": float(int(state.delayed)),
        "amax_compute_algo": float(_ALGOS.index(state.algo)),
    }


def _settings(state: ScalingState) -> dict[str, torch.Tensor]:
    device = state.scale.device
    values = _setting_values(state)
    return {
        name: torch.tensor(value, dtype=torch.float32 if name == "fp8_max" else torch.int64, device=device)
        for name, value in values.items()
    }


def _describe(name: str, value: float) -> str:
    # One setting as a person reads it.
    if name == "fp8_max":
        formats = {448.0: "E4M3", 57344.0: "E5M2", 65504.0: "float16"}
        return f"fp8 format {formats.get(value, '?')} (fp8_max {value:g})"
    if name == "margin":
        return f"margin {value:g}"
    if name == "delayed":
        return {1.0: "delayed scaling", 0.0: "current scaling"}.get(value, f"delayed={value:g}")
    algo = _ALGOS[int(value)] if value in (0.0, 1.0) else f"code {value:g}"
    return f"amax_compute_algo {algo!r}"


def fp8_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """All scaling buffers of ``module``, keyed ``"<scaling-state fqn>.<buffer>"``, and the settings their values
    are for, keyed ``"<scaling-state fqn>.<setting>"``; plain tensors only (``torch.load(weights_only=True)`` reads
    them).

    The settings, 0-dim tensors: ``fp8_max`` (fp32: 448 for E4M3, 57344 for E5M2: the state's format), ``margin``,
    ``delayed`` (1 for delayed scaling, 0 for current) and ``amax_compute_algo`` (0 for ``"max"``, 1 for
    ``"most_recent"``), the last three int64; on the state's device, like its buffers. :func:`load_fp8_state_dict`
    refuses a state saved with other settings. Beside them ``"<scaling-state fqn>.initialized"`` (int64, 1 or 0):
    whether the state's next delayed cast uses its history (:attr:`ScalingState.initialized`), which the buffers
    cannot always tell (a history rolled back to zeros by casts of all-zero tensors, a scale of 1).
    """
    _check_module(module, "fp8_state_dict")
    out: dict[str, torch.Tensor] = {}
    for name, state in module.named_modules():
        if isinstance(state, ScalingState):
            device = state.scale.device
            for buf_name, buf in state.named_buffers(recurse=False):
                out[f"{name}.{buf_name}"] = buf.detach().clone()
            for setting, value in _settings(state).items():
                out[f"{name}.{setting}"] = value
            out[f"{name}.{INITIALIZED}"] = torch.tensor(int(state.settle()), dtype=torch.int64, device=device)
    return out


def load_fp8_state_dict(module: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Load what :func:`fp8_state_dict` saved. Every value is checked before any is loaded: a bad checkpoint changes
    nothing. With ``strict=False`` keys the model does not have are ignored and missing ones keep their values; when
    no key of a non-empty ``state_dict`` names a state of the model's (nothing would load), a warning says so.

    Names may differ by a wrapper's: a state saved from ``DDP(model)`` or ``DataParallel(model)`` loads into
    ``model`` and the other way round, also where the model has a child of its own named ``module``.

    Loaded together with an :class:`~lightning_fp8.FP8GradScaler` state from the same checkpoint, in either order,
    the ``grad_output`` states match the loaded mu (see ``FP8GradScaler.load_state_dict``).

    The settings a state was saved with (its format, margin, delayed or current scaling, amax_compute_algo) must be
    the model's: its scale and history mean nothing under others, with or without ``strict``. Checkpoints written
    before the settings were saved have none, and load as before (unchecked).

    Each loaded state's ``initialized`` flag is the saved one, so that the casts after loading are those the saved
    model would have made. Checkpoints written before it was saved lack it: a state is then taken as initialized when
    it has cast and its history or scale shows it (a state whose casts were all of all-zero tensors is not).

    Raises:
        KeyError: with ``strict``, if buffer keys are missing or keys are unexpected (a different model).
        TypeError: if ``module`` is not an ``nn.Module`` or ``strict`` not a bool, if ``state_dict`` is not a dict
            with string keys, a value is not a plain (strided, not sparse or nested) tensor of the buffer's kind
            (floating point or integer; not bool), a setting is not one number, or an ``initialized`` entry is not one
            integer (not bool).
        ValueError: if a state was saved under other recipe settings (``fp8_format``, ``margin``, ``scaling``,
            ``amax_compute_algo``), a saved tensor's shape differs (e.g. another ``amax_history_len``), or a value
            cannot be a scaling state's: a scale that is not a power of two from 2**-126 to 2**127, a negative or NaN
            amax, a saturation outside [0, 1], a negative count, an ``initialized`` other than 0 or 1, or a value the
            buffer's dtype (fp32, int64) cannot hold exactly (a float64 scale of 2**200 would be inf in fp32); if
            the model's scaling state or a saved value is on the ``meta`` device (it holds no data); or if a delayed
            state's ``initialized`` is 1 without its ``amax_history`` and ``scale`` in the dict (``strict=False``).
    """
    states, loads, initialized = _checked(module, state_dict, strict, (), warn=True)
    filled: dict[str, set[int]] = {}
    for name, buf, _ in loads:
        filled.setdefault(name, set()).add(id(buf))
    grad_outputs = {name for name in filled if load_pairing.is_grad_output(name)}
    # Filled in the buffers its next casts use (scale, amax history): the state now holds the values saved beside the
    # saved mu. A load of neither or one (strict=False: counters alone, say) leaves live values, which follow the live
    # mu. (A load without the last amax, a statistic, keeps that one as it was.)
    whole = {n for n in grad_outputs if {id(getattr(states[n], b)) for b in PAIRED_BUFFERS} <= filled[n]}
    # Loaded right after the scaler (no cast between), from the same checkpoint: the pair is complete, and the saved
    # values take the scaler's correction (loaded mu / saved mu; 1 unless the scaler brought the saved mu within its
    # bounds).
    corrections = {n: c for n in whole if (c := load_pairing.scaler_load_pending(states[n])) is not None}
    with torch.no_grad():
        for _, buf, value in loads:
            buf.copy_(value)
    for name in grad_outputs:
        if name in whole:
            load_pairing.fp8_state_loaded(states[name], corrections.get(name))
        else:
            load_pairing.forget_loads(states[name])
    for state_name in set(filled) - set(initialized):  # saved without the flag
        initialized[state_name] = _inferred(states[state_name])
    for state_name, flag in initialized.items():
        states[state_name].set_initialized(flag)
    for state_name in filled:
        load_pairing.fp8_state_filled(states[state_name])
    with torch.no_grad():  # after the inference above, which reads the saved values (as in the other order)
        for name, correction in corrections.items():
            if correction != 1.0:
                rescale_grad_output_state(states[name], correction)


def check_fp8_state_dict(
    module: nn.Module,
    state_dict: dict[str, torch.Tensor],
    strict: bool = True,
    *,
    leaving_out: Collection[nn.Module] = (),
) -> None:
    """Raise what :func:`load_fp8_state_dict` would raise for these arguments, changing nothing: so that a load of
    several parts (the FP8 state, mu, other models' states) checks every part before it loads any.

    Args:
        module, state_dict, strict: as for :func:`load_fp8_state_dict`.
        leaving_out: submodules of ``module`` whose scaling states are not compared (FP8 layers about to be put back
            to ``nn.Linear``, whose states the checkpoint does not have).
    """
    _checked(module, state_dict, strict, leaving_out)


def _in_model_names(
    module: nn.Module, state_dict: dict[str, torch.Tensor], expected: set[str]
) -> dict[str, torch.Tensor]:
    """``state_dict`` keyed as ``module`` names its states (``expected``), where the two differ only by what wrappers
    add to names (DDP's leading ``module.``, torch.compile's ``_orig_mod.``, FSDP1's and activation checkpointing's: a
    state saved from ``DDP(model)`` loads into ``model``, and the other way round); as it is where that would be
    ambiguous.

    The model's names lose a leading ``module.`` when ``module`` is such a wrapper (``wraps_as_module``), not when
    it is a child of the user's named ``module`` (an EMA wrapper's): the saved keys are read as they are, or without
    one leading wrapper ``module.``, and the reading that maps the most keys to the model's states (every one, for a
    whole state) is taken, the keys as they are on a tie. Only where neither maps more keys than that are the model's
    names taken without their leading ``module.`` too (a wrapper that ``wraps_as_module`` does not know)."""
    if set(state_dict) <= expected:
        return state_dict
    wrapped = wraps_as_module(module)
    best, matched = state_dict, len(set(state_dict) & expected)
    for model_strip, saved_strip in ((wrapped, False), (wrapped, True), (True, False), (True, True)):
        model_key = {clean_name(key, strip_module=model_strip): key for key in expected}
        if len(model_key) != len(expected):  # two names would become one
            continue
        renamed = {model_key.get(clean_name(key, saved_strip), key): value for key, value in state_dict.items()}
        count = len(set(renamed) & expected)
        if len(renamed) == len(state_dict) and count > matched:  # else two names would become one
            best, matched = renamed, count
    return best


def _checked(
    module: nn.Module, state_dict: object, strict: bool, leaving_out: Collection[nn.Module], warn: bool = False
) -> tuple[dict[str, ScalingState], list[tuple[str, torch.Tensor, torch.Tensor]], dict[str, bool]]:
    """Check ``state_dict`` against ``module``; return its scaling states by name, the ``(state name, buffer, value)``
    copies to make and the ``initialized`` flags saved, by state name. With ``warn``, warn when ``strict`` is off and
    no key of a non-empty ``state_dict`` names a state of the model's (the load would change nothing)."""
    _check_module(module, "load_fp8_state_dict")
    # A bool: strict="no" (truthy) would check every key, strict=None skip the checks, against what was meant.
    check_flag("load_fp8_state_dict", "strict", strict)
    _check_mapping(state_dict)
    skipped = {id(m) for layer in leaving_out for m in layer.modules()}
    states = {n: m for n, m in module.named_modules() if isinstance(m, ScalingState) and id(m) not in skipped}
    meta = sorted(name for name, state in states.items() if state.scale.is_meta)
    if meta:
        raise ValueError(
            f"the model's FP8 scaling states {meta[:3]} are on the meta device (no data to load into): materialize "
            "the model first (model.to_empty(device=...), then its reset_parameters()), then load its FP8 state"
        )
    expected = {f"{name}.{field}" for name, state in states.items() for field in _fields(state)}
    state_dict = _in_model_names(module, state_dict, expected)
    if warn and not strict:
        _warn_if_nothing_matches(state_dict, expected)
    settings = {key for key in expected if key.rpartition(".")[2] in SETTINGS}
    flags = {key for key in expected if key.rpartition(".")[2] == INITIALIZED}
    if strict:
        _check_keys_match(state_dict, expected, optional=settings | flags)
    loads, initialized = _checked_loads(states, state_dict, expected, settings, flags)
    _check_flags_have_history(states, state_dict, initialized)
    return states, loads, initialized


def _warn_if_nothing_matches(state_dict: dict[str, torch.Tensor], expected: set[str]) -> None:
    """Warn when no key of a non-empty ``state_dict`` names one of the model's states (``expected``): a load with
    ``strict=False`` would change nothing, silently."""
    if state_dict and not expected:
        warnings.warn(
            f"load_fp8_state_dict(strict=False): this model has no FP8 scaling state (no FP8 layer), so none of the "
            f"{len(state_dict)} saved keys (e.g. {next(iter(state_dict))!r}) was loaded. Convert the model first "
            "(convert_to_fp8, with the recipe and module filter it was trained with), then load its FP8 state",
            stacklevel=4,
        )
    elif state_dict and not set(state_dict) & expected:
        warnings.warn(
            f"load_fp8_state_dict(strict=False): none of the {len(state_dict)} saved keys (e.g. "
            f"{next(iter(state_dict))!r}) names an FP8 scaling state of this model (e.g. {min(expected)!r}), so "
            "nothing was loaded. Load the fp8_state_dict() of this model (or of it wrapped in DDP/DataParallel), or "
            "pass strict=True to see the missing and unexpected keys",
            stacklevel=4,
        )


def _check_keys_match(state_dict: dict[str, torch.Tensor], expected: set[str], optional: set[str]) -> None:
    """``strict``: raise KeyError unless the keys of ``state_dict`` are the model's (``expected``), of which those in
    ``optional`` (settings and flags, which older checkpoints lack) may be missing."""
    missing = sorted(expected - set(state_dict) - optional)
    unexpected = sorted(set(state_dict) - expected)
    if missing or unexpected:
        fallback = (
            " If the saved run's 'bf16' fallback (FP8GradScaler nonfinite_fallback) put layers back to nn.Linear, "
            "save lightning_fp8.recovery.fallen_back_layers(model) with the checkpoint and call "
            "put_back_to_high_precision(model, names, optimizer) on this model before loading (docs: "
            "troubleshooting)."
            if missing and not unexpected
            else ""
        )
        raise KeyError(
            f"FP8 scaling state does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}; "
            "was the checkpoint written for a model converted with the same layers and recipe? (Names that differ "
            "only by a wrapper's prefix, DDP's 'module.' or torch.compile's '_orig_mod.', are matched already.)"
            f"{fallback}"
        )


def _checked_loads(
    states: dict[str, ScalingState],
    state_dict: dict[str, torch.Tensor],
    expected: set[str],
    settings: set[str],
    flags: set[str],
) -> tuple[list[tuple[str, torch.Tensor, torch.Tensor]], dict[str, bool]]:
    """Check each saved value of the model's states (``expected``; the ``settings`` first, then buffers and
    ``flags``); return the ``(state name, buffer, value)`` copies to make and the ``initialized`` flags by state."""
    meta = sorted(key for key, v in state_dict.items() if key in expected and isinstance(v, torch.Tensor) and v.is_meta)
    if meta:
        raise ValueError(
            f"FP8 scaling state {meta[:3]} is on the meta device (it holds no data): load the checkpoint with "
            "torch.load(..., map_location='cpu') (or a real device)"
        )
    for key in sorted(settings & set(state_dict)):  # first: a state of another recipe would fail the checks below
        state_name, _, name = key.rpartition(".")
        _check_setting(key, state_dict[key], _setting_values(states[state_name])[name])
    loads, initialized = [], {}
    for key, value in state_dict.items():
        if key not in expected or key in settings:
            continue
        state_name, _, buf_name = key.rpartition(".")
        if key in flags:
            initialized[state_name] = _check_initialized(key, value)
            continue
        buf = getattr(states[state_name], buf_name)
        _check_value(key, buf_name, value, buf)
        loads.append((state_name, buf, value))
    return loads, initialized


def _check_flags_have_history(
    states: dict[str, ScalingState], state_dict: dict[str, torch.Tensor], initialized: dict[str, bool]
) -> None:
    """Raise ValueError for a delayed state's ``initialized`` flag of 1 loaded without its history."""
    # A flag of 1 says the state's next delayed cast uses its history: loaded without that history (strict=False,
    # a hand-made dict), a fresh state would cast with scale 1 and saturate. A current-scaled state (weights, or
    # scaling="current") computes every scale from its tensor: the flag changes no cast there.
    loaded = {(state_name, buf_name) for state_name, buf_name in (key.rpartition(".")[::2] for key in state_dict)}
    given = lambda name: {(name, "amax_history"), (name, "scale")} <= loaded  # noqa: E731
    orphans = sorted(name for name, flag in initialized.items() if flag and states[name].delayed and not given(name))
    if orphans:
        raise ValueError(
            f"FP8 scaling state {orphans[0]!r}{f' (and {len(orphans) - 1} more)' if len(orphans) > 1 else ''} has "
            "'initialized' = 1 without its 'amax_history' and 'scale' in the same dict: the flag says the next cast "
            "uses that history, which this load would not give it. Load the whole state fp8_state_dict() saved, or "
            "leave the flag out"
        )


def _fields(state: ScalingState) -> list[str]:
    # The entries fp8_state_dict() saves for one state, after its name.
    return [name for name, _ in state.named_buffers(recurse=False)] + list(SETTINGS) + [INITIALIZED]


def _check_module(module: object, caller: str) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"{caller} takes the model (an nn.Module holding FP8 layers) first, got {type(module).__name__}: call "
            f"{caller}(model{', state_dict' if caller.startswith('load') else ''})"
        )


def _inferred(state: ScalingState) -> bool:
    # For checkpoints without the flag: initialized once a cast carried information, an amax in the history or a scale
    # it left. A state whose casts were all of empty or all-zero tensors (amax 0) has neither, and its next cast must
    # still use its own amax (as the live state's: ScalingState.note_cast).
    return bool(state.casts) and bool(state.amax_history.any() or state.scale != 1)


def _check_setting(key: str, value: object, mine: float) -> None:
    """Raise unless the saved setting ``value`` (``"<state>.<setting>"`` = ``key``) equals the model's, ``mine``."""
    state_name, _, name = key.rpartition(".")
    if not _is_number_tensor(value) or value.numel() != 1:
        shape = f" of shape {_shape(value)}" if isinstance(value, torch.Tensor) else ""  # a number has none
        raise TypeError(
            f"FP8 scaling state {key!r} is {_kind(value)}{shape}, expected a one-element tensor (what fp8_state_dict() "
            "saves): the checkpoint is corrupt or not an fp8_state_dict()"
        )
    saved = float(value.detach().double().cpu().reshape(()))
    if saved != mine:
        raise ValueError(
            f"FP8 scaling state {state_name!r} was saved with {_describe(name, saved)}, but this model's has "
            f"{_describe(name, mine)}: the checkpoint was written under another FP8 recipe (fp8_format, margin, "
            "scaling or amax_compute_algo), and its scales and amax histories mean something else here. Convert the "
            "model with the checkpoint's recipe to resume it, or do not load its FP8 state (the model's weights load "
            "without it; the first casts then compute their scales from the tensors themselves)"
        )
