"""What :class:`~lightning_fp8.FP8GradScaler` exposes read-only for monitoring: mu, the skipped steps and non-finite
events counted, the last saturation, the growth count and the actions taken; and ``torch.amp.GradScaler``'s
``get_scale`` / ``is_enabled`` spellings. :class:`_Readings` is a base of the scaler and reads its attributes.
"""

from __future__ import annotations

from typing import Any

import torch


class _Readings:
    """The scaler's read-only values (see the module docstring); the attributes are ``FP8GradScaler``'s."""

    @property
    def scale(self) -> torch.Tensor:
        """mu, a 0-dim fp32 tensor (a power of two)."""
        return torch.tensor(self._scale, dtype=torch.float32)

    def get_scale(self) -> float:
        """mu as a Python float (``torch.amp.GradScaler.get_scale``'s spelling; the loss is scaled by
        :meth:`scale_loss`, since ``scale`` is this property)."""
        return self._scale

    @property
    def skipped_steps(self) -> int:
        return self._skipped_steps

    @property
    def nonfinite_events(self) -> int:
        return self._nonfinite_events

    @property
    def last_saturation(self) -> float:
        """Fraction of gradient values at the FP8 maximum in the last step's casts (over all ranks)."""
        return self._last_saturation

    @property
    def growth_tracker(self) -> int:
        """Consecutive steps with headroom so far (mu doubles at ``growth_interval``)."""
        return self._growth_tracker

    @property
    def history(self) -> tuple[dict[str, Any], ...]:
        """Actions taken, oldest first: ``{"step", "action", "reason", "scale"}`` (the last 1000)."""
        return tuple(dict(entry) for entry in self._history)

    def is_enabled(self) -> bool:
        """True: ``torch.amp.GradScaler.is_enabled``'s spelling, for code written for it (an FP8GradScaler always
        scales; to train without one, do not create it)."""
        return True
