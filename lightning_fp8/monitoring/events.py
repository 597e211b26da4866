"""What :class:`~lightning_fp8.health.HealthMonitor` records and reports: the names of its series, the kinds of
events and the recovery actions, :class:`HealthEvent`, and the actions of ``FP8GradScaler``'s fallbacks.

The names are written down once here: the monitor, the checks of its saved state and the integrations (which add
the fallbacks a skipped step ran to its event) all use them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

EVENT_KINDS = ("grad_norm_spike", "loss_plateau", "nonfinite_loss", "nonfinite_grad")
ACTIONS = ("none", "skip_step", "lower_mu", "lower_lr", "fallback_bf16")
# The recovery of a step FP8GradScaler skipped: no update, mu halved.
SKIP_ACTION = "skip_step+lower_mu"
# FP8GradScaler's fallback descriptions -> action names: the phrase that comes first in the description names the
# action (the built-in fallbacks' descriptions begin with it; layer names after it may hold "lr" or "bf16").
_FALLBACK_ACTIONS = re.compile(r"(learning rate|\blr\b)|(high precision|\bbf16\b)")
SERIES = ("loss", "grad_norm", "param_norm", "samples_per_sec", "tokens_per_sec", "memory_gib")


@dataclass(frozen=True, kw_only=True)
class HealthEvent:
    """One alert: what happened at which step, the value that triggered it, and the recovery action taken."""

    step: int
    kind: str
    value: float
    message: str
    action: str = "none"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def scaler_fallbacks(history: Iterable[Mapping[str, Any]], after_step: int) -> tuple[list[str], int]:
    """The action names (:data:`ACTIONS`) of the fallbacks an ``FP8GradScaler.history`` records after scaler step
    ``after_step``, and the step of the last one (``after_step`` when there is none): what the integrations add to
    the event of the skipped step that ran them (``"skip_step+lower_mu+lower_lr"``)."""
    actions, last = [], after_step
    for entry in history:
        if entry.get("action") == "fallback" and entry.get("step", 0) > last:
            found = _FALLBACK_ACTIONS.search(str(entry.get("reason", "")).lower())
            actions.append("none" if found is None else "lower_lr" if found.group(1) else "fallback_bf16")
            last = entry["step"]
    return actions, last


def skipped_step_action(fallbacks: Iterable[str]) -> str:
    """The action of a skipped step's event: :data:`SKIP_ACTION` and the fallbacks it ran (names of :data:`ACTIONS`)."""
    if isinstance(fallbacks, str):  # one name: its characters would be taken as names
        fallbacks = [fallbacks]
    return "+".join([SKIP_ACTION, *(a for a in fallbacks if a != "none")])
