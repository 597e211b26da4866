"""FP8LMPrecision's optimizers: those ``configure_optimizers`` returned, as ``connect`` hands them to the strategy.

With ``replace_optimizers=True`` an AdamW or Adam becomes an :class:`~lightning_fp8.FP8AdamW` of the plugin's recipe,
gradient scaler and ``fp8_grads`` (under FSDP1 with its masters apart from the weights' storage), and the LR
schedulers follow it; a user's FP8AdamW is kept as built, and the gradient scaler it brings becomes the plugin's (one
mu scales each backward, so two scalers are refused). :class:`_PrecisionOptimizers` is a base of the plugin
(:mod:`~lightning_fp8.integrations.lightning.precision`) and reads its attributes; the swap itself (hyper-parameters,
param groups, schedulers) is :mod:`~lightning_fp8.integrations.lightning.optimizers`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_fp8.integrations.lightning import comm
from lightning_fp8.integrations.lightning import optimizers as optimizer_swap
from lightning_fp8.optim import master, swap
from lightning_fp8.recipe import FP8Recipe


class _PrecisionOptimizers:
    """The plugin's replacement of the optimizers from ``configure_optimizers``, and the one gradient scaler.

    Reads the plugin's attributes declared below, and calls its ``_give_scaler_the_model`` when it adopts a scaler.
    """

    recipe: FP8Recipe
    grad_scaler: Any
    fp8_grads: bool
    _grad_scaler_given: bool
    _wrapped_model: nn.Module | None
    _early_masters: list[nn.Parameter]

    def _replace_optimizer(self, optimizer: torch.optim.Optimizer, lr_scheduler_configs: list[Any]) -> Any:
        if optimizer_swap.is_mock_optimizer(optimizer):  # configure_optimizers returned None: kept, as Lightning does
            return optimizer
        fp8_kwargs: dict[str, Any] = {
            "recipe": self.recipe,
            "grad_scaler": self.grad_scaler,
            "fp8_grads": self.fp8_grads,
        }
        fsdp1 = comm.is_fsdp1_root(self._wrapped_model)
        if fsdp1:
            fp8_kwargs["fp8_params"] = optimizer_swap.keep_masters_apart(self._wrapped_model)
        new = optimizer_swap.to_fp8_optimizer(optimizer, **fp8_kwargs)
        if new is optimizer and fsdp1 and _holds_masters_in_storage(new):
            raise ValueError(
                "strategy='fsdp_fp8': the FP8AdamW returned by configure_optimizers keeps its fp16 masters in the FP8 "
                "weights' storage, which under FSDP is a view into FSDP's flat parameter (its first step would fail). "
                "Return torch.optim.AdamW (or Adam) from configure_optimizers: FP8LMPrecision replaces it with an "
                "FP8AdamW that keeps its masters apart, with FP8 and fp16 states sharded by FSDP"
            )
        if self._early_masters and getattr(new, "master_dtype", None) != torch.float16:
            raise ValueError(
                f"the FP8AdamW from configure_optimizers keeps {new.master_dtype} masters, but under DDP "
                f"FP8LMPrecision(recipe={self.recipe.opt_level!r} level) prepared fp16 ones before wrapping the model: "
                "use FP8LMPrecision(recipe='fp8-lm-o1') for an O1 optimizer, or the default FP8AdamW arguments"
            )
        if new is not optimizer:
            schedulers = [getattr(config, "scheduler", config) for config in lr_scheduler_configs]
            optimizer_swap.rebind_schedulers(schedulers, optimizer, new)
            optimizer_swap.hand_over(optimizer, new)  # for schedulers Lightning was not given, and a kept reference
        else:  # the user's FP8AdamW, kept as built
            swap.warn_if_level_differs(
                new,
                self.recipe,
                where="precision='fp8-lm'",
                run_recipe="trainer.precision_plugin.recipe",
                launch_with="train with a recipe of opt_level='{level}' (precision='fp8-lm' is O2, 'fp8-lm-o1' O1; or "
                "FP8LMPrecision(recipe=...))",
            )
            if getattr(new, "grad_scaler", None) is None:
                new.grad_scaler = self.grad_scaler  # unscale by our mu, report its casts to it
        return new

    def _adopt_brought_scaler(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Make the scaler that the user's FP8AdamWs bring the plugin's, before any optimizer is given one.

        Every backward is scaled by one mu, so one scaler: with two, the loss was scaled by the last one's mu and the
        first one's settings were ignored, as was a scaler given to the plugin itself."""
        from lightning_fp8.optim import FP8AdamW

        scalers = [o.grad_scaler for o in optimizers if isinstance(o, FP8AdamW) and o.grad_scaler is not None]
        brought = {id(scaler): scaler for scaler in scalers}
        if len(brought) > 1:
            raise ValueError(
                f"configure_optimizers returned FP8AdamWs with {len(brought)} different gradient scalers "
                "(grad_scaler=...), but precision='fp8-lm' scales each backward by one mu: only one of them would "
                "scale the loss and the others' settings would be ignored. Build them all with one FP8GradScaler, or "
                "with none (they then use the plugin's: FP8LMPrecision(grad_scaler=...))"
            )
        if not brought:
            return
        [scaler] = brought.values()
        if scaler is not self.grad_scaler and self._grad_scaler_given:
            raise ValueError(
                "FP8LMPrecision(grad_scaler=...) and the FP8AdamW from configure_optimizers (grad_scaler=...) bring "
                "two gradient scalers, but each backward is scaled by one mu: the plugin's would be ignored. Pass the "
                "same FP8GradScaler to both, or give it to only one of them"
            )
        self.grad_scaler = scaler  # the user's FP8AdamW brought its own scaler: scale by that mu
        self._give_scaler_the_model()


def _holds_masters_in_storage(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` (an FP8AdamW at O2) took any parameter's storage for its scaled fp16 master."""
    return any(master.master_scale(p) is not None for group in optimizer.param_groups for p in group["params"])
