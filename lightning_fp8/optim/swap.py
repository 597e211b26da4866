"""Replacing a fresh ``torch.optim.AdamW``/``Adam`` by an equivalent :class:`~lightning_fp8.FP8AdamW`.

The Lightning precision plugin and the Accelerate integration both receive ordinary AdamW optimizers and hand
FP8AdamW to the training loop. :func:`to_fp8_adamw` builds it with the same hyper-parameters and param groups
(extra keys such as ``initial_lr`` or a group ``name`` are kept); :func:`rebind_scheduler` points an LR scheduler
built on the old optimizer at the new one (``maximize`` carries over, per group). Anything that would silently change
the update rule (AMSGrad, Adam's coupled L2 weight decay, existing state) is an error that says what to do instead.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from lightning_fp8.warnings import warn_once

# torch.optim.Adam(W) keys (of the defaults and each group) that select an implementation, not the update rule:
# FP8AdamW has its own. (differentiable=True is refused before: autograd through the step, which FP8AdamW has not.)
_IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay")
_DROPPED_KEYS = (*_IMPLEMENTATION_KEYS, "amsgrad")


def is_replaceable(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is exactly ``torch.optim.AdamW`` or ``torch.optim.Adam`` (what FP8AdamW replaces)."""
    return type(optimizer) in (torch.optim.AdamW, torch.optim.Adam)


def check_replaceable(optimizer: torch.optim.Optimizer, *, source: str, opt_out: str) -> None:
    """Raise a ``ValueError`` if replacing ``optimizer`` by FP8AdamW would change training.

    Args:
        optimizer: an AdamW/Adam.
        source: where the optimizer came from, for the message (e.g. ``"configure_optimizers"``).
        opt_out: how the user keeps their optimizer instead, for the message.
    """
    name = type(optimizer).__name__
    if optimizer.state:
        raise ValueError(
            f"the {name} from {source} already has state for {len(optimizer.state)} parameter(s); FP8-LM can only "
            f"replace a fresh optimizer: create it before training starts (its state is restored afterwards)"
        )
    for i, group in enumerate(optimizer.param_groups):
        if group.get("amsgrad"):
            raise ValueError(
                f"{name}(param_groups[{i}] amsgrad=True) has no FP8AdamW equivalent: set amsgrad=False, or {opt_out}"
            )
        if group.get("differentiable"):
            raise ValueError(
                f"{name}(param_groups[{i}] differentiable=True) lets autograd run through the step, which FP8AdamW "
                f"cannot: set differentiable=False, or {opt_out}"
            )
        coupled_l2 = type(optimizer) is torch.optim.Adam and not group.get("decoupled_weight_decay", False)
        if coupled_l2 and group.get("weight_decay", 0) != 0:
            raise ValueError(
                f"Adam(weight_decay={group['weight_decay']}) adds an L2 term to the gradient, but FP8AdamW decays "
                "weights decoupled (AdamW): use torch.optim.AdamW(weight_decay=...) or Adam(weight_decay=0)"
            )


def to_fp8_adamw(
    optimizer: torch.optim.Optimizer, *, source: str = "the caller", opt_out: str = "keep it", **fp8_kwargs: Any
) -> torch.optim.Optimizer:
    """An ``FP8AdamW`` equivalent to a fresh AdamW/Adam (returned unchanged if it already is an FP8AdamW).

    Args:
        optimizer: a fresh ``torch.optim.AdamW`` or ``Adam``.
        source, opt_out: wording of the errors (see :func:`check_replaceable`).
        fp8_kwargs: ``FP8AdamW`` constructor arguments (``grad_scaler``, ``opt_level``...), passed where its
            signature accepts them.

    Raises:
        ValueError: see :func:`check_replaceable`.
    """
    from lightning_fp8.optim import FP8AdamW

    if isinstance(optimizer, FP8AdamW):
        return optimizer
    check_replaceable(optimizer, source=source, opt_out=opt_out)
    accepted = inspect.signature(FP8AdamW.__init__).parameters
    # The implementation keys of the defaults go as the groups' do: FP8AdamW refuses capturable=True, which picks
    # torch's CUDA-graph-safe implementation of the same update.
    defaults = {k: v for k, v in optimizer.defaults.items() if k not in _DROPPED_KEYS}
    kwargs = {k: v for k, v in {**defaults, **fp8_kwargs}.items() if k in accepted and k != "params"}
    groups = [{k: v for k, v in group.items() if k not in _DROPPED_KEYS} for group in optimizer.param_groups]
    return FP8AdamW(groups, **kwargs)


def retire(old: torch.optim.Optimizer, new: torch.optim.Optimizer, where: str, how_to_step: str) -> None:
    """Make ``old`` (the script's optimizer, which ``new`` replaced) a view of ``new`` for code that kept it.

    ``old`` gets the very list of group dicts that ``new`` steps with, again whenever a ``load_state_dict`` gives
    ``new`` new ones, so that what LR schedulers built on ``old`` read and write (``lr``, ``initial_lr``, OneCycleLR's
    ``betas``, ReduceLROnPlateau's reductions) is ``new``'s. ``old.step`` raises a RuntimeError naming ``where`` the
    swap happened and ``how_to_step``: a step of ``old`` would update the same weights a second time. (torch's check
    that a scheduler did not step before its optimizer reads ``old._opt_called``: the integration sets it when
    ``new`` steps.)"""
    old.param_groups = new.param_groups

    def share_param_groups(optimizer: torch.optim.Optimizer) -> None:
        old.param_groups = optimizer.param_groups

    new.register_load_state_dict_post_hook(share_param_groups)
    name, new_name = type(old).__name__, type(new).__name__

    def step(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"this {name} was replaced by {new_name} {where} and no longer steps: {how_to_step}. LR schedulers built "
            f"on the {name} need no change: they drive the {new_name}"
        )

    # torch's LR schedulers wrap an optimizer's step to watch it unless it carries this mark; without it they also
    # warn that the step "has been overridden after learning rate scheduler initialization".
    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    old.step = step  # type: ignore[method-assign]


def warn_if_level_differs(optimizer: Any, recipe: Any, *, where: str, run_recipe: str, launch_with: str) -> None:
    """Warn when a user's own FP8AdamW steps at another opt level than the run's ``recipe``: both integrations keep
    it as built, so its level wins, which was silent (a run asking for O1 trained with O2's fp16 masters).

    Args:
        optimizer: the user's FP8AdamW.
        recipe: the run's FP8Recipe.
        where: the call that keeps it, for the message (e.g. ``"accelerator.prepare"``).
        run_recipe: how the user names the run's recipe in code (e.g. ``"accelerator.fp8_lm_recipe"``).
        launch_with: how to run with the optimizer's level instead, with ``{level}`` for it.
    """
    if optimizer.opt_level == recipe.opt_level:
        return
    what = {"O1": "fp32 masters and moments", "O2": "fp16 masters, E4M3 and fp16 moments"}
    warn_once(
        f"{where}: your FP8AdamW steps at opt level {optimizer.opt_level} ({what[optimizer.opt_level]} for the FP8 "
        f"weights), but the run's recipe has opt_level={recipe.opt_level!r}: the FP8AdamW's level is used. To follow "
        f"the run, build it with opt_level={recipe.opt_level!r} (or recipe={run_recipe}) or use a "
        f"torch.optim.AdamW, which is replaced; to keep {optimizer.opt_level}, "
        f"{launch_with.format(level=optimizer.opt_level)}. Either silences this"
    )


def _track_step_called(optimizer: torch.optim.Optimizer) -> None:
    # torch's LRScheduler wraps optimizer.step to notice a scheduler stepping first; give the new optimizer the
    # same wrapper so a rebound scheduler behaves as if it had been built on it (and does not warn).
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    step = optimizer.step

    @functools.wraps(step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]


def rebind_scheduler(scheduler: Any, swapped: dict[int, torch.optim.Optimizer]) -> None:
    """Point ``scheduler`` (and those nested in ``SequentialLR``/``ChainedScheduler``) at the new optimizers.

    Args:
        scheduler: an LR scheduler.
        swapped: ``{id(old optimizer): new optimizer}``. The param groups were copied, so ``initial_lr`` and the
            current learning rate carry over.
    """
    new = swapped.get(id(getattr(scheduler, "optimizer", None)))
    if new is not None:
        scheduler.optimizer = new
        if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            _track_step_called(new)
    for inner in getattr(scheduler, "_schedulers", ()):
        rebind_scheduler(inner, swapped)
