""":class:`~lightning_fp8.optim.FP8AdamW`'s state as ``torch.optim.AdamW`` keeps it: fp32 moments and ``step``.

:func:`adamw_state_dict` converts a saved state dict (no optimizer needed), :func:`to_adamw` an optimizer's current
state; both divide each low-precision moment by its scale. For resuming without FP8.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lightning_fp8.optim.state_layout import dequantize

if TYPE_CHECKING:
    from lightning_fp8.optim.adamw import FP8AdamW


def to_adamw(opt: FP8AdamW) -> dict[str, Any]:
    """The state as ``torch.optim.AdamW`` keeps it: fp32 moments, ``step``; groups with AdamW's keys added."""
    return adamw_state_dict(torch.optim.Optimizer.state_dict(opt))  # the states as kept (0-dim scales)


def adamw_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A saved :class:`~lightning_fp8.FP8AdamW` state dict (``optimizer.state_dict()``, a Lightning checkpoint's
    ``optimizer_states`` entry) as ``torch.optim.AdamW``'s: fp32 moments, each low-precision one divided by its scale,
    ``step``; groups with AdamW's keys added to theirs (a scheduler's keys stay). For resuming without FP8:
    ``torch.optim.AdamW.load_state_dict`` takes an FP8AdamW state dict without a word but reads its scaled moments as
    they are stored (``x * scale``, the scales dropped), and Adam's steps are then off until the moments decay."""
    state = {
        index: {
            key: (saved[key].detach().cpu().clone() if key == "step" else dequantize(saved, key))
            for key in ("step", "exp_avg", "exp_avg_sq")
            if key in saved
        }
        for index, saved in state_dict["state"].items()
    }
    adamw_defaults = torch.optim.AdamW([torch.zeros(1)]).defaults
    # Every key a group holds stays: an LR scheduler's (initial_lr, max_lr, ...) and the user's own as well.
    groups = [{**adamw_defaults, **group} for group in state_dict["param_groups"]]
    return {"state": state, "param_groups": groups}
