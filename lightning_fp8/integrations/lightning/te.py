"""The optional Transformer Engine backend: ``FP8LMPrecision(backend="te")``.

Transformer Engine's ``te.pytorch.Linear`` does the FP8 GEMMs (its own cuBLASLt kernels and scaling state);
this project's FP8AdamW, gradient scale mu and FP8 communication stay as they are. The recipe maps onto TE's:
delayed scaling -> ``DelayedScaling`` (same format, margin, history length and amax algorithm), current scaling ->
``Float8CurrentScaling``. TE needs a CUDA GPU; without TE installed, ``backend="te"`` raises an ImportError that
says how to install it.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Generator
from typing import Any

import torch
from torch import nn

from lightning_fp8.convert import _checked_filter, replace_children
from lightning_fp8.eligibility import shared_parameter_ids
from lightning_fp8.recipe import FP8Recipe
from lightning_fp8.warnings import warn_once

INSTALL_HINT = "pip install lightning-fp8[te]"


def require_transformer_engine() -> Any:
    """``transformer_engine.pytorch``, or an ImportError with the install command."""
    try:
        return importlib.import_module("transformer_engine.pytorch")
    except ImportError as err:
        raise ImportError(
            f"FP8LMPrecision(backend='te') needs NVIDIA Transformer Engine, which is not installed ({err}): "
            f"`{INSTALL_HINT}` (needs a CUDA GPU), or use backend='native'"
        ) from err


def te_recipe(recipe: FP8Recipe) -> Any:
    """Transformer Engine's recipe object equivalent to ``recipe``."""
    te_recipes = importlib.import_module("transformer_engine.common.recipe")
    fp8_format = te_recipes.Format.HYBRID if recipe.fp8_format == "hybrid" else te_recipes.Format.E4M3
    if recipe.scaling == "current":
        if not hasattr(te_recipes, "Float8CurrentScaling"):
            raise ImportError(f"FP8Recipe(scaling='current') needs Transformer Engine >= 2.2: `{INSTALL_HINT}` -U")
        return te_recipes.Float8CurrentScaling(fp8_format=fp8_format)
    return te_recipes.DelayedScaling(
        margin=recipe.margin,
        fp8_format=fp8_format,
        amax_history_len=recipe.amax_history_len,
        amax_compute_algo=recipe.amax_compute_algo,
    )


def _to_te_linear(te: Any, linear: nn.Linear) -> nn.Module:
    new = te.Linear(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        params_dtype=linear.weight.dtype,
        device=linear.weight.device,
    )
    with torch.no_grad():  # same values, and the same state_dict keys ("weight", "bias")
        new.weight.copy_(linear.weight)
        if linear.bias is not None:
            new.bias.copy_(linear.bias)
    new.train(linear.training)
    return new


def convert_to_te(
    module: nn.Module, recipe: FP8Recipe, module_filter_fn: Callable[[nn.Module, str], bool] | None = None
) -> nn.Module:
    """Replace ``module``'s ``nn.Linear`` layers by ``te.pytorch.Linear`` in place (weights copied).

    As :func:`~lightning_fp8.convert_to_fp8`: layers whose sizes are not multiples of 16, whose weight another module
    also holds (tied weights), or that ``module_filter_fn`` rejects, stay ``nn.Linear``. ``module_filter_fn``'s answers
    are checked as there (a string, or None for every layer, raises a TypeError), and every layer is asked before the
    first one changes: an error leaves the model as it was.
    """
    te = require_transformer_engine()
    module_filter_fn = _checked_filter(module_filter_fn)
    # named_modules() gives each layer once, under the name replace_children passes; the root is not replaced.
    linears = [(fqn, m) for fqn, m in module.named_modules() if fqn and type(m) is nn.Linear]
    chosen = {id(m) for fqn, m in linears if module_filter_fn is None or module_filter_fn(m, fqn)}
    if module_filter_fn is not None:
        module_filter_fn.check()
    # A TE layer gets a copy of the weight: a tied one (an output head sharing the token embedding) would be untied.
    shared = shared_parameter_ids(module)
    skipped: list[str] = []
    tied: list[str] = []
    done: dict[int, nn.Module] = {}  # a layer registered under several names becomes one TE layer (decided once)

    def convert(child: nn.Module, fqn: str) -> nn.Module:
        if id(child) not in done:
            done[id(child)] = _convert_one(child, fqn)
        return done[id(child)]

    def _convert_one(child: nn.Module, fqn: str) -> nn.Module:
        if id(child) not in chosen:
            return child
        if child.in_features % 16 or child.out_features % 16:
            skipped.append(fqn)
        elif id(child.weight) in shared:
            tied.append(fqn)
        else:
            return _to_te_linear(te, child)
        return child

    replace_children(module, convert)
    if skipped:
        warn_once(
            f"backend='te' left {len(skipped)} linear layer(s) in high precision (sizes not multiples of 16): "
            f"{', '.join(skipped)}"
        )
    if tied:
        warn_once(
            f"backend='te' left {len(tied)} linear layer(s) in high precision because their weight is shared with "
            f"another module (tied weights): {', '.join(tied)}"
        )
    return module


@contextlib.contextmanager
def te_autocast(recipe: FP8Recipe) -> Generator[None, None, None]:
    """Transformer Engine's FP8 region (``fp8_autocast``, or ``autocast`` in TE versions that renamed it)."""
    te = require_transformer_engine()
    enter = getattr(te, "fp8_autocast", None)
    if enter is not None:
        with enter(enabled=True, fp8_recipe=te_recipe(recipe)):
            yield
    else:
        with te.autocast(enabled=True, recipe=te_recipe(recipe)):
            yield
