"""fp8_stats: a read-only snapshot of the FP8 scaling state of a model, its optimizer and its gradient scaler.

What the core keeps (DESIGN.md "Monitoring and health"), gathered in one place so that callbacks, loggers and
notebooks never reach into buffers themselves:

- per FP8 layer and role (``input``, ``weight``, ``grad_output``): ``scale``, ``amax``, ``amax_history``,
  ``saturation`` (fraction of the last cast at the FP8 maximum), ``nonfinite_count`` and ``casts``;
- a per-role ``summary`` over all layers (smallest and largest scale, largest amax and saturation, total
  non-finite casts), the compact view a logger wants every few steps;
- per optimizer (when given): the scales of the low-precision optimizer states (``exp_avg``, ``exp_avg_sq``,
  master weight, whatever 0-dim ``*scale*`` entries the optimizer keeps per parameter) and their min/max;
- per gradient scaler (when given): ``scale`` (mu), ``skipped_steps``, ``last_saturation``, ``nonfinite_events``.

Every value is a Python number (or list of numbers): the tensors are copied to the host in one transfer per
dtype, so calling this every ``log_every_n_steps`` costs one synchronization, not one per buffer.
"""

from __future__ import annotations

import collections
import numbers
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lightning_fp8.scaling import ROLES, ScalingState

# Name fragments that wrappers (DDP, FSDP1, activation checkpointing, torch.compile) insert into module and
# parameter names; stripped so the names in the stats are the user's own.
_WRAPPER_FRAGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")

# Scaling-state buffers reported per role, by dtype: floats and integer counters are copied in separate batches.
_FLOAT_FIELDS = ("scale", "amax", "saturation")
_INT_FIELDS = ("nonfinite_count", "casts")

_SCALER_FIELDS = ("skipped_steps", "last_saturation", "nonfinite_events")


# The wrappers that register the model they wrap as their child "module" (whose names then start "module."):
# torch's DistributedDataParallel and DataParallel (Accelerate and Lightning wrap with DDP), DeepSpeed's engine.
_MODULE_WRAPPERS: tuple[type, ...] = (nn.parallel.DistributedDataParallel, nn.DataParallel)
_MODULE_WRAPPER_NAMES = ("DeepSpeedEngine",)


def clean_name(name: str, strip_module: bool = True) -> str:
    """``name`` without the path components that DDP/FSDP/compile wrappers add (``_fsdp_wrapped_module``,
    ``_checkpoint_wrapped_module``, ``_orig_mod``, and with ``strip_module`` a leading ``module``): whole
    components only ("my_orig_mod.fc" stays as it is). :func:`fp8_stats` strips the leading ``module`` only when
    the model it is given is such a wrapper (:func:`wraps_as_module`), never a user's own child of that name."""
    parts = [part for part in name.split(".") if f"{part}." not in _WRAPPER_FRAGMENTS]
    return ".".join(parts[1:] if strip_module and parts[:1] == ["module"] else parts)


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module that ``torch.compile``'s ``OptimizedModule`` wrapper(s) of ``model`` hold (``_orig_mod``); ``model``
    itself when it is not compiled that way."""
    while isinstance(getattr(model, "_orig_mod", None), nn.Module):
        model = model._orig_mod
    return model


def wraps_as_module(model: nn.Module) -> bool:
    """Whether ``model`` (through torch.compile's ``_orig_mod``) is a DDP/DataParallel/DeepSpeed wrapper, whose
    child ``module`` (the leading ``module.`` of the names) is the wrapped model."""
    model = unwrap_compiled(model)
    child = model._modules.get("module")
    if child is None:
        return False
    return isinstance(model, _MODULE_WRAPPERS) or any(c.__name__ in _MODULE_WRAPPER_NAMES for c in type(model).__mro__)


def _clean_names(names: Iterable[str], strip_module: bool = True) -> dict[str, str]:
    # clean_name of each, except where two names would become one: those keep their full names, so that no
    # layer's entries overwrite another's.
    names = list(dict.fromkeys(names))
    cleaned = {name: clean_name(name, strip_module) for name in names}
    counts = collections.Counter(cleaned.values())
    return {name: short if counts[short] == 1 else name for name, short in cleaned.items()}


class _HostBatch:
    """Collects 0-dim and 1-dim tensors and copies them to the host in one transfer per dtype family."""

    def __init__(self) -> None:
        self._floats: list[torch.Tensor] = []
        self._ints: list[torch.Tensor] = []

    def add(self, t: torch.Tensor) -> tuple[str, int, int, bool]:
        """Queue ``t``; returns a handle ``(kind, start, stop, is_scalar)`` that :func:`_resolve` turns into values."""
        bucket = self._floats if t.is_floating_point() else self._ints
        start = sum(x.numel() for x in bucket)
        bucket.append(t.detach().reshape(-1))
        return ("f" if bucket is self._floats else "i", start, start + t.numel(), t.dim() == 0)

    def fetch(self) -> dict[str, list[float] | list[int]]:
        out: dict[str, Any] = {"f": [], "i": []}
        for key, bucket, dtype in (("f", self._floats, torch.float32), ("i", self._ints, torch.int64)):
            if bucket:
                device = bucket[0].device
                out[key] = torch.cat([t.to(device=device, dtype=dtype) for t in bucket]).cpu().tolist()
        return out


def _resolve(handles: Any, host: dict[str, list]) -> Any:
    # Replace every (kind, start, stop, is_scalar) handle in a nested dict by its host value(s).
    if isinstance(handles, dict):
        return {k: _resolve(v, host) for k, v in handles.items()}
    kind, start, stop, is_scalar = handles
    values = host[kind][start:stop]
    return values[0] if is_scalar else values


# The submodule (an nn.ModuleDict of ScalingStates) under which an FP8 layer keeps its scaling state.
_SCALING_CONTAINER = "fp8_scaling"


def _scaling_states(model: nn.Module) -> Iterable[tuple[str, str, ScalingState]]:
    # (layer name, role, state) for every ScalingState; layers keep them under "<layer>.fp8_scaling.<role>".
    # Only a whole trailing "fp8_scaling" path component is dropped, never part of the user's own layer name
    # ("head_fp8_scaling" is a layer of that name); the model itself being the layer gives "root".
    states = [(name, module) for name, module in model.named_modules() if isinstance(module, ScalingState)]
    short = _clean_names((name.rpartition(".")[0] for name, _ in states), wraps_as_module(model))
    for name, module in states:
        parent, _, role = name.rpartition(".")
        path = short[parent].split(".") if parent else []
        if path and path[-1] == _SCALING_CONTAINER:
            path.pop()
        yield ".".join(path) or "root", role, module


def _layer_handles(model: nn.Module, batch: _HostBatch) -> dict[str, dict[str, dict[str, Any]]]:
    layers: dict[str, dict[str, dict[str, Any]]] = {}
    for layer, role, state in _scaling_states(model):
        if state.scale.is_meta:
            raise ValueError(
                f"fp8_stats: the FP8 scaling state of layer {layer!r} ({role}) is on the meta device (it holds no "
                "data): materialize the model first (model.to_empty(device=...), then its reset_parameters())"
            )
        entry = {f: batch.add(getattr(state, f)) for f in (*_FLOAT_FIELDS, *_INT_FIELDS)}
        entry["amax_history"] = batch.add(state.amax_history)
        layers.setdefault(layer, {})[role] = entry
    return layers


def _summarize_layers(layers: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, float]]:
    summary: dict[str, dict[str, float]] = {}
    for role in ROLES:
        entries = [roles[role] for roles in layers.values() if role in roles]
        if not entries:
            continue
        summary[role] = {
            "scale_min": min(e["scale"] for e in entries),
            "scale_max": max(e["scale"] for e in entries),
            "amax_max": max(e["amax"] for e in entries),
            "saturation_max": max(e["saturation"] for e in entries),
            "saturation_mean": sum(e["saturation"] for e in entries) / len(entries),
            "nonfinite_count": sum(e["nonfinite_count"] for e in entries),
        }
    return summary


def _optimizer_handles(
    optimizer: torch.optim.Optimizer, model: nn.Module, batch: _HostBatch
) -> dict[str, dict[str, Any]]:
    # Low-precision optimizer states carry one 0-dim fp32 scale per tensor (DESIGN.md "FP8AdamW": state layout);
    # they are recognised by name (a key containing "scale"), so any optimizer following that layout is covered.
    params = list(model.named_parameters())
    short = _clean_names((n for n, _ in params), wraps_as_module(model))
    names = {id(p): short[n] for n, p in params}
    states: dict[str, dict[str, Any]] = {}
    for index, (param, state) in enumerate(optimizer.state.items()):
        scales = {
            key: batch.add(value)
            for key, value in state.items()
            if isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point() and "scale" in key
        }
        if scales:
            states[names.get(id(param), f"param_{index}")] = scales
    return states


def _summarize_optimizer(states: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    summary: dict[str, dict[str, float]] = {}
    for scales in states.values():
        for key, value in scales.items():
            entry = summary.setdefault(key, {"min": value, "max": value})
            entry["min"], entry["max"] = min(entry["min"], value), max(entry["max"], value)
    return summary


def _check_grad_scaler(grad_scaler: Any) -> None:
    # fp8_stats reads mu from `scale`: a number or a one-element real tensor (FP8GradScaler.scale is a 0-dim fp32
    # tensor). torch.amp.GradScaler has a `scale` too, but a method (scale(outputs) multiplies them by its loss scale).
    scale = getattr(grad_scaler, "scale", None)
    if isinstance(scale, torch.Tensor):
        if scale.numel() == 1 and not scale.is_complex() and scale.dtype != torch.bool:
            return
        what = f"a `scale` that is a {scale.dtype} tensor of shape {tuple(scale.shape)}"
    elif isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        return
    elif scale is None:
        what = "no `scale`"
    else:
        what = f"a `scale` that is a {'method' if callable(scale) else type(scale).__name__}, not a number"
    if isinstance(grad_scaler, torch.amp.GradScaler):
        what += ": torch.amp.GradScaler is PyTorch's fp16 loss scaler, not FP8 training's"
    kind = f"{type(grad_scaler).__module__}.{type(grad_scaler).__qualname__}"
    raise TypeError(
        f"fp8_stats(grad_scaler=...) expects an FP8GradScaler (lightning_fp8.FP8GradScaler, whose `scale` is mu, a "
        f"number), got {kind}, with {what}. Pass the FP8GradScaler the run uses (Lightning's precision='fp8-lm': "
        "trainer.precision_plugin.grad_scaler; Accelerate: accelerator.fp8_grad_scaler), or leave grad_scaler=None"
    )


def _scaler_handles(grad_scaler: Any, batch: _HostBatch) -> tuple[dict[str, Any], dict[str, Any]]:
    # a one-element tensor of any shape is one number (mu, a counter), as a 0-dim one is
    handles: dict[str, Any] = {"scale": batch.add(torch.as_tensor(grad_scaler.scale).reshape(()))}
    plain: dict[str, Any] = {}
    for field in _SCALER_FIELDS:
        value = getattr(grad_scaler, field, None)
        if isinstance(value, torch.Tensor):
            handles[field] = batch.add(value.reshape(()) if value.numel() == 1 else value)
        elif value is not None:
            plain[field] = value
    return handles, plain


def _not_an_optimizer_hint(value: Any) -> str:
    # What to do instead, by what was passed: the second positional argument is the optimizer, so a scaler or the model
    # there is an argument in the wrong place, not one optimizer too many.
    if isinstance(value, (list, tuple)):
        return "for several, call fp8_stats once per optimizer"
    if hasattr(value, "scale_loss") or isinstance(value, torch.amp.GradScaler):
        return "a gradient scaler goes in grad_scaler=..., e.g. fp8_stats(model, optimizer, grad_scaler=scaler)"
    return (
        "the arguments are fp8_stats(model, optimizer, grad_scaler), the optimizer being the one that trains model's "
        "parameters (e.g. FP8AdamW), or None"
    )


def fp8_stats(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, grad_scaler: Any | None = None
) -> dict[str, Any]:
    """A snapshot of the FP8 statistics of ``model`` (and of ``optimizer`` and ``grad_scaler`` when given).

    Read-only: nothing is modified, and the values are copies (Python numbers).

    Args:
        model: a model converted with :func:`~lightning_fp8.convert_to_fp8` (wrapped by DDP/FSDP/torch.compile or
            not: the names are the wrapped model's own; a leading ``module`` is left out only when ``model`` is a
            DDP, DataParallel or DeepSpeed wrapper, so a child of the user's own named ``module`` keeps its name).
        optimizer: an optimizer over ``model``'s parameters, e.g. :class:`~lightning_fp8.FP8AdamW`; its per-
            parameter 0-dim state entries whose key contains ``"scale"`` are reported.
        grad_scaler: a :class:`~lightning_fp8.FP8GradScaler` (anything whose ``scale`` attribute is mu: a number
            or a one-element tensor; not ``torch.amp.GradScaler``, whose ``scale`` is a method).

    Returns:
        ``{"layers": {layer: {role: {"scale", "amax", "amax_history", "saturation", "nonfinite_count",
        "casts"}}}, "summary": {role: {"scale_min", "scale_max", "amax_max", "saturation_max",
        "saturation_mean", "nonfinite_count"}}}``, plus ``"optimizer": {"states": {param: {key: scale}},
        "summary": {key: {"min", "max"}}}`` and ``"grad_scaler": {"scale", "skipped_steps",
        "last_saturation", "nonfinite_events"}`` when those are given.

    Raises:
        TypeError: if ``model`` is not an ``nn.Module``, ``optimizer`` not an optimizer, or ``grad_scaler``'s
            ``scale`` is not a number or a one-element tensor (it has none, or it is a method, as
            ``torch.amp.GradScaler``'s).
        ValueError: if a scaling state of ``model`` is on the meta device (not materialized yet).

    Examples:
        >>> from lightning_fp8 import convert_to_fp8
        >>> model = convert_to_fp8(nn.Sequential(nn.Linear(32, 16)))
        >>> _ = model(torch.randn(4, 32))
        >>> sorted(fp8_stats(model)["layers"]["0"])
        ['grad_output', 'input', 'weight']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fp8_stats(model=...) expects an nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"fp8_stats(optimizer=...) expects one torch.optim.Optimizer, got {type(optimizer).__name__}: "
            + _not_an_optimizer_hint(optimizer)
        )
    if grad_scaler is not None:
        _check_grad_scaler(grad_scaler)
    batch = _HostBatch()
    handles: dict[str, Any] = {"layers": _layer_handles(model, batch)}
    if optimizer is not None:
        handles["optimizer"] = _optimizer_handles(optimizer, model, batch)
    plain_scaler: dict[str, Any] = {}
    if grad_scaler is not None:
        handles["grad_scaler"], plain_scaler = _scaler_handles(grad_scaler, batch)
    values = _resolve(handles, batch.fetch())

    out: dict[str, Any] = {"layers": values["layers"], "summary": _summarize_layers(values["layers"])}
    if optimizer is not None:
        out["optimizer"] = {"states": values["optimizer"], "summary": _summarize_optimizer(values["optimizer"])}
    if grad_scaler is not None:
        out["grad_scaler"] = {**values["grad_scaler"], **plain_scaler}
    return out
