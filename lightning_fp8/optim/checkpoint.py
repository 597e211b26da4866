"""FP8AdamW state dicts: saving with masters, loading any AdamW-like state, exporting to ``torch.optim.AdamW``.

Layout per parameter (DESIGN.md "State layout"): every state tensor has the parameter's shape, every scale
is a 0-dim fp32 tensor. Low-precision states are ``key`` (fp16/FP8 storage, ``x * scale``), ``key_scale``
and ``key_amax`` for ``key`` in ``master``, ``exp_avg``, ``exp_avg_sq``; other parameters have exactly the
keys of ``torch.optim.AdamW`` (``step``, ``exp_avg``, ``exp_avg_sq`` in fp32).

Loading is by value: each saved state is dequantized to fp32 and stored in this optimizer's dtypes with a
fresh scale, except where dtype and scale already match, which copies the bits (a resumed run continues
bit-identically). So a ``torch.optim.AdamW`` state dict, an O1 one and an O2 one all load anywhere.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from lightning_fp8 import ops
from lightning_fp8.kernels.reference_adamw import SCALED_STATE_MAX
from lightning_fp8.optim import master, shards
from lightning_fp8.scaling import compute_scale

if TYPE_CHECKING:
    from lightning_fp8.optim.adamw import FP8AdamW

_KEYS = ("master", "exp_avg", "exp_avg_sq")


def dequantize(state: dict[str, Any], key: str) -> torch.Tensor:
    """``state[key]`` as fp32, unscaled."""
    x = state[key].detach().float()
    scale = state.get(f"{key}_scale")
    if scale is not None and state[key].dtype in SCALED_STATE_MAX:
        x = x / scale.to(x.device)
    return x


def quantize(value: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(stored, scale, amax)`` of the fp32 ``value`` in ``dtype``: scaled for fp16/FP8, else scale 1."""
    amax = ops.amax(value)
    if dtype not in SCALED_STATE_MAX:
        return value.to(dtype), torch.ones((), dtype=torch.float32, device=value.device), amax
    scale = compute_scale(amax, dtype)
    fmax = SCALED_STATE_MAX[dtype]
    return (value * scale).clamp(-fmax, fmax).to(dtype), scale, amax


def store(state: dict[str, Any], key: str, value: torch.Tensor, dtype: torch.dtype, shape, device) -> None:
    """Put the fp32 ``value`` into ``state`` as ``key``, ``key_scale``, ``key_amax`` in ``dtype``."""
    stored, scale, amax = quantize(value.detach().float().reshape(shape).to(device), dtype)
    state[key], state[f"{key}_scale"], state[f"{key}_amax"] = stored, scale, amax


def _param_order(opt: FP8AdamW) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def with_masters(opt: FP8AdamW, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Add ``"master"`` (the parameter's own storage) for adopted weights, without touching ``opt.state``."""
    packed = dict(state_dict["state"])
    for index, p in enumerate(_param_order(opt)):
        if index in packed and master.master_scale(p) is not None and p in opt._low_precision:
            packed[index] = {**packed[index], "master": p.detach()}
    return {**state_dict, "state": packed}


def shard_scalars(opt: FP8AdamW, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Export the 0-dim scales and amaxes of sharded (DTensor) parameters as DTensors of one element per shard.

    They belong to this rank's shard; as plain tensors, torch.distributed.checkpoint would take them for
    replicated values and save (and load on every rank) one rank's only.
    """
    packed = dict(state_dict["state"])
    for index, p in enumerate(_param_order(opt)):
        if index in packed and shards.is_dtensor(p):
            packed[index] = {
                key: _per_shard(value, p) if _is_shard_scalar(key, value) else value
                for key, value in packed[index].items()
            }
    return {**state_dict, "state": packed}


def _is_shard_scalar(key: str, value: Any) -> bool:
    return key.endswith(("_scale", "_amax")) and isinstance(value, torch.Tensor) and value.dim() == 0


def _per_shard(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    # Sharded on a mesh dimension means one scalar per rank there; not Placement.is_shard(): FSDP2 on top of
    # tensor parallelism shards with _StridedShard, which is no Shard in recent torch (and would lose ranks' values).
    placements = [Replicate() if placement.is_replicate() else Shard(0) for placement in p.placements]
    return DTensor.from_local(value.detach().reshape(1), p.device_mesh, placements, run_check=False)


def _local_scalars(saved: dict[str, Any]) -> dict[str, Any]:
    """``saved`` with per-shard scalars (see :func:`shard_scalars`) back as this rank's 0-dim tensors."""
    return {
        key: value.to_local().reshape(()) if key.endswith(("_scale", "_amax")) and shards.is_dtensor(value) else value
        for key, value in saved.items()
    }


def load(opt: FP8AdamW, state_dict: dict[str, Any]) -> None:
    """Body of :meth:`FP8AdamW.load_state_dict` (see the module docstring)."""
    saved_groups = state_dict["param_groups"]
    _check_states(opt, state_dict)  # before anything is loaded: a bad checkpoint changes nothing
    # The base class validates the groups and restores their hyper-parameters; the states are loaded here,
    # because the base class would cast every state to the parameter's dtype.
    torch.optim.Optimizer.load_state_dict(opt, {"state": {}, "param_groups": saved_groups})
    for group in opt.param_groups:
        group.setdefault("maximize", False)
    params = _param_order(opt)
    saved_ids = [i for group in saved_groups for i in group["params"]]
    for index, p in zip(saved_ids, params, strict=True):
        saved = state_dict["state"].get(index)
        if saved is not None:
            _load_one(opt, p, saved)


def _check_states(opt: FP8AdamW, state_dict: dict[str, Any]) -> None:
    """Raise ValueError for a state that cannot be its parameter's: a moment or master of another size, a scaled
    (FP8, fp16) one without its scale, a scale that is not finite and positive, a negative or non-finite step."""
    saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
    params = _param_order(opt)
    if len(saved_ids) != len(params):
        return  # torch.optim.Optimizer.load_state_dict says what does not match
    fix = "the checkpoint is corrupt or was written for another model"
    for index, p in zip(saved_ids, params, strict=True):
        saved = state_dict["state"].get(index)
        if saved is None:
            continue
        saved = _local_scalars(saved)
        for key in ("exp_avg", "exp_avg_sq", "master"):
            value = saved.get(key)
            if value is None:
                continue
            where = f"FP8AdamW.load_state_dict: parameter {index}'s {key!r}"
            if not isinstance(value, torch.Tensor) or value.numel() != p.numel():
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"{where} is {shape}, its parameter {tuple(p.shape)}: {fix}")
            scale = saved.get(f"{key}_scale")
            if value.dtype in SCALED_STATE_MAX and key != "master" and scale is None:
                raise ValueError(f"{where} is {value.dtype} without its '{key}_scale': {fix}")
            if scale is not None and not (torch.isfinite(scale).all() and (scale > 0).all()):
                raise ValueError(f"{where} has the scale {scale.tolist()}, not finite and positive: {fix}")
        step = saved.get("step")
        if step is not None and not (math.isfinite(float(step)) and float(step) >= 0):
            raise ValueError(f"FP8AdamW.load_state_dict: parameter {index}'s step is {float(step)}: {fix}")


def _copy_or_convert(state: dict[str, Any], saved: dict[str, Any], key: str, dtype, p: torch.Tensor) -> None:
    scaled = dtype in SCALED_STATE_MAX
    exact = saved[key].dtype == dtype and (not scaled or f"{key}_scale" in saved)
    if not exact:
        store(state, key, dequantize(saved, key), dtype, p.shape, p.device)
        return
    state[key] = saved[key].detach().to(p.device).clone()
    state[f"{key}_scale"] = saved.get(f"{key}_scale", torch.ones(())).detach().to(p.device, torch.float32).clone()
    amax = saved.get(f"{key}_amax")
    state[f"{key}_amax"] = amax.detach().to(p.device).clone() if amax is not None else ops.amax(dequantize(state, key))


def _load_one(opt: FP8AdamW, p: torch.Tensor, saved: dict[str, Any]) -> None:
    saved = _local_scalars(saved)
    state = opt.state[p]
    if p in opt._low_precision and master.master_scale(p) is not None:  # the adopted master's scale is p's
        state["master_scale"] = master.master_scale(p)
        state["master_amax"] = getattr(p, master.AMAX_ATTR)
    if "step" in saved:
        state["step"] = torch.as_tensor(saved["step"], dtype=torch.float32).detach().cpu().clone().reshape(())
    with torch.no_grad():
        if p not in opt._low_precision or p in opt._moments_only:  # the master is high precision
            for key, dtype in (("exp_avg", opt.exp_avg_dtype), ("exp_avg_sq", opt.exp_avg_sq_dtype)):
                if key in saved and p in opt._moments_only:
                    _copy_or_convert(state, saved, key, dtype, p)
                elif key in saved:
                    state[key] = dequantize(saved, key).to(p.device).reshape(p.shape)
            if p.dtype != torch.float32:
                source = dequantize(saved, "master") if "master" in saved else p.detach().float()
                state["master"] = source.to(p.device).reshape(p.shape)
            elif "master" in saved:
                p.copy_(dequantize(saved, "master").reshape(p.shape))
            return
        if "master_scale" in state and master.master_scale(p) is not None:
            _load_adopted_master(p, saved)
        elif "master" in saved:
            _copy_or_convert(state, saved, "master", opt.master_dtype, p)
        elif "step" in state:  # a torch.optim.AdamW state: the parameter is the master
            store(state, "master", p.detach().float(), opt.master_dtype, p.shape, p.device)
        for key, dtype in (("exp_avg", opt.exp_avg_dtype), ("exp_avg_sq", opt.exp_avg_sq_dtype)):
            if key in saved:
                _copy_or_convert(state, saved, key, dtype, p)


def _load_adopted_master(p: torch.Tensor, saved: dict[str, Any]) -> None:
    if "master" not in saved:
        return  # a torch.optim.AdamW state: the weight is the parameter's current value
    scale, amax = master.master_scale(p), getattr(p, master.AMAX_ATTR)
    if saved["master"].dtype == p.dtype and "master_scale" in saved:
        p.copy_(saved["master"].reshape(p.shape))
        scale.copy_(saved["master_scale"])
        amax.copy_(saved["master_amax"] if "master_amax" in saved else ops.amax(dequantize(saved, "master")))
        return
    stored, new_scale, new_amax = quantize(dequantize(saved, "master").to(p.device).reshape(p.shape), p.dtype)
    p.copy_(stored)
    scale.copy_(new_scale)
    amax.copy_(new_amax)


def to_adamw(opt: FP8AdamW) -> dict[str, Any]:
    """The state as ``torch.optim.AdamW`` keeps it: fp32 moments, ``step``; groups with AdamW's keys."""
    state_dict = opt.state_dict()
    state = {
        index: {
            key: (saved[key].detach().cpu().clone() if key == "step" else dequantize(saved, key))
            for key in ("step", "exp_avg", "exp_avg_sq")
            if key in saved
        }
        for index, saved in ((i, _local_scalars(s)) for i, s in state_dict["state"].items())
    }
    adamw_defaults = torch.optim.AdamW([torch.zeros(1)]).defaults
    groups = [
        {**adamw_defaults, **{k: v for k, v in group.items() if k in adamw_defaults or k == "params"}}
        for group in state_dict["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


def stats(opt: FP8AdamW) -> dict[str, Any]:
    """Body of :meth:`FP8AdamW.fp8_state_stats`."""
    names = [f"{k}_{suffix}" for k in _KEYS for suffix in ("scale", "amax")]
    rows: dict[int, list[torch.Tensor]] = {}
    for index, p in enumerate(_param_order(opt)):
        state = opt.state.get(p, {})
        if p in opt._low_precision and all(name in state for name in names):
            rows[index] = [state[name].float().reshape(1).to(p.device) for name in names]
    values: dict[int, list[float]] = {}
    by_device: dict[torch.device, list[int]] = {}
    for index, row in rows.items():
        by_device.setdefault(row[0].device, []).append(index)
    for indices in by_device.values():  # one host transfer per device
        table = torch.cat([torch.cat(rows[i]) for i in indices]).reshape(len(indices), len(names)).tolist()
        values.update(zip(indices, table, strict=True))
    params = {f"param_{i}": dict(zip(names, values[i], strict=True)) for i in sorted(values)}
    summary: dict[str, dict[str, float]] = {}
    for entry in params.values():
        for name, value in entry.items():
            s = summary.setdefault(name, {"min": value, "max": value})
            s["min"], s["max"] = min(s["min"], value), max(s["max"], value)
    out: dict[str, Any] = {"params": params, "summary": summary}
    scaler = opt.grad_scaler
    if scaler is not None:
        out["grad_scaler"] = {
            "scale": float(scaler.scale),
            "skipped_steps": scaler.skipped_steps,
            "last_saturation": scaler.last_saturation,
            "nonfinite_events": scaler.nonfinite_events,
            "growth_tracker": scaler.growth_tracker,
        }
    return out
