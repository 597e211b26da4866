"""Statistics of :class:`~lightning_fp8.optim.FP8AdamW`'s low-precision states: the scale and amax of each, their
range over all parameters, and the gradient scaler's counters (:meth:`FP8AdamW.fp8_state_stats`, for monitoring).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lightning_fp8.optim.state_layout import _KEYS, _param_order

if TYPE_CHECKING:
    from lightning_fp8.optim.adamw import FP8AdamW


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
