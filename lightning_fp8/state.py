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
    """Load what :func:`fp8_state_dict` saved.

    Raises:
        KeyError: with ``strict``, if keys are missing or unexpected (a different model or recipe).
        ValueError: if a saved tensor's shape differs (e.g. another ``amax_history_len``).
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
    for key, value in state_dict.items():
        state_name, _, buf_name = key.rpartition(".")
        if state_name not in states:
            continue
        buf = getattr(states[state_name], buf_name)
        if buf.shape != value.shape:
            raise ValueError(
                f"FP8 scaling state {key!r} has shape {tuple(value.shape)} in the checkpoint but "
                f"{tuple(buf.shape)} in the model (amax_history_len differs?)"
            )
        buf.copy_(value)
    for state in states.values():
        state.initialized = bool(state.casts)
