"""Masters kept apart from their parameters, and values written to those parameters between steps.

FP8AdamW keeps some masters apart from the parameter they update: a bf16 or fp16 parameter's fp32 master, and an FP8
weight's fp16 master after :meth:`~lightning_fp8.FP8AdamW.release_weights` or when the weight was frozen as the
optimizer was built. Each step writes the new value into the parameter as well. ``torch.optim.AdamW`` steps from the
parameter's current values, so a write between steps (``model.load_state_dict``, an in-place ``fill_`` or
``clamp_``, a rollback to a snapshot) is what its next step continues from; a master kept apart would continue from
its own values and overwrite the write.

So each step notes such a parameter's version counter and storage after writing it (:func:`mark`), and the next step
takes what was written since (:func:`take_writes`): where the parameter's values differ from the master's rounded to
the parameter's dtype, the master takes the parameter's; the other elements keep the master's precision, so putting
the same values back (an EMA swap for evaluation) changes nothing. DTensor (FSDP2) parameters are not tracked.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_fp8.optim import checkpoint, shards


def mark(p: torch.Tensor) -> tuple[int, int] | None:
    """What changes when anything writes ``p`` in place (its version counter) or swaps its storage (``p.data = t``);
    ``None`` for a DTensor (not tracked: a wrapper without storage of its own)."""
    return None if shards.is_dtensor(p) else (p._version, p.data_ptr())


def take_writes(p: torch.Tensor, state: dict[str, Any], marked: tuple[int, int] | None) -> None:
    """Put the values written to ``p`` since the step that ``marked`` it into its master kept apart, ``state["master"]``
    (plain, or scaled with ``master_scale``). Reads the values only when ``p`` was written (a host sync then)."""
    if marked is None or marked == mark(p):
        return
    kept = checkpoint.dequantize(state, "master")
    value = p.detach().to(kept.device)
    changed = value != kept.to(value.dtype)
    if not bool(changed.any()):
        return
    merged = torch.where(changed, value.float(), kept)
    if "master_scale" in state:
        checkpoint.store(state, "master", merged, state["master"].dtype, merged.shape, merged.device)
    else:
        state["master"].copy_(merged)
