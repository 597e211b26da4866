"""convert_to_fp8: swap a model's ``nn.Linear`` layers for :class:`~lightning_fp8.FP8Linear` in place."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from lightning_fp8.linear import FP8Linear
from lightning_fp8.recipe import FP8Recipe, resolve_recipe
from lightning_fp8.warnings import warn_once

ModuleFilter = Callable[[nn.Module, str], bool]


def _is_convertible_type(module: nn.Module) -> bool:
    # Exactly nn.Linear: subclasses (e.g. nn.MultiheadAttention's out_proj, whose weight is used without
    # calling forward) may not route through forward, so converting them would change nothing or break them.
    return type(module) is nn.Linear


def convert_to_fp8(
    module: nn.Module, recipe: FP8Recipe | str | None = None, module_filter_fn: ModuleFilter | None = None
) -> nn.Module:
    """Replace every ``nn.Linear`` in ``module`` by an :class:`FP8Linear` that shares its parameters.

    Idempotent (FP8 layers are left as they are). Layers whose feature sizes are not multiples of 16, and
    layers whose weight is shared with another module (tied weights), stay in high precision and are named in
    one warning. State dict keys do not change, so checkpoints load into
    the model before or after conversion.

    Args:
        module: the model; converted in place. If it is itself an ``nn.Linear``, a new layer is returned.
        recipe: an :class:`FP8Recipe`, a recipe name, or ``None`` for ``"fp8-lm"``.
        module_filter_fn: ``fn(module, fqn) -> bool``; a linear layer is converted only where it returns True
            (e.g. ``lambda m, fqn: "lm_head" not in fqn`` keeps the output head in high precision).

    Returns:
        The converted module (the same object unless ``module`` is a bare ``nn.Linear``).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"convert_to_fp8 expects an nn.Module, got {type(module).__name__}")
    recipe = resolve_recipe(recipe)
    skipped: list[str] = []
    tied: list[str] = []
    shared = _shared_parameter_ids(module)
    done: dict[int, nn.Module] = {}  # a layer registered under several names becomes one FP8Linear (as decided first)

    def convert(child: nn.Module, fqn: str) -> nn.Module:
        if id(child) not in done:
            done[id(child)] = _convert_one(child, fqn)
        return done[id(child)]

    def _convert_one(child: nn.Module, fqn: str) -> nn.Module:
        if not _is_convertible_type(child) or (module_filter_fn is not None and not module_filter_fn(child, fqn)):
            return child
        if child.in_features % 16 or child.out_features % 16:
            skipped.append(f"{fqn or '<root>'} ({child.in_features}->{child.out_features})")
            return child
        if id(child.weight) in shared:
            # A tied weight (e.g. an output head sharing the token embedding) is read by another module too; the
            # FP8 optimizer's O2 storage of FP8 weights would change what that module sees.
            tied.append(fqn or "<root>")
            return child
        return FP8Linear.from_linear(child, recipe)

    root = convert(module, "")
    if root is not module:
        return root
    for parent_name, parent in list(module.named_modules()):
        if isinstance(parent, FP8Linear):
            continue
        for name, child in list(parent.named_children()):
            fqn = f"{parent_name}.{name}" if parent_name else name
            new = convert(child, fqn)
            if new is not child:
                setattr(parent, name, new)
    if tied:
        warn_once(
            f"convert_to_fp8 left {len(tied)} linear layer(s) in high precision because their weight is shared with "
            f"another module (tied weights): {', '.join(tied)}"
        )
    if skipped:
        warn_once(
            f"convert_to_fp8 left {len(skipped)} linear layer(s) in high precision because their feature sizes "
            f"are not multiples of 16: {', '.join(skipped)}"
        )
    return module


def _shared_parameter_ids(module: nn.Module) -> set[int]:
    owners: dict[int, int] = {}
    for sub in module.modules():
        for p in sub.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return {pid for pid, count in owners.items() if count > 1}


def fp8_modules(module: nn.Module) -> dict[str, FP8Linear]:
    """The FP8 layers of ``module`` by qualified name."""
    return {name: m for name, m in module.named_modules() if isinstance(m, FP8Linear)}
