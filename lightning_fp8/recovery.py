"""Recovery actions after repeated non-finite gradients (DESIGN.md "Monitoring and health").

:class:`~lightning_fp8.FP8GradScaler` runs one of these after ``fallback_after`` consecutive non-finite steps
and records what it did in its ``history``:

- :func:`lower_lr`: multiply every parameter group's learning rate by a factor;
- :func:`fallback_to_high_precision`: put the FP8 layers whose gradients were non-finite back to
  ``nn.Linear`` (their weights get fp32 optimizer states again); the user's autocast (bf16) then applies. Not for
  layers with DTensor parameters (FSDP2's ``fully_shard``, tensor parallelism): those keep references to the
  module object, so it cannot be swapped; use ``"lower_lr"`` there.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_fp8.linear import FP8Linear
from lightning_fp8.optim.shards import is_dtensor


def lower_lr(optimizer: torch.optim.Optimizer, factor: float) -> str:
    """Multiply every group's ``lr`` (and ``initial_lr``, which schedulers start from) by ``factor``.

    A scheduler that recomputes the lr from its own stored base values overrides this at its next step; use a
    callable fallback that also adjusts the scheduler in that case.
    """
    for group in optimizer.param_groups:
        for key in ("lr", "initial_lr"):
            if key in group:
                value = group[key]
                if isinstance(value, torch.Tensor):
                    value.mul_(factor)
                else:
                    group[key] = value * factor
    return f"lowered the learning rate by {factor}x"


def _offending_layers(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[str]:
    # A layer offends when the last backward's grad_output cast saw a non-finite amax, or its weight's last FP8
    # gradient (kept by FP8AdamW until the step) was non-finite.
    skipped = getattr(optimizer, "skipped_grad_amax", {})
    bad_params = {p for p, amax in skipped.items() if not bool(torch.isfinite(amax))}
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, FP8Linear):
            continue
        grad_state = module.fp8_scaling["grad_output"]
        if not bool(torch.isfinite(grad_state.amax)) or module.weight in bad_params:
            names.append(name)
    return names


def fallback_to_high_precision(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, lr_factor: float = 0.5
) -> str:
    """Replace the offending FP8 layers of ``model`` by ``nn.Linear`` layers with the same parameters.

    When no layer can be blamed (the non-finite values came from elsewhere), lower the learning rate instead.

    Returns:
        What was done, for the scaler's history.

    Raises:
        ValueError: when an offending layer has DTensor parameters (FSDP2, tensor parallelism), before anything
            is changed.
    """
    names = _offending_layers(model, optimizer)
    if not names:
        what = lower_lr(optimizer, lr_factor) if optimizer is not None else "nothing (no optimizer)"
        return f"no FP8 layer had non-finite gradients; {what}"
    modules = dict(model.named_modules())
    sharded = [name for name in names if any(is_dtensor(p) for p in modules[name].parameters(recurse=False))]
    if sharded:
        raise ValueError(
            f"FP8GradScaler(nonfinite_fallback='bf16') cannot put {', '.join(map(repr, sharded))} back to nn.Linear: "
            "their parameters are DTensors (fully_shard or tensor parallelism), whose hooks keep references to the "
            "FP8Linear modules, so a new module would get sharded weights. Nothing was changed; use "
            "nonfinite_fallback='lower_lr' (or a callable) for sharded models"
        )
    for name in names:
        layer = modules[name]
        if optimizer is not None and hasattr(optimizer, "release"):
            optimizer.release(layer.weight)
        linear = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(linear)
        linear.in_features, linear.out_features = layer.in_features, layer.out_features
        linear.weight, linear.bias = layer.weight, layer.bias
        linear.train(layer.training)
        parent_name, _, child = name.rpartition(".")
        setattr(modules[parent_name] if parent_name else model, child, linear)
    return f"put {len(names)} layer(s) back to high precision: {', '.join(names)}"

