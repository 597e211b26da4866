"""The loss that :class:`~lightning_fp8.FP8GradScaler` scales by mu, and which mu the gradients then carry.

:meth:`_LossScaling.scale_loss` returns ``loss * mu`` and remembers that mu (:attr:`_LossScaling.loss_scale`): the
gradients of a backward through it carry it, and unscaling divides by it even where another optimizer's ``update()``
has changed mu since. It also keeps the last few one-value losses it returned (:meth:`_LossScaling.scaled_losses`), so
that a reader handed a loss (Lightning's callbacks) can tell whether it carries mu. Apart from the step: the loss is
scaled before any gradient exists, and the integrations scale it in their own backward
(:meth:`_LossScaling._scale_for_backward`). :class:`_LossScaling` is a base of the scaler and reads its attributes.
"""

from __future__ import annotations

import torch


class _LossScaling:
    """Scaling the loss by mu and recording it (see the module docstring); the attributes are ``FP8GradScaler``'s."""

    @property
    def loss_scale(self) -> float:
        """The mu the current gradients carry: that of the last :meth:`scale_loss` (another optimizer's
        :meth:`update` may have changed :attr:`scale` since), else mu. What unscaling them divides by."""
        return self._loss_scale if self._loss_scale is not None else self._scale

    @property
    def loss_was_scaled(self) -> bool:
        """Whether :meth:`scale_loss` was called (since construction or the last :meth:`load_state_dict`): the
        gradients then carry :attr:`loss_scale`; a loop that never scales its loss leaves them unscaled."""
        return self._loss_scale is not None

    @torch.compiler.disable  # its records would make a compiled caller recompile at every call (guards on them)
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * mu``: call ``.backward()`` on the result. The gradients are later unscaled by this mu, even when
        another optimizer's :meth:`update` has changed mu before their step; gradients summed over several backwards
        are all unscaled by the last one's mu (see docs/concepts/gradient-scaling.md). Inside a compiled function it
        runs eagerly (a graph break), so a change of mu does not recompile the function."""
        scaled = self._scale_for_backward(loss)
        self._losses_scaled += 1
        if scaled.numel() == 1:  # a loss; a larger tensor (backward with a gradient) is not kept
            self._scaled_losses.append((self._losses_scaled, scaled.detach(), self._scale))
        return scaled

    def _scale_for_backward(self, loss: torch.Tensor) -> torch.Tensor:
        """:meth:`scale_loss` without the record :meth:`scaled_losses` reads: for the integrations, which scale the
        loss in their own backward (the loss the user's code returned stays unscaled, nothing to recognise)."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"FP8GradScaler.scale_loss takes the loss tensor (to call .backward() on the result), got "
                f"{type(loss).__name__}; for several losses, scale each one (or their sum)"
            )
        if not loss.is_floating_point() or loss.element_size() == 1:  # an int loss has no gradient; a complex one no
            # .backward() without one; an FP8 one no arithmetic
            raise TypeError(
                f"FP8GradScaler.scale_loss takes a real floating-point loss (float32, bfloat16, float16, float64), got "
                f"a {loss.dtype} tensor: compute the loss in high precision (a complex loss: backward its real part, "
                "or abs())"
            )
        self._loss_scale = self._scale
        return loss * self._scale

    @property
    def losses_scaled(self) -> int:
        """How many times :meth:`scale_loss` was called: a mark to pass to :meth:`scaled_losses` later."""
        return self._losses_scaled

    def scaled_losses(self, since: int = 0, until: int | None = None) -> list[tuple[torch.Tensor, float]]:
        """The one-value losses :meth:`scale_loss` returned after :attr:`losses_scaled` was ``since`` and until it was
        ``until`` (None: until now; the last 32 at most), oldest first, each detached (its value: no graph is kept)
        with the mu it was multiplied by.

        How a reader handed a loss tells whether it carries mu, and which mu, whatever mu is by then: a
        ``training_step`` that returns ``scaler.scale_loss(loss)`` hands Lightning's callbacks a copy of that value
        (``TrainingHealthMonitor`` divides it by its mu), one that scales in ``backward`` hands them the loss unscaled.
        """
        return [(scaled, mu) for serial, scaled, mu in self._scaled_losses
                if serial > since and (until is None or serial <= until)]  # fmt: skip
