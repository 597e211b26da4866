"""FP8AdamW's constructor arguments: the state dtypes each optimization level gives FP8 linear weights, the dtypes
a user may choose instead, and the checks of the arguments (run before any parameter is touched)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lightning_fp8.formats import E4M3, E5M2
from lightning_fp8.recipe import ArgumentTypeError, FP8Recipe, resolve_recipe

_FP32, _FP16, _BF16 = torch.float32, torch.float16, torch.bfloat16
# (master, exp_avg, exp_avg_sq) of FP8 linear weights per optimization level.
_LEVEL_DTYPES = {"O1": (_FP32, _FP32, _FP32), "O2": (_FP16, E4M3, _FP16)}
_ALLOWED = {
    "master_dtype": (_FP32, _FP16, _BF16),
    "exp_avg_dtype": (_FP32, _BF16, _FP16, E4M3, E5M2),
    # FP8-LM: an FP8 second moment diverged, so it is not offered.
    "exp_avg_sq_dtype": (_FP32, _BF16, _FP16),
}


def fp8_param_ids(fp8_params: Any) -> set[int]:
    """The ids of the ``fp8_params`` argument's tensors (none for ``None``); TypeError for anything else."""
    if fp8_params is None:
        return set()
    params = list(fp8_params) if isinstance(fp8_params, Iterable) and not isinstance(fp8_params, torch.Tensor) else None
    if params is None or not all(isinstance(p, torch.Tensor) for p in params):
        raise TypeError(
            f"FP8AdamW(fp8_params=...) takes an iterable of the weight tensors to store as FP8 linear weights (e.g. "
            f"[m.weight for m in model.modules() if isinstance(m, FP8Linear)]), got {type(fp8_params).__name__}"
            + ("" if params is None else " holding " + ", ".join(sorted({type(p).__name__ for p in params})))
        )
    return {id(p) for p in params}


def resolved_settings(
    recipe: FP8Recipe | str | None,
    opt_level: str | None,
    dtypes: tuple[torch.dtype | None, torch.dtype | None, torch.dtype | None],
    scale_update: Any,
    low_precision_moments: Any,
) -> tuple[FP8Recipe, str, tuple[torch.dtype, torch.dtype, torch.dtype]]:
    """Check FP8AdamW's ``opt_level``, state ``dtypes`` (master, exp_avg, exp_avg_sq), ``scale_update`` and
    ``low_precision_moments``; return the recipe, the level (the recipe's by default) and the dtypes (the level's)."""
    recipe = resolve_recipe(recipe, "FP8AdamW(recipe=...)")
    opt_level = opt_level if opt_level is not None else recipe.opt_level
    if not isinstance(opt_level, str) or opt_level not in _LEVEL_DTYPES:
        error = ValueError if isinstance(opt_level, str) else ArgumentTypeError
        raise error(f"FP8AdamW(opt_level={opt_level!r}) is not supported: choose 'O1' or 'O2'")
    chosen = dict(zip(_ALLOWED, dtypes, strict=True))
    for (name, dtype), default in zip(chosen.items(), _LEVEL_DTYPES[opt_level], strict=True):
        chosen[name] = default if dtype is None else dtype
        if chosen[name] not in _ALLOWED[name]:
            error = ValueError if isinstance(dtype, torch.dtype) else ArgumentTypeError
            raise error(f"FP8AdamW({name}={dtype!r}) is not supported: choose one of {list(_ALLOWED[name])}")
    if scale_update not in ("one_pass", "two_pass"):
        error = ValueError if isinstance(scale_update, str) else ArgumentTypeError
        raise error(f"FP8AdamW(scale_update={scale_update!r}) is not supported: use 'one_pass' or 'two_pass'")
    if low_precision_moments not in ("fp8_weights", "all"):
        raise (ValueError if isinstance(low_precision_moments, str) else ArgumentTypeError)(
            f"FP8AdamW(low_precision_moments={low_precision_moments!r}) is not supported: use 'fp8_weights' (the "
            "moments of FP8 linear weights only) or 'all' (every parameter's)"
        )
    return recipe, opt_level, tuple(chosen.values())
