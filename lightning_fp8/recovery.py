"""Recovery actions after repeated non-finite gradients (DESIGN.md "Monitoring and health").

:class:`~lightning_fp8.FP8GradScaler` runs one of these after ``fallback_after`` consecutive non-finite steps
and records what it did in its ``history``:

- :func:`lower_lr`: multiply every parameter group's learning rate by a factor;
- :func:`fallback_to_high_precision`: put the FP8 layers whose gradients were non-finite back to
  ``nn.Linear`` (their weights get fp32 optimizer states again); the user's autocast (bf16) then applies. An
  :class:`~lightning_fp8.FP8MLP` one of whose layers is put back becomes an :class:`UnfusedMLP` (its fused path needs
  two FP8 layers) holding the same layers, the put-back one an ``nn.Linear``, the other still FP8. Not for
  layers with DTensor parameters (FSDP2's ``fully_shard``, tensor parallelism): those keep references to the
  module object, so it cannot be swapped; nor under DistributedDataParallel, which hooked the parameters and
  buffers (at O2 a weight would get its own dtype back and DDP would stop averaging its gradients). Use
  ``"lower_lr"`` there.

A model converted afresh (to resume from a checkpoint) has every layer in FP8 again. :func:`fallen_back_layers`
names the layers that were put back, to be saved with the checkpoint; :func:`put_back_to_high_precision` puts them
back in the new model before the checkpoint is loaded. The Lightning plugin does both itself. Those two, and the swap
itself, live in :mod:`lightning_fp8.fallback_layers` (importable from here too).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from lightning_fp8.fallback_layers import UnfusedMLP as UnfusedMLP  # re-exported: models pickled with it name it here
from lightning_fp8.fallback_layers import _as_list, _check_model, _check_optimizer, put_back_to_high_precision
from lightning_fp8.fallback_layers import fallen_back_layers as fallen_back_layers  # re-exported
from lightning_fp8.linear import FP8Linear
from lightning_fp8.stats import clean_name, wraps_as_module


def lower_lr(optimizer: torch.optim.Optimizer, factor: float) -> str:
    """Multiply every group's ``lr`` (and ``initial_lr``, which schedulers start from) by ``factor``.

    A scheduler that recomputes the lr from its own stored base values overrides this at its next step; use a
    callable fallback that also adjusts the scheduler in that case.

    Raises:
        TypeError: when ``optimizer`` is not an optimizer (a list of them: call it for each) or ``factor`` not a number.
        ValueError: when ``factor`` is not in (0, 1).
    """
    factor = _check_factor("lower_lr(factor=...)", factor)
    _check_optimizer("lower_lr(optimizer=...)", optimizer)
    lowered: set[int] = set()  # tensors already multiplied: torch puts one lr tensor in every group it was given to
    for group in optimizer.param_groups:
        for key in ("lr", "initial_lr"):
            if key in group:
                value = group[key]
                if not isinstance(value, torch.Tensor):
                    group[key] = value * factor
                elif id(value) not in lowered:
                    lowered.add(id(value))
                    value.mul_(factor)
    return f"lowered the learning rate by {factor}x"


def _check_factor(where: str, factor: object) -> float:
    """``factor`` as a Python float, or raise unless it lowers a learning rate: a real number in (0, 1). A factor of 5
    or -1 multiplied it by that and the history still said "lowered"; NaN made it NaN. As a float: a NumPy factor
    made every ``lr`` a NumPy number, and the optimizer's state dict then failed ``torch.load(weights_only=True)``."""
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
        raise TypeError(f"{where}: must be a number in (0, 1), got {type(factor).__name__}")
    if not 0.0 < factor < 1.0:
        raise ValueError(f"{where}: must be in (0, 1) (the learning rate is multiplied by it), got {factor!r}")
    return float(factor)


def _offending_layers(
    model: nn.Module, skipped: list[torch.optim.Optimizer], nonfinite_grads: Mapping[torch.Tensor, torch.Tensor]
) -> list[str]:
    # A layer offends when a gradient of the skipped step was non-finite: its weight's or bias's in param.grad (the
    # accumulated gradient: any micro-batch of the step, not only the last backward), or its weight's FP8 gradient that
    # a skipped FP8AdamW kept (skipped_grad_amax; an optimizer that stepped since keeps an older one); or when its last
    # grad_output cast saw a non-finite amax and the layer took part in the step (a gradient of it is there, or its
    # weight is frozen): the amax of a layer unused since an earlier bad step stays inf. `nonfinite_grads` (the
    # scaler's flags of param.grad when it skipped the step) count like the kept FP8 gradients: the loop may have zeroed
    # param.grad since.
    kept: dict[torch.Tensor, list[torch.Tensor]] = {}
    for opt in skipped:
        for p, amax in getattr(opt, "skipped_grad_amax", {}).items():
            kept.setdefault(p, []).append(amax)
    for p, flag in nonfinite_grads.items():
        kept.setdefault(p, []).append(torch.where(flag > 0, math.inf, 0.0))
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, FP8Linear):
            continue
        params = [p for p in (module.weight, module.bias) if p is not None]
        grads = [p.grad for p in params if p.grad is not None]
        if not all(_all_finite(g) for g in [*grads, *(a for p in params for a in kept.get(p, []))]):
            names.append(name)
            continue
        took_part = grads or any(p in kept for p in params) or not module.weight.requires_grad
        if took_part and not bool(torch.isfinite(module.fp8_scaling["grad_output"].amax)):
            names.append(name)
    return names


def _all_finite(t: torch.Tensor) -> bool:
    # This rank's values (a DTensor's shard: the fallback refuses sharded layers anyway, naming them).
    return bool(torch.isfinite(t.to_local() if hasattr(t, "to_local") else t).all())


def fallback_to_high_precision(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
    lr_factor: float = 0.5,
    skipped: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    *,
    nonfinite_grads: Mapping[torch.Tensor, torch.Tensor] | None = None,
) -> str:
    """Replace the offending FP8 layers of ``model`` by ``nn.Linear`` layers with the same parameters
    (:func:`put_back_to_high_precision`): those whose gradients of the skipped step were non-finite.

    When no layer can be blamed (the non-finite values came from elsewhere), lower the learning rate instead.
    ``optimizer``: the optimizer, or every optimizer over the model's weights (several FP8AdamW at O2 each hold
    their weights' masters, which must come back from the one that holds them). ``skipped``: the optimizers whose
    step was skipped (default: all of ``optimizer``): their kept FP8 gradients count, and only their learning rate
    is lowered. ``nonfinite_grads``: ``{param: flag}``, 0-dim flags taken when the step was skipped, > 0 where
    ``param.grad`` held inf or NaN (what :class:`~lightning_fp8.FP8GradScaler` passes): they blame their layers also
    where the loop has zeroed ``param.grad`` since.

    Returns:
        What was done, for the scaler's history.

    Raises:
        ValueError: before anything is changed, when an offending layer cannot be put back (see
            :func:`put_back_to_high_precision`): DTensor parameters, or DistributedDataParallel.
        TypeError: when ``model`` is not an ``nn.Module``, or ``optimizer`` or ``skipped`` is not an optimizer, a
            list of them or None.
    """
    lr_factor = _check_factor("fallback_to_high_precision(lr_factor=...)", lr_factor)
    _check_model("fallback_to_high_precision(model=...)", model)
    optimizers = _as_list(optimizer, "fallback_to_high_precision(optimizer=...)")
    skipped = optimizers if skipped is None else _as_list(skipped, "fallback_to_high_precision(skipped=...)")
    names = _offending_layers(model, skipped, nonfinite_grads or {})
    if not names:
        what = [lower_lr(opt, lr_factor) for opt in skipped][-1] if skipped else "nothing (no optimizer)"
        return f"no FP8 layer had non-finite gradients; {what}"
    put_back_to_high_precision(model, names, optimizers)
    # The names as the user's model has them (not torch.compile's "_orig_mod." or a DDP/FSDP wrapper's path).
    shown = [clean_name(name, strip_module=wraps_as_module(model)) for name in names]
    return f"put {len(names)} layer(s) back to high precision: {', '.join(shown)}"
