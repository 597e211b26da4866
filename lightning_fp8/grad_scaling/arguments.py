"""The arguments of :class:`~lightning_fp8.FP8GradScaler`, checked: what ``FP8GradScaler(...)`` raises for each."""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_fp8.grad_scaling.state import _is_power_of_two

if TYPE_CHECKING:
    from lightning_fp8.grad_scaler import FP8GradScaler

_FALLBACKS = ("lower_lr", "bf16")
# The bounds of mu: the loss is multiplied by it in fp32, where 2**-149 and below are 0 (every gradient 0) and 2**128 is
# inf. A normal fp32 number, as the FP8 scales.
MIN_MU, MAX_MU = 2.0**-126, 2.0**127

Fallback = str | nn.Module | Callable[["FP8GradScaler", torch.optim.Optimizer], str]


def _check_number(name: str, value: object, allowed: str, integer: bool = False) -> None:
    """Raise a ``TypeError`` naming ``name`` unless ``value`` is a real number (an int when ``integer``), not a bool:
    ``True`` would pass the range checks as 1 and a string would fail them with a bare comparison error."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if integer else numbers.Real):
        raise TypeError(f"FP8GradScaler({name}={value!r}): must be {allowed}, got {type(value).__name__}")


def check_model(model: object) -> None:
    """Raise a ``TypeError`` unless ``model`` is an ``nn.Module`` or None (it failed at the first change of mu, inside
    ``update()``, with the scale already changed)."""
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(
            f"FP8GradScaler(model=...) got a {type(model).__name__}: expected the FP8 model (an nn.Module) or None; "
            "for several models, pass the module that holds them all"
        )


def warn_if_model_is_another(model: nn.Module | None, optimizer: torch.optim.Optimizer) -> None:
    """Warn when ``model`` (the scaler's) holds none of ``optimizer``'s FP8 weights: a change of mu then rescales the
    ``grad_output`` scaling states of a model that is not trained, and the trained one's delayed scales lag mu
    (stale by the factor mu changed by, as if no model had been given). Checked at an optimizer's first step."""
    from lightning_fp8.optim.master import is_fp8_weight

    if model is None:
        return
    fp8 = [p for group in optimizer.param_groups for p in group["params"] if is_fp8_weight(p)]
    if fp8 and not {id(p) for p in fp8} & {id(p) for p in model.parameters()}:
        warnings.warn(
            f"FP8GradScaler.step: none of this {type(optimizer).__name__}'s FP8 weights is a parameter of the scaler's "
            f"model ({type(model).__name__}), so a change of mu rescales that model's grad_output scaling states, not "
            "those of the model being trained (its delayed scales then lag mu). Give the trained model: "
            "FP8GradScaler(model=model), or scaler.model = model",
            stacklevel=3,
        )


def fallback_model(nonfinite_fallback: Fallback | nn.Module | None, model: nn.Module | None) -> tuple:
    """``(nonfinite_fallback, model)`` with a module given as ``nonfinite_fallback`` turned into ``("bf16", module)``;
    ValueError if ``model`` names another module (the scaler would rescale and fall back on the wrong one)."""
    if not isinstance(nonfinite_fallback, nn.Module):
        return nonfinite_fallback, model
    if model is not None and model is not nonfinite_fallback:
        raise ValueError(
            f"FP8GradScaler(nonfinite_fallback=<{type(nonfinite_fallback).__name__}>, model=<{type(model).__name__}>): "
            "two different models; give the model once, as FP8GradScaler(nonfinite_fallback='bf16', model=model)"
        )
    return "bf16", nonfinite_fallback


def check_optimizer(method: str, optimizer: object) -> None:
    """TypeError for ``FP8GradScaler.<method>(optimizer)`` given what is no optimizer (no ``param_groups``)."""
    if not hasattr(optimizer, "param_groups"):
        raise TypeError(
            f"FP8GradScaler.{method}(optimizer) takes the optimizer to {method.rstrip('_')} (a torch.optim.Optimizer), "
            f"got {type(optimizer).__name__}"
        )


def check_new_scale(new_scale: object, min_scale: float, max_scale: float) -> float:
    """``FP8GradScaler.update(new_scale)``'s value as a float; TypeError / ValueError, naming it, unless it is a number
    or a one-element floating-point tensor, a power of two within ``[min_scale, max_scale]``."""
    if isinstance(new_scale, torch.Tensor):
        if new_scale.numel() != 1 or not new_scale.is_floating_point():
            raise TypeError(
                f"FP8GradScaler.update(new_scale=...): a tensor must have one floating-point element, got shape "
                f"{tuple(new_scale.shape)} and dtype {new_scale.dtype}"
            )
        if new_scale.is_meta:
            raise ValueError("FP8GradScaler.update(new_scale=...) is a meta tensor (no value): pass a number or a "
                             "tensor with its value")  # fmt: skip
        new_scale = new_scale.item()
    if isinstance(new_scale, bool) or not isinstance(new_scale, numbers.Real):
        raise TypeError(f"FP8GradScaler.update(new_scale={new_scale!r}): must be a number, a positive power of two")
    value = float(new_scale)
    if not _is_power_of_two(value):
        raise ValueError(
            f"FP8GradScaler.update(new_scale={value!r}): mu must be a positive power of two (scaling by it is exact); "
            f"the nearest is 2**{round(math.log2(value)) if math.isfinite(value) and value > 0 else '...'}"
        )
    if not min_scale <= value <= max_scale:
        raise ValueError(
            f"FP8GradScaler.update(new_scale={value!r}): outside this scaler's [min_scale, max_scale] = "
            f"[{min_scale}, {max_scale}]"
        )
    return value


def _check_scale(name: str, value: object) -> None:
    """Raise unless ``value`` (``init_scale``, ``min_scale`` or ``max_scale``) is a power of two mu can take."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"FP8GradScaler({name}={value!r}): must be a number, a positive power of two")
    if not _is_power_of_two(float(value)):
        raise ValueError(f"FP8GradScaler({name}={value!r}): must be a positive power of two (e.g. 1.0, 2**16)")
    if not MIN_MU <= float(value) <= MAX_MU:
        raise ValueError(
            f"FP8GradScaler({name}={value!r}): must be from 2**-126 to 2**127 (a normal fp32 number; mu multiplies "
            "the loss in fp32)"
        )


def _check_arguments(
    init_scale: float,
    growth_interval: int,
    saturation_threshold: float,
    headroom: float,
    min_scale: float,
    max_scale: float,
    nonfinite_fallback: Fallback | None,
    fallback_after: int,
    lr_factor: float,
    model: nn.Module | None,
    process_group: Any = None,
    need_model: bool = True,
) -> None:
    """Raise what ``FP8GradScaler(...)`` raises for its arguments (``nonfinite_fallback`` an ``nn.Module`` already
    turned into ``"bf16"`` with that ``model``). ``need_model=False``: ``"bf16"`` without a model passes (a setting
    changed later, where an integration may give the model before the first step, which checks it)."""
    for name, value in (("init_scale", init_scale), ("min_scale", min_scale), ("max_scale", max_scale)):
        _check_scale(name, value)
    if not min_scale <= init_scale <= max_scale:
        raise ValueError(
            f"FP8GradScaler: need min_scale <= init_scale <= max_scale, got {min_scale}, {init_scale}, {max_scale}"
        )
    _check_number("growth_interval", growth_interval, "an int >= 1", integer=True)
    _check_number("fallback_after", fallback_after, "an int >= 1", integer=True)
    _check_number("saturation_threshold", saturation_threshold, "a number in [0, 1)")
    _check_number("headroom", headroom, "a number >= 1")
    _check_number("lr_factor", lr_factor, "a number in (0, 1)")
    if growth_interval < 1:
        raise ValueError(f"FP8GradScaler(growth_interval={growth_interval!r}): must be an int >= 1")
    if not 0.0 <= saturation_threshold < 1.0:
        raise ValueError(f"FP8GradScaler(saturation_threshold={saturation_threshold!r}): must be in [0, 1)")
    if not 1.0 <= headroom < math.inf:  # inf (or NaN): mu could never grow
        raise ValueError(f"FP8GradScaler(headroom={headroom!r}): must be finite and >= 1 (a factor under the FP8 max)")
    if fallback_after < 1:
        raise ValueError(f"FP8GradScaler(fallback_after={fallback_after!r}): must be an int >= 1")
    if not 0.0 < lr_factor < 1.0:
        raise ValueError(f"FP8GradScaler(lr_factor={lr_factor!r}): must be in (0, 1)")
    if isinstance(nonfinite_fallback, str) and nonfinite_fallback not in _FALLBACKS:
        raise ValueError(
            f"FP8GradScaler(nonfinite_fallback={nonfinite_fallback!r}): choose one of {list(_FALLBACKS)}, "
            "an nn.Module, a callable fn(scaler, optimizer) -> str, or None"
        )
    check_model(model)
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"FP8GradScaler(process_group=...) got a {type(process_group).__name__}: pass a process group "
            "(torch.distributed.new_group, or a DeviceMesh's get_group()), or None for the world"
        )
    if need_model and nonfinite_fallback == "bf16" and model is None:
        raise ValueError(
            "FP8GradScaler(nonfinite_fallback='bf16') needs the model: pass model=... as well (under Lightning, where "
            "the model is converted inside the fit, pass the arguments as a dict instead, "
            "FP8LMPrecision(grad_scaler={'nonfinite_fallback': 'bf16'}): the plugin gives the scaler its module)"
        )
    if nonfinite_fallback is not None and not isinstance(nonfinite_fallback, str) and not callable(nonfinite_fallback):
        raise TypeError(
            f"FP8GradScaler(nonfinite_fallback=...) got a {type(nonfinite_fallback).__name__}: expected a string, "
            "an nn.Module or a callable"
        )


# The settings FP8GradScaler keeps as public attributes, with the type __init__ stores them as (None: as given).
SETTINGS: dict[str, type | None] = {
    "growth_interval": int, "saturation_threshold": float, "headroom": float, "min_scale": float, "max_scale": float,
    "nonfinite_fallback": None, "fallback_after": int, "lr_factor": float, "process_group": None,
}  # fmt: skip


class _Settings:
    """A setting assigned after construction (``scaler.fallback_after = 0``, ``scaler.nonfinite_fallback = "lower-lr"``)
    is checked as ``FP8GradScaler(...)`` checks it: a bad value raises at once and the scaler keeps its old one, instead
    of failing later, after a skipped step, with a message naming neither. A base of the scaler."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in SETTINGS and "_history" in self.__dict__:  # constructed: __init__ checks its arguments together
            value = checked_setting(self, name, value)
        super().__setattr__(name, value)


def checked_setting(scaler: FP8GradScaler, name: str, value: Any) -> Any:
    """``value`` for ``scaler.<name> = value``, checked against the scaler's other settings and its mu and stored as
    ``__init__`` stores it; an ``nn.Module`` given as ``nonfinite_fallback`` is ``"bf16"`` with that module as the
    scaler's model (as in ``__init__``). TypeError / ValueError naming the assignment, the scaler unchanged."""
    settings = {key: getattr(scaler, key) for key in SETTINGS}
    model = scaler.model
    try:
        if name == "nonfinite_fallback" and isinstance(value, nn.Module):
            value, model = fallback_model(value, None if scaler._model_from_integration else model)
        if name in ("min_scale", "max_scale"):
            _check_scale(name, value)
            low, high = (value, settings["max_scale"]) if name == "min_scale" else (settings["min_scale"], value)
            if not low <= scaler._scale <= high:
                raise ValueError(
                    f"mu is {scaler._scale}, outside [min_scale, max_scale] = [{low}, {high}]: bring mu within them "
                    "first (scaler.update(new_scale=...)), or change the other bound first"
                    if low <= high
                    else f"need min_scale <= max_scale, got [{low}, {high}]"
                )
        settings[name] = value
        _check_arguments(scaler._scale, **settings, model=model, need_model=False)
    except (TypeError, ValueError) as err:
        raise type(err)(f"FP8GradScaler.{name} = {value!r}: {err}") from None
    if model is not scaler.model:
        scaler.model = model  # the module given as nonfinite_fallback, now the user's model
    kind = SETTINGS[name]
    return value if kind is None else kind(value)
