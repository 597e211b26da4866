""":class:`~lightning_fp8.optim.FP8AdamW`'s state as ``torch.optim.AdamW`` keeps it: fp32 moments and ``step``.

:func:`adamw_state_dict` converts a saved state dict (no optimizer needed), :func:`to_adamw` an optimizer's current
state; both divide each low-precision moment by its scale. For resuming without FP8.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lightning_fp8.kernels.reference_adamw import SCALED_STATE_MAX
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
    they are stored (``x * scale``, the scales dropped), and Adam's steps are then off until the moments decay.

    Raises:
        ValueError: for anything but such a state dict (a whole checkpoint, an optimizer, a state that is not a dict,
            a moment that is not a tensor), or a state whose FP8 or fp16 moment lacks its scale (its stored values are
            the moment times the scale, which would be exported as the moment).
    """
    _check_form(state_dict)
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


def _check_form(state_dict: Any) -> None:
    """ValueError unless ``state_dict`` has the form of an optimizer's ``state_dict()`` and each of its moments can be
    told from its stored values (the rule of ``FP8AdamW.load_state_dict``: a scaled moment comes with its scale, except
    the fp16 moments of a state with torch.optim.AdamW's keys only, which hold their values)."""
    if not (
        isinstance(state_dict, dict)
        and isinstance(state_dict.get("state"), dict)
        and isinstance(state_dict.get("param_groups"), list)
    ):
        got = (
            f"a dict with keys {sorted(map(str, state_dict))}"
            if isinstance(state_dict, dict)
            else type(state_dict).__name__
        )
        hint = ""
        if isinstance(state_dict, dict) and "optimizer_states" in state_dict:
            hint = " (a Lightning checkpoint: pass one of its checkpoint['optimizer_states'])"
        elif isinstance(state_dict, torch.optim.Optimizer):
            hint = " (an optimizer: pass optimizer.state_dict(), or call FP8AdamW.to_adamw_state_dict())"
        raise ValueError(
            "adamw_state_dict expects a saved FP8AdamW state dict (optimizer.state_dict(): a dict with 'state' and "
            f"'param_groups'), got {got}{hint}"
        )
    for index, saved in state_dict["state"].items():
        if not isinstance(saved, dict):
            raise ValueError(
                f"adamw_state_dict: the state of parameter {index} is a {type(saved).__name__}, not a dict: the state "
                "dict is corrupt, or not an optimizer's"
            )
        torch_keys_only = set(saved) <= {"step", "exp_avg", "exp_avg_sq"}
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in saved:
                continue
            value = saved[key]
            if not isinstance(value, torch.Tensor):
                raise ValueError(
                    f"adamw_state_dict: parameter {index}'s {key!r} is a {type(value).__name__}, not a tensor: the "
                    "state dict is corrupt, or not an AdamW's"
                )
            scaled = value.dtype in SCALED_STATE_MAX and not (value.dtype == torch.float16 and torch_keys_only)
            if scaled and f"{key}_scale" not in saved:
                raise ValueError(
                    f"adamw_state_dict: parameter {index}'s {key!r} is {value.dtype} without its '{key}_scale' "
                    "(FP8AdamW stores it as value * scale, so its values cannot be told): the state dict is corrupt, "
                    "or lost its scales on the way (export it from the checkpoint as it was saved)"
                )
