"""Which linear layers of a prepared model become FP8, whether their GEMMs run in FP8 or in emulation, and the report
of it (``accelerator.fp8_report``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_fp8 import ops
from lightning_fp8.convert import convert_to_fp8, convertible_linears, fp8_modules
from lightning_fp8.integrations.accelerate.config import FP8LaunchConfig
from lightning_fp8.stats import unwrap_compiled
from lightning_fp8.warnings import warn_once

ModuleFilter = Callable[[nn.Module, str], bool]


def linears_with_shared_weights(model: nn.Module) -> set[str]:
    """Names of the ``nn.Linear`` layers whose weight another module also holds (a tied output head)."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    return {
        name
        for name, m in model.named_modules(remove_duplicate=False)
        if type(m) is nn.Linear and owners.get(id(m.weight), 0) > 1
    }


def module_filter(config: FP8LaunchConfig, user_filter: ModuleFilter | None, tied: set[str]) -> ModuleFilter:
    """``convert_to_fp8``'s filter: the launch's exclusions, the user's filter, and no tied weights."""

    def keep_fp8(module: nn.Module, fqn: str) -> Any:
        if not config.module_filter(module, fqn):
            return False
        # The script's answer as it is: convert_to_fp8 reads it by truthiness and refuses a string ("no" would
        # convert) and None for every layer (a filter without a return statement), both silent once made a bool.
        answer = True if user_filter is None else user_filter(module, fqn)
        if not answer:
            return answer
        if fqn in tied:
            warn_once(
                f"lightning_fp8: {fqn} stays in high precision because its weight is shared with another module "
                "(tied embeddings): FP8AdamW stores FP8 weights scaled, which the other module would read. "
                "Exclude it (LIGHTNING_FP8_EXCLUDE / exclude_modules) to silence this"
            )
            return False
        return answer

    return keep_fp8


def emulation_reason(device: torch.device) -> str | None:
    """Why FP8 GEMMs are emulated on ``device``, or ``None`` where they are real."""
    if ops.has_fp8_gemm(device):
        return None
    if device.type != "cuda":
        return f"the device is {device.type}, not a CUDA GPU"
    if os.environ.get("LIGHTNING_FP8_EMULATE_GEMM") == "1":
        return "LIGHTNING_FP8_EMULATE_GEMM=1"
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} has compute capability {major}.{minor}; FP8 GEMMs need 8.9+"


def to_convert(model: nn.Module, config: FP8LaunchConfig, user_filter: ModuleFilter | None) -> dict[str, nn.Linear]:
    """The linear layers of ``model`` that :func:`convert` would make FP8 layers, by name; nothing is converted."""
    return convertible_linears(model, module_filter(config, user_filter, linears_with_shared_weights(model)))


def convert(
    model: nn.Module, config: FP8LaunchConfig, user_filter: ModuleFilter | None, device: torch.device
) -> tuple[nn.Module, dict[str, Any]]:
    """Convert ``model`` in place; return it and a report (converted count, high-precision layers, emulation).

    Warns once when an exclude pattern matches no linear layer, when nothing was converted and when the GEMMs are
    emulated on ``device``.
    """
    # A model the script compiled before prepare(): its layers under their own names, not "_orig_mod."'s (the
    # patterns, the user's filter and the report name them so); in place, unless the model is itself a linear layer.
    target = unwrap_compiled(model)
    if isinstance(target, nn.Linear):
        target = model
    unmatched = config.unmatched_patterns(target)
    if unmatched:
        warn_once(
            f"lightning_fp8: the exclude pattern(s) {unmatched} (LIGHTNING_FP8_EXCLUDE / --fp8-exclude / "
            f"exclude_modules) match no linear layer of {type(target).__name__}, so they keep nothing in high "
            "precision: a pattern matches a linear layer's qualified name (blocks.0.mlp.fc) or its last name "
            "component (fc), with fnmatch wildcards; check the spelling against model.named_modules()"
        )
    keep_fp8 = module_filter(config, user_filter, linears_with_shared_weights(target))
    _check_converted_layers(target, config, keep_fp8)
    converted_target = convert_to_fp8(target, config.recipe, module_filter_fn=keep_fp8)
    if target is model:
        model = converted_target
    converted = sorted(fp8_modules(converted_target))
    kept = sorted(name for name, m in converted_target.named_modules() if type(m) is nn.Linear)
    if not converted:
        warn_once(
            f"lightning_fp8: no linear layer of {type(target).__name__} was converted to FP8: convert_to_fp8's "
            "warnings name the layers it left in high precision and why (feature sizes not multiples of 16, tied "
            "weights, transformers' Conv1D, ...); LIGHTNING_FP8_EXCLUDE / fp8_module_filter must not exclude them "
            "either"
        )
    reason = emulation_reason(device)
    if reason is not None:
        warn_once(
            f"lightning_fp8: FP8 GEMMs are not available ({reason}). FP8-LM runs in emulation: the FP8 casts, "
            "scales, FP8 optimizer states and FP8 communication are real, but each FP8 GEMM is computed by "
            "dequantizing to fp32 (same numerics, no speed-up)"
        )
    return model, {"converted_layers": len(converted), "high_precision_linears": kept, "emulated_gemm": bool(reason)}


def _check_converted_layers(model: nn.Module, config: FP8LaunchConfig, keep_fp8: ModuleFilter) -> None:
    """Raise ValueError, before anything changes, for FP8 layers the script converted itself that this launch would
    not make FP8 as they are: excluded (``LIGHTNING_FP8_EXCLUDE`` / ``--fp8-exclude`` / ``exclude_modules`` /
    ``fp8_module_filter``: conversion leaves FP8 layers as they are, so they silently trained in FP8 and the report
    named nothing in high precision), or converted with other scaling settings than the launch's recipe."""
    layers = fp8_modules(model)
    excluded = sorted(name for name, layer in layers.items() if not keep_fp8(layer, name))
    if excluded:
        raise ValueError(
            f"lightning_fp8: the model passed to prepare() already has FP8 layers that this launch keeps in high "
            f"precision (LIGHTNING_FP8_EXCLUDE / --fp8-exclude / exclude_modules / fp8_module_filter): {excluded}. "
            "prepare() converts the model itself: pass it unconverted, or leave those layers out of your own "
            "convert_to_fp8 (module_filter_fn); nothing was changed"
        )
    other = {name: layer.recipe for name, layer in layers.items() if not layer.recipe.same_scaling(config.recipe)}
    if other:
        name, recipe = next(iter(other.items()))
        raise ValueError(
            f"lightning_fp8: the model passed to prepare() was already converted, its layer {name!r} with {recipe} "
            f"({len(other)} layer(s) so), but this Accelerator's recipe (fp8_lm_recipe= / LIGHTNING_FP8_RECIPE / "
            f"--fp8-recipe / the config's lightning_fp8 section) is {config.recipe}, whose scaling differs. "
            "prepare() converts the model itself: pass it unconverted, or launch with the recipe you converted "
            "with; nothing was changed"
        )


def combined_report(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report for every prepared model (``reports``: :func:`convert`'s, in prepare order): the converted layers
    summed, and with several models each high-precision layer named ``model<i>.<name>``, as the logged statistics
    name the models (``fp8/model<i>/...``)."""
    if len(reports) == 1:
        return dict(reports[0])
    kept = [f"model{i}.{name}" if name else f"model{i}"  # "": the model is itself a layer kept in high precision
            for i, report in enumerate(reports) for name in report["high_precision_linears"]]  # fmt: skip
    return {
        "converted_layers": sum(report["converted_layers"] for report in reports),
        "high_precision_linears": kept,
        "emulated_gemm": any(report["emulated_gemm"] for report in reports),
    }
