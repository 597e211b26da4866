"""The FP8 model that :class:`~lightning_fp8.FP8GradScaler` follows: whose ``grad_output`` scales mu changes rescale.

A scaler given its model (``model=``, :attr:`_ScalerModel.model`) rescales the delayed ``grad_output`` scaling states
of its FP8 layers whenever mu changes, and its ``"bf16"`` fallback finds the layers to put back there. The
integrations give theirs where the user gave none (:meth:`_ScalerModel._take_model`); without any, an optimizer
training FP8 layers with delayed scaling warns once at its first step (:meth:`_ScalerModel._warn_if_no_model`). Apart:
it is the scaler's one link to the model, which the step and the rules only read. :class:`_ScalerModel` is a base of
the scaler and reads its attributes.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from lightning_fp8.grad_scaling.arguments import check_model


class _ScalerModel:
    """The scaler's FP8 model, given or taken (see the module docstring); the attributes are ``FP8GradScaler``'s."""

    @property
    def model(self) -> nn.Module | None:
        """The FP8 model whose ``grad_output`` scaling states mu changes rescale, and where the ``"bf16"`` fallback
        finds layers to put back (``model=``; the Lightning and Accelerate integrations give theirs where none
        was given)."""
        return self._model

    @model.setter
    def model(self, model: nn.Module | None) -> None:
        check_model(model)
        self._model = model
        self._model_from_integration = False

    def _take_model(self, model: nn.Module) -> None:
        """Make ``model``, an integration's FP8 model, this scaler's :attr:`model` where it has none or one an
        integration gave it (a Trainer fitting a second model, a later ``prepare``, a new training after
        ``free_memory``): mu changes then rescale the model being trained. A model the user gave (``model=``, or
        set since) is the user's and stays."""
        if self._model is None or self._model_from_integration:
            self._model = model
            self._model_from_integration = True

    def _refuse_fallback_without_model(self) -> None:
        """Raise, before a step changes anything, when the ``"bf16"`` fallback has no model to put layers back in: it
        was set after construction (``scaler.nonfinite_fallback = "bf16"``, which ``__init__`` refuses without one)
        and no model was given since, by ``scaler.model = ...`` or an integration."""
        if self.nonfinite_fallback == "bf16" and self._model is None:
            raise ValueError(
                "FP8GradScaler(nonfinite_fallback='bf16') has no model to put layers back in: give it, "
                "scaler.model = model (the Lightning and Accelerate integrations give theirs), or choose another "
                "fallback (scaler.nonfinite_fallback = 'lower_lr')"
            )

    def _warn_if_no_model(self, optimizer: torch.optim.Optimizer) -> None:
        """Warn once when this scaler has no :attr:`model` and ``optimizer`` trains FP8 layers with delayed scaling:
        their ``grad_output`` scales come from amaxes recorded at an earlier mu, so after mu grows 16x (the fp16 rule)
        their casts saturate (measured: 78% of the values of a small MLP's) until the amax history rolls over, and
        nothing tells (those casts report to no scaler). Checked at an optimizer's first step."""
        from lightning_fp8.optim.master import is_fp8_weight, layer_recipes

        if self._model is not None or getattr(self, "_warned_no_model", False):  # (absent from older pickles)
            return
        weights = [p for group in optimizer.param_groups for p in group["params"] if is_fp8_weight(p)]
        if any(recipe.scaling == "delayed" for recipe in layer_recipes(weights)):
            self._warned_no_model = True
            warnings.warn(
                f"FP8GradScaler has no model, and this {type(optimizer).__name__} trains FP8 layers with delayed "
                "scaling: each change of mu leaves their grad_output scales off by its factor until their amax "
                "history rolls over (after mu grows, those casts saturate). Give the model, FP8GradScaler(model=model) "
                "or scaler.model = model, so that mu changes rescale them exactly",
                stacklevel=3,
            )
