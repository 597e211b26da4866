"""The optimizer side of FP8-LM under Accelerate: AdamW -> FP8AdamW, schedulers rebound, steps through mu.

``accelerator.prepare`` receives the user's ``torch.optim.AdamW`` (or ``Adam``). :func:`to_fp8_optimizer`
builds an :class:`~lightning_fp8.FP8AdamW` with the same hyper-parameters and param groups (extra group keys
such as ``initial_lr`` or a group ``name`` are kept); :func:`rebind_scheduler` points an LR scheduler built on the
old optimizer at the new one. :class:`FP8AcceleratedOptimizer` is Accelerate's optimizer wrapper with the step
routed through the :class:`~lightning_fp8.FP8GradScaler`: the step is skipped on every rank when any rank saw a
non-finite gradient, and ``step_was_skipped`` tells Accelerate's scheduler wrapper not to advance.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from accelerate.optimizer import AcceleratedOptimizer
from typing_extensions import override

from lightning_fp8.optim import FP8AdamW

# torch.optim.Adam(W) group keys that select an implementation, not the update rule: FP8AdamW has its own.
_IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay")
_SWAPPABLE = (torch.optim.AdamW, torch.optim.Adam)


def is_swappable(optimizer: torch.optim.Optimizer) -> bool:
    """Whether :func:`to_fp8_optimizer` replaces ``optimizer`` (exactly ``torch.optim.AdamW`` or ``Adam``)."""
    return type(optimizer) in _SWAPPABLE


def _check_swappable(optimizer: torch.optim.Optimizer) -> None:
    name = type(optimizer).__name__
    if optimizer.state:
        raise ValueError(
            f"the {name} passed to accelerator.prepare already has state for {len(optimizer.state)} parameter(s); "
            "FP8-LM replaces it with FP8AdamW and can only replace a fresh optimizer: prepare it before training "
            "(accelerator.load_state restores its state afterwards)"
        )
    for i, group in enumerate(optimizer.param_groups):
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise ValueError(
                    f"{name}(param_groups[{i}] {flag}=True) has no FP8AdamW equivalent: set {flag}=False, or launch "
                    "with LIGHTNING_FP8_RECIPE=none to train without FP8-LM"
                )
        coupled_l2 = type(optimizer) is torch.optim.Adam and not group.get("decoupled_weight_decay", False)
        if coupled_l2 and group.get("weight_decay", 0) != 0:
            raise ValueError(
                f"Adam(weight_decay={group['weight_decay']}) adds an L2 term to the gradient, but FP8AdamW decays "
                "weights decoupled (AdamW): use torch.optim.AdamW(weight_decay=...) or Adam(weight_decay=0)"
            )


def to_fp8_optimizer(optimizer: torch.optim.Optimizer, **fp8_kwargs: Any) -> torch.optim.Optimizer:
    """An :class:`~lightning_fp8.FP8AdamW` equivalent to a fresh ``torch.optim.AdamW``/``Adam``.

    Args:
        optimizer: the user's optimizer (no state yet).
        fp8_kwargs: ``FP8AdamW`` constructor arguments (``grad_scaler``, ``opt_level``...), passed where its
            signature accepts them.

    Raises:
        ValueError: for an optimizer with state, AMSGrad, ``maximize``, or Adam with coupled (L2) weight decay.
    """
    _check_swappable(optimizer)
    accepted = inspect.signature(FP8AdamW.__init__).parameters
    kwargs = {k: v for k, v in {**optimizer.defaults, **fp8_kwargs}.items() if k in accepted and k != "params"}
    dropped = (*_IMPLEMENTATION_KEYS, "amsgrad", "maximize")
    groups = [{k: v for k, v in group.items() if k not in dropped} for group in optimizer.param_groups]
    return FP8AdamW(groups, **kwargs)


def _track_step_called(optimizer: torch.optim.Optimizer) -> None:
    # torch's LRScheduler wraps optimizer.step to notice a scheduler stepping first; give the new optimizer the
    # same wrapper so a rebound scheduler behaves as if it had been built on it.
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


class FP8AcceleratedOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper whose step goes through the FP8 gradient scaler (mu).

    On a step that synchronizes gradients (the last micro-batch of :meth:`accelerate.Accelerator.accumulate`):
    ``grad_scaler.step(optimizer)`` (agree across ranks, skip on a non-finite gradient, else unscale and step),
    then ``grad_scaler.update()`` (halve or double mu), then ``on_step(stepped)``.

    Args:
        optimizer: the optimizer to wrap (usually an ``FP8AdamW``).
        device_placement: as ``AcceleratedOptimizer``.
        grad_scaler: the :class:`~lightning_fp8.FP8GradScaler` of this accelerator.
        on_step: called with True after a step, False after a skipped one (statistics, health).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        device_placement: bool,
        grad_scaler: Any,
        on_step: Callable[[bool], None],
    ) -> None:
        super().__init__(optimizer, device_placement=device_placement, scaler=None)
        self.grad_scaler = grad_scaler
        self._on_step = on_step

    @override
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        if closure is not None:
            raise ValueError(
                "FP8-LM optimizer steps take no closure: the loss is scaled by mu in accelerator.backward and the "
                "step may be skipped on a non-finite gradient, which a closure re-evaluation cannot follow"
            )
        if not self.gradient_state.sync_gradients:
            return
        stepped = bool(self.grad_scaler.step(self.optimizer))
        self.grad_scaler.update()
        # The scaler calls FP8AdamW's update directly, past the optimizer.step that LR schedulers watch.
        self.optimizer._opt_called = True  # type: ignore[attr-defined]
        self._is_overflow = not stepped
        self._on_step(stepped)
