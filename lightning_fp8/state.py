"""Saving and loading the FP8 scaling state of a model (scales, amax histories, counters).

The state lives in non-persistent buffers so a converted model keeps ``nn.Linear``'s state_dict keys;
these two functions put it into (and take it out of) a checkpoint beside the model's state_dict.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_fp8.scaling import ScalingState


def fp8_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """All scaling buffers of ``module``, keyed ``"<scaling-state fqn>.<buffer>"``; plain tensors only."""
    out: dict[str, torch.Tensor] = {}
    for name, state in module.named_modules():
        if isinstance(state, ScalingState):
            for buf_name, buf in state.named_buffers(recurse=False):
                out[f"{name}.{buf_name}"] = buf.detach().clone()
    return out


def load_fp8_state_dict(module: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Load what :func:`fp8_state_dict` saved. Every value is checked before any is loaded: a bad checkpoint changes
    nothing. With ``strict=False`` keys the model does not have are ignored and missing ones keep their values.

    Raises:
        KeyError: with ``strict``, if keys are missing or unexpected (a different model or recipe).
        TypeError: if a value is not a tensor of the buffer's kind (floating point or integer).
        ValueError: if a saved tensor's shape differs (e.g. another ``amax_history_len``), or a value cannot be a
            scaling state's: a scale that is not a finite positive power of two, a negative or NaN amax, a
            saturation outside [0, 1], a negative count.
    """
    expected = fp8_state_dict(module)
    if strict:
        missing, unexpected = sorted(set(expected) - set(state_dict)), sorted(set(state_dict) - set(expected))
        if missing or unexpected:
            raise KeyError(
                f"FP8 scaling state does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}; "
                "was the checkpoint written for a model converted with the same layers and recipe?"
            )
    states = {name: m for name, m in module.named_modules() if isinstance(m, ScalingState)}
    loads = []
    for key, value in state_dict.items():
        if key not in expected:
            continue
        state_name, _, buf_name = key.rpartition(".")
        buf = getattr(states[state_name], buf_name)
        _check_value(key, buf_name, value, buf)
        loads.append((buf, value))
    with torch.no_grad():
        for buf, value in loads:
            buf.copy_(value)
    for state in states.values():
        # Initialized once a cast carried information: an amax in the history, or a scale it left. A state whose casts
        # were all of empty tensors (amax 0) has neither, and its next cast must still use its own amax.
        state.initialized = bool(state.casts) and bool(state.amax_history.any() or state.scale != 1)


def _check_value(key: str, buf_name: str, value: object, buf: torch.Tensor) -> None:
    """Raise if ``value`` cannot be loaded into the scaling-state buffer ``buf`` (named ``buf_name``)."""
    fix = "the checkpoint is corrupt or not an fp8_state_dict(); save it again, or load the model without it"
    if not isinstance(value, torch.Tensor) or value.is_floating_point() != buf.is_floating_point():
        kind = type(value).__name__ if not isinstance(value, torch.Tensor) else f"a {value.dtype} tensor"
        raise TypeError(f"FP8 scaling state {key!r} is {kind}, expected a {buf.dtype} tensor: {fix}")
    if buf.shape != value.shape:
        raise ValueError(
            f"FP8 scaling state {key!r} has shape {tuple(value.shape)} in the checkpoint but "
            f"{tuple(buf.shape)} in the model (amax_history_len differs?)"
        )
    v = value.detach().double().cpu()
    if buf_name == "scale":
        bad = not (torch.isfinite(v).all() and (v > 0).all() and (torch.frexp(v).mantissa == 0.5).all())
        what = "a finite positive power of two"
    elif buf_name == "saturation":
        bad, what = not ((v >= 0) & (v <= 1)).all(), "in [0, 1]"
    else:  # amax, amax_history (inf is a recorded overflow), nonfinite_count, casts
        bad, what = not (v >= 0).all(), "non-negative"
    if bad:
        raise ValueError(f"FP8 scaling state {key!r} holds {value.tolist()}, but it must be {what}: {fix}")
