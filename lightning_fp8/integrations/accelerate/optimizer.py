"""The optimizer side of FP8-LM under Accelerate: AdamW -> FP8AdamW, schedulers rebound, steps through mu.

``accelerator.prepare`` receives the user's ``torch.optim.AdamW`` (or ``Adam``). :func:`to_fp8_optimizer`
builds an :class:`~lightning_fp8.FP8AdamW` with the same hyper-parameters and param groups (extra group keys
such as ``initial_lr`` or a group ``name`` are kept); :func:`rebind_scheduler` points an LR scheduler prepared
after the swap at the new one. :class:`FP8AcceleratedOptimizer` is Accelerate's optimizer wrapper with the step
routed through the :class:`~lightning_fp8.FP8GradScaler`: the step is skipped on every rank when any rank saw a
non-finite gradient, and ``step_was_skipped`` tells Accelerate's scheduler wrapper not to advance. Through
:meth:`FP8AcceleratedOptimizer.take_over`, the schedulers still built on the replaced AdamW (never prepared, or
prepared before the optimizer) drive the FP8AdamW too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from accelerate.optimizer import AcceleratedOptimizer
from typing_extensions import override

from lightning_fp8.integrations.clipping import UnscaledGradients
from lightning_fp8.optim import FP8AdamW, checkpoint, swap
from lightning_fp8.recipe import FP8Recipe

_OPT_OUT = "launch with LIGHTNING_FP8_RECIPE=none to train without FP8-LM"


def to_fp8_optimizer(optimizer: torch.optim.Optimizer, **fp8_kwargs: Any) -> torch.optim.Optimizer:
    """An :class:`~lightning_fp8.FP8AdamW` equivalent to a fresh ``torch.optim.AdamW``/``Adam`` passed to prepare."""
    return swap.to_fp8_adamw(optimizer, source="accelerator.prepare", opt_out=_OPT_OUT, **fp8_kwargs)


def warn_if_level_differs(optimizer: FP8AdamW, recipe: FP8Recipe) -> None:
    """:func:`swap.warn_if_level_differs` for ``accelerator.prepare``, which keeps a script's own FP8AdamW as built."""
    swap.warn_if_level_differs(
        optimizer,
        recipe,
        where="accelerator.prepare",
        run_recipe="accelerator.fp8_lm_recipe",
        launch_with="launch with opt_level='{level}' (the lightning_fp8 config section, "
        'LIGHTNING_FP8_RECIPE=\'{{"name": "...", "opt_level": "{level}"}}\' or Accelerator(fp8_lm_recipe=...))',
    )


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
        before_step: called before a step that syncs gradients (the health monitor's parameter norm).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        device_placement: bool,
        grad_scaler: Any,
        on_step: Callable[[bool], None],
        before_step: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(optimizer, device_placement=device_placement, scaler=None)
        self.grad_scaler = grad_scaler
        self._on_step = on_step
        self._before_step = before_step
        # Tensor parallelism: the states are DTensor shards, saved by the accelerator's checkpoint hooks with
        # torch.distributed.checkpoint; Accelerate's own optimizer file then holds a placeholder.
        self.sharded_states = False
        self.replaced: list[torch.optim.Optimizer] = []  # the script's optimizers that self.optimizer replaced
        self.unscaled: UnscaledGradients | None = None  # accelerator.unscale_gradients's true gradients (unscale)

    def unscale(self, mu: float) -> None:
        """Divide the gradients by ``mu`` in place until :meth:`scale_back` (the next backward, or the step, which
        unscales inside FP8AdamW's fused kernel): fp16 gradients keep their scaled values where nothing changes
        them meanwhile (:class:`~lightning_fp8.integrations.clipping.UnscaledGradients`). Already unscaled, or mu 1:
        nothing to do."""
        if self.unscaled is None and mu != 1.0:
            self.unscaled = UnscaledGradients(self.optimizer, mu)

    def scale_back(self) -> None:
        """End :meth:`unscale`: the gradients carry mu again (a no-op when they are not unscaled)."""
        region, self.unscaled = self.unscaled, None
        if region is not None:
            region.scale_back()

    @override
    def zero_grad(self, set_to_none: bool | None = None) -> None:
        if self.gradient_state.sync_gradients:  # Accelerate's zero_grad clears them then (not while accumulating)
            self.unscaled = None
        super().zero_grad(set_to_none)

    def take_over(self, replaced: torch.optim.Optimizer) -> None:
        """Make the LR schedulers built on ``replaced`` (the script's AdamW, which ``self.optimizer`` replaced in
        ``prepare``) drive ``self.optimizer``, whether they were prepared or not and in any prepare order.

        A scheduler reads and writes its optimizer's ``param_groups`` (``lr``, ``initial_lr``, OneCycleLR's ``betas``,
        ReduceLROnPlateau's reductions): ``replaced`` gets the very list of group dicts that ``self.optimizer`` steps
        with, again whenever a ``load_state_dict`` gives ``self.optimizer`` new ones. torch's check that a scheduler
        did not step before its optimizer reads ``replaced._opt_called``, which :meth:`step` sets. ``replaced`` can
        no longer step (its ``step`` raises: another update of the same weights).
        """
        self.replaced.append(replaced)
        swap.retire(replaced, self.optimizer, "in accelerator.prepare (FP8-LM)", "step the optimizer that prepare "
                    "returned (`model, optimizer = accelerator.prepare(model, optimizer)`)")  # fmt: skip

    @override
    def state_dict(self) -> dict[str, Any]:
        if self.sharded_states:
            from lightning_fp8.integrations.accelerate.tensor_parallel import sharded_optimizer_placeholder

            return sharded_optimizer_placeholder(self.optimizer)
        return super().state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._is_placeholder(state_dict):
            return  # the accelerator's load_state restored the states already
        super().load_state_dict(state_dict)

    def check_state_dict(self, state_dict: Any) -> None:
        """Raise what :meth:`load_state_dict` would raise for ``state_dict``, changing nothing, so that
        ``accelerator.load_state`` can check the optimizer file before it loads the model.

        Raises:
            ValueError: for a tensor-parallel placeholder outside tensor parallelism, a dict that is not an optimizer's
                ``state_dict()``, parameter groups of other sizes than this optimizer's (torch's
                ``Optimizer.load_state_dict`` refuses them), and what ``FP8AdamW.load_state_dict`` refuses.
        """
        if self._is_placeholder(state_dict):
            return
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if not (isinstance(groups, list) and all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                                 for g in groups)):  # fmt: skip
            got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(
                f"expected an optimizer's state_dict() (a dict with 'state' and 'param_groups', each group listing its "
                f"'params'), got {got}: the file is corrupt or not an optimizer checkpoint"
            )
        saved = [len(group["params"]) for group in groups]
        own = [len(group["params"]) for group in self.optimizer.param_groups]
        if saved != own:
            raise ValueError(
                f"the checkpoint has parameter groups of {saved} parameters, the prepared optimizer's are {own}: it "
                "was saved for another model or another grouping of its parameters; prepare the optimizer as the run "
                "that saved it did"
            )
        if isinstance(self.optimizer, FP8AdamW):
            # What FP8AdamW.load_state_dict checks before it loads anything. It looks at each parameter's shape and
            # sharding only, which putting fallen-back layers back to nn.Linear (before the load) does not change.
            self.optimizer.check_state_dict(state_dict)

    def _is_placeholder(self, state_dict: Any) -> bool:
        """Whether ``state_dict`` is the tensor-parallel placeholder (the states are in the sharded checkpoint)."""
        from lightning_fp8.integrations.accelerate.tensor_parallel import is_placeholder

        if not (isinstance(state_dict, dict) and is_placeholder(state_dict)):
            return False
        if not self.sharded_states:
            raise ValueError(
                "this optimizer checkpoint was saved by a tensor-parallel run (its states are sharded in "
                "<checkpoint>/lightning_fp8/tensor_parallel): load it with the same tensor-parallel launch"
            )
        return True

    @override
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        if closure is not None:
            raise ValueError(
                "FP8-LM optimizer steps take no closure: the loss is scaled by mu in accelerator.backward and the "
                "step may be skipped on a non-finite gradient, which a closure re-evaluation cannot follow"
            )
        if checkpoint.is_state_init_step(self.optimizer):  # torch's state-making step (DCP): no loss, no scaler
            self.optimizer.step()
            return
        self.scale_back()  # the step unscales by mu itself (and checks the gradients as they then are)
        if not self.gradient_state.sync_gradients:
            return
        if self._before_step is not None:
            self._before_step()
        stepped = bool(self.grad_scaler.step(self.optimizer))
        self.grad_scaler._update(judge_unstepped=False)  # this step's: another optimizer's unscale_ stays its own
        # What the LR schedulers watch (torch's wrapper of optimizer.step sets it), also when the scaler skipped the
        # step and on the optimizers it replaced, whose schedulers drive this one (take_over).
        for optimizer in (self.optimizer, *self.replaced):
            optimizer._opt_called = True  # type: ignore[attr-defined]
        self._is_overflow = not stepped
        self._on_step(stepped)
