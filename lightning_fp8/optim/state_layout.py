"""How :class:`~lightning_fp8.optim.FP8AdamW` keeps a parameter's states: their keys, their dtypes, and
``stored = value * scale``.

Layout per parameter (DESIGN.md "State layout"): every state tensor has the parameter's shape, every scale
is a 0-dim fp32 tensor. Low-precision states are ``key`` (fp16/FP8 storage, ``x * scale``), ``key_scale``
and ``key_amax`` for ``key`` in ``master``, ``exp_avg``, ``exp_avg_sq``; other parameters have exactly the
keys of ``torch.optim.AdamW`` (``step``, ``exp_avg``, ``exp_avg_sq`` in fp32).

The dtypes a state may have: the scaled ones (fp16, FP8: ``SCALED_STATE_MAX``), stored as ``value * key_scale``,
and the unscaled ones (fp64, fp32, bf16), which hold the value itself, with scale 1. :func:`dequantize` reads either
as fp32 values, :func:`quantize` and :func:`store` write them; saving, loading, the checks of loaded states and the
release of adopted weights all go through them. A state dict lists the states by the parameter's index in
``param_groups`` order (:func:`_param_order`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lightning_fp8 import ops
from lightning_fp8.kernels.reference_adamw import SCALED_STATE_MAX
from lightning_fp8.optim import shards
from lightning_fp8.scale_rule import compute_scale

if TYPE_CHECKING:
    from lightning_fp8.optim.adamw import FP8AdamW

_KEYS = ("master", "exp_avg", "exp_avg_sq")
_ADAMW_KEYS = ("step", "exp_avg", "exp_avg_sq")  # torch.optim.AdamW's: a state has all of them or none
# The dtypes a state may have besides the scaled ones (SCALED_STATE_MAX): these hold the value itself, with scale 1.
_UNSCALED = (torch.float64, torch.float32, torch.bfloat16)


def dequantize(state: dict[str, Any], key: str) -> torch.Tensor:
    """``state[key]`` as fp32, unscaled: ``stored / scale``, the scale 0-dim or broadcast (see :mod:`.shard_scales`).

    A DTensor state gives a DTensor sharded the same way (each shard divided by its own scale).
    """
    value = state[key]
    x = shards.local(value).detach().float()
    scale = state.get(f"{key}_scale")
    if scale is not None and value.dtype in SCALED_STATE_MAX:
        scale = shards.local(scale)
        x = x / (scale.reshape(()) if scale.numel() == 1 else scale).to(x.device)
    return shards.like(value, x)


def quantize(value: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(stored, scale, amax)`` of the fp32 ``value`` in ``dtype``: scaled for fp16/FP8, else scale 1."""
    amax = ops.amax(value)
    if dtype not in SCALED_STATE_MAX:
        return value.to(dtype), torch.ones((), dtype=torch.float32, device=value.device), amax
    scale = compute_scale(amax, dtype)
    fmax = SCALED_STATE_MAX[dtype]
    return (value * scale).clamp(-fmax, fmax).to(dtype), scale, amax


def store(state: dict[str, Any], key: str, value: torch.Tensor, dtype: torch.dtype, shape, device) -> None:
    """Put the fp32 ``value`` into ``state`` as ``key``, ``key_scale``, ``key_amax`` in ``dtype``."""
    stored, scale, amax = quantize(value.detach().float().reshape(shape).to(device), dtype)
    state[key], state[f"{key}_scale"], state[f"{key}_amax"] = stored, scale, amax


def _param_order(opt: FP8AdamW) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]
