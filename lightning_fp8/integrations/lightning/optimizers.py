"""Swapping the optimizers a LightningModule returns for :class:`~lightning_fp8.FP8AdamW`.

``configure_optimizers`` returns ordinary ``torch.optim.AdamW``/``Adam``; FP8-LM needs the precision-decoupled
optimizer. :func:`to_fp8_optimizer` builds an ``FP8AdamW`` with the same hyper-parameters and param groups
(extra keys such as ``initial_lr`` or a group ``name`` are kept), :func:`rebind_schedulers` points the LR
schedulers that referenced the old optimizer at the new one (``maximize`` carries over, per group), and
:func:`hand_over` makes the old optimizer share the new one's param groups for code that kept it. Anything that
would change the update rule silently (AMSGrad, Adam's coupled L2 weight decay) is an error that says what to do
instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lightning_fp8.optim import swap

_OPT_OUT = "keep this optimizer with FP8LMPrecision(replace_optimizers=False)"


def to_fp8_optimizer(optimizer: torch.optim.Optimizer, **fp8_kwargs: Any) -> torch.optim.Optimizer:
    """An ``FP8AdamW`` equivalent to ``optimizer`` (returned unchanged if it already is one).

    Raises:
        ValueError: for an optimizer other than AdamW/Adam, or one FP8AdamW cannot replace exactly
            (:func:`lightning_fp8.optim.swap.check_replaceable`).
    """
    from lightning_fp8.optim import FP8AdamW

    if not isinstance(optimizer, FP8AdamW) and not swap.is_replaceable(optimizer):
        name = type(optimizer).__name__
        raise ValueError(
            f"precision='fp8-lm' replaces AdamW/Adam with the FP8 optimizer FP8AdamW, but configure_optimizers "
            f"returned {name}: return torch.optim.AdamW (or lightning_fp8.FP8AdamW) instead, or pass "
            f"FP8LMPrecision(replace_optimizers=False) to keep {name} with FP8 GEMMs and fp32 optimizer states"
        )
    return swap.to_fp8_adamw(optimizer, source="configure_optimizers", opt_out=_OPT_OUT, **fp8_kwargs)


def is_mock_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is Lightning's stand-in for ``configure_optimizers`` returning None (either namespace):
    it holds none of the model's parameters and steps nothing, so there is nothing to replace or scale for it."""
    return any(cls.__name__ == "_MockOptimizer" for cls in type(optimizer).__mro__)


def rebind_schedulers(schedulers: Iterable[Any], old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
    """Point every scheduler that references ``old`` (nested ones too) at ``new``."""
    for scheduler in schedulers:
        swap.rebind_scheduler(scheduler, {id(old): new})


def hand_over(old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
    """Make ``old`` (the optimizer ``configure_optimizers`` returned, which ``new`` replaced) drive ``new``
    (:func:`~lightning_fp8.optim.swap.retire`): Lightning rebinds only the LR schedulers it was given, a module may keep
    others (stepped by hand in manual optimization) or the optimizer itself. ``new``'s steps count as ``old``'s for
    torch's scheduler-order check."""
    keep = f"keep the {type(old).__name__} with FP8LMPrecision(replace_optimizers=False)"
    swap.retire(old, new, "from configure_optimizers (precision='fp8-lm')", f"step self.optimizers() ({keep})")

    def count_step(*_: Any) -> None:
        old._opt_called = True  # type: ignore[attr-defined]  # read by torch's LRScheduler.step

    new.register_step_post_hook(count_step)


def adopt_masters_early(module: nn.Module, device: torch.device) -> list[nn.Parameter]:
    """Turn the trainable FP8 layers' weights into FP8AdamW's O2 fp16 masters now (on ``device``); returns them.

    FP8AdamW at O2 keeps each FP8 weight's master in the weight's own storage, changing its dtype. DDP hooks the
    parameters' gradient accumulators when it wraps the model, and a later dtype change silently detaches them
    ("parameters that were not used in producing the loss"), so under DDP the storage must change before the
    wrapper is built. FP8AdamW then takes the adopted masters over as they are.

    Frozen weights (``requires_grad=False``) keep their storage, as FP8AdamW leaves them: DDP hooks no accumulator of
    theirs, and adopting them would only round them to fp16 for good. Unfrozen later, they train as on one device:
    FP8AdamW adopts one added in a new param group then, and keeps the master of one it already held apart.
    """
    from lightning_fp8.convert import fp8_modules
    from lightning_fp8.optim import master

    module.to(device)  # the master's scale lives beside the weight: adopt where the weight will stay
    weights = [layer.weight for layer in fp8_modules(module).values() if layer.weight.requires_grad]
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
