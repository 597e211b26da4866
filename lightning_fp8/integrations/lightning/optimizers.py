"""Swapping the optimizers a LightningModule returns for :class:`~lightning_fp8.FP8AdamW`.

``configure_optimizers`` returns ordinary ``torch.optim.AdamW``/``Adam``; FP8-LM needs the precision-decoupled
optimizer. :func:`to_fp8_optimizer` builds an ``FP8AdamW`` with the same hyper-parameters and param groups
(extra keys such as ``initial_lr`` or a group ``name`` are kept), and :func:`rebind_schedulers` points the LR
schedulers that referenced the old optimizer at the new one. Anything that would change the update rule
silently (AMSGrad, ``maximize``, Adam's coupled L2 weight decay) is an error that says what to do instead.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

# torch.optim.Adam(W) group keys that select an implementation, not the update rule: FP8AdamW has its own.
_IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay")


def fp8_adamw_class() -> type[torch.optim.Optimizer]:
    from lightning_fp8.optim import FP8AdamW

    return FP8AdamW


def _check_convertible(optimizer: torch.optim.Optimizer) -> None:
    name = type(optimizer).__name__
    if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam):
        raise ValueError(
            f"precision='fp8-lm' replaces AdamW/Adam with the FP8 optimizer FP8AdamW, but configure_optimizers "
            f"returned {name}: return torch.optim.AdamW (or lightning_fp8.FP8AdamW) instead, or pass "
            f"FP8LMPrecision(replace_optimizers=False) to keep {name} with FP8 GEMMs and fp32 optimizer states"
        )
    if optimizer.state:
        raise ValueError(
            f"the {name} returned by configure_optimizers already has state for {len(optimizer.state)} "
            "parameter(s); precision='fp8-lm' can only replace a fresh optimizer: create it in configure_optimizers"
        )
    for i, group in enumerate(optimizer.param_groups):
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise ValueError(
                    f"{name}(param_groups[{i}] {flag}=True) has no FP8AdamW equivalent: set {flag}=False or keep "
                    f"this optimizer with FP8LMPrecision(replace_optimizers=False)"
                )
        coupled_l2 = type(optimizer) is torch.optim.Adam and not group.get("decoupled_weight_decay", False)
        if coupled_l2 and group.get("weight_decay", 0) != 0:
            raise ValueError(
                f"Adam(weight_decay={group['weight_decay']}) adds an L2 term to the gradient, but FP8AdamW decays "
                "weights decoupled (AdamW): use torch.optim.AdamW(weight_decay=...) or Adam(weight_decay=0)"
            )


def to_fp8_optimizer(optimizer: torch.optim.Optimizer, **fp8_kwargs: Any) -> torch.optim.Optimizer:
    """An ``FP8AdamW`` equivalent to ``optimizer`` (returned unchanged if it already is one).

    Args:
        optimizer: a fresh ``torch.optim.AdamW`` or ``Adam`` (no state yet).
        fp8_kwargs: extra ``FP8AdamW`` constructor arguments (e.g. the recipe), passed where it accepts them.

    Raises:
        ValueError: for another optimizer type, an optimizer that has state, AMSGrad, ``maximize``, or Adam
            with coupled weight decay.
    """
    fp8_cls = fp8_adamw_class()
    if isinstance(optimizer, fp8_cls):
        return optimizer
    _check_convertible(optimizer)
    accepted = inspect.signature(fp8_cls.__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    defaults.update({k: v for k, v in fp8_kwargs.items() if k in accepted})
    groups = [
        {k: v for k, v in group.items() if k not in _IMPLEMENTATION_KEYS and k not in ("amsgrad", "maximize")}
        for group in optimizer.param_groups
    ]
    return fp8_cls(groups, **defaults)


def _track_step_called(optimizer: torch.optim.Optimizer) -> None:
    # torch's LRScheduler wraps optimizer.step to warn when the scheduler steps first; a rebound scheduler must
    # find the same wrapper on the new optimizer or it warns that `optimizer.step()` was overridden.
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    step = optimizer.step

    @functools.wraps(step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]


def rebind_schedulers(schedulers: Iterable[Any], old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
    """Point every scheduler (and the schedulers nested in ``SequentialLR``/``ChainedScheduler``) that references
    ``old`` at ``new``. The param groups were copied, so ``initial_lr`` and the current LR carry over."""
    for scheduler in schedulers:
        if getattr(scheduler, "optimizer", None) is old:
            scheduler.optimizer = new
            if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
                _track_step_called(new)
        rebind_schedulers(getattr(scheduler, "_schedulers", ()), old, new)


def adopt_masters_early(module: nn.Module, device: torch.device) -> list[nn.Parameter]:
    """Turn the FP8 layers' weights into FP8AdamW's O2 fp16 masters now (on ``device``); returns them.

    FP8AdamW at O2 keeps each FP8 weight's master in the weight's own storage, changing its dtype. DDP hooks the
    parameters' gradient accumulators when it wraps the model, and a later dtype change silently detaches them
    ("parameters that were not used in producing the loss"), so under DDP the storage must change before the
    wrapper is built. FP8AdamW then takes the adopted masters over as they are.
    """
    from lightning_fp8.convert import fp8_modules
    from lightning_fp8.optim import master

    module.to(device)  # the master's scale lives beside the weight: adopt where the weight will stay
    weights = [layer.weight for layer in fp8_modules(module).values()]
    for weight in weights:
        if master.master_scale(weight) is None:
            master.adopt(weight, torch.float16)
    return weights


def keep_masters_apart(model: nn.Module) -> list[nn.Parameter]:
    """Stop FP8AdamW from taking the FP8 weights' storage (FSDP1 owns it: the weights are views of its flat
    parameter); returns them, to be passed as ``FP8AdamW(fp8_params=...)`` so they keep low-precision states
    with the master stored in the optimizer state."""
    from lightning_fp8.convert import fp8_modules
    from lightning_fp8.optim import master

    weights = [layer.weight for layer in fp8_modules(model).values()]
    for weight in weights:
        setattr(weight, master.MARKER, False)
    return weights
